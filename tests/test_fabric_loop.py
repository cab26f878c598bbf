"""``SparseTraining`` under Lightning Fabric, in a loop shaped like litgpt's pretraining loop
(``examples/fabric_pretrain.py``): DDPStrategy (one CPU process, gloo), gradient accumulation
under ``fabric.no_backward_sync``, a warm-up, clipping, the sparsity state in
``fabric.save``/``fabric.load``'s ``state``: the resumed run is the uninterrupted one bit for
bit, and the schedule's work runs at optimizer steps only. The same on litgpt's own ``GPT``
where litgpt is installed (the ``litgpt`` extra)."""

from __future__ import annotations

import runpy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_sparse import SparseTraining

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = runpy.run_path(
    str(ROOT / "examples" / "fabric_pretrain.py"), run_name="fabric_pretrain"
)
pretrain, demo_gpt = EXAMPLE["pretrain"], EXAMPLE["demo_gpt"]


@pytest.fixture
def fabric() -> Iterator[L.Fabric]:
    """A one-process DDP Fabric on the CPU; its process group is closed afterwards."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="ddp")
    fabric.launch()
    yield fabric
    if dist.is_initialized():
        dist.destroy_process_group()


def litgpt_gpt() -> tuple[nn.Module, list[str]]:
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        vocab_size=64,
        padded_vocab_size=64,
        intermediate_size=64,
        mlp_class_name="GptNeoxMLP",
    )
    return litgpt.GPT(config), [
        "transformer.h.*.mlp.fc.weight",
        "transformer.h.*.mlp.proj.weight",
    ]


def check_resume(
    fabric: L.Fabric,
    factory: Callable[[], tuple[nn.Module, list[str]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    original = SparseTraining.before_optimizer_step

    def counting(self: SparseTraining, step: int, *args: Any) -> bool:
        calls.append(step)
        return original(self, step, *args)

    monkeypatch.setattr(SparseTraining, "before_optimizer_step", counting)
    straight, straight_sp, state = pretrain(
        fabric, factory, total_steps=12, accumulate=2
    )
    # 24 micro-batches, 12 optimizer steps: the work ran once a step, the 2:4 phase ended at 8
    assert state["iter_num"] == 24
    assert calls == list(range(12))
    assert straight_sp.state_dict()["history"] == [(0, 0), (8, 1)]
    path = tmp_path / "mid.ckpt"
    pretrain(fabric, factory, total_steps=12, stop_at=5, checkpoint=path)
    resumed, resumed_sp, resumed_state = pretrain(
        fabric, factory, total_steps=12, checkpoint=path, resume=True
    )
    assert resumed_state["iter_num"] == 24
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed_sp.state_dict()["history"] == [(0, 0), (8, 1)]


def test_a_fabric_resume_is_the_uninterrupted_run(fabric, tmp_path, monkeypatch):
    check_resume(fabric, demo_gpt, tmp_path, monkeypatch)


def test_a_fabric_loop_on_litgpt_gpt_resumes_bit_for_bit(fabric, tmp_path, monkeypatch):
    check_resume(fabric, litgpt_gpt, tmp_path, monkeypatch)


def test_the_sparse_phase_runs_2_4_forwards_under_fabric(fabric, tmp_path):
    """Stopped in the 2:4 phase: the exported MLP weights hold 2 of every 4, the model's
    parameter names are the user's own (no Fabric or DDP prefix)."""
    _, sparsity, _ = pretrain(
        fabric, total_steps=12, stop_at=3, checkpoint=tmp_path / "c"
    )
    exported = sparsity.export_state_dict()
    weight = exported["transformer.h.0.mlp.c_fc.weight"]
    assert (weight.reshape(-1, 4).ne(0).sum(dim=1) <= 2).all()
    assert [t.name for t in sparsity.selection.targets] == [
        f"transformer.h.{i}.mlp.{n}.weight"
        for i in range(2)
        for n in ("c_fc", "c_proj")
    ]
