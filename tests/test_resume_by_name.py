"""Saved state reaches the right parameter by name, not by position.

The model here (``helpers.OutOfOrderModule``) has 36 sparsified layers of one shape whose
parameter names sort differently from model order: twelve blocks in an ``nn.Sequential``
(``blocks.10.*`` sorts before ``blocks.2.*``), each defining its layers out of alphabetical
order (``up``, ``gate``, ``down``). A mask given to the wrong layer of the same shape raises no
error, so every check compares masks by parameter name: after a resume in each kind of phase
(hard masks and straight-through), after a resume from a checkpoint that lists its masks in
another order, and in the exports (dense and compressed) of a straight-through phase, whose
stored weights are dense so that only the masks make them sparse. The DDP counterpart is
``test_distributed.py::test_ddp_resume_restores_each_mask_to_its_own_parameter``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, OutOfOrderModule, RepeatedBatch, fast_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.formats.compressed import load_compressed, save_compressed

pytestmark = FEW_UPDATES

WIDTH = 8
STATE_KEY = "SparsityCallback{'name': 'sparsity'}"
# (label, phase, the step a resume starts at: inside the phase, where the layers' masks differ
# (after the first update for `gmp`, whose ramp starts dense), before a mask update for
# `magnitude`, so that the resumed steps run on the restored masks)
PHASES: list[tuple[str, dict[str, Any], int]] = [
    ("static", {"sparsity": 0.5, "until": 3}, 2),
    (
        "set",
        {"sparsity": 0.5, "algorithm": "set", "update_every": 1, "until": 6},
        4,
    ),
    (
        "rigl",
        {"sparsity": 0.5, "algorithm": "rigl", "update_every": 1, "until": 9},
        7,
    ),
    ("gmp", {"sparsity": 0.7, "algorithm": "gmp", "update_every": 1, "until": 12}, 11),
    (
        "magnitude",
        {"sparsity": 0.6, "algorithm": "magnitude", "update_every": 3, "until": 16},
        14,
    ),
    ("runtime 2:4", {"sparsity": "2:4", "until": 19}, 17),
]
SCHEDULE = [phase for _, phase, _ in PHASES] + [{"sparsity": 0.0}]
MAX_STEPS = 20
HARD = {"static", "set", "rigl", "gmp"}
EXPORT_STEP = 14  # inside the magnitude phase: the stored weights are dense


def sparsity_callback() -> SparsityCallback:
    return SparsityCallback(
        phases=SCHEDULE, params=OutOfOrderModule.PARAMS, verbose=False
    )


class Probe(L.Callback):
    """Placed after the SparsityCallback: the masks the engine holds once it is restored, and
    per optimizer step the masks that step uses (after its update), all keyed by name; at
    ``export_step``, the export of the live model and its output on a fixed input."""

    def __init__(self, cb: SparsityCallback, export_step: int | None = None) -> None:
        self.cb = cb
        self.export_step = export_step
        self.restored: dict[str, torch.Tensor] = {}
        self.steps: dict[int, dict[str, torch.Tensor]] = {}
        self.hard_state_checked: list[int] = []
        self.export: dict[str, torch.Tensor] = {}
        self.output: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.restored = {k: v.clone() for k, v in self.cb.sparsifier.masks.items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sp = self.cb.sparsifier
        if sp.algorithm is None:
            self.steps[trainer.global_step] = {}
            return
        masks = {t.name: sp.current_mask(t).clone() for t in sp.targets}
        self.steps[trainer.global_step] = masks
        if not sp.algorithm.straight_through:
            # pruned weights, their gradients and their optimizer state are zeros, by name
            for t in sp.targets:
                pruned = ~masks[t.name]
                state = optimizer.state.get(t.param, {})
                assert bool((t.param.detach()[pruned] == 0).all()), t.name
                assert bool((t.param.grad[pruned] == 0).all()), t.name
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        assert bool((state[key][pruned] == 0).all()), (t.name, key)
            self.hard_state_checked.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.export_step:
            # copies: unmasked tensors of an export are the live parameters
            self.export = {k: v.clone() for k, v in export_state_dict(trainer).items()}
            with torch.no_grad():
                self.output = pl_module(probe_input())


def probe_input() -> torch.Tensor:
    return torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(7))


def fit(
    out, ckpt_path=None, seed: int = 0, checkpoints: bool = False
) -> tuple[OutOfOrderModule, Probe]:
    L.seed_everything(seed, verbose=False)
    model = OutOfOrderModule()
    cb = sparsity_callback()
    probe = Probe(cb, export_step=None if ckpt_path else EXPORT_STEP)
    callbacks: list[L.Callback] = [cb, probe]
    if checkpoints:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out,
                every_n_train_steps=1,
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = fast_trainer(
        max_steps=MAX_STEPS,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=checkpoints,
    )
    # identical batches: a resume mid-epoch sees the batches of the uninterrupted run
    data = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=WIDTH), batch_size=6)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    assert trainer.global_step == MAX_STEPS
    return model, probe


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """The uninterrupted run, with a checkpoint after every optimizer step."""
    out = tmp_path_factory.mktemp("reference")
    model, probe = fit(out, checkpoints=True)
    return {"out": out, "model": model, "probe": probe}


def test_the_model_names_sort_out_of_model_order(reference):
    names = list(reference["probe"].steps[0])
    assert len(names) == 36 and names[:3] == [
        "blocks.0.up.weight",
        "blocks.0.gate.weight",
        "blocks.0.down.weight",
    ]
    assert names != sorted(names)
    # layers of one shape hold different masks, so a mask on the wrong layer is visible
    masks = reference["probe"].steps[0]
    assert len({tuple(m.flatten().tolist()) for m in masks.values()}) == len(masks)


def assert_same_by_name(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert got.keys() == expected.keys(), what
    wrong = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not wrong, f"{what}: {len(wrong)} tensors differ by name, e.g. {wrong[:3]}"


def check_resume(reference: dict[str, Any], ckpt_path, out, step: int) -> Probe:
    """Resume from ``ckpt_path`` (written after ``step`` optimizer steps) and compare with the
    uninterrupted run: restored masks, the masks of every later step, the final weights."""
    saved = torch.load(ckpt_path, weights_only=False)["callbacks"][STATE_KEY]["masks"]
    # every layer has its own mask: one restored to another layer would show
    assert (
        len({tuple(m.flatten().tolist()) for m in saved.values()}) == len(saved) == 36
    )
    model, probe = fit(out, ckpt_path=ckpt_path, seed=123)
    restored = {f"{name}_mask": mask for name, mask in probe.restored.items()}
    assert_same_by_name(restored, saved, "restored masks")
    expected_steps = reference["probe"].steps
    assert sorted(probe.steps) == list(range(step, MAX_STEPS))
    for s in range(step, MAX_STEPS):
        assert_same_by_name(probe.steps[s], expected_steps[s], f"step {s}")
    expected = reference["model"].state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    return probe


@pytest.mark.parametrize(
    ("label", "step"), [(label, step) for label, _, step in PHASES]
)
def test_resume_restores_each_mask_to_its_own_parameter(
    reference, tmp_path, label, step
):
    probe = check_resume(
        reference, reference["out"] / f"step={step}.ckpt", tmp_path, step
    )
    assert probe.restored, "the checkpoint was written in a sparse phase"
    if label in HARD:  # the first resumed step ran with the restored masks
        assert probe.hard_state_checked[0] == step


def test_resume_ignores_the_order_of_the_saved_masks(reference, tmp_path):
    """A checkpoint whose masks are listed in reverse (as another tool might write them)."""
    step = 7  # rigl: hard masks, updated at every step
    ckpt = torch.load(reference["out"] / f"step={step}.ckpt", weights_only=False)
    masks = ckpt["callbacks"][STATE_KEY]["masks"]
    ckpt["callbacks"][STATE_KEY]["masks"] = dict(reversed(list(masks.items())))
    path = tmp_path / "reversed.ckpt"
    torch.save(ckpt, path)
    check_resume(reference, path, tmp_path / "resumed", step)


def test_exports_fold_each_mask_into_its_own_weight(reference, tmp_path):
    """In a straight-through phase (dense stored weights), the dense export of the live model,
    of its checkpoint and the compressed file all equal weight x own mask, by name, and give
    the sparse model's output."""
    probe = reference["probe"]
    ckpt_path = reference["out"] / f"step={EXPORT_STEP}.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    weights = ckpt["state_dict"]
    masks = probe.steps[EXPORT_STEP - 1]  # the masks of the step just taken
    saved = ckpt["callbacks"][STATE_KEY]["masks"]
    assert_same_by_name(saved, {f"{k}_mask": v for k, v in masks.items()}, "saved")
    dense_stored = [
        name for name in masks if bool((weights[name][~masks[name]] != 0).any())
    ]
    assert len(dense_stored) == len(masks)  # straight-through: only the masks sparsify
    folded = {name: weights[name] * masks[name] for name in masks}
    path = tmp_path / "model.safetensors"
    save_compressed(ckpt_path, path, verbose=False)
    for what, export in [
        ("trainer export", probe.export),
        ("checkpoint export", export_state_dict(ckpt_path)),
        ("compressed file", load_compressed(path)),
    ]:
        assert export.keys() == weights.keys(), what
        assert_same_by_name({k: export[k] for k in masks}, folded, what)
        plain = OutOfOrderModule()
        plain.load_state_dict(export, strict=True)
        with torch.no_grad():
            assert torch.allclose(plain(probe_input()), probe.output, atol=1e-6), what


