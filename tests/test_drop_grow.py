"""set / rigl: drop-and-grow invariants, RigL's choice, seeding, schedules, training, resume."""

import zlib

import lightning as L
import pytest
import torch
from helpers import TinyModule, fast_trainer, random_loader, resumable_fit
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms import MaskContext, build_algorithm
from lightning_sparse.algorithms.drop_grow import drop_and_grow
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import NM, is_nm, mark_top_k, num_kept, target_mask
from lightning_sparse.masks.tiles import is_transposable_2to4


def algo_for(total=100, **phase):
    return build_algorithm(resolve_phases([Phase(**phase)], total_steps=total)[0])


def random_mask(shape, target, seed):
    return target_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(seed)), target
    )


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    groups=st.integers(1, 10),
    target=st.sampled_from([0.0, 0.3, 0.75, 0.95, NM(2, 4), NM(1, 4), NM(4, 8)]),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_drop_and_grow_invariants(rows, groups, target, fraction, seed):
    m = target.m if isinstance(target, NM) else 4
    shape = (rows, groups * m)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen)
    grow = torch.randn(shape, generator=gen)
    mask = random_mask(shape, target, seed)
    weight = weight * mask
    n_active = int(mask.sum())
    n_drop = round(fraction * n_active)
    new = drop_and_grow(weight, grow.clone(), mask, n_drop, target)
    # the target holds exactly
    if isinstance(target, NM):
        groups_new = new.reshape(rows, -1, target.m).sum(-1)
        assert bool((groups_new == target.n).all())
    else:
        assert int(new.sum()) == num_kept(new.numel(), target)
    # survivors are the largest-magnitude active weights (no ties: random weights)
    magnitude = weight.abs()[mask].sort().values
    threshold = magnitude[n_drop - 1] if n_drop else -1.0
    survivors = mask & (weight.abs() > threshold)
    assert int(survivors.sum()) == n_active - n_drop
    assert bool((new[survivors]).all())
    # the rest of the new mask is the best-scoring of the others (dropped ones may come back)
    grown = new & ~survivors
    if grown.any() and (~new).any():
        assert grow[grown].min() >= grow[~new].max() or isinstance(target, NM)


