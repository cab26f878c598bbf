"""Masked decay (SR-STE) of straight-through phases: the gradient of every pruned weight gains
``decay * weight``, once per optimizer step, after unscaling, on every backend; refused for hard
masks; a resume is exact."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import (
    FEW_UPDATES,
    MetricsLog,
    RepeatedBatch,
    StopAt,
    TinyModule,
    fast_trainer,
    pretend_gpu,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.masks.tiles import transposable_2to4_mask

pytestmark = FEW_UPDATES

DECAY = 0.25  # large, so that the decay term stands far above rounding
LR = 0.1
PARAMS = ("net.fc1.weight", "net.fc2.weight")


class GradProbe(L.Callback):
    """After the SparsityCallback: the weights, gradients and masks the optimizer step sees."""

    def __init__(self, cb: SparsityCallback) -> None:
        self.cb = cb
        self.seen: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sp = self.cb.sparsifier
        self.seen[trainer.global_step] = {
            t.name: (
                t.param.detach().clone(),
                t.param.grad.clone(),
                sp.current_mask(t).clone(),
                type(t.module).__name__,
            )
            for t in sp.targets
        }


def loader(inputs: int = 8) -> DataLoader:
    return DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=inputs), batch_size=6)


def one_step(phase, decay, width=16, inputs=8, steps=1, **trainer_kwargs):
    """A fit of ``steps`` optimizer steps with plain SGD: (model before, model after, probe)."""
    L.seed_everything(0, verbose=False)
    model = TinyModule(optimizer="sgd", lr=LR, width=width, inputs=inputs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    extra = {} if decay is None else {"decay": decay}
    cb = SparsityCallback(phases=[{**phase, **extra}], verbose=False)
    probe = GradProbe(cb)
    trainer = fast_trainer(
        max_steps=steps, callbacks=[cb, probe], deterministic=True, **trainer_kwargs
    )
    trainer.fit(model, loader(inputs))
    return before, model, probe


def assert_decayed(plain, decayed, factor=DECAY):
    """``decayed`` gradients are ``plain`` ones plus ``factor * weight`` where pruned, and
    exactly ``plain`` where kept."""
    for name in PARAMS:
        weight, grad, mask, _ = decayed[name]
        weight0, grad0, mask0, _ = plain[name]
        assert torch.equal(weight, weight0) and torch.equal(mask, mask0)
        assert 0 < int((~mask).sum()) < mask.numel()
        assert torch.equal(grad[mask], grad0[mask]), name  # kept: untouched
        expected = grad0[~mask] + factor * weight[~mask]
        torch.testing.assert_close(grad[~mask], expected, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(grad[~mask], grad0[~mask])


PHASES = {
    "runtime 2:4": {"sparsity": "2:4"},
    "magnitude 2:4": {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2},
    "magnitude 50%": {"sparsity": 0.5, "algorithm": "magnitude", "update_every": 1},
}


@pytest.mark.parametrize("phase", PHASES.values(), ids=PHASES.keys())
def test_decay_adds_decay_times_weight_to_pruned_gradients_only(phase):
    _, _, plain = one_step(phase, None)
    before, model, decayed = one_step(phase, DECAY)
    assert_decayed(plain.seen[0], decayed.seen[0])
    # the SGD step applied the decayed gradient: w1 = w0 - lr * (g + decay * (1 - m) * w0)
    params = dict(model.named_parameters())
    for name in PARAMS:
        _, grad0, mask, _ = plain.seen[0][name]
        w0 = before[name]
        expected = w0 - LR * (grad0 + DECAY * (~mask) * w0)
        torch.testing.assert_close(params[name].detach(), expected, rtol=0, atol=1e-7)


def test_decay_zero_is_no_decay():
    phase = PHASES["runtime 2:4"]
    _, off, _ = one_step(phase, None, steps=3)
    _, zero, _ = one_step(phase, 0.0, steps=3)
    for p, q in zip(off.parameters(), zero.parameters()):
        assert torch.equal(p, q)


def test_decay_is_applied_once_per_optimizer_step_with_accumulation():
    phase = PHASES["magnitude 50%"]
    _, _, plain = one_step(phase, None, accumulate_grad_batches=3)
    _, _, decayed = one_step(phase, DECAY, accumulate_grad_batches=3)
    assert list(decayed.seen) == [0]  # one optimizer step of three micro-batches
    assert_decayed(plain.seen[0], decayed.seen[0])


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_decay_is_applied_to_unscaled_gradients(precision):
    """With a GradScaler (scale 2**16), a decay added before unscaling would shrink 65536-fold."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu")
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        kwargs = {"precision": precision}
    phase = PHASES["runtime 2:4"]
    _, _, plain = one_step(phase, None, **kwargs)
    _, _, decayed = one_step(phase, DECAY, **kwargs)
    assert_decayed(plain.seen[0], decayed.seen[0])


