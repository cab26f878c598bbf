"""Refilling N:M groups and transposable 2:4 tiles after a drop, exactly, where there is a choice.

After the drop of a drop-and-grow update, every group of M along the input dimension (or every
4x4 tile of a transposable 2:4 weight) that lost weights regrows as many:

- row-wise N:M (:func:`refill_groups_`): the group keeps its survivors and takes the free
  positions with the highest keys, ties to the lower position (a NaN key counts as ``-inf``);
- transposable 2:4 (:func:`refill_tiles_`): the tile becomes, among the 90 patterns with exactly
  2 per row and per column that contain its survivors, the one whose added positions have the
  largest total key (summed in float64: exact unless the keys of a tile span more than 2**29),
  ties to the first pattern in increasing bit order; or, for random regrowth, one of those
  patterns drawn uniformly.

Only groups and tiles with a choice are worked on: a tile that lost one weight can only take it
back (after a 30% drop by magnitude, 55% of the tiles of a random 3072x768 2:4 weight have a
single completion), and a group that lost nothing keeps its weights. Both work in place: on the
mask as it was before the drop, and on the dropped entries, which become the entries that
changed. The work runs through :class:`~lightning_sparse.masks.elementwise.Ops` (NumPy on the CPU, torch
elsewhere); ``keys`` callbacks receive and return arrays of that namespace.

Example:
    >>> import torch
    >>> from lightning_sparse.masks.elementwise import ops_for
    >>> from lightning_sparse.masks.patterns import NM
    >>> mask = torch.tensor([[True, True, False, False, False, False, True, True]])
    >>> dropped = torch.tensor([[False, True, False, False, False, False, False, False]])
    >>> keys = torch.tensor([[0.0, 0.5, 0.9, 0.1, 3.0, 2.0, 0.0, 0.0]])
    >>> ops = ops_for(mask)
    >>> groups = ops.array(keys).reshape(-1, 4)
    >>> refill_groups_(ops, mask, dropped, NM(2, 4), lambda index: groups[index])
    >>> mask.int().tolist(), dropped.int().tolist()
    ([[1, 0, 1, 0, 0, 0, 1, 1]], [[0, 1, 1, 0, 0, 0, 0, 0]])
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_sparse.kernels import loops as cpu_kernels
from lightning_sparse.masks.elementwise import Ops
from lightning_sparse.masks.patterns import NM
from lightning_sparse.masks.tiles import _patterns_cpu

Keys = Callable[[object], object]
"""Given ascending group (or tile) indices, the keys of their positions: ``(len, M)`` for groups,
``(len, 16)`` (row-major within the tile) for tiles; the highest keys regrow."""

_PAIRS = tuple(tuple(pair) for pair in cpu_kernels.PAIR_COLUMNS.tolist())
"""The 6 pairs of columns a row of a 2:4 tile may keep."""


@dataclass(frozen=True)
class TileKeys:
    """:data:`Keys` for :func:`refill_tiles_` read from an array laid out like the weight:
    ``values`` (2-D, NumPy or torch; ``|values|`` with ``magnitude``). On the CPU the compiled
    refill reads them in place."""

    ops: Ops
    values: object
    magnitude: bool = False

    def __call__(self, index):
        cols = self.values.shape[1]
        tile_rows = self.values.reshape(-1, 4)  # a tile row's 4 keys
        per_row = cols // 4
        # tile t covers tile rows (4 * (t // per_row) + r) * per_row + t % per_row
        first = 4 * (index // per_row) * per_row + index % per_row
        where = first[:, None] + per_row * self.ops.arange(4)
        chosen = self.ops.take_rows(tile_rows, where.reshape(-1)).reshape(-1, 16)
        return self.ops.xp.abs(chosen, out=chosen) if self.magnitude else chosen


@dataclass(frozen=True)
class GroupKeys:
    """:data:`Keys` for :func:`refill_groups_` read from an array laid out like the weight:
    ``values`` (NumPy or torch, groups of ``m`` along the last axis; ``|values|`` with
    ``magnitude``). On the CPU the compiled refill reads them in place."""

    ops: Ops
    values: object
    m: int
    magnitude: bool = False

    def __call__(self, index):
        chosen = self.ops.take_rows(self.values.reshape(-1, self.m), index)  # a copy
        return self.ops.xp.abs(chosen, out=chosen) if self.magnitude else chosen


def refill_groups_(
    ops: Ops,
    mask: Tensor,
    dropped: Tensor,
    target: NM,
    keys: Keys | None,
    seed: int = 0,
) -> None:
    """Refill, in place, every group of ``target.m`` along the last axis of ``mask`` (viewed
    as ``(out, -1)``) that ``dropped`` (a subset of ``mask``, shaped like it) took entries
    from: the group keeps its survivors and takes the free positions with the highest
    ``keys`` (ties: the lower position; NaN counts as ``-inf``), or with ``keys`` ``None`` the
    highest :func:`uniform_bits` of ``seed`` and the flat position, until it holds
    ``target.n``. ``dropped`` becomes the entries whose flag changed (dropped and not
    regrown, or regrown and not dropped)."""
    n, m = target.n, target.m
    groups = ops.array(mask).reshape(-1, m)
    lost = ops.array(dropped).reshape(-1, m)
    if ops.xp is np and m <= _MAX_RANKED and _compiled_loop_reads(keys, GroupKeys):
        values = None if keys is None else keys.values.reshape(-1, m)
        magnitude = keys is not None and keys.magnitude
        offset = np.uint64(_seed_offset(seed))
        flags = (groups.view(np.uint8), lost.view(np.uint8))
        cpu_kernels.refill_groups(*flags, n, values, magnitude, offset)
        return
    if keys is None:
        keys = functools.partial(_random_group_keys, ops, m, seed)
    groups &= ~lost  # the survivors
    word = _WORDS.get(m) if ops.xp is np else None
    for start in range(0, len(groups), CHUNK_GROUPS):  # temporaries stay small
        part = groups[start : start + CHUNK_GROUPS]
        short = ops.nonzero(_group_counts(ops, part) < n)
        if len(short) == 0:
            continue
        kept = ops.take_rows(part, short)
        short = short + start
        scores = keys(short)
        scores[ops.xp.isnan(scores)] = -float("inf")  # NaN last: ranks stay an order
        scores[kept] = float("inf")  # survivors come first
        grown = _top_n_per_row(ops, scores, n) & ~kept
        if word is not None:  # a group's flags as one machine word: a cheaper scatter
            grown = np.ascontiguousarray(grown).view(word)
            groups.view(word)[short] |= grown
            lost.view(word)[short] ^= grown
        else:
            groups[short] |= grown
            lost[short] ^= grown


def _compiled_loop_reads(keys: Keys | None, kind: type) -> bool:
    """Whether a compiled CPU refill can take ``keys``: random (``None``), or keys of ``kind``
    (:class:`GroupKeys`, :class:`TileKeys`) in a dtype the loops take."""
    return keys is None or isinstance(keys, kind) and cpu_kernels.accepts(keys.values)


def _random_group_keys(ops: Ops, m: int, seed: int, index):
    """Random :data:`Keys` of groups: the :func:`uniform_bits` of their flat positions."""
    return ops.to_float64(uniform_bits(ops, index[:, None] * m + ops.arange(m), seed))


CHUNK_GROUPS = 1 << 14
"""Groups (and tiles) worked on at once: their temporaries stay a few MiB."""
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _group_counts(ops: Ops, groups):
    """How many entries of each row of the bool ``(groups, m)`` array are set."""
    if ops.xp is np and groups.shape[1] == 4:  # 4 bytes of 0/1 summed in the top byte
        words = groups.view(np.uint32).reshape(-1)
        return (words * np.uint32(0x01010101)) >> np.uint32(24)
    return groups.sum(1)


_MAX_RANKED = 8
"""Up to this group size, groups are ranked by pairwise comparisons (beyond it, sorted)."""


def _top_n_per_row(ops: Ops, scores, n: int):
    """Per row of ``scores``, the ``n`` highest (ties: the lower column), as a bool mask."""
    rows, m = scores.shape
    xp = ops.xp
    if m > _MAX_RANKED:
        order = xp.argsort(-scores, axis=1, kind="stable") if xp is np else None
        if order is None:
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        chosen = xp.zeros(scores.shape, dtype=bool) if xp is np else None
        if chosen is None:
            return torch.zeros_like(scores, dtype=torch.bool).scatter_(
                1, order[:, :n], True
            )
        np.put_along_axis(chosen, order[:, :n], True, axis=1)
        return chosen
    # rank by pairwise comparisons: a handful of vector ops over contiguous columns
    columns = scores.T.copy() if xp is np else scores.t().contiguous()
    rank = (
        np.zeros((m, rows), dtype=np.int8)
        if xp is np
        else torch.zeros((m, rows), dtype=torch.int8, device=scores.device)
    )
    for i in range(m):
        for j in range(i + 1, m):
            j_first = columns[j] > columns[i]  # a tie goes to the lower column i
            rank[i] += j_first
            rank[j] += ~j_first
    return (rank < n).T


@dataclass(frozen=True)
class _TileTables:
    codes: Tensor  # (90,) int64: the 2:4 patterns with 2 per row and column, ascending
    count: Tensor  # (65536,) int64: how many of them contain each 16-bit survivor code
    first: Tensor  # (65536,) int64: where that code's patterns start in ``completions``
    completions: Tensor  # pattern indices, grouped by survivor code, ascending
    completion_pairs: Tensor  # (len(completions), 4): 6 * row + the pair the row keeps
    nibble_word: (
        Tensor  # (16,) int32: a tile row's 4 flags as 4 bool bytes (native order)
    )


@functools.cache
def _tile_tables_cpu() -> _TileTables:
    patterns = _patterns_cpu(True)  # (90, 16) bool, position 4 * row + col
    codes = (patterns.long() << torch.arange(16)).sum(1)
    survivor = torch.arange(1 << 16)
    contains = (survivor[:, None] & codes[None, :]) == survivor[:, None]
    count = contains.sum(1)
    first = count.cumsum(0) - count
    completions = contains.nonzero()[:, 1]
    pair_index = {pair: i for i, pair in enumerate(_PAIRS)}
    pair_of_row = torch.tensor(
        [
            [pair_index[tuple(row.nonzero().squeeze(1).tolist())] for row in p]
            for p in patterns.view(90, 4, 4)
        ]
    )
    completion_pairs = (pair_of_row + 6 * torch.arange(4))[completions]
    nibbles = ((torch.arange(16)[:, None] >> torch.arange(4)) & 1).to(torch.bool)
    nibble_word = nibbles.contiguous().view(torch.int32).view(16)
    return _TileTables(codes, count, first, completions, completion_pairs, nibble_word)


def _tile_tables(ops: Ops) -> _TileTables:
    return _tile_tables_in(ops.xp is np, ops.device)


@functools.cache
def _tile_tables_in(numpy: bool, device: torch.device) -> _TileTables:
    """The tables as NumPy arrays (``numpy``) or as tensors on ``device``."""
    tables = _tile_tables_cpu()
    ops = Ops(np if numpy else torch, device)
    return _TileTables(*(ops.array(t.to(device)) for t in vars(tables).values()))


def tile_codes(ops: Ops, mask):
    """The 16-bit code ``sum(2**(4 * row + col))`` of every 4x4 tile of a 2-D bool array, in
    row-major tile order (int64)."""
    rows, cols = mask.shape
    if ops.xp is np:
        # 8 bits per byte along each row: tile column 2j is byte j's low nibble, 2j+1 its high
        packed = np.packbits(mask, axis=1, bitorder="little").reshape(rows // 4, 4, -1)
        nibbles = np.empty((rows // 4, 4, cols // 4), dtype=np.int64)
        nibbles[:, :, 0::2] = packed[:, :, : (cols // 4 + 1) // 2] & 0xF
        nibbles[:, :, 1::2] = packed[:, :, : cols // 8] >> 4
        codes = (
            nibbles[:, 0]
            | nibbles[:, 1] << 4
            | nibbles[:, 2] << 8
            | nibbles[:, 3] << 12
        )
        return codes.reshape(-1)
    tiles = mask.view(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3)
    weights = (1 << torch.arange(16, device=mask.device)).view(4, 4)
    return (tiles.to(torch.int64) * weights).sum((2, 3)).reshape(-1)


def refill_tiles_(
    ops: Ops,
    mask: Tensor,
    dropped: Tensor,
    keys: Keys | None,
    seed: int = 0,
) -> int:
    """Refill, in place, a transposable 2:4 ``mask`` (2-D, both dimensions multiples of 4,
    every tile an exactly-2 pattern) after ``dropped`` (a subset of it) took entries: per
    tile, the survivors plus the best completion by ``keys``, or one drawn uniformly (a hash
    of ``seed`` and the tile's position) when ``keys`` is ``None``; a tile with a single
    completion regrows what it dropped. ``dropped`` becomes the entries whose flag changed.
    Returns how many leading tile rows (4 rows of ``mask`` each) were refilled: all of them,
    unless the survivors of some tile fit no pattern (a mask that was not transposable); the
    tile rows after those are left as they were."""
    rows, cols = mask.shape
    # (the compiled loop reads 4 flags as a little-endian word; the array ops any order)
    if (
        ops.xp is np
        and sys.byteorder == "little"
        and _compiled_loop_reads(keys, TileKeys)
    ):
        flags = [ops.array(t).view(np.uint32) for t in (mask, dropped)]
        values = None if keys is None else keys.values
        magnitude = keys is not None and keys.magnitude
        offset = np.uint64(_seed_offset(seed))
        tables = _compact_tile_tables()
        return cpu_kernels.refill_tiles(*flags, values, magnitude, offset, *tables)
    tables = _tile_tables(ops)
    per_row = cols // 4
    band = max(1, CHUNK_GROUPS // per_row)  # tile rows worked on at once
    word = np.int32 if ops.xp is np else torch.int32
    mask_rows, dropped_rows = ops.array(mask), ops.array(dropped)
    mask_words, dropped_words = (
        a.view(word).reshape(rows // 4, 4, per_row) for a in (mask_rows, dropped_rows)
    )
    for r0 in range(0, rows // 4, band):
        lines = slice(4 * r0, 4 * (r0 + band))
        codes = tile_codes(ops, mask_rows[lines] & ~dropped_rows[lines])
        count = ops.take(tables.count, codes)
        if bool((count == 0).any()):
            return r0
        choice = ops.nonzero(count > 1)
        tile_row, tile_col = choice // per_row + r0, choice % per_row
        lost = [dropped_words[tile_row, r, tile_col] for r in range(4)]
        dropped_words[r0 : r0 + band] = 0  # a single completion regrows what it dropped
        if len(choice) == 0:
            continue
        codes, count = codes[choice], count[choice]
        tiles = choice + r0 * per_row
        if keys is None:
            pick = (uniform_bits(ops, tiles, seed) * count) >> 53
            pattern = ops.take(tables.completions, ops.take(tables.first, codes) + pick)
        else:
            pattern = _best_completions(ops, keys(tiles), codes, count, tables)
        tile = ops.take(tables.codes, pattern)
        for r in range(4):
            kept, added = (tile >> (4 * r)) & 0xF, ((tile & ~codes) >> (4 * r)) & 0xF
            mask_words[tile_row, r, tile_col] = ops.take(tables.nibble_word, kept)
            dropped_words[tile_row, r, tile_col] = lost[r] ^ ops.take(
                tables.nibble_word, added
            )
    return rows // 4


@functools.cache
def _compact_tile_tables() -> tuple[np.ndarray, ...]:
    """The tables the compiled refill reads, in the narrowest integer dtypes that hold them
    (0.3 MiB instead of 2 MiB in int64: they stay in the L2 cache, about 1.3x faster)."""
    tables = _tile_tables_cpu()
    return (
        tables.codes.numpy(),
        tables.count.numpy().astype(np.uint8),  # at most 90
        tables.first.numpy().astype(np.int32),
        tables.completions.numpy().astype(np.uint8),  # pattern indices: < 90
        tables.completion_pairs.numpy().astype(np.uint8),  # 6 * row + pair: < 24
    )


def _seed_offset(seed: int) -> int:
    """What :func:`uniform_bits` adds for ``seed`` (as an unsigned 64-bit value)."""
    return (seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) % (1 << 64)


def uniform_bits(ops: Ops, index, seed: int):
    """53 uniform random bits (int64) per entry of ``index``, a hash of ``(seed, index)``: the
    same on every device and however the indices are split (SplitMix64's mixer, with the
    shifts masked so that arithmetic and logical shifts agree)."""
    increment, first, second = (_signed(c) for c in cpu_kernels.SPLITMIX64)
    x = ops.to_int64(index) * increment + _signed(_seed_offset(seed))
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * first
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * second
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return (x >> 11) & ((1 << 53) - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _best_completions(ops: Ops, keys, codes, count, tables: _TileTables):
    """Per tile, the completion (a pattern index) with the largest total key, ties to the first
    in pattern order. Every completion contains the survivors, so totals over whole patterns
    rank them as totals over the added positions would."""
    n = len(codes)
    position = ops.to_float64(keys).reshape(n, 4, 4)
    pair_sums = (
        np.empty((n, 4, 6))
        if ops.xp is np
        else torch.empty((n, 4, 6), dtype=torch.float64, device=ops.device)
    )
    for q, (a, b) in enumerate(
        _PAIRS
    ):  # (tile, row, pair): tile t, row r, pair q at 24t+6r+q
        pair_sums[:, :, q] = position[:, :, a] + position[:, :, b]
    pair_sums = pair_sums.reshape(-1)
    best = codes.copy() if ops.xp is np else codes.clone()
    for low, high in _WIDTHS:
        tiles = ops.nonzero((count >= low) & (count <= high))
        if len(tiles) == 0:
            continue
        width = ops.arange(high)
        present = width < ops.take(count, tiles)[:, None]
        first = ops.take(tables.first, ops.take(codes, tiles))
        slot = first[:, None] + width * present  # (tiles, high): a completion's index
        where = ops.take_rows(tables.completion_pairs, slot)  # (tiles, high, 4)
        where += (24 * tiles)[:, None, None]
        parts = ops.take(pair_sums, where)
        totals = parts[:, :, 0] + parts[:, :, 1] + parts[:, :, 2] + parts[:, :, 3]
        totals[~present] = -float("inf")
        chosen = slot[ops.arange(len(tiles)), ops.argmax_rows(totals)]
        best[tiles] = ops.take(tables.completions, chosen)
    return best


_WIDTHS = ((2, 2), (3, 4), (5, 7), (8, 15), (16, 90))
"""Buckets of completion counts, each evaluated at once (a tile has 2-7 completions mostly)."""