@settings(max_examples=40, deadline=None)
@given(
    tile_rows=st.integers(1, 4),
    tile_cols=st.integers(1, 6),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_transposable_2to4_stays_transposable(tile_rows, tile_cols, fraction, seed):
    shape = (4 * tile_rows, 4 * tile_cols)
    gen = torch.Generator().manual_seed(seed)
    select = algo_for(sparsity="2:4", algorithm="rigl").select
    mask = select(torch.rand(shape, generator=gen), NM(2, 4))
    assert is_transposable_2to4(mask)
    weight = torch.randn(shape, generator=gen) * mask
    n_active = int(mask.sum())
    n_drop = round(fraction * n_active)
    new = drop_and_grow(
        weight, torch.rand(shape, generator=gen), mask, n_drop, NM(2, 4), "tiles"
    )
    assert is_transposable_2to4(new)
    tiles = new.reshape(tile_rows, 4, tile_cols, 4).sum((1, 3))
    assert bool((tiles == 8).all()), "every tile keeps exactly 2 per row and column"
    magnitude = weight.abs()[mask].sort().values
    threshold = magnitude[n_drop - 1] if n_drop else -1.0
    survivors = mask & (weight.abs() > threshold)
    assert bool(new[survivors].all()), "survivors stay"


def test_2to4_tiles_from_one_that_is_not_transposable_on_refill_by_groups(mask_path):
    """A 2:4 mask whose second tile row is not transposable (3 in a column of a tile, still
    2 of every 4 along the rows): from it on, on every path, the groups of 4 along the rows
    are refilled; N:M holds everywhere and the tile rows before it stay transposable."""
    gen = torch.Generator().manual_seed(0)
    select = algo_for(sparsity="2:4", algorithm="rigl").select
    mask = select(torch.rand(12, 8, generator=gen), NM(2, 4))
    mask[4:8, :4] = torch.tensor(
        [[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0]]
    )
    assert is_nm(mask, NM(2, 4)) and not is_transposable_2to4(mask)
    weight = torch.randn(12, 8, generator=gen) * mask
    weight[4:8, :4] += 10 * weight[4:8, :4].sign()  # (the tile keeps its 3 in a column)
    grow = torch.rand(12, 8, generator=gen)
    new = drop_and_grow(weight, grow, mask, 20, NM(2, 4), "tiles")
    assert is_nm(new, NM(2, 4)) and int(new.sum()) == int(mask.sum())
    assert is_transposable_2to4(new[:4])
    survivors = mask & (weight.abs() > weight.abs()[mask].sort().values[19])
    assert bool(new[survivors].all()), "survivors stay"


def test_rigl_regrows_exactly_the_top_gradient_positions():
    algo = algo_for(
        sparsity=0.5,
        algorithm="rigl",
        update_every=1,
        drop_fraction=0.5,
        drop_fraction_decay="constant",
    )
    weight = torch.tensor([[3.0, 0.0, -0.5, 0.0], [0.0, 2.0, 0.0, -1.0]])
    mask = weight != 0
    grad = torch.tensor([[0.1, -9.0, 5.0, 0.2], [7.0, 0.3, 0.0, -0.1]])
    new = algo.update_mask(weight, mask, 0.5, MaskContext("w", 1, 0, grad))
    # active |w|: 3, 0.5, 2, 1 -> drop the two smallest (0.5 and 1); regrow where |grad| is
    # largest among the rest: -9.0 (0, 1) and 7.0 (1, 0) (5.0 sits on a dropped weight)
    assert new.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_rigl_keeps_a_layer_without_gradient_and_set_is_seeded():
    rigl = algo_for(sparsity=0.5, algorithm="rigl", update_every=1)
    mask = random_mask((8, 8), 0.5, 0)
    weight = torch.randn(8, 8) * mask
    assert torch.equal(
        rigl.update_mask(weight, mask, 0.5, MaskContext("w", 3, 0)), mask
    )
    set_a = algo_for(sparsity=0.5, algorithm="set", update_every=1, seed=5)
    masks = {
        (name, step, seed): algo_for(
            sparsity=0.5, algorithm="set", update_every=1, seed=seed
        ).update_mask(weight, mask, 0.5, MaskContext(name, step, seed))
        for name in ("a", "b")
        for step in (3, 4)
        for seed in (5, 6)
    }
    again = set_a.update_mask(weight, mask, 0.5, MaskContext("a", 3, 5))
    assert torch.equal(again, masks["a", 3, 5])
    assert len({tuple(m.flatten().tolist()) for m in masks.values()}) == len(masks)


def make_net(order):
    torch.manual_seed(0)  # every rank starts from the same weights
    net = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4)
    )
    # a rank may list its parameters in any order
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    return net, targets if order == 0 else targets[::-1]


