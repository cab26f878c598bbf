"""Transposable 2:4 masks: 2:4 along the rows *and* the columns of every 4x4 tile.

A weight viewed as ``(out, -1)`` is cut into 4x4 tiles. A mask is *transposable* when
every tile keeps at most 2 of 4 in each of its rows and each of its columns, so both
``W`` (forward) and ``W.T`` (the input-gradient GEMM of the backward pass) are 2:4
sparse. This is the mask the PyTorch 2:4 training recipe re-derives from the dense
weights at every step.

- :func:`transposable_2to4_mask`: greedy by ``|w|``, bit for bit the choice of torch's
  Python reference ``_sparse_semi_structured_tile(dense.abs())`` (the
  ``largest_abs_values_greedy`` behaviour), ties included, in vectorized torch ops.
- :func:`greedy_2to4_mask`: the same greedy choice by torch's CUDA tile kernel where it runs
  (a CUDA float16/bfloat16 weight whose dimensions are multiples of 128), at memory speed;
  it can differ from :func:`transposable_2to4_mask` only where ``|w|`` ties within a tile.
- :func:`optimal_transposable_2to4_mask`: per tile, the pattern with the largest kept
  ``sum |w|`` among the 90 that keep exactly 2 per row and column (or among all 186
  maximal transposable patterns).
- :func:`is_transposable_2to4`: the check.

Plain row-wise 2:4 is ``masks.topk_mask(w.abs(), NM(2, 4))``; it is not repeated here.
All functions depend on magnitudes only: to maximize the kept energy ``sum w**2`` rather
than ``sum |w|``, pass ``w.square()``.

Example:
    >>> import torch
    >>> from lightning_sparse.masks.tiles import (
    ...     is_transposable_2to4,
    ...     transposable_2to4_mask,
    ... )
    >>> w = torch.randn(8, 16)
    >>> mask = transposable_2to4_mask(w)
    >>> mask.shape, mask.dtype, is_transposable_2to4(mask)
    (torch.Size([8, 16]), torch.bool, True)
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_sparse.masks.patterns import nm_groups

__all__ = [
    "SORTING_NETWORK_16",
    "greedy_2to4_mask",
    "has_4x4_tiles",
    "is_transposable_2to4",
    "optimal_transposable_2to4_mask",
    "transposable_2to4_mask",
]

_TILE = 4

SORTING_NETWORK_16 = (
    (0, 13), (1, 12), (2, 15), (3, 14), (4, 8), (5, 6), (7, 11), (9, 10),
    (0, 5), (1, 7), (2, 9), (3, 4), (6, 13), (8, 14), (10, 15), (11, 12),
    (0, 1), (2, 3), (4, 5), (6, 8), (7, 9), (10, 11), (12, 13), (14, 15),
    (0, 2), (1, 3), (4, 10), (5, 11), (6, 7), (8, 9), (12, 14), (13, 15),
    (1, 2), (3, 12), (4, 6), (5, 7), (8, 10), (9, 11), (13, 14),
    (1, 4), (2, 6), (5, 8), (7, 10), (9, 13), (11, 14),
    (2, 4), (3, 6), (9, 12), (11, 13),
    (3, 5), (6, 8), (7, 9), (10, 12),
    (3, 4), (5, 6), (7, 8), (9, 10), (11, 12),
    (6, 7), (8, 9),
)  # fmt: skip
"""A minimal-size (60 comparators, 10 layers) sorting network for 16 inputs (M. W. Green),
checked exhaustively by the 0-1 principle in the tests. Comparator ``(i, j)``, ``i < j``, leaves
the minimum on wire ``i`` and the maximum on wire ``j``: it sorts the greedy's 16 keys per tile."""

# Fast path: |w| as an order-preserving integer (the IEEE bits without the sign), a key
# dtype twice as wide, the mask that clears the sign, and the bits to which every NaN is
# clamped: just above +inf, since torch's sort ranks NaN above everything and all NaNs as
# equal (so position decides among them, as it does here).
_BITS = {
    torch.float32: (torch.int32, torch.int64, 0x7FFFFFFF, 0x7F800001),
    torch.float16: (torch.int16, torch.int32, 0x7FFF, 0x7C01),
    torch.bfloat16: (torch.int16, torch.int32, 0x7FFF, 0x7F81),
}

