"""Refilling N:M groups and transposable 2:4 tiles after a drop, exactly, where there is a choice.

After the drop of a drop-and-grow update, every group of M along the input dimension (or every
4x4 tile of a transposable 2:4 weight) that lost weights regrows as many:

- row-wise N:M (:func:`refill_groups_`): the group keeps its survivors and takes the free
  positions with the highest keys, ties to the lower position (a NaN key counts as ``-inf``);
- transposable 2:4 (:func:`refill_tiles_`): the tile becomes, among the 90 patterns with exactly
  2 per row and per column that contain its survivors, the one whose positions have the largest
  total key (summed in float64), ties to the first pattern in increasing bit order; or, for
  random regrowth, one of those patterns drawn uniformly.

Only groups and tiles with a choice are worked on: a tile that lost one weight can only take it
back, and a group that lost nothing keeps its weights. Both work in place, on the mask as it was
before the drop and on the dropped entries, which become the entries that changed. Keys are laid
out like the weight; without keys, regrowth is random, from a hash of the seed and the position.
The torch operations here define the result; on CPU float32/float64 tensors the compiled loops
of :mod:`lightning_sparse.kernels` give the same bits.

Example:
    >>> import torch
    >>> from lightning_sparse.masks import NM
    >>> mask = torch.tensor([[True, True, False, False, False, False, True, True]])
    >>> dropped = torch.tensor([[False, True, False, False, False, False, False, False]])
    >>> keys = torch.tensor([[0.0, 0.5, 0.9, 0.1, 3.0, 2.0, 0.0, 0.0]])
    >>> refill_groups_(mask, dropped, NM(2, 4), keys)
    >>> mask.int().tolist(), dropped.int().tolist()
    ([[1, 0, 1, 0, 0, 0, 1, 1]], [[0, 1, 1, 0, 0, 0, 0, 0]])
"""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from lightning_sparse import kernels
from lightning_sparse.masks.elementwise import flat_nonzero
from lightning_sparse.masks.patterns import NM
from lightning_sparse.masks.tiles import tile_patterns