@settings(max_examples=20, deadline=None)
@given(
    algorithm=st.sampled_from(["set", "rigl"]),
    sparsity=st.sampled_from([0.5, 0.9, "2:4"]),
    distribution=st.sampled_from(["uniform", "erk", "global"]),
    seed=st.integers(0, 1000),
)
def test_same_masks_on_every_rank_and_for_the_same_seed(
    algorithm, sparsity, distribution, seed
):
    if sparsity == "2:4":
        distribution = "uniform"
    phase = Phase(
        sparsity=sparsity,
        algorithm=algorithm,
        seed=seed,
        init="random",
        distribution=distribution,
        update_every=1,
    )
    results = []
    for order in (0, 1, 0):  # rank 0, rank 1 (other parameter order), a second run
        net, targets = make_net(order)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sp = Sparsifier("g", targets, resolve_phases([phase], total_steps=20))
        sp.on_step_start(0, [opt])
        for step in (1, 2):
            for (
                name,
                p,
            ) in net.named_parameters():  # all-reduced: the same on every rank
                gen = torch.Generator().manual_seed(
                    zlib.crc32(f"{name}{step}".encode())
                )
                p.grad = torch.randn(p.shape, generator=gen)
            sp.before_optimizer_step(step, opt, [opt])
        results.append({name: m.clone() for name, m in sp.masks.items()})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name])
        assert torch.equal(results[0][name], results[2][name])


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        ("cosine", [0.3, 0.15, 0.0, 0.0]),
        ("linear", [0.3, 0.15, 0.0, 0.0]),
        ("constant", [0.3, 0.3, 0.3, 0.3]),
    ],
)
def test_drop_fraction_decays_to_zero_at_update_stop(decay, expected):
    algo = algo_for(
        sparsity=0.9,
        algorithm="set",
        update_start=10,
        update_stop=30,
        drop_fraction_decay=decay,
    )
    values = [algo.drop_fraction_at(s) for s in (10, 20, 30, 40)]
    assert values == pytest.approx(expected)


def test_dst_defaults_and_schedule_form():
    algo = algo_for(total=200, sparsity=0.9, algorithm="rigl")
    assert algo.update_stop == 150 and algo.drop_fraction == 0.3
    assert algo.decay == "cosine" and algo.needs_grad
    assert algo.drop_fraction_at(75) == pytest.approx(0.15)
    scheduled = algo_for(
        sparsity=0.9,
        algorithm="rigl",
        drop_fraction={"type": "cosine", "init": 0.4, "half_period": 100},
    )
    assert scheduled.drop_fraction_at(50) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("phase", "message"),
    [
        (
            {"drop_fraction": 1.5},
            r"drop_fraction=1.5 is the fraction of active weights",
        ),
        ({"drop_fraction": "lots"}, r"drop_fraction='lots'; use a number in \[0, 1\]"),
        ({"drop_fraction_decay": "exp"}, r"drop_fraction_decay='exp'; use one of"),
        (
            {
                "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 10},
                "drop_fraction_decay": "linear",
            },
            r"drop_fraction_decay does nothing when drop_fraction is a schedule",
        ),
        ({"drop_fraction": {"type": "sine"}}, r"schedule type='sine' is unknown"),
        ({"ramp": "cubic"}, r"option 'ramp' does nothing for algorithm 'set'"),
    ],
)
def test_bad_dst_options_are_named(phase, message):
    with pytest.raises((ValueError, TypeError), match=message):
        algo_for(sparsity=0.9, algorithm="set", **phase)


def test_decay_needs_a_known_end():
    with pytest.raises(
        ValueError, match=r"drop_fraction cannot decay to zero at update_stop"
    ):
        algo_for(total=float("inf"), sparsity=0.9, algorithm="rigl")
    algo_for(
        total=float("inf"),
        sparsity=0.9,
        algorithm="rigl",
        drop_fraction_decay="constant",
    )


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 20),
    length=st.integers(1, 60),
    update_start=st.integers(0, 30),
    every=st.integers(1, 7),
    stop=st.one_of(st.none(), st.integers(1, 90)),
    step=st.integers(0, 100),
)
def test_update_index_counts_the_mask_choices(
    start, length, update_start, every, stop, step
):
    phases = [Phase(sparsity=0.0, until=start)] if start else []
    phases.append(
        Phase(
            sparsity=0.5,
            algorithm="set",
            until=start + length,
            update_every=every,
            update_start=start + update_start if start + update_start else None,
            update_stop=max(stop or start + length, start + update_start, 1),
            drop_fraction_decay="constant",
        )
    )
    phases.append(Phase(sparsity=0.0))
    resolved = resolve_phases(phases, total_steps=start + length + 10)
    algo = build_algorithm(resolved[-2])
    step = start + step % length
    expected = 0 if step <= start else 1 + sum(map(algo.is_update_step, range(step)))
    assert algo.update_index(step) == expected


