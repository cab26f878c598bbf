"""litgpt's ``GPT`` from tiny ``Config``s (random weights, no downloads): ``lm_head`` is
registered before the blocks, so the head is found by name and the last block's ``mlp.proj``
is sparse like every other. Every check reads the map a layer computes (it is fed an
identity), not the stored tensor."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import StopAt, fast_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from probes import (
    PHASES,
    EffectiveProbe,
    assert_phases,
    effective_rows,
    kept_per_group,
    run_phase,
    zero_fraction,
)
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.masks.tiles import transposable_2to4_mask

litgpt = pytest.importorskip("litgpt")

MLPS = {  # the MLP's weights per litgpt MLP class
    "GptNeoxMLP": ("fc", "proj"),
    "LLaMAMLP": ("fc_1", "fc_2", "proj"),
}


def tiny_gpt(mlp: str = "GptNeoxMLP") -> litgpt.GPT:
    config = litgpt.Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        block_size=32,
        vocab_size=256,
        padded_vocab_size=256,
        intermediate_size=128,
        mlp_class_name=mlp,
    )
    return litgpt.GPT(config)


@pytest.mark.parametrize("mlp", MLPS)
def test_default_selection_finds_lm_head_by_name(mlp):
    model = tiny_gpt(mlp)
    assert list(dict(model.named_children())) == [
        "lm_head",
        "transformer",
    ]  # head first
    sel = select_parameters(model)
    assert sel.excluded["lm_head.weight"] == "output head"
    assert sel.excluded["transformer.wte.weight"] == "embedding"
    assert [t.name for t in sel.targets] == [
        f"transformer.h.{i}.{w}.weight"
        for i in range(2)
        for w in ("attn.qkv", "attn.proj", *(f"mlp.{m}" for m in MLPS[mlp]))
    ]
    assert "transformer.h.1.mlp.proj.weight" in [t.name for t in sel.targets]


def test_static_70_percent_is_exact_on_the_effective_weights():
    sp = run_phase(tiny_gpt(), 0.7)
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert int((rows == 0).sum()) == round(0.7 * rows.numel()), t.name
    assert sp.actual_sparsity() == pytest.approx(0.7, abs=1e-4)


@pytest.mark.parametrize("algorithm", ["static", "runtime"])
@pytest.mark.parametrize("mlp", MLPS)
def test_2to4_runs_along_the_input_dimension(mlp, algorithm):
    sp = run_phase(tiny_gpt(mlp), "2:4", algorithm=algorithm)
    for t in sp.targets:
        rows = effective_rows(t.module)  # (out, in), measured
        kept = kept_per_group(rows, 4)
        if algorithm == "static":
            assert bool((kept == 2).all()), t.name
        else:  # the greedy transposable tile: 2:4 along rows and columns
            assert bool((kept <= 2).all()), t.name
            assert torch.equal(rows != 0, transposable_2to4_mask(rows) & (rows != 0))


class LitGPTModule(L.LightningModule):
    """Next-token prediction with a litgpt ``GPT`` (its logits), AdamW."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.model(ids[:, :-1])  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(batches: int, repeat: bool = False) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2 if repeat else 2 * batches, 17), generator=gen)
    if repeat:  # identical batches: an exact resume does not depend on data order
        ids = ids.repeat(batches, 1)
    return DataLoader(TensorDataset(ids), batch_size=2)


def test_fit_through_sparse_and_dense_phases():
    model = tiny_gpt()
    layers = ["model.transformer.h.1.mlp.proj", "model.transformer.h.0.attn.qkv"]
    probe = EffectiveProbe(layers)
    cb = SparsityCallback(phases=PHASES, verbose=False)
    fast_trainer(max_steps=5, callbacks=[cb, probe]).fit(LitGPTModule(model), tokens(5))
    assert_phases(probe)
    assert zero_fraction(model.lm_head) < 0.01  # the head stays dense throughout


RESUME_PHASES = [
    {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2, "until": 3},
    {"sparsity": 0.7, "algorithm": "gmp", "update_every": 1, "until": 6},
    {"sparsity": 0.0},
]


def litgpt_run(tmp_path, stop_at=None, ckpt_path=None, seed=0):
    L.seed_everything(seed, verbose=False)
    module = LitGPTModule(tiny_gpt())
    callbacks: list[L.Callback] = [
        SparsityCallback(phases=RESUME_PHASES, verbose=False)
    ]
    if stop_at:
        callbacks.append(
            ModelCheckpoint(
                dirpath=tmp_path, every_n_train_steps=stop_at, filename="{step}"
            )
        )
        callbacks.append(StopAt(stop_at))
    trainer = fast_trainer(
        max_steps=7,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(stop_at),
    )
    trainer.fit(module, tokens(4, repeat=True), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("resume_step", [2, 5])  # in the magnitude 2:4 and gmp phases
def test_resume_is_bitwise_and_the_export_loads_strictly(tmp_path, resume_step):
    reference = litgpt_run(tmp_path / "ref")
    litgpt_run(tmp_path / "ck", stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed = litgpt_run(tmp_path / "resumed", ckpt_path=ckpt, seed=1)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    fresh = LitGPTModule(tiny_gpt())
    fresh.load_state_dict(export_state_dict(ckpt), strict=True)
    rows = effective_rows(fresh.model.transformer.h[1].mlp.proj)
    if resume_step == 2:  # the magnitude phase's 2:4 folded in, along the inputs
        assert bool((kept_per_group(rows, 4) == 2).all())
    else:
        assert float((rows == 0).float().mean()) > 0.5