def test_decay_on_the_kernel_path_decays_the_mask_the_layer_ran(monkeypatch):
    """A pretend GPU runs the 2:4 layers through the semi_structured backend (its CPU
    emulation): the decayed entries are those outside the greedy transposable 2:4 mask of the
    weights, the mask the layer computed with."""
    pretend_gpu(monkeypatch)
    phase = PHASES["runtime 2:4"]
    _, _, plain = one_step(phase, None, width=128, inputs=128, precision="bf16-mixed")
    _, _, decayed = one_step(
        phase, DECAY, width=128, inputs=128, precision="bf16-mixed"
    )
    for name in PARAMS:
        weight, _, mask, module = decayed.seen[0][name]
        assert module == "SemiStructuredLinear"
        assert torch.equal(mask, transposable_2to4_mask(weight))
    assert_decayed(plain.seen[0], decayed.seen[0])


@pytest.mark.parametrize(
    "phase",
    [
        {"sparsity": 0.5},
        {"sparsity": "2:4", "algorithm": "static"},
        {"sparsity": 0.5, "algorithm": "gmp"},
        {"sparsity": 0.5, "algorithm": "set"},
        {"sparsity": 0.5, "algorithm": "rigl"},
    ],
    ids=["static", "static 2:4", "gmp", "set", "rigl"],
)
def test_decay_on_a_hard_mask_algorithm_is_refused_with_the_algorithms_that_accept_it(
    phase,
):
    algorithm = phase.get("algorithm", "static")
    with pytest.raises(ValueError) as err:  # when the callback is built, before fit
        SparsityCallback(phases=[{**phase, "decay": 2e-4}], verbose=False)
    message = str(err.value)
    assert f"option 'decay' does nothing for algorithm '{algorithm}'" in message
    assert "'decay' is accepted by [" in message
    assert "'magnitude'" in message and "'runtime'" in message
    assert "nothing to decay" in message


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1e-4, ValueError, r"decay=-0.0001: use a finite number >= 0 such as 2.0e-4"),
        (math.nan, ValueError, r"decay=nan: use a finite number >= 0"),
        (math.inf, ValueError, r"decay=inf: use a finite number >= 0"),
        ("strong", ValueError, r"decay='strong' is not a number"),
        (True, TypeError, r"decay=True has type bool"),
        ([1e-4], TypeError, r"decay=\[0.0001\] has type list"),
    ],
)
def test_bad_decay_values_are_refused_at_construction(value, error, message):
    with pytest.raises(error, match=r"phases\[0\]: " + message):
        SparsityCallback(phases=[{"sparsity": "2:4", "decay": value}])


def test_decay_values_as_yaml_writes_them():
    # YAML 1.1 (PyYAML) reads an unquoted 2e-4 as a string; 2.0e-4 as a float
    for value in ("2e-4", 2.0e-4, 0, "0"):
        cb = SparsityCallback(phases=[{"sparsity": "2:4", "decay": value}])
        assert cb.phases[0].decay == float(value)
    with pytest.raises(ValueError, match=r"\['decay'\] would do nothing"):
        SparsityCallback(phases=[{"sparsity": 0.0, "decay": 2e-4}])


RESUME_PHASES = [
    {
        "sparsity": 0.5,
        "algorithm": "magnitude",
        "update_every": 2,
        "decay": 0.05,
        "until": 4,
    },
    {"sparsity": "2:4", "decay": 0.05, "until": 8},
    {"sparsity": 0.0},
]


def resume_run(tmp_path, phases=RESUME_PHASES, stop_at=None, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    model = TinyModule(lr=0.05, weight_decay=0.1)
    cb = SparsityCallback(phases=phases, log_every_n_steps=1, verbose=False)
    logger = MetricsLog()
    callbacks = [cb]
    if stop_at:
        callbacks += [
            StopAt(stop_at),
            ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=stop_at),
        ]
    trainer = fast_trainer(
        max_steps=10,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=bool(stop_at),
        deterministic=True,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, cb, logger.series("sparsity/sparsity/flip_rate")


@pytest.mark.parametrize("resume_step", [3, 6])
def test_resume_with_decay_is_bitwise_equal_to_the_uninterrupted_run(
    tmp_path, resume_step
):
    reference, ref_cb, ref_flips = resume_run(tmp_path / "ref")
    undecayed, _, _ = resume_run(
        tmp_path / "plain",
        phases=[{k: v for k, v in p.items() if k != "decay"} for p in RESUME_PHASES],
    )
    assert not torch.equal(reference.net.fc1.weight, undecayed.net.fc1.weight)
    resume_run(tmp_path / "ck", stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed, cb, flips = resume_run(tmp_path / "resumed", ckpt_path=ckpt)
    for (name, p), q in zip(resumed.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    # the flip rates after the resume, and the summary's records, are those of the full run
    assert sorted(flips) == list(range(resume_step, 8))
    assert flips == {s: r for s, r in ref_flips.items() if s >= resume_step}
    assert (cb.flips.first, cb.flips.last, cb.flips.peak) == (
        ref_cb.flips.first,
        ref_cb.flips.last,
        ref_cb.flips.peak,
    )