class MaskProbe(L.Callback):
    """After the SparsityCallback, before the optimizer step: what the step will start from."""

    def __init__(self, cb):
        self.cb = cb
        self.checked_updates = 0
        self.previous = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sp = self.cb.sparsifier
        step = trainer.global_step
        algo = sp.algorithm
        targets = algo.layer_targets(
            step, {t.name: t.param for t in sp.targets}, sp.masks
        )
        for t in sp.targets:
            mask = sp.masks[t.name]
            target = targets[t.name]
            if isinstance(target, NM):
                assert is_transposable_2to4(mask), "2:4 on 4x4 tiles stays transposable"
                assert (
                    is_nm(mask, target)
                    and int(mask.sum()) * target.m == mask.numel() * target.n
                )
            else:
                assert int(mask.sum()) == num_kept(mask.numel(), target)
            assert bool((t.param[~mask] == 0).all()), "pruned weights are zero"
            assert bool((t.param.grad[~mask] == 0).all()), "and get no gradient"
            state = optimizer.state.get(t.param, {})
            if self.previous is not None and sp.last_update_step == step:
                regrown = mask & ~self.previous[t.name]
                assert bool((t.param[regrown] == 0).all()), (
                    "regrown weights start at zero"
                )
                for value in state.values():
                    if torch.is_tensor(value) and value.shape == mask.shape:
                        assert bool((value[regrown] == 0).all()), "with zeroed state"
                self.checked_updates += regrown.any().item()
        self.previous = {name: m.clone() for name, m in sp.masks.items()}


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
@pytest.mark.parametrize(
    ("sparsity", "distribution"),
    [(0.8, "uniform"), (0.8, "erk"), (0.8, "global"), ("2:4", None)],
)
def test_training_keeps_exact_targets_after_every_update(
    algorithm, sparsity, distribution
):
    phase = {
        "sparsity": sparsity,
        "algorithm": algorithm,
        "update_every": 2,
        "drop_fraction_decay": "constant",
    }
    if distribution:
        phase["distribution"] = distribution
    cb = SparsityCallback(phases=[phase], verbose=False)
    probe = MaskProbe(cb)
    L.seed_everything(0, verbose=False)
    fast_trainer(max_steps=10, callbacks=[cb, probe]).fit(TinyModule(), random_loader())
    assert cb.sparsifier.last_update_step == 8
    assert probe.checked_updates > 0


class RecordingRigL(L.Callback):
    """Before the SparsityCallback: the accumulated gradient as Lightning hands it over."""

    def __init__(self):
        self.grads = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads[trainer.global_step] = pl_module.net.fc1.weight.grad.clone()