# Tiles per chunk. On the CPU, the greedy's chunk is small enough that its keys stay in
# the L2 cache and that every op stays below ATen's parallel grain (32768 elements): the
# greedy is a few hundred small ops per chunk, serial by design. An OpenMP region per op
# would cost more than it saves, and far more on an oversubscribed CPU (where each region
# waits for a time slice). The optimal mask is a few large ops per chunk (a matmul, an
# argmax): those use the threads. On other devices a chunk is (nearly) the whole weight.
_CPU_CHUNK_TILES = 8192
_CPU_CHUNK_TILES_OPTIMAL = 8192
_DEVICE_CHUNK_TILES = 1 << 20


def _as_2d(weight: Tensor, what: str = "weight") -> Tensor:
    """``weight`` viewed as ``(out, -1)``, detached and contiguous, after checking the shape."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension, got a scalar")
    flat = weight.detach().reshape(weight.shape[0], math.prod(weight.shape[1:]))
    rows, cols = flat.shape
    if rows % _TILE or cols % _TILE:
        viewed = "" if weight.dim() == 2 else f" (viewed as {rows}x{cols})"
        raise ValueError(
            f"transposable 2:4 masks work on 4x4 tiles, but {what} of shape "
            f"{tuple(weight.shape)}{viewed} has {rows} rows and {cols} columns; both must "
            f"be multiples of 4. Pad the layer's in/out features to multiples of 4, leave "
            f"this parameter dense, or use row-wise 2:4 (topk_mask(w.abs(), NM(2, 4))), "
            f"which needs only the columns to be a multiple of 4"
        )
    return flat.contiguous()


def _chunk_tile_rows(tile_cols: int, device: torch.device, cpu_budget: int) -> int:
    """How many rows of tiles to process at once."""
    budget = cpu_budget if device.type == "cpu" else _DEVICE_CHUNK_TILES
    return max(1, budget // max(tile_cols, 1))


def _write_tiles(out: Tensor, r0: int, tile_masks: Tensor) -> None:
    """Write ``(k * tile_cols, 16)`` per-tile flags into tile rows ``r0 ...`` of ``out``.

    A tile row of 4 bools is one int32, so this is a ``(k, tiles, 4) -> (k, 4, tiles)``
    transpose of int32 words: 4x fewer elements to move than bools.
    """
    rows, cols = out.shape
    tile_cols = cols // _TILE
    k = tile_masks.shape[0] // tile_cols
    dst = out.view(torch.int32).view(rows // _TILE, _TILE, tile_cols)[r0 : r0 + k]
    dst.copy_(tile_masks.view(torch.int32).view(k, tile_cols, _TILE).permute(0, 2, 1))


@functools.cache
def _greedy_tables_cpu() -> tuple[Tensor, Tensor, Tensor]:
    """The greedy as a finite automaton over the kept set of a tile.

    A state is a set of kept positions with at most 2 per row and per column of the tile
    (7343 such sets, all reachable). Visiting position ``p = 4 * row + col`` adds it when
    its row and its column each hold fewer than 2. Tables are indexed by
    ``16 * state + (15 - p)``, the form in which the sort keys carry positions: ``step``
    gives ``16 * next_state``, ``last`` gives ``next_state``, ``keep[state]`` the flags.
    """
    codes = torch.arange(1 << 16)
    pos = torch.arange(16)
    bits = (codes[:, None] >> pos) & 1
    grid = bits.view(-1, _TILE, _TILE)
    valid = (grid.sum(2) <= 2).all(1) & (grid.sum(1) <= 2).all(1)
    states = codes[valid]
    state_id = torch.full((1 << 16,), -1, dtype=torch.int64)
    state_id[states] = torch.arange(states.numel())
    tiles = grid[valid]
    row_open = tiles.sum(2) < 2
    col_open = tiles.sum(1) < 2
    can_keep = row_open[:, pos // _TILE] & col_open[:, pos % _TILE]
    nxt = state_id[states[:, None] | (can_keep.long() << pos)]
    assert (nxt >= 0).all()
    by_q = nxt.flip(1).reshape(-1)  # column q = 15 - p
    return by_q * 16, by_q, bits[valid].bool()


@functools.cache
def _greedy_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    step, last, keep = _greedy_tables_cpu()
    return step.to(device, torch.int32), last.to(device, torch.int32), keep.to(device)


@functools.cache
def _last_writes() -> tuple[tuple[bool, bool], ...]:
    """For each comparator of ``SORTING_NETWORK_16``: is it the last to write its (low, high) wire?"""
    last: dict[int, tuple[int, int]] = {}
    for index, (i, j) in enumerate(SORTING_NETWORK_16):
        last[i], last[j] = (index, 0), (index, 1)
    return tuple(
        (last[i] == (index, 0), last[j] == (index, 1))
        for index, (i, j) in enumerate(SORTING_NETWORK_16)
    )


def _sort_columns(keys: Tensor, spare: list[Tensor], out: Tensor) -> None:
    """Sort every column of ``keys`` (16, n) into ``out`` (16, n), descending.

    One ``minimum`` and one ``maximum`` per comparator of ``SORTING_NETWORK_16``, each over a
    contiguous row: for the small rows used on the CPU, faster than batching comparators
    over strided views. Rows of ``keys`` and the two ``spare`` rows serve as scratch; the
    last write to each wire goes straight to ``out`` (reversed: largest in row 0).
    """
    wires = list(keys.unbind(0))
    free = list(spare)
    for (i, j), (last_i, last_j) in zip(SORTING_NETWORK_16, _last_writes()):
        lo = out[15 - i] if last_i else free.pop()
        hi = out[15 - j] if last_j else free.pop()
        torch.minimum(wires[i], wires[j], out=lo)
        torch.maximum(wires[i], wires[j], out=hi)
        free += [wires[i], wires[j]]
        wires[i], wires[j] = lo, hi


def _run_automaton(
    qs: Tensor, tables: tuple[Tensor, Tensor, Tensor], out: Tensor
) -> None:
    """Feed every tile's positions, largest ``|w|`` first, through the greedy automaton.

    Row ``k`` of ``qs`` (16, tiles), int32, holds ``15 - p`` for each tile's entry of rank
    ``k``. Writes the ``(tiles, 16)`` kept flags into ``out``.
    """
    step, last, keep = tables
    state = torch.zeros(qs.shape[1], dtype=torch.int32, device=qs.device)
    index = torch.empty_like(state)
    for k in range(16):
        torch.add(state, qs[k], out=index)
        torch.index_select(step if k < 15 else last, 0, index, out=state)
    # 16 flags as two int64 words: a cheaper row copy, and a serial op up to 8192 tiles
    torch.index_select(keep.view(torch.int64), 0, state, out=out.view(torch.int64))


def transposable_2to4_mask(weight: Tensor) -> Tensor:
    """Greedy transposable 2:4 keep-mask by magnitude, one 4x4 tile at a time.

    In every 4x4 tile the 16 entries are visited by decreasing ``|w|`` (ties: the earlier
    row-major position first, as a stable descending sort does), and an entry is kept when
    its row and its column within the tile each hold fewer than 2 kept entries. Every tile
    row and column keeps at most 2: a tile keeps 8, or 7 when the one row and the one
    column left with room meet at an entry already kept (~16% of Gaussian tiles).

    The choice is exactly that of torch's Python reference
    ``torch.sparse._semi_structured_conversions._sparse_semi_structured_tile(w.abs())``
    (``largest_abs_values_greedy``), ties, zeros and NaNs (ranked largest) included, but
    vectorized over tiles: per tile, keys ``|w| bits << 4 | 15 - position`` sorted by a
    sorting network, then the greedy as a table-driven automaton. torch's CUDA kernel
    ``torch._sparse_semi_structured_tile`` may break ties differently, and its signed
    default keeps far less of the weight energy (~0.56 vs ~0.82 on Gaussian weights).

    Args:
        weight: a real tensor viewed as ``(out, -1)``, both dimensions multiples of 4.

    Returns:
        A bool keep-mask shaped like ``weight``, on its device. ``weight`` is not modified.

    Example:
        >>> import torch
        >>> w = torch.tensor(
        ...     [[9.0, 8, 7, 0], [6, 5, 0, 4], [0, 3, 2, 1], [-9, 0, 0, 0]]
        ... )
        >>> mask = transposable_2to4_mask(w)
        >>> mask.int().tolist()
        [[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 1, 1], [1, 0, 1, 0]]
        >>> (w.abs() * mask).sum().item()  # the optimal mask keeps 39.0
        38.0
    """
    flat = _as_2d(weight)
    rows, cols = flat.shape
    out = torch.empty((rows, cols), dtype=torch.bool, device=flat.device)
    if flat.dtype.is_floating_point and flat.element_size() == 1:
        flat = flat.float()  # fp8: exact and order-preserving
    if flat.dtype in (torch.bool, torch.complex64, torch.complex128, torch.complex32):
        raise TypeError(
            f"weight must be a real floating point or integer tensor, got {flat.dtype}"
        )
    if out.numel() == 0:
        return out.view(weight.shape)

    tile_rows, tile_cols = rows // _TILE, cols // _TILE
    chunk = _chunk_tile_rows(tile_cols, flat.device, _CPU_CHUNK_TILES)
    n = min(chunk, tile_rows) * tile_cols
    kept = torch.empty((n, 16), dtype=torch.bool, device=flat.device)
    fast = _BITS.get(flat.dtype)
    tables = _greedy_tables(flat.device)

    if fast is None:  # float64, integers: a stable argsort per tile, same automaton
        tiles = flat.view(tile_rows, _TILE, tile_cols, _TILE)
        for r0 in range(0, tile_rows, chunk):
            k = min(chunk, tile_rows - r0)
            mag = tiles[r0 : r0 + k].abs().permute(0, 2, 1, 3)
            mag = mag.reshape(k * tile_cols, 16)
            order = torch.argsort(mag, dim=1, descending=True, stable=True)
            qs = (15 - order).t().to(torch.int32).contiguous()
            _run_automaton(qs, tables, kept[: k * tile_cols])
            _write_tiles(out, r0, kept[: k * tile_cols])
        return out.view(weight.shape)

    # Keys (|w| bits << 4) | (15 - p) are distinct within a tile, and by decreasing key
    # they come by decreasing |w|, ties to the smaller position p: the stable descending
    # sort. A sorting network over the 16 key rows sorts the keys of all tiles at once.
    bits_dtype, key_dtype, abs_bits, nan_bits = fast
    bits = flat.view(bits_dtype).view(tile_rows, _TILE, tile_cols, _TILE)
    position = torch.arange(15, -1, -1, device=flat.device, dtype=key_dtype).view(16, 1)
    raw = torch.empty((16, n), dtype=bits_dtype, device=flat.device)
    keys = torch.empty((16, n), dtype=key_dtype, device=flat.device)
    spare = [torch.empty(n, dtype=key_dtype, device=flat.device) for _ in range(2)]
    ordered = torch.empty((16, n), dtype=key_dtype, device=flat.device)
    qs = torch.empty((16, n), dtype=torch.int32, device=flat.device)
    for r0 in range(0, tile_rows, chunk):
        k = min(chunk, tile_rows - r0)
        m = k * tile_cols
        for r in range(_TILE):  # positions 4r..4r+3: ops of up to 4 * 8192 elements
            at = slice(_TILE * r, _TILE * r + _TILE)
            raw_r = raw[at, :m]
            raw_r.view(_TILE, k, tile_cols).copy_(bits[r0 : r0 + k, r].permute(2, 0, 1))
            raw_r.bitwise_and_(abs_bits).clamp_(max=nan_bits)  # |w|, every NaN the same
            keys[at, :m].copy_(raw_r).bitwise_left_shift_(4).bitwise_or_(position[at])
        keys_k = keys[:, :m]
        _sort_columns(keys_k, [x[:m] for x in spare], ordered[:, :m])
        for r in range(_TILE):
            at = slice(_TILE * r, _TILE * r + _TILE)
            torch.bitwise_and(ordered[at, :m], 15, out=qs[at, :m])
        _run_automaton(qs[:, :m], tables, kept[:m])
        _write_tiles(out, r0, kept[:m])
    return out.view(weight.shape)


@functools.cache
def tile_patterns(exactly_two: bool) -> Tensor:
    """Candidate tile patterns as ``(K, 16)`` bool, position ``p = 4 * row + col``.

    The maximal transposable patterns: at most 2 per tile row and column, and no entry can
    be added. There are 186: the 90 with exactly 2 in every row and column (8 kept), then
    96 that keep 7, each group by increasing ``sum(2**p)``. For ``|w| >= 0`` the best
    transposable mask is always one of them. ``exactly_two`` keeps only the first 90.
    """
    codes = torch.arange(1 << 16)
    pos = torch.arange(16)
    bits = (codes[:, None] >> pos) & 1
    grid = bits.view(-1, _TILE, _TILE)
    valid = (grid.sum(2) <= 2).all(1) & (grid.sum(1) <= 2).all(1)
    row_open = grid.sum(2) < 2
    col_open = grid.sum(1) < 2
    room = row_open[:, pos // _TILE] & col_open[:, pos % _TILE]
    can_add = (room & (bits == 0)).any(1)
    maximal = bits[valid & ~can_add]
    full = maximal.sum(1) == 8
    patterns = torch.cat([maximal[full], maximal[~full]]).bool()
    assert patterns.shape == (186, 16) and int(full.sum()) == 90
    return patterns[:90] if exactly_two else patterns


@functools.cache
def _patterns(
    exactly_two: bool, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    patterns = tile_patterns(exactly_two)
    return patterns.to(device), patterns.t().to(device, dtype).contiguous()


def _score_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 where fp32 matmuls are true fp32, else float64 (no TF32/bf16 shortcuts)."""
    if dtype == torch.float64:
        return torch.float64
    if device.type == "cpu" and torch.get_float32_matmul_precision() == "highest":
        mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
        if getattr(mkldnn, "fp32_precision", "none") in ("none", "ieee"):
            return torch.float32
    return torch.float64


