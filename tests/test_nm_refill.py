"""Refilling N:M groups and transposable 2:4 tiles: the exact rule, checked against brute force
(exact arithmetic, every pattern), on the NumPy and the torch paths."""

import sys
from fractions import Fraction

import pytest
import torch

from lightning_sparse.kernels import loops as cpu_kernels
from lightning_sparse.masks import NM, topk_mask
from lightning_sparse.masks import elementwise as array_ops
from lightning_sparse.masks.elementwise import ops_for
from lightning_sparse.masks.refill import (
    GroupKeys,
    TileKeys,
    refill_groups_,
    refill_tiles_,
    tile_codes,
)
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
)

CODES = sorted(
    code
    for code in range(1 << 16)
    if all((code >> (4 * r) & 0xF).bit_count() == 2 for r in range(4))
    and all(sum(code >> (4 * r + c) & 1 for r in range(4)) == 2 for c in range(4))
)


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(array_ops, "numpy_view", lambda tensor: None)
    return request.param


def dropped_from(mask, fraction, seed):
    gen = torch.Generator().manual_seed(seed)
    return mask & (torch.rand(mask.shape, generator=gen) < fraction)


def grown_by(refill, survivors, dropped):
    """Run ``refill(mask, changed)`` (in place) on the mask before ``dropped``; check that
    ``changed`` became what changed and the survivors stayed. Returns ``(grown, result)``."""
    mask, changed = survivors | dropped, dropped.clone()
    result = refill(mask, changed)
    assert torch.equal(changed, (survivors | dropped) ^ mask)
    assert not bool((survivors & ~mask).any())
    return mask & ~survivors, result


def keys_of(shape, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: exact ties between completions
        return torch.randint(0, 3, shape, generator=gen).float()
    return torch.rand(shape, generator=gen)


def on_both_paths(refill, key_array, survivors, keys_kind, dtype, monkeypatch):
    """``refill(ops, keys, seed)`` through the compiled CPU loop and through the array ops
    (keys: ``key_array(ops, values)`` of ``keys_kind`` values shaped like ``survivors``, then
    the same keys as a plain callable on the NumPy path; random: on the torch path)."""
    ops = ops_for(survivors)
    if keys_kind == "random":
        compiled = refill(ops, None, 7)
        monkeypatch.setattr(array_ops, "numpy_view", lambda tensor: None)
        return compiled, refill(ops_for(survivors), None, 7)
    values = keys_of(survivors.shape, keys_kind == "ties", 3).to(dtype) - 0.5
    if keys_kind == "nan":
        values.view(-1)[::7] = float("nan")
    keys = key_array(ops, ops.array(values))
    return refill(ops, keys, 0), refill(ops, lambda index: keys(index), 0)


def best_tile(survivor_code, keys):
    """Brute force: the first pattern (ascending code) containing the survivors with the
    largest exact sum of keys over the positions it adds."""
    best, best_sum = None, None
    for code in CODES:
        if code & survivor_code != survivor_code:
            continue
        total = sum(
            Fraction(float(keys[p]))
            for p in range(16)
            if code >> p & 1 and not survivor_code >> p & 1
        )
        if best_sum is None or total > best_sum:
            best, best_sum = code, total
    return best


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("fraction", [0.2, 0.5, 1.0])
def test_tiles_take_the_best_completion(path, ties, fraction):
    shape = (16, 24)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(1))
    )
    dropped = dropped_from(mask, fraction, 2)
    survivors = mask & ~dropped
    keys = keys_of(shape, ties, 3)
    ops = ops_for(survivors, keys)
    tiles = ops.array(keys).reshape(4, 4, 6, 4)
    grown, done = grown_by(
        lambda mask, changed: refill_tiles_(
            ops,
            mask,
            changed,
            lambda index: tiles[index // 6, :, index % 6, :].reshape(-1, 16),
        ),
        survivors,
        dropped,
    )
    new = survivors | grown
    assert done == 4 and is_transposable_2to4(new)
    new_codes = tile_codes(ops, ops.array(new))
    survivor_codes = tile_codes(ops, ops.array(survivors))
    key_tiles = keys.view(4, 4, 6, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    for t in range(24):
        assert int(new_codes[t]) == best_tile(int(survivor_codes[t]), key_tiles[t])


def test_tiles_at_random_are_valid_uniform_and_reproducible(path):
    shape = (8, 8)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(4))
    )
    dropped = mask.clone()  # every tile empties: any of the 90 patterns may come
    survivors = torch.zeros_like(mask)
    ops = ops_for(survivors)
    seen = {}
    for seed in range(300):
        new = mask.clone()
        assert refill_tiles_(ops, new, dropped.clone(), None, seed) == 2
        assert is_transposable_2to4(new) and int(new.sum()) == 32
        code = int(tile_codes(ops, ops.array(new))[0])
        seen[code] = seen.get(code, 0) + 1
    assert len(seen) > 80, "uniform over the 90 patterns"
    again = [grown_by(random_refill(ops, 5), survivors, dropped)[0] for _ in range(2)]
    assert torch.equal(*again)


def random_refill(ops, seed):
    return lambda mask, changed: refill_tiles_(ops, mask, changed, None, seed)