PAIR_COLUMNS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
"""The 6 pairs of columns a row of a 2:4 tile may keep, in the order of the pair indices."""
SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""SplitMix64's increment and its mixer's two multipliers (:func:`position_bits`)."""
CHUNK_GROUPS = 1 << 14
"""Groups (and tiles) worked on at once: their temporaries stay a few MiB."""
MAX_RANKED = 8
"""Up to this group size, groups are ranked by pairwise comparisons (beyond it, sorted)."""


def refill_groups_(
    mask: Tensor,
    dropped: Tensor,
    target: NM,
    keys: Tensor | None = None,
    magnitude: bool = False,
    seed: int = 0,
) -> None:
    """Refill, in place, every group of ``target.m`` along the last axis of ``mask`` (viewed
    as ``(out, -1)``, contiguous) that ``dropped`` (a subset of ``mask``, shaped like it)
    took entries from: the group keeps its survivors and takes the free positions with the
    highest ``keys`` (``|keys|`` with ``magnitude``; ties: the lower position; NaN counts as
    ``-inf``), or with ``keys`` ``None`` the highest :func:`position_bits` of ``seed`` and
    the flat position, until it holds ``target.n``. ``dropped`` becomes the entries whose
    flag changed (dropped and not regrown, or regrown and not dropped)."""
    n, m = target.n, target.m
    with_keys = () if keys is None else (keys,)
    if m <= MAX_RANKED and kernels.accepts(mask, dropped, *with_keys):
        kernels.refill_groups_(mask, dropped, n, m, keys, magnitude, seed_offset(seed))
        return
    groups, lost = mask.view(-1, m), dropped.view(-1, m)
    flat_keys = None if keys is None else keys.reshape(-1, m)
    groups &= ~lost  # the survivors
    for start in range(0, len(groups), CHUNK_GROUPS):  # temporaries stay small
        part = groups[start : start + CHUNK_GROUPS]
        short = flat_nonzero(part.sum(1) < n)
        if len(short) == 0:
            continue
        kept = part[short]
        short = short + start
        if flat_keys is None:
            positions = short[:, None] * m + torch.arange(m, device=mask.device)
            scores = position_bits(positions, seed).to(torch.float64)
        else:
            scores = flat_keys[short]  # a copy
            if magnitude:
                scores.abs_()
        scores[scores.isnan()] = -float("inf")  # NaN last: ranks stay an order
        scores[kept] = float("inf")  # survivors come first
        grown = _top_n_per_row(scores, n) & ~kept
        groups[short] |= grown
        lost[short] ^= grown


def _top_n_per_row(scores: Tensor, n: int) -> Tensor:
    """Per row of ``scores``, the ``n`` highest (ties: the lower column), as a bool mask."""
    rows, m = scores.shape
    if m > MAX_RANKED:
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(
            1, order[:, :n], True
        )
    # rank by pairwise comparisons: a handful of vector ops over contiguous columns
    columns = scores.t().contiguous()
    rank = torch.zeros((m, rows), dtype=torch.int8, device=scores.device)
    for i in range(m):
        for j in range(i + 1, m):
            j_first = columns[j] > columns[i]  # a tie goes to the lower column i
            rank[i] += j_first
            rank[j] += ~j_first
    return (rank < n).t()


@dataclass(frozen=True)
class TileTables:
    """The transposable 2:4 patterns and, per 16-bit survivor code, the patterns containing it."""

    codes: Tensor  # (90,) int64: the 2:4 patterns with 2 per row and column, ascending
    count: Tensor  # (65536,) int64: how many of them contain each survivor code
    first: Tensor  # (65536,) int64: where that code's patterns start in ``completions``
    completions: Tensor  # pattern indices, grouped by survivor code, ascending
    completion_pairs: Tensor  # (len(completions), 4): 6 * row + the pair the row keeps
    nibble_word: (
        Tensor  # (16,) int32: a tile row's 4 flags as 4 bool bytes (native order)
    )


_CPU = torch.device("cpu")


@functools.cache
def tile_tables(device: torch.device = _CPU) -> TileTables:
    """The :class:`TileTables` on ``device`` (built once per device)."""
    if device.type != "cpu":
        return TileTables(*(t.to(device) for t in astuple(tile_tables())))
    patterns = tile_patterns(True)  # (90, 16) bool, position 4 * row + col
    codes = (patterns.long() << torch.arange(16)).sum(1)
    survivor = torch.arange(1 << 16)
    contains = (survivor[:, None] & codes[None, :]) == survivor[:, None]
    count = contains.sum(1)
    first = count.cumsum(0) - count
    completions = contains.nonzero()[:, 1]
    pair_index = {pair: i for i, pair in enumerate(PAIR_COLUMNS)}
    pair_of_row = torch.tensor(
        [
            [pair_index[tuple(row.nonzero().squeeze(1).tolist())] for row in p]
            for p in patterns.view(90, 4, 4)
        ]
    )
    completion_pairs = (pair_of_row + 6 * torch.arange(4))[completions]
    nibbles = ((torch.arange(16)[:, None] >> torch.arange(4)) & 1).to(torch.bool)
    nibble_word = nibbles.contiguous().view(torch.int32).view(16)
    return TileTables(codes, count, first, completions, completion_pairs, nibble_word)


@functools.cache
def _kernel_tables() -> tuple[Tensor, ...]:
    """The tables the compiled tile refill reads (CPU, one tuple for the process)."""
    return astuple(tile_tables())[:5]


def tile_codes(mask: Tensor) -> Tensor:
    """The 16-bit code ``sum(2**(4 * row + col))`` of every 4x4 tile of a 2-D bool tensor, in
    row-major tile order (int64).

    >>> tile_codes(torch.eye(4, dtype=torch.bool)).tolist()
    [33825]
    """
    rows, cols = mask.shape
    tiles = mask.view(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3)
    weights = (1 << torch.arange(16, device=mask.device)).view(4, 4)
    return (tiles.to(torch.int64) * weights).sum((2, 3)).reshape(-1)


def refill_tiles_(
    mask: Tensor,
    dropped: Tensor,
    keys: Tensor | None = None,
    magnitude: bool = False,
    seed: int = 0,
) -> int:
    """Refill, in place, a transposable 2:4 ``mask`` (2-D, contiguous, both dimensions multiples
    of 4, every tile an exactly-2 pattern) after ``dropped`` (a subset of it) took entries: per
    tile, the survivors plus the completion with the largest total of ``keys`` (2-D like the
    mask; ``|keys|`` with ``magnitude``), or one drawn uniformly (a hash of ``seed`` and the
    tile's position) when ``keys`` is ``None``; a tile with a single completion regrows what
    it dropped. ``dropped`` becomes the entries whose flag changed.

    Returns how many leading tile rows (4 rows of ``mask`` each) were refilled: all of them,
    unless the survivors of some tile fit no pattern (a mask that was not transposable); that
    tile row and those after it are left as they were."""
    rows, cols = mask.shape
    with_keys = () if keys is None else (keys,)
    if kernels.accepts(mask, dropped, *with_keys):
        offset = seed_offset(seed)
        return kernels.refill_tiles_(
            mask, dropped, keys, magnitude, offset, _kernel_tables()
        )
    tables = tile_tables(mask.device)
    per_row = cols // 4
    band = max(1, CHUNK_GROUPS // per_row)  # tile rows worked on at once
    mask_words, dropped_words = (
        t.view(torch.int32).reshape(rows // 4, 4, per_row) for t in (mask, dropped)
    )
    for r0 in range(0, rows // 4, band):
        lines = slice(4 * r0, 4 * (r0 + band))
        codes = tile_codes(mask[lines] & ~dropped[lines])
        count = tables.count[codes]
        misfits = flat_nonzero(count == 0)
        stop = None if len(misfits) == 0 else r0 + int(misfits[0]) // per_row
        if stop is not None:  # refill the tile rows before the first misfit, then stop
            codes, count = (
                codes[: (stop - r0) * per_row],
                count[: (stop - r0) * per_row],
            )
        end = r0 + len(codes) // per_row
        choice = flat_nonzero(count > 1)
        tile_row, tile_col = choice // per_row + r0, choice % per_row
        lost = [dropped_words[tile_row, r, tile_col] for r in range(4)]
        dropped_words[r0:end] = 0  # a single completion regrows what it dropped
        if len(choice):
            codes, count = codes[choice], count[choice]
            tiles = choice + r0 * per_row
            if keys is None:
                pick = (position_bits(tiles, seed) * count) >> 53
                pattern = tables.completions[tables.first[codes] + pick]
            else:
                values = _tile_keys(keys, tiles, magnitude)
                pattern = _best_completions(values, codes, count, tables)
            tile = tables.codes[pattern]
            for r in range(4):
                kept, added = (
                    (tile >> (4 * r)) & 0xF,
                    ((tile & ~codes) >> (4 * r)) & 0xF,
                )
                mask_words[tile_row, r, tile_col] = tables.nibble_word[kept]
                dropped_words[tile_row, r, tile_col] = (
                    lost[r] ^ tables.nibble_word[added]
                )
        if stop is not None:
            return stop
    return rows // 4


def _tile_keys(keys: Tensor, tiles: Tensor, magnitude: bool) -> Tensor:
    """The keys of the given tiles (row-major tile indices of 2-D ``keys``), ``(len, 16)``."""
    per_row = keys.shape[1] // 4
    tile_rows = keys.reshape(-1, 4)  # a tile row's 4 keys
    # tile t covers tile rows (4 * (t // per_row) + r) * per_row + t % per_row
    first = 4 * (tiles // per_row) * per_row + tiles % per_row
    where = first[:, None] + per_row * torch.arange(4, device=keys.device)
    chosen = tile_rows[where.reshape(-1)].reshape(-1, 16)
    return chosen.abs_() if magnitude else chosen


def seed_offset(seed: int) -> int:
    """What :func:`position_bits` adds for ``seed`` (as an unsigned 64-bit value)."""
    return (seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) % (1 << 64)


def position_bits(index: Tensor, seed: int) -> Tensor:
    """53 uniform random bits (int64) per entry of ``index``, a hash of ``(seed, index)``: the
    same on every device and however the indices are split (SplitMix64's mixer, with the
    shifts masked so that arithmetic and logical shifts agree).

    >>> bits = position_bits(torch.arange(1000), seed=7)
    >>> bool((bits >= 0).all() and (bits < 2**53).all()), len(bits.unique())
    (True, 1000)
    """
    increment, first, second = (_signed(c) for c in SPLITMIX64)
    x = index.to(torch.int64) * increment + _signed(seed_offset(seed))
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * first
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * second
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return (x >> 11) & ((1 << 53) - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _best_completions(
    keys: Tensor, codes: Tensor, count: Tensor, tables: TileTables
) -> Tensor:
    """Per tile, the completion (a pattern index) with the largest total key, ties to the first
    in pattern order. Every completion contains the survivors, so totals over whole patterns
    rank them as totals over the added positions would."""
    n = len(codes)
    device = keys.device
    position = keys.to(torch.float64).reshape(n, 4, 4)
    pair_sums = torch.empty((n, 4, 6), dtype=torch.float64, device=device)
    for q, (a, b) in enumerate(PAIR_COLUMNS):  # tile t, row r, pair q at 24t + 6r + q
        pair_sums[:, :, q] = position[:, :, a] + position[:, :, b]
    pair_sums = pair_sums.reshape(-1)
    best = codes.clone()
    for low, high in _WIDTHS:
        tiles = flat_nonzero((count >= low) & (count <= high))
        if len(tiles) == 0:
            continue
        width = torch.arange(high, device=device)
        present = width < count[tiles][:, None]
        first = tables.first[codes[tiles]]
        slot = first[:, None] + width * present  # (tiles, high): a completion's index
        where = tables.completion_pairs[slot]  # (tiles, high, 4)
        where += (24 * tiles)[:, None, None]
        parts = pair_sums[where]
        totals = parts[:, :, 0] + parts[:, :, 1] + parts[:, :, 2] + parts[:, :, 3]
        totals[~present] = -float("inf")
        chosen = slot[torch.arange(len(tiles), device=device), totals.argmax(1)]
        best[tiles] = tables.completions[chosen]
    return best


_WIDTHS = ((2, 2), (3, 4), (5, 7), (8, 15), (16, 90))
"""Buckets of completion counts, each evaluated at once (a tile has 2-7 completions mostly)."""