def optimal_transposable_2to4_mask(
    weight: Tensor, *, exactly_two: bool = True
) -> Tensor:
    """Best transposable 2:4 keep-mask: per 4x4 tile, the largest kept ``sum |w|``.

    With ``exactly_two=True`` (the default) every tile keeps exactly 2 per row and per
    column (exactly half the weights): the best of those 90 patterns. That is not always
    as much as the greedy keeps: the greedy can end with 7 entries that no 8-entry
    pattern contains, and they can weigh more (~3% of Gaussian tiles).
    ``exactly_two=False`` searches all 186 maximal transposable patterns (the 90, and 96
    that keep 7 and cannot grow), so it keeps the most possible in every tile, never
    less than the greedy.

    All tiles are scored by one matmul ``(tiles, 16) @ (16, 90 or 186)`` and an argmax.
    Scores are float32 on the CPU when fp32 matmuls are true fp32 there, else float64
    (so TF32 or bf16 matmul settings cannot change the choice). Ties go to the first
    pattern in a fixed order (8-entry patterns first).

    Args:
        weight: a floating point tensor viewed as ``(out, -1)``, both dimensions
            multiples of 4.
        exactly_two: keep exactly 2 per row and column of every tile (else at most 2).

    Returns:
        A bool keep-mask shaped like ``weight``, on its device. ``weight`` is not modified.

    Example:
        >>> import torch
        >>> w = torch.tensor(
        ...     [[9.0, 8, 7, 0], [6, 5, 0, 4], [0, 3, 2, 1], [-9, 0, 0, 0]]
        ... )
        >>> mask = optimal_transposable_2to4_mask(w)
        >>> mask.int().tolist()
        [[0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]]
        >>> (w.abs() * mask).sum().item()  # the greedy keeps 38.0, starting with 9
        39.0
    """
    flat = _as_2d(weight)
    if not flat.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating point tensor, got {flat.dtype}")
    rows, cols = flat.shape
    out = torch.empty((rows, cols), dtype=torch.bool, device=flat.device)
    if out.numel() == 0:
        return out.view(weight.shape)
    score_dtype = _score_dtype(flat.dtype, flat.device)
    patterns, columns = _patterns(exactly_two, flat.device, score_dtype)
    tile_rows, tile_cols = rows // _TILE, cols // _TILE
    chunk = _chunk_tile_rows(tile_cols, flat.device, _CPU_CHUNK_TILES_OPTIMAL)
    n = min(chunk, tile_rows) * tile_cols
    mag = torch.empty((n, 16), dtype=score_dtype, device=flat.device)
    scores = torch.empty((n, len(patterns)), dtype=score_dtype, device=flat.device)
    kept = torch.empty((n, 16), dtype=torch.bool, device=flat.device)
    tiles = flat.view(tile_rows, _TILE, tile_cols, _TILE)
    for r0 in range(0, tile_rows, chunk):
        k = min(chunk, tile_rows - r0)
        m = k * tile_cols
        mag_k = mag[:m]
        mag_k.view(k, tile_cols, _TILE, _TILE).copy_(
            tiles[r0 : r0 + k].permute(0, 2, 1, 3)
        )
        mag_k.abs_()
        torch.mm(mag_k, columns, out=scores[:m])
        torch.index_select(patterns, 0, scores[:m].argmax(1), out=kept[:m])
        _write_tiles(out, r0, kept[:m])
    return out.view(weight.shape)


