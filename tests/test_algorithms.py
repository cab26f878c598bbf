import pytest
import torch

from lightning_sparse.algorithms import MaskContext, build_algorithm
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.masks import NM, is_nm, target_mask
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
    transposable_2to4_mask,
)


def algo_for(total=100, **phase):
    resolved = resolve_phases([Phase(**phase)], total_steps=total)
    return build_algorithm(resolved[0])


def test_static_topk_and_random_init():
    algo = algo_for(sparsity=0.5)
    w = torch.tensor([[4.0, -1.0], [0.5, -3.0]])
    assert algo.initial_mask(w, 0.5, MaskContext("w", 0, 0)).tolist() == [
        [True, False],
        [False, True],
    ]
    assert not algo.dynamic and not algo.is_update_step(50)
    rand = algo_for(sparsity=0.5, init="random", seed=7)
    w = torch.randn(64, 64)
    m1 = rand.initial_mask(w, 0.5, MaskContext("layer.weight", 0, rand.seed))
    m2 = rand.initial_mask(w * 100, 0.5, MaskContext("layer.weight", 0, rand.seed))
    other = rand.initial_mask(w, 0.5, MaskContext("other.weight", 0, rand.seed))
    assert torch.equal(m1, m2)  # random: independent of the weights
    assert not torch.equal(m1, other)  # derived from the parameter name
    assert int(m1.sum()) == 64 * 32


def test_magnitude_updates_every_n_steps_within_window():
    algo = algo_for(sparsity=0.5, algorithm="magnitude", update_every=10)
    assert algo.straight_through and algo.dynamic
    assert [s for s in range(100) if algo.is_update_step(s)] == list(range(10, 100, 10))
    w = torch.randn(8, 8)
    new = algo.update_mask(
        w, torch.ones(8, 8, dtype=torch.bool), 0.5, MaskContext("w", 10, 0)
    )
    assert int(new.sum()) == 32 and w.abs()[new].min() > w.abs()[~new].max()


def test_gmp_cubic_ramp_and_subset_property():
    algo = algo_for(sparsity=0.8, algorithm="gmp", update_every=10, update_stop=50)
    targets = [algo.target_at(s) for s in (0, 10, 50, 60)]
    assert (
        targets[0] == 0.0
        and targets[2] == pytest.approx(0.8)
        and targets[3] == pytest.approx(0.8)
    )
    assert targets[1] == pytest.approx(0.8 * (1 - (1 - 10 / 50) ** 3))
    assert [s for s in range(100) if algo.is_update_step(s)] == [10, 20, 30, 40, 50]
    w = torch.randn(32, 32)
    mask = torch.ones_like(w, dtype=torch.bool)
    for step in (10, 20, 30, 40, 50):
        new = algo.update_mask(
            w * mask, mask, algo.target_at(step), MaskContext("w", step, 0)
        )
        assert bool((new <= mask).all()), "gmp never revives a pruned weight"
        mask = new
    assert int((~mask).sum()) == round(0.8 * 1024)


@pytest.mark.parametrize("ramp", ["linear", "cosine"])
def test_gmp_other_ramps_reach_target(ramp):
    algo = algo_for(
        sparsity=0.6,
        algorithm="gmp",
        ramp=ramp,
        initial_sparsity=0.2,
        update_every=5,
        update_stop=20,
    )
    assert algo.target_at(0) == pytest.approx(0.2)
    assert algo.target_at(10) == pytest.approx(0.4)  # midpoint of both symmetric ramps
    assert algo.target_at(20) == pytest.approx(0.6)


def test_gmp_default_ramp_ends_at_three_quarters_of_phase():
    algo = algo_for(total=200, sparsity=0.9, algorithm="gmp")
    assert algo.update_stop == 150 and algo.update_every == 100


