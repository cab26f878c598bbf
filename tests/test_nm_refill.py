"""Refilling N:M groups and transposable 2:4 tiles: the exact rule, checked against brute force
(exact arithmetic, every pattern), on the torch operations and on the compiled CPU loops, which
must agree bit for bit."""

import sys
from fractions import Fraction

import pytest
import torch
from helpers import on_both_paths

from lightning_sparse.masks import NM, target_mask
from lightning_sparse.masks.refill import refill_groups_, refill_tiles_, tile_codes
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


def keys_for(kind, shape, dtype):
    """Keys of a kind (``None`` for random regrowth) and the seed to refill with."""
    if kind == "random":
        return None, 7
    values = keys_of(shape, kind == "ties", 3).to(dtype) - 0.5
    if kind == "nan":
        values.view(-1)[::7] = float("nan")
    return values, 0


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
def test_tiles_take_the_best_completion(mask_path, ties, fraction):
    shape = (16, 24)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(1))
    )
    dropped = dropped_from(mask, fraction, 2)
    survivors = mask & ~dropped
    keys = keys_of(shape, ties, 3)
    grown, done = grown_by(
        lambda mask, changed: refill_tiles_(mask, changed, keys),
        survivors,
        dropped,
    )
    new = survivors | grown
    assert done == 4 and is_transposable_2to4(new)
    new_codes = tile_codes(new)
    survivor_codes = tile_codes(survivors)
    key_tiles = keys.view(4, 4, 6, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    for t in range(24):
        assert int(new_codes[t]) == best_tile(int(survivor_codes[t]), key_tiles[t])


def test_tiles_at_random_are_valid_uniform_and_reproducible(mask_path):
    shape = (8, 8)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(4))
    )
    dropped = mask.clone()  # every tile empties: any of the 90 patterns may come
    survivors = torch.zeros_like(mask)
    seen = {}
    for seed in range(300):
        new = mask.clone()
        assert refill_tiles_(new, dropped.clone(), None, seed=seed) == 2
        assert is_transposable_2to4(new) and int(new.sum()) == 32
        code = int(tile_codes(new)[0])
        seen[code] = seen.get(code, 0) + 1
    assert len(seen) > 80, "uniform over the 90 patterns"
    again = [grown_by(random_refill(5), survivors, dropped)[0] for _ in range(2)]
    assert torch.equal(*again)


def random_refill(seed):
    return lambda mask, changed: refill_tiles_(mask, changed, None, seed=seed)


@pytest.mark.parametrize("keys_kind", ["gaussian", "ties", "nan", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_tiles_choose_what_the_torch_ops_choose(keys_kind, dtype):
    """With the [cpu] extra, tile refills on CPU float tensors run a compiled loop over the
    tiles; it regrows exactly what the torch operations regrow, ties and NaN included."""
    shape = (64, 96)
    mask = optimal_transposable_2to4_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(1))
    )
    dropped = dropped_from(mask, 0.5, 2)
    survivors = mask & ~dropped
    keys, seed = keys_for(keys_kind, shape, dtype)
    expected, compiled = on_both_paths(
        lambda: grown_by(
            lambda mask, changed: refill_tiles_(mask, changed, keys, True, seed),
            survivors,
            dropped,
        )[0]
    )
    assert is_transposable_2to4(survivors | compiled)
    assert torch.equal(compiled, expected)


@pytest.mark.parametrize("by_keys", [False, True])
def test_tiles_stop_at_a_tile_row_that_was_not_transposable(mask_path, by_keys):
    """Leading tile rows before the first tile whose survivors fit no pattern are refilled,
    on every path; the rest are left as they were (the caller refills them by groups)."""
    mask = optimal_transposable_2to4_mask(
        torch.rand(8, 4, generator=torch.Generator().manual_seed(1))
    )
    dropped = mask.clone()
    mask[4, :3] = True  # three in a tile row: no 2:4 pattern contains them
    dropped[4] = False
    before = mask.clone(), dropped.clone()
    keys = keys_of((8, 4), False, 2) if by_keys else None
    done = 4 * refill_tiles_(mask, dropped, keys, seed=3)
    assert done == 4
    assert is_transposable_2to4(mask[:done]) and int(mask[:done].sum()) == 2 * done
    assert torch.equal(dropped[:done], before[0][:done] ^ mask[:done])
    assert torch.equal(mask[done:], before[0][done:])
    assert torch.equal(dropped[done:], before[1][done:])


@pytest.mark.parametrize("target", [NM(2, 4), NM(1, 4), NM(4, 8), NM(3, 16)])
@pytest.mark.parametrize("keys_kind", ["distinct", "ties", "nan"])
def test_groups_keep_survivors_and_take_the_best_free_positions(
    mask_path, target, keys_kind
):
    shape = (6, 4 * target.m)
    mask = target_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(5)), target
    )
    survivors = mask & ~dropped_from(mask, 0.6, 6)
    keys = keys_of(shape, keys_kind == "ties", 7)
    if keys_kind == "nan":  # NaN counts as -inf: still exactly n per group
        keys.view(-1)[::3] = float("nan")
    grown, _ = grown_by(
        lambda mask, changed: refill_groups_(mask, changed, target, keys),
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
def test_compiled_groups_choose_what_the_torch_ops_choose(target, keys_kind, dtype):
    """With the [cpu] extra, refills of groups up to 8 on CPU float tensors run a compiled
    loop; it regrows exactly what the torch operations regrow, ties and NaN included."""
    shape = (50, 6 * target.m)  # 300 groups
    mask = target_mask(
        torch.rand(shape, generator=torch.Generator().manual_seed(5)), target
    )
    survivors = mask & ~dropped_from(mask, 0.6, 6)
    keys, seed = keys_for(keys_kind, shape, dtype)
    expected, compiled = on_both_paths(
        lambda: grown_by(
            lambda mask, changed: refill_groups_(
                mask, changed, target, keys, True, seed
            ),
            survivors,
            mask & ~survivors,
        )[0]
    )
    new = (survivors | compiled).view(-1, target.m)
    assert bool((new.sum(1) == target.n).all())
    assert torch.equal(compiled, expected)


def test_tiles_on_a_big_endian_machine_take_the_torch_ops(monkeypatch):
    """The compiled tile loop reads 4 flags as a little-endian word; elsewhere the torch
    operations (which read words in native order) refill, with the same result."""
    mask = optimal_transposable_2to4_mask(
        torch.rand(16, 16, generator=torch.Generator().manual_seed(8))
    )
    dropped = dropped_from(mask, 0.5, 9)
    survivors = mask & ~dropped
    little, _ = grown_by(random_refill(4), survivors, dropped)
    monkeypatch.setattr(sys, "byteorder", "big")
    assert torch.equal(grown_by(random_refill(4), survivors, dropped)[0], little)