TILE_KERNEL_MULTIPLE = 128  # both dimensions, for torch's tile kernel
TILE_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def tile_kernel_takes(weight: Tensor) -> bool:
    """Whether torch's CUDA tile kernel can choose the greedy mask of ``weight``.

    Example:
        >>> import torch
        >>> tile_kernel_takes(torch.zeros(128, 256, dtype=torch.bfloat16))  # a CPU tensor
        False
    """
    return (
        weight.device.type == "cuda"
        and weight.dtype in TILE_KERNEL_DTYPES
        and weight.dim() == 2
        and weight.numel() > 0
        and all(size % TILE_KERNEL_MULTIPLE == 0 for size in weight.shape)
    )


@torch.library.custom_op("lightning_sparse::tile_kernel_mask", mutates_args=())
def _tile_kernel_mask(weight: Tensor) -> Tensor:
    """The keep-mask that torch's tile kernel chooses for a weight it takes.

    The kernel reads row-major weights only; a Conv1D weight's rows (its transpose) are
    strided, so they are copied first.
    """
    rows = weight.contiguous()
    *_, bitmask = torch._sparse_semi_structured_tile(
        rows, algorithm="largest_abs_values_greedy", use_cutlass=False
    )
    ones = torch.ones_like(rows)
    return torch._sparse_semi_structured_apply_dense(ones, bitmask) != 0


