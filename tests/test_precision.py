"""Mixed and low precision (16-mixed with a real GradScaler, bf16-mixed, bf16-true weights) and
steps with non-finite losses."""

from typing import Any

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, TinyModule, fast_trainer, random_loader
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_sparse import SparsityCallback
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import NM, is_nm, num_kept

pytestmark = FEW_UPDATES


class BadLossAt(TinyModule):
    """A loss times ``factor`` (inf: an overflow, nan) at the given optimizer steps, so every
    gradient of those steps is non-finite."""

    def __init__(self, bad_steps: set[int], factor: float = float("inf")) -> None:
        super().__init__()
        self.bad_steps, self.factor = bad_steps, factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * self.factor if self.global_step in self.bad_steps else loss


class Snapshots(L.Callback):
    """After the sparsity callbacks: masks as the optimizer step sees them, weights after it."""

    def __init__(self, *groups: SparsityCallback) -> None:
        self.groups = groups
        self.masks: dict[int, dict[str, torch.Tensor]] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.scale: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        self.masks[step] = {
            t.name: cb.sparsifier.current_mask(t).clone()
            for cb in self.groups
            for t in cb.sparsifier.targets
        }
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scale[step] = scaler.get_scale()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights[trainer.global_step - 1] = {
            n: p.detach().clone() for n, p in pl_module.named_parameters()
        }


def two_groups() -> tuple[SparsityCallback, SparsityCallback]:
    """fc1 straight-through (magnitude), fc2 hard (gmp); both update at every step."""
    straight = SparsityCallback(
        phases=[{"sparsity": 0.5, "algorithm": "magnitude", "update_every": 1}],
        params=["net.fc1.weight"],
        name="straight",
        verbose=False,
    )
    hard = SparsityCallback(
        phases=[{"sparsity": 0.8, "algorithm": "gmp", "update_every": 1}],
        params=["net.fc2.weight"],
        name="hard",
        verbose=False,
    )
    return straight, hard


def sixteen_mixed(device: str) -> dict[str, Any]:
    if (
        device == "cpu"
    ):  # Lightning maps precision='16-mixed' to bf16 on the CPU: pass the plugin
        scaler = torch.amp.GradScaler("cpu")
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"accelerator": "cuda", "precision": "16-mixed"}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs a CUDA GPU"
                ),
            ],
        ),
    ],
)
def test_a_step_the_gradscaler_skips_updates_no_mask(device, caplog):
    bad = 3
    straight, hard = two_groups()
    snap = Snapshots(straight, hard)
    trainer = fast_trainer(
        max_steps=8, callbacks=[straight, hard, snap], **sixteen_mixed(device)
    )
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        trainer.fit(BadLossAt({bad}), random_loader())
    # the scaler skipped step 3 (and lowered its scale); no other step was skipped
    assert snap.scale[bad + 1] == snap.scale[bad] / 2
    assert all(snap.scale[s] == snap.scale[0] for s in range(bad + 1))
    for name, weight in snap.weights[bad].items():
        assert torch.equal(weight, snap.weights[bad - 1][name]), name
    # the masks the skipped step saw are those of the step before (no update ran) ...
    for name, mask in snap.masks[bad].items():
        assert torch.equal(mask, snap.masks[bad - 1][name]), name
    # ... and updates resumed afterwards (gmp's ramp prunes more at every update)
    fc2 = "net.fc2.weight"
    assert int(snap.masks[bad + 1][fc2].sum()) < int(snap.masks[bad][fc2].sum())
    assert int(snap.masks[bad - 1][fc2].sum()) < int(snap.masks[bad - 2][fc2].sum())
    skipped = [
        r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()
    ]
    assert skipped == [
        f"[straight] step {bad}: mask update skipped: non-finite weights or gradients",
        f"[hard] step {bad}: mask update skipped: non-finite weights or gradients",
    ]


PHASES = [
    {"sparsity": 0.5, "until": 3},
    {"sparsity": 0.6, "algorithm": "magnitude", "update_every": 1, "until": 6},
    {"sparsity": 0.7, "algorithm": "gmp", "update_every": 1, "until": 10},
    {"sparsity": "2:4", "until": 13},
    {"sparsity": 0.0},
]


class ExactMasks(L.Callback):
    """Checks at every step that each mask meets its target exactly and hard zeros are stored."""

    def __init__(self, cb: SparsityCallback) -> None:
        self.cb = cb
        self.checked: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sp = self.cb.sparsifier
        algo = sp.algorithm
        if algo is None:
            return
        target = algo.target_at(trainer.global_step)
        for t in sp.targets:
            mask = sp.current_mask(t)
            assert mask.dtype == torch.bool
            if isinstance(target, NM):
                assert is_nm(mask, target)
            else:
                assert int(mask.sum()) == num_kept(mask.numel(), target)
            if not algo.straight_through:
                assert bool((t.param[~mask] == 0).all())
                assert bool((t.param.grad[~mask] == 0).all())
        self.checked.append(trainer.global_step)


@pytest.mark.parametrize(
    ("precision", "weight_dtype"),
    [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)],
)
def test_bf16_training_keeps_exact_masks(precision, weight_dtype):
    cb = SparsityCallback(phases=PHASES, verbose=False)
    check = ExactMasks(cb)
    model = TinyModule()
    trainer = fast_trainer(max_steps=15, precision=precision, callbacks=[cb, check])
    trainer.fit(model, random_loader())
    assert check.checked == list(range(13))
    assert model.net.fc1.weight.dtype == weight_dtype
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.global_step == 15


def test_an_overflow_outside_the_group_also_skips_its_update():
    """GradScaler skips the whole optimizer step when any of its gradients overflows, so the
    group must not update its masks even when its own gradients are finite."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    phases = resolve_phases([Phase(sparsity=0.8, algorithm="gmp", update_every=1)], 10)
    logs: list[str] = []
    sp = Sparsifier("g", select_parameters(net).targets, phases, log=logs.append)
    assert [t.name for t in sp.targets] == ["0.weight"]
    updated, kept = [], []
    for step in range(4):
        sp.on_step_start(step, [opt])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 2:
            net[2].bias.grad[0] = float("inf")  # a parameter the group does not own
        scaler.unscale_(opt)
        updated.append(sp.before_optimizer_step(step, opt, [opt]))
        kept.append(int(sp.masks["0.weight"].sum()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert updated == [False, True, False, True]
    assert kept[2] == kept[1] > kept[3]
    assert logs == ["[g] step 2: mask update skipped: non-finite weights or gradients"]


def test_nan_loss_steps_never_change_masks(caplog):
    """Without a GradScaler, a NaN loss poisons the weights (that is the model's problem); the
    masks keep their last finite choice, and every later update is skipped and logged instead of
    ranking NaNs."""
    straight, hard = two_groups()
    snap = Snapshots(straight, hard)
    trainer = fast_trainer(max_steps=8, callbacks=[straight, hard, snap])
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        trainer.fit(BadLossAt({3}, factor=float("nan")), random_loader())
    assert not torch.isfinite(snap.weights[3]["net.fc1.weight"]).any()
    for step in range(3, 8):
        for name, mask in snap.masks[step].items():
            assert torch.equal(mask, snap.masks[2][name]), (step, name)
    assert int(snap.masks[2]["net.fc1.weight"].sum()) == 64  # 50% of 128, exact
    skipped = [
        r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()
    ]
    # magnitude updates at steps 1-7, gmp at 1-6 (its ramp ends at 75% of the run)
    assert sum(m.startswith("[straight]") for m in skipped) == 5
    assert sum(m.startswith("[hard]") for m in skipped) == 4
