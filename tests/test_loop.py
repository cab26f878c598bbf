"""``SparseTraining`` in a plain PyTorch loop: a resume from a mid-run checkpoint is the
uninterrupted run bit for bit (2:4 then dense, RigL, learned masks), the loop and the callback
train the same weights and masks from the same model, data and phases, a loop that forgets a
call is told so with the fix, and none of it imports Lightning."""

from __future__ import annotations

import runpy
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_sparse import SparseTraining, SparsityCallback

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = runpy.run_path(
    str(ROOT / "examples" / "plain_loop.py"), run_name="plain_loop"
)
TinyLM, batch, train = EXAMPLE["TinyLM"], EXAMPLE["batch"], EXAMPLE["train"]

DENSE_AFTER_24 = [{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}]
RIGL = [{"sparsity": 0.5, "algorithm": "rigl", "update_every": 2}]
LEARNED = [
    {"sparsity": "2:4", "algorithm": "learned", "until": 0.5, "mask_lr": 0.05},
    {"sparsity": "2:4", "algorithm": "static"},
]


def equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "phases", [DENSE_AFTER_24, RIGL, LEARNED], ids=["24-then-dense", "rigl", "learned"]
)
def test_a_resume_from_a_mid_run_checkpoint_is_the_uninterrupted_run(
    tmp_path: Path, phases: list[dict[str, Any]]
) -> None:
    """Gradient accumulation, a warm-up schedule, dropout (restore_rng) and a checkpoint at
    step 5 of 10 (the 2:4 phase ends at step 7): the resumed run's weights, masks and
    step equal the uninterrupted run's."""
    straight, straight_sp = train(total_steps=10, phases=phases)
    path = tmp_path / "mid.pt"
    train(total_steps=10, phases=phases, stop_at=5, checkpoint=path)
    resumed, resumed_sp = train(total_steps=10, phases=phases, checkpoint=path)
    assert equal_states(straight.state_dict(), resumed.state_dict())
    straight_state, resumed_state = straight_sp.state_dict(), resumed_sp.state_dict()
    assert equal_states(straight_state["masks"], resumed_state["masks"])
    assert straight_state["history"] == resumed_state["history"]
    assert straight_state["step"] == resumed_state["step"] == 10
    # the flip rate measured over step 0, before the checkpoint, resumes with it
    assert straight_state["flip_rate"]["first"][0] == 0
    assert straight_state["flip_rate"] == resumed_state["flip_rate"]
    if phases is DENSE_AFTER_24:
        assert straight_state["history"] == [(0, 0), (7, 1)]
    if phases is RIGL:  # hard masks: half of each selected weight is stored as zeros
        weight = straight.blocks[0].fc.weight
        assert (weight == 0).float().mean().item() == 0.5


def test_a_sparse_phase_trains_2_4_weights_and_the_export_holds_them(
    tmp_path: Path,
) -> None:
    """Stopped inside the 2:4 phase: every group of 4 consecutive inputs of a selected weight
    keeps at most 2 non-zeros in the export, the unselected weights are the model's own."""
    model, sparsity = train(total_steps=10, stop_at=4, checkpoint=tmp_path / "c.pt")
    exported = sparsity.export_state_dict()
    for name in ("blocks.0.fc.weight", "blocks.1.proj.weight"):
        groups = exported[name].reshape(-1, 4)
        assert (groups.ne(0).sum(dim=1) <= 2).all()
        assert not torch.equal(exported[name], model.state_dict()[name])  # dense stored
    assert torch.equal(exported["wte.weight"], model.wte.weight)