@_tile_kernel_mask.register_fake
def _(weight: Tensor) -> Tensor:
    return weight.new_empty(weight.shape, dtype=torch.bool)


def greedy_2to4_mask(weight: Tensor) -> Tensor:
    """The greedy transposable 2:4 keep-mask of :func:`transposable_2to4_mask`, chosen by
    torch's CUDA kernel ``torch._sparse_semi_structured_tile(W, "largest_abs_values_greedy")``
    where it runs (:func:`tile_kernel_takes`), else by :func:`transposable_2to4_mask`.

    The kernel compares ``|w|`` in the weight's own (16-bit) dtype and orders equal values
    its own way, so the two masks can differ only where ``|w|`` ties within a tile; both are
    greedy choices. On the CPU this is :func:`transposable_2to4_mask`. The kernel runs as one
    custom op, ``lightning_sparse::tile_kernel_mask``, which ``torch.compile`` traces as a
    single node of the graph.

    Example:
        >>> import torch
        >>> w = torch.randn(8, 16)
        >>> torch.equal(greedy_2to4_mask(w), transposable_2to4_mask(w))
        True
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():  # shapes only: a CUDA weight the kernel takes
        ...     mask = greedy_2to4_mask(torch.empty(128, 256, device="cuda", dtype=torch.bfloat16))
        >>> mask.shape, mask.dtype, mask.device.type
        (torch.Size([128, 256]), torch.bool, 'cuda')
    """
    if not tile_kernel_takes(weight):
        return transposable_2to4_mask(weight)
    return _tile_kernel_mask(weight)