def test_runtime_projects_nm():
    algo = algo_for(sparsity="2:4")
    assert algo.name == "runtime" and algo.projects and algo.straight_through
    w = torch.randn(8, 16)
    mask = algo.project(w)
    # 2:4 on 4x4 tiles: the transposable greedy, the CUDA kernel's choice (~49% kept)
    assert torch.equal(mask, transposable_2to4_mask(w)) and is_transposable_2to4(mask)
    # other N:M targets and shapes: N largest |w| of every M along the input dimension
    w = torch.randn(6, 16)
    assert torch.equal(algo.project(w), target_mask(w.abs(), NM(2, 4)))
    assert int(algo_for(sparsity="1:4").project(torch.randn(8, 16)).sum()) == 32


def test_2to4_masks_of_stored_mask_algorithms_are_transposable():
    w = torch.randn(16, 32)
    for algo in (
        algo_for(sparsity="2:4", algorithm=a) for a in ("static", "magnitude")
    ):
        mask = algo.initial_mask(w, NM(2, 4), MaskContext("w", 0, 0))
        # exactly 2 per row and column of every 4x4 tile: exactly 50%, and the best such
        assert is_transposable_2to4(mask) and is_nm(mask, NM(2, 4))
        assert int(mask.sum()) == w.numel() // 2
        assert torch.equal(mask, optimal_transposable_2to4_mask(w))
        updated = algo.update_mask(w, mask, NM(2, 4), MaskContext("w", 5, 0))
        assert is_transposable_2to4(updated)
    # any real scores: the highest total score per tile (shifting keeps the argmax)
    score = torch.randn(8, 8)
    assert torch.equal(
        algo_for(sparsity="2:4", algorithm="static").select(score, NM(2, 4)),
        optimal_transposable_2to4_mask(score - score.min()),
    )
    # a convolution (4-D) keeps N of every M along its input dimension
    conv = torch.randn(8, 4, 2, 2)
    assert torch.equal(
        algo_for(sparsity="2:4", algorithm="static").select(conv.abs(), NM(2, 4)),
        target_mask(conv.abs(), NM(2, 4)),
    )


@pytest.mark.parametrize(
    ("phase", "message"),
    [
        (
            {"sparsity": 0.5, "update_every": 10},
            r"phases\[0\]: option 'update_every' does nothing for algorithm 'static'",
        ),
        (
            {"sparsity": 0.5, "algorithm": "runtime"},
            r"algorithm 'runtime' projects to an N:M pattern, but sparsity=0.5",
        ),
        (
            {"sparsity": "2:4", "algorithm": "gmp"},
            r"algorithm 'gmp' does not support N:M sparsity \(2:4\)",
        ),
        (
            {"sparsity": 0.5, "algorithm": "gmp", "initial_sparsity": 0.6},
            r"initial_sparsity=0.6 must be below the target sparsity=0.5",
        ),
        (
            {"sparsity": 0.5, "algorithm": "gmp", "ramp": "square"},
            r"ramp='square'; use one of \['cosine', 'cubic', 'linear'\]",
        ),
        (
            {"sparsity": 0.5, "algorithm": "prune_it"},
            r"phases\[0\].algorithm='prune_it' is not a registered algorithm; known: \[",
        ),
        (
            {"sparsity": 0.5, "distribution": "erk_typo"},
            r"distribution='erk_typo' is not available",
        ),
        (
            {
                "sparsity": 0.5,
                "algorithm": "magnitude",
                "update_start": 50,
                "update_stop": 20,
            },
            r"update_stop \(step 20\) is before update_start \(step 50\)",
        ),
    ],
)
def test_bad_algorithm_options(phase, message):
    with pytest.raises((ValueError, TypeError), match=message):
        algo_for(**phase)


def test_gmp_needs_known_phase_end():
    with pytest.raises(
        ValueError,
        match=r"the phase has no known end, so gmp cannot place its ramp: set update_stop",
    ):
        algo_for(total=float("inf"), sparsity=0.5, algorithm="gmp")