class Tokens(Dataset):
    """Item ``i``: micro-batch ``i % accumulate`` of optimizer step ``i // accumulate``."""

    def __init__(self, steps: int, accumulate: int) -> None:
        self.steps, self.accumulate = steps, accumulate

    def __len__(self) -> int:
        return self.steps * self.accumulate

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(i // self.accumulate, i % self.accumulate)


class LitLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM(dropout=0.0)

    def training_step(self, pair: Any, index: int) -> torch.Tensor:
        inputs, targets = pair
        logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


@pytest.mark.parametrize(
    "phases", [DENSE_AFTER_24, RIGL], ids=["24-then-dense", "rigl"]
)
def test_the_callback_and_the_loop_train_the_same_weights_and_masks(
    phases: list[dict[str, Any]],
) -> None:
    steps, accumulate = 6, 2
    params = ["blocks.*.fc.weight", "blocks.*.proj.weight"]
    torch.manual_seed(0)
    lit = LitLM()
    cb = SparsityCallback(
        phases=phases, params=[f"model.{p}" for p in params], verbose=False
    )
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[cb],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(lit, DataLoader(Tokens(steps, accumulate), batch_size=None))

    net, sparsity = plain_loop(phases, params, steps, accumulate)
    assert equal_states(lit.model.state_dict(), net.state_dict())
    loop_masks = sparsity.sparsifier.state_dict()["masks"]
    cb_masks = {
        k.removeprefix("model."): v
        for k, v in cb.sparsifier.state_dict()["masks"].items()
    }
    assert equal_states(cb_masks, loop_masks)
    assert len(loop_masks) == (4 if phases is RIGL else 0)  # dense at the end: no masks


def plain_loop(
    phases: list[dict[str, Any]], params: list[str], steps: int, accumulate: int
) -> tuple[torch.nn.Module, SparseTraining]:
    """The callback test's run as a plain loop over the same loader."""
    torch.manual_seed(0)
    net = TinyLM(dropout=0.0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    sparsity = SparseTraining(
        net, optimizer, phases=phases, params=params, total_steps=steps, verbose=False
    )
    loader = DataLoader(Tokens(steps, accumulate), batch_size=None)
    for index, (inputs, targets) in enumerate(loader):
        logits = net(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (loss / accumulate).backward()
        if (index + 1) % accumulate == 0:
            optimizer.step()
            sparsity.step()
            optimizer.zero_grad()
    sparsity.end()
    return net, sparsity


def tiny_loop() -> tuple[torch.nn.Module, torch.optim.Optimizer, SparseTraining]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sparsity = SparseTraining(
        net, optimizer, sparsity=0.5, total_steps=10, params=["0.weight"], verbose=False
    )
    return net, optimizer, sparsity


def backward(net: torch.nn.Module) -> None:
    net(torch.ones(2, 8)).sum().backward()


def test_two_optimizer_steps_without_the_step_call_between_raise_with_the_fix() -> None:
    net, optimizer, _ = tiny_loop()
    backward(net)
    optimizer.step()
    with pytest.raises(
        RuntimeError, match=r"ran twice at step 0 without SparseTraining\.step\(\)"
    ):
        optimizer.step()


@pytest.mark.parametrize("call", ["state_dict", "end"])
def test_a_checkpoint_or_the_end_after_a_step_without_the_step_call_raises(
    call: str,
) -> None:
    net, optimizer, sparsity = tiny_loop()
    backward(net)
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"call sparsity\.step\(\) right after each"):
        getattr(sparsity, call)()
    sparsity.step()
    getattr(sparsity, call)()  # with the call, fine


def test_a_step_call_without_an_optimizer_step_warns_once() -> None:
    _, _, sparsity = tiny_loop()
    with pytest.warns(UserWarning, match="not after each micro-batch"):
        sparsity.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparsity.step()
    assert sparsity.current_step == 2


def test_the_hard_masks_hold_through_the_optimizer_steps() -> None:
    """The step pre-hook masks the gradients of pruned weights: SGD with momentum and
    weight decay leaves them exactly zero."""
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(
        net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1
    )
    sparsity = SparseTraining(
        net, optimizer, sparsity=0.75, total_steps=5, params=["weight"], verbose=False
    )
    pruned = net.weight.detach() == 0
    assert pruned.float().mean().item() == 0.75
    for _ in range(5):
        net(torch.randn(3, 16)).square().sum().backward()
        optimizer.step()
        sparsity.step()
        optimizer.zero_grad()
    assert torch.equal(net.weight.detach() == 0, pruned)


def test_a_callback_state_resumes_with_its_step_and_without_it_says_how() -> None:
    _, _, sparsity = tiny_loop()
    state = sparsity.state_dict()
    del state["step"]
    with pytest.raises(ValueError, match=r"step=checkpoint\['global_step'\]"):
        sparsity.load_state_dict(state)
    sparsity.load_state_dict(state, step=3)
    assert sparsity.current_step == 3


@pytest.mark.parametrize("total", [0, 2.5, None, True])
def test_the_run_length_is_checked(total: Any) -> None:
    net = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="total_steps=.*positive integer"):
        SparseTraining(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            sparsity=0.5,
            total_steps=total,
        )


def test_the_optimizer_is_required() -> None:
    net = torch.nn.Linear(8, 8)
    with pytest.raises(TypeError, match="takes the optimizer"):
        SparseTraining(net, [], sparsity=0.5, total_steps=4)


def test_the_loop_and_its_export_import_no_lightning() -> None:
    """The plain-loop example, run in a fresh interpreter, leaves no Lightning module loaded."""
    code = (
        "import runpy, sys\n"
        f"example = runpy.run_path({str(ROOT / 'examples' / 'plain_loop.py')!r}, run_name='x')\n"
        "model, sparsity = example['train'](total_steps=4)\n"
        "assert len(sparsity.export_state_dict()) > 0\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric'))\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_zero_gradient_step_at_learning_rate_0_before_any_state_is_not_a_step() -> (
    None
):
    """What torch.distributed.checkpoint runs to create an optimizer's state before loading
    into it: no step counted, no mask touched; the first real step after it counts."""
    net, optimizer, sparsity = tiny_loop()
    masks = sparsity.sparsifier.state_dict()["masks"]
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()  # creates no state for SGD: a second one is the same
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.1
    backward(net)
    optimizer.step()
    with pytest.raises(RuntimeError, match="ran twice"):
        optimizer.step()  # the real step was counted
    assert equal_states(sparsity.sparsifier.state_dict()["masks"], masks)


def test_metrics_report_the_schedule_for_a_logger() -> None:
    """50% static on one 8x8 weight: target and actual 0.5 in phase 1; a static mask's flip
    rate, measured over step 0, is 0."""
    net, optimizer, sparsity = tiny_loop()
    assert "sparsity/sparsity/flip_rate" not in sparsity.metrics()
    backward(net)
    optimizer.step()
    sparsity.step()
    assert sparsity.metrics() == {
        "sparsity/sparsity/target": 0.5,
        "sparsity/sparsity/actual": 0.5,
        "sparsity/sparsity/phase": 1.0,
        "sparsity/sparsity/flip_rate": 0.0,
    }


def test_the_end_is_the_last_call() -> None:
    """After end() the optimizer steps without the group's work, and step() says why."""
    net, optimizer, sparsity = tiny_loop()
    sparsity.end()
    backward(net)
    optimizer.step()
    optimizer.step()  # no hook left: no "ran twice"
    with pytest.raises(
        RuntimeError, match=r"SparseTraining\.step\(\) after SparseTraining\.end\(\)"
    ):
        sparsity.step()


def test_a_group_not_yet_active_saves_the_checkpoint_state_it_waits_to_restore():
    """Built for the callback, before fit start activates it: its checkpoint state is the
    state it was given to restore (nothing is lost by a save in between), or empty."""
    from lightning_sparse.loop import loop_run_length
    from lightning_sparse.settings import GroupSettings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    settings = GroupSettings("SparsityCallback", sparsity=0.5, verbose=False)
    run = loop_run_length(10)
    waiting = {"masks": {"0.weight": torch.ones(16, 8, dtype=torch.bool)}, "step": 3}
    built = SparseTraining.from_settings(settings, model, run, pending_state=waiting)
    assert built.group_state() == waiting
    assert SparseTraining.from_settings(settings, model, run).group_state() == {}


def test_verbose_prints_the_plan_on_this_rank_and_cuda_graph_timing_warns_uncompiled(
    capsys,
) -> None:
    """A single process is rank 0: ``verbose`` prints the plan table there. Timing layers as
    CUDA graphs warns for a model not compiled with them; the default timing does not."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseTraining(
            net, optimizer, sparsity=0.5, total_steps=10, params=["0.weight"]
        )
    assert "0.weight" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="not compiled with CUDA graphs"):
        SparseTraining(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            sparsity=0.5,
            total_steps=10,
            params=["0.weight"],
            verbose=False,
            verify_speed="cuda_graphs",
        )


def test_a_selection_of_nothing_is_named_for_the_loop() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))  # its only Linear is the head
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"^SparseTraining 'sparsity' selects no param"
    ):
        SparseTraining(net, optimizer, sparsity=0.5, total_steps=10, verbose=False)