def has_4x4_tiles(weight: Tensor) -> bool:
    """Whether ``weight`` is 2-D with both dimensions multiples of 4 (and not empty).

    Example:
        >>> import torch
        >>> has_4x4_tiles(torch.zeros(8, 12)), has_4x4_tiles(torch.zeros(8, 6)), has_4x4_tiles(torch.zeros(4, 4, 4))
        (True, False, False)
    """
    return (
        weight.dim() == 2
        and weight.numel() > 0
        and weight.shape[0] % _TILE == 0
        and weight.shape[1] % _TILE == 0
    )


def is_transposable_2to4(mask: Tensor) -> bool:
    """Whether every 4x4 tile of ``mask`` keeps at most 2 per row and at most 2 per column.

    ``mask`` is viewed as ``(out, -1)`` (both dimensions multiples of 4); nonzero means kept.

    Example:
        >>> import torch
        >>> is_transposable_2to4(torch.eye(4, dtype=torch.bool).repeat(2, 2))
        True
        >>> is_transposable_2to4(torch.ones(4, 4, dtype=torch.bool))
        False
    """
    flat = _as_2d(mask, "mask") != 0
    rows, cols = flat.shape
    in_rows = nm_groups(flat, _TILE).sum(-1, dtype=torch.int32)  # (rows, tile cols)
    in_cols = flat.view(rows // _TILE, _TILE, cols).sum(1, dtype=torch.int32)
    return bool((in_rows <= 2).all() and (in_cols <= 2).all())
