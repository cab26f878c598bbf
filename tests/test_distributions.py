"""Distributions: ERK densities against the formula, global thresholds, uniform, errors."""

import math

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, TinyModule, fast_trainer, random_loader
from torch import nn

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms.distributions import erk_densities, spread
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import num_kept

pytestmark = FEW_UPDATES


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32, 64)
        self.out = nn.Linear(64, 10)


def erk_by_hand(shapes, sparsity, dense=()):
    """RigL-paper ERK: density_l = eps * sum(shape) / prod(shape), with the layers in ``dense``
    kept dense and eps solving sum(density_l * n_l) = (1 - sparsity) * sum(n_l)."""
    numel = {n: math.prod(s) for n, s in shapes.items()}
    budget = (1 - sparsity) * sum(numel.values()) - sum(numel[n] for n in dense)
    eps = budget / sum(sum(s) for n, s in shapes.items() if n not in dense)
    return {
        n: 1.0 if n in dense else eps * sum(s) / numel[n] for n, s in shapes.items()
    }


def test_erk_densities_match_the_formula_on_a_small_model():
    net = ConvNet()
    shapes = {
        t.name: t.param.shape for t in select_parameters(net, params="*.weight").targets
    }
    assert shapes["conv.weight"] == (16, 3, 3, 3)
    densities = erk_densities(0.9, shapes)
    assert densities == pytest.approx(erk_by_hand(shapes, 0.9))
    # the group keeps 10% overall, smaller layers keep more
    total = sum(math.prod(s) for s in shapes.values())
    kept = sum(densities[n] * math.prod(s) for n, s in shapes.items())
    assert kept == pytest.approx(0.1 * total)
    assert densities["conv.weight"] > densities["conv2.weight"]
    # per-layer targets encode exact counts
    targets = spread("erk", 0.9, shapes, None)
    for name, shape in shapes.items():
        numel = math.prod(shape)
        assert num_kept(numel, targets[name]) == round(densities[name] * numel)


def test_erk_caps_densities_at_one_and_redistributes():
    shapes = {"tiny": torch.Size([2, 3]), "big": torch.Size([256, 512])}
    densities = erk_densities(0.5, shapes)
    assert densities["tiny"] == 1.0
    assert densities == pytest.approx(erk_by_hand(shapes, 0.5, dense={"tiny"}))
    assert densities["big"] * 256 * 512 + 6 == pytest.approx(0.5 * (256 * 512 + 6))


def test_global_keeps_the_largest_magnitudes_of_the_group():
    torch.manual_seed(0)
    weights = {
        "a": torch.randn(40, 40) * 3,
        "b": torch.randn(50, 60),
        "c": torch.randn(7, 9),
    }
    shapes = {n: w.shape for n, w in weights.items()}
    targets = spread("global", 0.8, shapes, lambda name: weights[name].abs())
    everything = torch.cat([w.abs().flatten() for w in weights.values()])
    threshold = everything.sort(descending=True).values[
        num_kept(everything.numel(), 0.8) - 1
    ]
    for name, w in weights.items():
        assert num_kept(w.numel(), targets[name]) == int((w.abs() >= threshold).sum())
    total = sum(num_kept(w.numel(), targets[n]) for n, w in weights.items())
    assert total == num_kept(everything.numel(), 0.8)
    assert targets["a"] < targets["b"], "the larger-scale layer keeps more"


@pytest.mark.parametrize("distribution", ["uniform", "erk", "global"])
@pytest.mark.parametrize("algorithm", ["static", "gmp"])
def test_distributions_reach_the_group_target_in_training(distribution, algorithm):
    phase = {"sparsity": 0.75, "algorithm": algorithm, "distribution": distribution}
    if algorithm == "gmp":
        phase["update_every"] = 2
    cb = SparsityCallback(phases=[phase], verbose=False)
    L.seed_everything(0, verbose=False)
    fast_trainer(max_steps=8, callbacks=[cb]).fit(TinyModule(), random_loader())
    sp = cb.sparsifier
    kept = sum(int(m.sum()) for m in sp.masks.values())
    total = sum(m.numel() for m in sp.masks.values())
    if distribution == "erk":  # one rounding per layer
        assert abs(kept - num_kept(total, 0.75)) <= len(sp.masks)
    else:
        assert kept == num_kept(total, 0.75)
    per_layer = {name: 1 - float(m.float().mean()) for name, m in sp.masks.items()}
    if distribution == "uniform":
        assert per_layer == pytest.approx(dict.fromkeys(per_layer, 0.75))
    else:
        assert len(set(per_layer.values())) > 1


def test_erk_init_with_random_masks_and_gmp_ramps_every_layer():
    net = ConvNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    targets = select_parameters(net, params="*.weight").targets
    phases = resolve_phases(
        [Phase(sparsity=0.9, algorithm="gmp", distribution="erk", update_every=5)], 100
    )
    sp = Sparsifier("g", targets, phases)
    sp.on_step_start(0, [opt])
    shapes = {t.name: t.param.shape for t in targets}
    for step in (5, 40, 75):
        for t in targets:
            t.param.grad = torch.zeros_like(t.param)
        sp.before_optimizer_step(step, opt, [opt])
        expected = spread("erk", sp.algorithm.target_at(step), shapes, None)
        for t in targets:
            assert int(sp.masks[t.name].sum()) == num_kept(
                t.param.numel(), expected[t.name]
            )


@pytest.mark.parametrize(
    ("phase", "message"),
    [
        (
            {"sparsity": 0.5, "distribution": "normal"},
            r"distribution='normal' is not available; use one of \['erk', 'global', 'uniform'\]",
        ),
        (
            {"sparsity": "2:4", "algorithm": "set", "distribution": "erk"},
            r"distribution='erk' spreads a fraction over layers, but sparsity='2:4'",
        ),
        (
            {"sparsity": "2:4", "distribution": "global"},
            r"option 'distribution' does nothing for algorithm 'runtime'",
        ),
    ],
)
def test_bad_distributions_are_named(phase, message):
    with pytest.raises(ValueError, match=message):
        SparsityCallback(phases=[phase], verbose=False).on_fit_start(
            fast_trainer(max_steps=4), TinyModule()
        )
