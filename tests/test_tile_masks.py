"""Transposable 2:4 tile masks: properties, exact agreement with torch's Python reference, optimality."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch
from torch.sparse._semi_structured_conversions import _sparse_semi_structured_tile

from lightning_sparse.masks import tiles as tile_masks
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
    transposable_2to4_mask,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
FAST_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference_values(weight: torch.Tensor) -> torch.Tensor:
    """torch's reference on ``|w|``: the kept magnitudes, pruned entries zeroed (it works in place)."""
    return _sparse_semi_structured_tile(weight.abs().clone())


def reference_mask(weight: torch.Tensor) -> torch.Tensor:
    """The exact keep-mask of torch's reference on ``|w|``, kept zeros included.

    The reference returns values, so a kept 0 is indistinguishable from a pruned entry. Feeding it
    the dense rank (1, 2, ...) of every ``|w|`` instead keeps the order and the ties but no zeros.
    """
    _, rank = torch.unique(weight.abs().double(), return_inverse=True)
    return _sparse_semi_structured_tile((rank + 1).double()) != 0


def tile_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept per tile row and per tile column, each shaped ``(tile_rows, tile_cols, 4)``."""
    flat = mask.reshape(mask.shape[0], -1)
    tiles = (
        flat.view(flat.shape[0] // 4, 4, flat.shape[1] // 4, 4)
        .permute(0, 2, 1, 3)
        .int()
    )
    return tiles.sum(3), tiles.sum(2)


def tile_sums(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Kept ``sum |w|`` of every 4x4 tile, in float64."""
    kept = (weight.abs().double() * mask).reshape(weight.shape[0], -1)
    return kept.view(kept.shape[0] // 4, 4, kept.shape[1] // 4, 4).sum((1, 3))


def integer_weights(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Small integers: many ties (and zeros, and both signs of the same magnitude)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def gaussian_weights(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


# --- agreement with torch's reference ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_reference_on_gaussian_weights(
    dtype: torch.dtype, seed: int
) -> None:
    w = gaussian_weights((64, 128), seed, dtype)
    mask = transposable_2to4_mask(w)
    assert torch.equal(reference_values(w), w.abs() * mask)
    assert torch.equal(mask, reference_mask(w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_reference_with_ties(dtype: torch.dtype, seed: int) -> None:
    w = integer_weights((64, 128), seed, dtype)
    assert torch.equal(transposable_2to4_mask(w), reference_mask(w))


@pytest.mark.parametrize("shape", [(4, 4), (8, 4), (4, 12), (12, 40), (8, 2, 2, 2)])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_greedy_matches_reference_on_other_shapes(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    for w in (gaussian_weights(shape, 3, dtype), integer_weights(shape, 3, dtype)):
        flat = w.reshape(shape[0], -1)
        assert torch.equal(transposable_2to4_mask(w), reference_mask(flat).view(shape))


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_greedy_matches_reference_on_extreme_values(dtype: torch.dtype) -> None:
    """Tiny and huge magnitudes, +-0, +-inf and NaNs (which torch's sort ranks above inf)."""
    gen = torch.Generator().manual_seed(4)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")]
    )
    tiny = torch.finfo(dtype).tiny
    w = (
        torch.randn(32, 64, generator=gen)
        * torch.tensor([tiny, 1.0, 1e4]).repeat(64)[:64]
    )
    pick = torch.rand(32, 64, generator=gen) < 0.2
    w = torch.where(pick, specials[torch.randint(0, 6, (32, 64), generator=gen)], w).to(
        dtype
    )
    mask = transposable_2to4_mask(w)
    assert torch.equal(reference_values(w) != 0, mask & (w != 0))
    assert is_transposable_2to4(mask)


def test_greedy_matches_reference_on_integer_weights() -> None:
    w = integer_weights((16, 32), 5, torch.int64)
    assert torch.equal(transposable_2to4_mask(w), reference_mask(w))


def test_greedy_ignores_signs() -> None:
    w = gaussian_weights((32, 64), 6, torch.float32)
    flips = torch.where(torch.rand(w.shape) < 0.5, -1.0, 1.0)
    assert torch.equal(transposable_2to4_mask(w), transposable_2to4_mask(w * flips))


@pytest.mark.parametrize("fn", [transposable_2to4_mask, optimal_transposable_2to4_mask])
def test_chunked_processing_gives_the_same_mask(
    fn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiles are processed in chunks of tile rows: chunk edges and a short last chunk change nothing."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for shape in [(52, 64), (8, 256)]:  # 13 tile rows; 64 tiles per tile row
            w = integer_weights(shape, 7, dtype) + gaussian_weights(shape, 7, dtype) / 8
            whole = fn(w)
            # 48 tiles: 3 tile rows of 16, or 1 tile row of 64 (more than the budget)
            monkeypatch.setattr(tile_masks, "_CPU_CHUNK_TILES", 48)
            monkeypatch.setattr(tile_masks, "_CPU_CHUNK_TILES_OPTIMAL", 48)
            assert torch.equal(fn(w), whole)
            monkeypatch.undo()
            if fn is transposable_2to4_mask:
                assert torch.equal(whole, reference_mask(w))


def test_sorting_network_sorts_every_01_input() -> None:
    """By the 0-1 principle, a comparator network that sorts all 2**16 0/1 inputs sorts anything."""
    v = (torch.arange(1 << 16)[:, None] >> torch.arange(16)) & 1
    cols = list(v.t())
    for i, j in tile_masks.SORTING_NETWORK_16:
        cols[i], cols[j] = (
            torch.minimum(cols[i], cols[j]),
            torch.maximum(cols[i], cols[j]),
        )
    s = torch.stack(cols, 1)
    assert len(tile_masks.SORTING_NETWORK_16) == 60
    assert bool((s[:, 1:] >= s[:, :-1]).all())


# --- properties ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_properties(dtype: torch.dtype) -> None:
    w = gaussian_weights((64, 96), 8, dtype)
    before = w.clone()
    mask = transposable_2to4_mask(w)
    assert (
        mask.shape == w.shape and mask.dtype == torch.bool and mask.device == w.device
    )
    assert torch.equal(w, before)
    rows, cols = tile_counts(mask)
    assert int(rows.max()) <= 2 and int(cols.max()) <= 2
    assert is_transposable_2to4(mask)
    # The greedy ends with a set that cannot grow: 8 kept (2 per row and column) in most tiles,
    # else 7 (~20% of Gaussian tiles: the one row and the one column with room meet at a kept entry).
    per_tile = rows.sum(2)
    assert int(per_tile.min()) >= 7 and float((per_tile == 8).float().mean()) > 0.7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("exactly_two", [True, False])
def test_optimal_properties(dtype: torch.dtype, exactly_two: bool) -> None:
    w = integer_weights((64, 96), 9, dtype) + gaussian_weights((64, 96), 9, dtype)
    before = w.clone()
    mask = optimal_transposable_2to4_mask(w, exactly_two=exactly_two)
    assert (
        mask.shape == w.shape and mask.dtype == torch.bool and mask.device == w.device
    )
    assert torch.equal(w, before)
    rows, cols = tile_counts(mask)
    assert is_transposable_2to4(mask)
    if exactly_two:
        assert bool((rows == 2).all()) and bool((cols == 2).all())
    else:
        assert int(rows.max()) <= 2 and int(cols.max()) <= 2
        assert int(rows.sum(2).min()) >= 7


@pytest.mark.parametrize("fn", [transposable_2to4_mask, optimal_transposable_2to4_mask])
def test_layouts_and_autograd(fn) -> None:
    """Non-contiguous, conv-shaped and requires_grad weights; the result never tracks gradients."""
    w = gaussian_weights((32, 64), 10, torch.float32)
    expected = fn(w)
    assert torch.equal(fn(w.t().contiguous().t()), expected)
    assert torch.equal(fn(w.view(32, 4, 4, 4)), expected.view(32, 4, 4, 4))
    wt = w.t()  # (64, 32), a non-contiguous view
    assert torch.equal(fn(wt), fn(wt.contiguous()))
    p = torch.nn.Parameter(w.clone())
    mask = fn(p)
    assert torch.equal(mask, expected) and not mask.requires_grad and p.grad is None


@pytest.mark.parametrize("fn", [transposable_2to4_mask, optimal_transposable_2to4_mask])
def test_empty_weight(fn) -> None:
    mask = fn(torch.empty(0, 8))
    assert mask.shape == (0, 8) and mask.dtype == torch.bool


# --- optimality ----------------------------------------------------------------------------------


def brute_force_best(tile: list[list[float]]) -> float:
    """Largest kept sum over all 0/1 4x4 patterns with exactly 2 per row and per column."""
    pairs = list(itertools.combinations(range(4), 2))
    best = -1.0
    for choice in itertools.product(pairs, repeat=4):
        if all(sum(c in pair for pair in choice) == 2 for c in range(4)):
            best = max(
                best, sum(tile[r][c] for r, pair in enumerate(choice) for c in pair)
            )
    return best


def brute_force_best_at_most_two(tiles: torch.Tensor) -> torch.Tensor:
    """Largest kept sum over all 2**16 masks of each ``(16,)`` tile with <= 2 per row and column."""
    masks = (torch.arange(1 << 16)[:, None] >> torch.arange(16)) & 1
    grid = masks.view(-1, 4, 4)
    ok = masks[(grid.sum(2) <= 2).all(1) & (grid.sum(1) <= 2).all(1)]
    return (tiles.abs().double() @ ok.double().t()).amax(1)


def test_optimal_matches_brute_force() -> None:
    for w in (
        gaussian_weights((8, 16), 11, torch.float64),
        integer_weights((8, 16), 11, torch.float64),
    ):
        sums = tile_sums(w, optimal_transposable_2to4_mask(w))
        for i, j in itertools.product(range(2), range(4)):
            tile = w.abs()[4 * i : 4 * i + 4, 4 * j : 4 * j + 4].tolist()
            assert float(sums[i, j]) == pytest.approx(brute_force_best(tile), abs=1e-12)


def test_optimal_at_most_two_matches_brute_force() -> None:
    w = gaussian_weights((16, 64), 11, torch.float64)
    tiles = w.view(4, 4, 16, 4).permute(0, 2, 1, 3).reshape(64, 16)
    sums = tile_sums(w, optimal_transposable_2to4_mask(w, exactly_two=False)).reshape(
        64
    )
    assert torch.allclose(sums, brute_force_best_at_most_two(tiles), rtol=0, atol=1e-12)


def test_greedy_can_beat_the_best_exactly_two_pattern() -> None:
    """The greedy takes 9, 9 (filling column 2), then 6, 6, 3, 2, 1 and is stuck at 7 kept: 36.
    No pattern with exactly 2 per row and column keeps more than 35 here."""
    w = torch.tensor(
        [[0, 6, 9, 2], [0, 1, 0, 6], [0, 0, 9, 2], [3, 0, 8, 0]], dtype=torch.float32
    )
    greedy = transposable_2to4_mask(w)
    assert int(greedy.sum()) == 7 and float((w * greedy).sum()) == 36.0
    assert (
        float((w * optimal_transposable_2to4_mask(w)).sum())
        == 35.0
        == brute_force_best(w.tolist())
    )
    assert (
        float((w * optimal_transposable_2to4_mask(w, exactly_two=False)).sum()) == 36.0
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_optimal_keeps_at_least_as_much_as_greedy(dtype: torch.dtype) -> None:
    for w in (
        gaussian_weights((64, 128), 12, dtype),
        integer_weights((64, 128), 12, dtype),
    ):
        greedy_mask = transposable_2to4_mask(w)
        greedy = tile_sums(w, greedy_mask)
        best = tile_sums(w, optimal_transposable_2to4_mask(w, exactly_two=False))
        assert bool((best >= greedy * (1 - 1e-6)).all())
        # With exactly 2 per row and column: wherever the greedy kept 8 (one of the 90
        # patterns), and over the whole weight.
        exact = tile_sums(w, optimal_transposable_2to4_mask(w))
        greedy_kept_8 = tile_counts(greedy_mask)[0].sum(2) == 8
        assert bool((exact >= greedy * (1 - 1e-6))[greedy_kept_8].all())
        assert float(exact.sum()) >= float(greedy.sum())
        assert float(best.sum()) >= float(exact.sum())


def test_optimal_uses_float64_scores_when_fp32_matmuls_may_be_reduced() -> None:
    w = gaussian_weights((32, 64), 13, torch.float32)
    expected = optimal_transposable_2to4_mask(w)
    assert tile_masks._score_dtype(torch.float32, torch.device("cpu")) == torch.float32
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert (
            tile_masks._score_dtype(torch.float32, torch.device("cpu")) == torch.float64
        )
        assert torch.equal(optimal_transposable_2to4_mask(w), expected)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert tile_masks._score_dtype(torch.float32, torch.device("cuda")) == torch.float64


def test_tables() -> None:
    step, last, keep = tile_masks._greedy_tables_cpu()
    assert keep.shape == (7343, 16) and step.shape == last.shape == (7343 * 16,)
    assert tile_masks.tile_patterns(True).shape == (90, 16)
    assert tile_masks.tile_patterns(False).shape == (186, 16)


# --- is_transposable_2to4 ------------------------------------------------------------------------


def test_is_transposable_2to4() -> None:
    ok = torch.tensor(
        [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], dtype=torch.bool
    )
    assert is_transposable_2to4(ok.repeat(2, 3))
    assert is_transposable_2to4(ok.float().repeat(2, 3))  # nonzero means kept
    assert is_transposable_2to4(torch.zeros(8, 8, dtype=torch.bool))
    row_of_three = ok.clone()
    row_of_three[0, 2] = True
    assert not is_transposable_2to4(row_of_three)
    col_of_three = ok.clone()
    col_of_three[2, 0] = True
    col_of_three[2, 2] = False  # the row stays at 2, column 0 gets 3
    assert not is_transposable_2to4(col_of_three)
    # Row-wise 2:4 is not enough: here every row keeps 2 of 4, but column 0 keeps 4.
    rowwise = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)
    assert not is_transposable_2to4(rowwise)
    # Tiles are aligned at multiples of 4: three in a column across two tiles is fine.
    straddle = torch.zeros(8, 4, dtype=torch.bool)
    straddle[2:5, 0] = True
    assert is_transposable_2to4(straddle)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", [transposable_2to4_mask, optimal_transposable_2to4_mask, is_transposable_2to4]
)
@pytest.mark.parametrize("shape", [(6, 8), (8, 6), (3, 5), (8, 3, 3), (10,)])
def test_shape_not_multiple_of_4(fn, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="multiples of 4") as info:
        fn(torch.ones(shape))
    message = str(info.value)
    assert str(tuple(shape)) in message and "Pad" in message and "dense" in message


def test_other_errors() -> None:
    with pytest.raises(ValueError, match="scalar"):
        transposable_2to4_mask(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        transposable_2to4_mask([[1.0] * 4] * 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        transposable_2to4_mask(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="floating point"):
        optimal_transposable_2to4_mask(torch.ones(4, 4, dtype=torch.int32))


def test_docstring_examples() -> None:
    result = doctest.testmod(tile_masks, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0