@pytest.mark.parametrize("keys_kind", ["gaussian", "ties", "nan", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_tiles_choose_what_the_array_ops_choose(keys_kind, dtype, monkeypatch):
    """On the CPU, :class:`TileKeys` and random refills run a compiled loop over the tiles; it
    regrows exactly what the NumPy (keys: any callable) and torch (random) paths regrow."""
    shape = (64, 96)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(1))
    )
    dropped = dropped_from(mask, 0.5, 2)
    survivors = mask & ~dropped
    compiled, expected = on_both_paths(
        lambda ops, keys, seed: grown_by(
            lambda mask, changed: refill_tiles_(ops, mask, changed, keys, seed),
            survivors,
            dropped,
        )[0],
        lambda ops, values: TileKeys(ops, values, magnitude=True),
        survivors,
        keys_kind,
        dtype,
        monkeypatch,
    )
    assert is_transposable_2to4(survivors | compiled)
    assert torch.equal(compiled, expected)


@pytest.mark.parametrize("by_keys", [False, True])
def test_tiles_stop_at_a_tile_row_that_was_not_transposable(path, by_keys):
    """Leading tile rows before the first tile whose survivors fit no pattern are refilled
    (the compiled loop goes tile row by tile row, the array ops by chunks of tile rows); the
    rest are left as they were (the caller chooses them another way)."""
    mask = optimal_transposable_2to4_mask(
        torch.rand(8, 4, generator=torch.Generator().manual_seed(1))
    )
    dropped = mask.clone()
    mask[4, :3] = True  # three in a tile row: no 2:4 pattern contains them
    dropped[4] = False
    before = mask.clone(), dropped.clone()
    ops = ops_for(mask)
    keys = TileKeys(ops, ops.array(keys_of((8, 4), False, 2))) if by_keys else None
    done = 4 * refill_tiles_(ops, mask, dropped, keys, 3)
    assert done == (4 if path == "numpy" else 0)
    if done:
        assert is_transposable_2to4(mask[:done]) and int(mask[:done].sum()) == 2 * done
    assert torch.equal(dropped[:done], before[0][:done] ^ mask[:done])
    assert torch.equal(mask[done:], before[0][done:])
    assert torch.equal(dropped[done:], before[1][done:])


@pytest.mark.parametrize("target", [NM(2, 4), NM(1, 4), NM(4, 8), NM(3, 16)])
@pytest.mark.parametrize("keys_kind", ["distinct", "ties", "nan"])
def test_groups_keep_survivors_and_take_the_best_free_positions(
    path, target, keys_kind
):
    shape = (6, 4 * target.m)
    mask = topk_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(5)), target
    )
    survivors = mask & ~dropped_from(mask, 0.6, 6)
    keys = keys_of(shape, keys_kind == "ties", 7)
    if keys_kind == "nan":  # NaN counts as -inf: still exactly n per group
        keys.view(-1)[::3] = float("nan")
    ops = ops_for(survivors, keys)
    groups = ops.array(keys).reshape(-1, target.m)
    grown, _ = grown_by(
        lambda mask, changed: refill_groups_(
            ops, mask, changed, target, lambda index: groups[index]
        ),
        survivors,
        mask & ~survivors,
    )
    new = (survivors | grown).view(-1, target.m)
    assert bool((new.sum(1) == target.n).all())
    ranked = keys.nan_to_num(nan=-float("inf"))
    for g, (kept, key) in enumerate(
        zip(survivors.view(-1, target.m), ranked.view(-1, target.m))
    ):
        free = [p for p in range(target.m) if not kept[p]]
        free.sort(key=lambda p: (-float(key[p]), p))
        expected = set(free[: target.n - int(kept.sum())])
        assert {
            p for p in range(target.m) if grown.view(-1, target.m)[g, p]
        } == expected


@pytest.mark.parametrize("target", [NM(2, 4), NM(1, 4), NM(4, 8), NM(1, 2), NM(3, 6)])
@pytest.mark.parametrize("keys_kind", ["gaussian", "ties", "nan", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_groups_choose_what_the_array_ops_choose(
    target, keys_kind, dtype, monkeypatch
):
    """On the CPU, :class:`GroupKeys` and random refills of groups up to 8 run a compiled
    loop; it regrows exactly what the NumPy (keys: any callable) and torch (random) paths do."""
    shape = (50, 6 * target.m)  # 300 groups
    mask = topk_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(5)), target
    )
    survivors = mask & ~dropped_from(mask, 0.6, 6)
    compiled, expected = on_both_paths(
        lambda ops, keys, seed: grown_by(
            lambda mask, changed: refill_groups_(
                ops, mask, changed, target, keys, seed
            ),
            survivors,
            mask & ~survivors,
        )[0],
        lambda ops, values: GroupKeys(ops, values, target.m, magnitude=True),
        survivors,
        keys_kind,
        dtype,
        monkeypatch,
    )
    new = (survivors | compiled).view(-1, target.m)
    assert bool((new.sum(1) == target.n).all())
    assert torch.equal(compiled, expected)


def test_tiles_on_a_big_endian_machine_take_the_array_ops(monkeypatch):
    """The compiled tile loop reads 4 flags as a little-endian word; elsewhere the array ops
    (which read words in native order) refill, with the same result."""
    mask = optimal_transposable_2to4_mask(
        torch.rand(16, 16, generator=torch.Generator().manual_seed(8))
    )
    dropped = dropped_from(mask, 0.5, 9)
    survivors = mask & ~dropped
    ops = ops_for(mask)
    compiled, _ = grown_by(random_refill(ops, 4), survivors, dropped)
    monkeypatch.setattr(sys, "byteorder", "big")
    monkeypatch.setattr(cpu_kernels, "refill_tiles", None)  # not called
    assert torch.equal(grown_by(random_refill(ops, 4), survivors, dropped)[0], compiled)