def test_rigl_ranks_the_accumulated_dense_gradient(monkeypatch):
    seen = {}
    from lightning_sparse.algorithms.drop_grow import RigL

    original = RigL.grow_score

    def spy(self, weight, mask, ctx):
        if ctx.name == "net.fc1.weight":
            seen[ctx.step] = (ctx.grad.clone(), mask.clone())
        return original(self, weight, mask, ctx)

    monkeypatch.setattr(RigL, "grow_score", spy)
    cb = SparsityCallback(
        phases=[
            {
                "sparsity": 0.75,
                "algorithm": "rigl",
                "update_every": 2,
                "drop_fraction_decay": "constant",
            }
        ],
        verbose=False,
    )
    recorder = RecordingRigL()
    trainer = fast_trainer(
        max_steps=6, accumulate_grad_batches=3, callbacks=[recorder, cb]
    )
    trainer.fit(TinyModule(), random_loader(n=144))
    assert sorted(seen) == [2, 4]
    for step, (grad, mask) in seen.items():
        assert torch.equal(
            grad, recorder.grads[step]
        )  # all 3 micro-batches, not yet masked
        assert bool((grad[~mask] != 0).any()), "pruned positions have dense gradients"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradients_skip_the_update_and_say_so(bad):
    logs = []
    net = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    phase = Phase(
        sparsity=0.5, algorithm="rigl", update_every=1, drop_fraction_decay="constant"
    )
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["0.weight"]).targets,
        resolve_phases([phase], total_steps=10),
        log=logs.append,
    )
    sp.on_step_start(0, [opt])
    before = sp.masks["0.weight"].clone()
    net[0].weight.grad = torch.randn(8, 8)
    net[0].weight.grad[0, 0] = bad
    assert sp.before_optimizer_step(1, opt, [opt]) is False
    assert torch.equal(sp.masks["0.weight"], before) and sp.last_update_step == -1
    assert logs == ["[g] step 1: mask update skipped: non-finite weights or gradients"]
    net[0].weight.grad = torch.full((8, 8), 3e38)  # finite, though its sum is not
    assert sp.before_optimizer_step(2, opt, [opt]) is True


def test_at_most_one_update_per_step_also_after_restoring_state():
    net = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    targets = select_parameters(net, params=["0.weight"]).targets
    phases = resolve_phases(
        [
            Phase(
                sparsity=0.5,
                algorithm="set",
                update_every=1,
                drop_fraction_decay="constant",
            )
        ],
        10,
    )
    sp = Sparsifier("g", targets, phases)
    sp.on_step_start(0, [opt])
    net[0].weight.grad = torch.randn(8, 8)
    assert sp.before_optimizer_step(3, opt, [opt]) is True
    after = sp.masks["0.weight"].clone()
    assert (
        sp.before_optimizer_step(3, opt, [opt]) is False
    )  # a second optimizer, same step
    restored = Sparsifier("g", targets, phases)
    restored.load_state_dict(sp.state_dict(), [opt])
    assert (
        restored.before_optimizer_step(3, opt, [opt]) is False
    )  # resumed inside step 3
    assert torch.equal(restored.masks["0.weight"], after)
    assert restored.before_optimizer_step(4, opt, [opt]) is True


def resume_run(tmp_path, phases, stop_at=None, ckpt_path=None):
    callback = SparsityCallback(phases=phases, verbose=False)
    return resumable_fit(tmp_path, [callback], 12, stop_at, ckpt_path), callback


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
@pytest.mark.parametrize("resume_step", [3, 4])
def test_resume_is_bitwise_equal(tmp_path, algorithm, resume_step):
    phases = [
        {"sparsity": "2:4", "algorithm": algorithm, "update_every": 2, "until": 6},
        {
            "sparsity": 0.7,
            "algorithm": algorithm,
            "update_every": 1,
            "distribution": "erk",
        },
    ]
    reference, ref_cb = resume_run(tmp_path / "ref", phases)
    resume_run(tmp_path / "ck", phases, stop_at=resume_step)
    resumed, cb = resume_run(
        tmp_path / "res", phases, ckpt_path=tmp_path / "ck" / f"step={resume_step}.ckpt"
    )
    for (key, a), b in zip(
        reference.state_dict().items(), resumed.state_dict().values()
    ):
        assert torch.equal(a, b), key
    for name, mask in ref_cb.sparsifier.masks.items():
        assert torch.equal(mask, cb.sparsifier.masks[name])


def test_a_layer_count_off_target_is_brought_to_it_exactly():
    # a DST layer whose mask count differs from the target (e.g. a hand-made mask) is
    # brought to the target exactly by its next update
    mask = mark_top_k(torch.rand(10, 10), 40)
    new = drop_and_grow(torch.randn(10, 10) * mask, torch.rand(10, 10), mask, 5, 0.5)
    assert int(new.sum()) == 50