# Two Cerebras groups share the 36 weights (24 rigl, 12 static); each callback's state is found
# by the callback's name (``sparsity_0``, ``sparsity_1``), then each mask by its parameter's.
GROUPS = [
    {
        "algorithm": "rigl",
        "sparsity": 0.5,
        "update": {"freq": 1},
        "param_filter": ["blocks.*.up.weight", "blocks.*.gate.weight"],
    },
    {"sparsity": 0.7, "init_method": "topk", "param_filter": ["blocks.*.down.weight"]},
]
GROUP_STEPS, GROUP_RESUME = 8, 5


class GroupMasks(L.Callback):
    """Placed after the SparsityCallbacks: each step's masks of every group, by name."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps[trainer.global_step] = {
            t.name: cb.sparsifier.current_mask(t).clone()
            for cb in trainer.callbacks
            if isinstance(cb, SparsityCallback)
            for t in cb.sparsifier.targets
        }


def fit_groups(groups, out, ckpt_path=None) -> tuple[OutOfOrderModule, GroupMasks]:
    L.seed_everything(0, verbose=False)
    model = OutOfOrderModule()
    probe = GroupMasks()
    checkpoint = ModelCheckpoint(
        dirpath=out, every_n_train_steps=GROUP_RESUME, save_top_k=-1, filename="{step}"
    )
    callbacks = [*SparsityCallback.from_config(groups, verbose=False), probe]
    trainer = fast_trainer(
        max_steps=GROUP_STEPS,
        deterministic=True,
        callbacks=[*callbacks, checkpoint],
        enable_checkpointing=True,
    )
    data = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=WIDTH), batch_size=6)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, probe


def test_cerebras_groups_resume_each_to_their_own_parameters(tmp_path):
    reference, expected = fit_groups(GROUPS, tmp_path / "reference")
    ckpt = tmp_path / "reference" / f"step={GROUP_RESUME}.ckpt"
    states = torch.load(ckpt, weights_only=False)["callbacks"]
    assert len(states["SparsityCallback{'name': 'sparsity_0'}"]["masks"]) == 24
    assert len(states["SparsityCallback{'name': 'sparsity_1'}"]["masks"]) == 12
    model, got = fit_groups(GROUPS, tmp_path / "resumed", ckpt_path=ckpt)
    assert sorted(got.steps) == list(range(GROUP_RESUME, GROUP_STEPS))
    for step in got.steps:
        assert len(got.steps[step]) == 36
        assert_same_by_name(got.steps[step], expected.steps[step], f"step {step}")
    expected_weights = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected_weights[key]), key
    # groups listed in another order are other groups: refused, never mixed up
    with pytest.raises(
        ValueError, match=r"masks for parameters this group does not select|has no mask"
    ):
        fit_groups(GROUPS[::-1], tmp_path / "reordered", ckpt_path=ckpt)
