"""Triton kernels for cuSPARSELt's 2:4 format: one pass over a weight writes ``W24`` and ``W24.T``
packed, choosing the mask on the way (:func:`mask_and_pack`) or taking a stored one
(:func:`pack`).

What they compute is defined by the torch ops they replace, and the tests compare the two bit for
bit (under ``TRITON_INTERPRET=1`` on the CPU):

- :func:`mask_and_pack`: ``mask = transposable_2to4_mask(W)`` (greedy by ``|w|``, ties to the
  earlier position, :mod:`~lightning_sparse.masks.tiles`), then
  ``cusparselt_packer.compress(W * mask)`` and ``compress((W * mask).T)``;
- :func:`pack`: ``packing(mask).compress(W)`` and ``packing(mask.T).compress(W.T)``
  (:mod:`~lightning_sparse.backends.cusparselt_packer`, whose docstring has the format).

One program reads one ``B x B`` block of ``W`` (``B = 128``, or 64) once and writes its share of
both packings. ``n`` and ``k`` are multiples of 128, and cuSPARSELt's metadata is laid out in
regions of 64 rows by 8 groups (128 words; the interleave inside a region is the packer's), so a
block's share is whole regions of both outputs::

    W (n, k), 16-bit        packed W (n, 9k/16), read flat
    +------+------+--       +-------------------------------+----------------------------+
    |(i,j) |      |         | values (n, k/2): rows iB..,   | metadata (n k/8 bytes):    |
    | B x B|      |  ---->  | columns jB/2..: per group its | regions (R, C), R from     |
    +------+------+         | 2 stored values, positions    | iB/64, C from jB/32; one   |
    |      |      |         | ascending, padding +0         | nibble idx0 | idx1 << 2    |
                            +-------------------------------+ per group                  |
                                                            +----------------------------+
    one 4x4 tile:           key = |w| bits << 4 | 15 - p,   packed W.T (k, 9n/16): the
      p =  0  1  2  3       sorted by the network, visited  same from the block's
           4  5  6  7       largest first: kept while its   transpose: rows jB..,
           8  9 10 11       tile row and tile column each   regions R from jB/64,
          12 13 14 15       hold fewer than 2               C from iB/32

The keys are distinct, so their order is that of a stable descending sort (ties to the earlier
position), as in the torch reference, whose sorting network this is. The runtime packing stores
the non-zeros of ``W * mask`` (a kept ``-0.0`` or ``+0.0`` is padding, as ``compress`` reads
it); the stored-mask packing stores the mask's positions, zeros included.

The wrappers check shapes and dtypes; the kernels decide nothing. Which packer runs, and only
after it was compared with ``torch._cslt_compress`` on the running GPU, is decided by
:mod:`~lightning_sparse.backends.cusparselt`. The packings equal the torch path's for finite
weights (``W * mask`` turns a pruned ``inf`` into a ``NaN`` that the torch path stores); the
mask equals it for any.

Example (under ``TRITON_INTERPRET=1`` this runs on CPU tensors):
    >>> import torch
    >>> from lightning_sparse.backends.cusparselt_packer import compress
    >>> from lightning_sparse.masks.tiles import transposable_2to4_mask
    >>> w = torch.randn(128, 256).to(torch.bfloat16)
    >>> if runs_on(w.device):
    ...     packed, packed_t = mask_and_pack(w)
    ...     w24 = w * transposable_2to4_mask(w)
    ...     assert torch.equal(packed.view(torch.int16), compress(w24).view(torch.int16))
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_sparse.backends.cusparselt_packer import DTYPES, MULTIPLE, supports
from lightning_sparse.masks.tiles import SORTING_NETWORK_16

BLOCK = 128
"""Rows and columns of ``W`` per program by default (the packer's shape multiple, so every weight
it takes): not yet tuned on a GPU."""
WARPS = {64: 8, 128: 16}
"""The block sizes the kernels take (whole metadata regions that divide every weight the packer
takes) and the warps of a program for each: about 80 and 110 registers a thread for sm90 as
Triton 3.8 compiles them, no spills (compiled without a GPU); not yet tuned on a GPU."""
INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether this process runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1`` when
this module was imported): then they take CPU tensors, slowly."""

_LOW = tl.constexpr(tuple(i for i, _ in SORTING_NETWORK_16))
_HIGH = tl.constexpr(tuple(j for _, j in SORTING_NETWORK_16))
_COMPARATORS = tl.constexpr(len(SORTING_NETWORK_16))


def _nan_bits(dtype: torch.dtype) -> int:
    """The key bits of every NaN: just above +inf's (``|w|`` is the IEEE bits without the
    sign), so that NaNs rank equal and above everything, as in the torch reference."""
    return int(torch.tensor(math.inf, dtype=dtype).view(torch.int16)) + 1


def runs_on(device: torch.device) -> bool:
    """Whether the kernels take tensors on ``device``: CUDA, or the CPU under the interpreter."""
    return device.type == ("cpu" if INTERPRETED else "cuda")


Packed = tuple["Tensor | None", "Tensor | None"]
"""``(packed W, packed W.T)``: each in cuSPARSELt's format, or ``None`` where not asked for."""


def mask_and_pack(
    weight: Tensor,
    keep: Tensor | None = None,
    *,
    rows: bool = True,
    columns: bool = True,
    block: int = BLOCK,
    warps: int | None = None,
) -> Packed:
    """``(compress(W24), compress(W24.T))`` for ``W24 = weight * transposable_2to4_mask(weight)``,
    in one read of ``weight`` (``rows``/``columns``: write ``W24``'s, ``W24.T``'s); with
    ``keep`` (a bool tensor shaped like ``weight``), the mask is written there too. ``block``
    (64 or 128) and ``warps`` (``None``: ``WARPS[block]``): each program's share of the weight
    and its threads."""
    _check(weight, "weight", block)
    if keep is not None:
        _check_mask(keep, weight, "keep")
    return _launch(weight, keep, rows, columns, block, warps, choose=True)


def pack(
    weight: Tensor,
    mask: Tensor,
    *,
    rows: bool = True,
    columns: bool = True,
    block: int = BLOCK,
    warps: int | None = None,
) -> Packed:
    """``(packing(mask).compress(weight), packing(mask.T).compress(weight.T))`` for a bool
    ``mask`` with at most 2 kept in each group of 4 of its rows and of its columns (a
    transposable 2:4 mask; not checked), in one read of ``weight`` and ``mask``; ``rows``,
    ``columns``, ``block`` and ``warps`` as for :func:`mask_and_pack`."""
    _check(weight, "weight", block)
    _check_mask(mask, weight, "mask")
    return _launch(weight, mask, rows, columns, block, warps, choose=False)


def _launch(
    weight: Tensor,
    mask: Tensor | None,
    rows: bool,
    columns: bool,
    block: int,
    warps: int | None,
    choose: bool,
) -> Packed:
    """Run the kernel over ``weight``: its mask chosen (``choose``; written into ``mask`` where
    given) or read from ``mask``; returns the packings asked for."""
    packed, packed_t = _outputs(weight, rows, columns)
    n, k = weight.shape
    _pack_kernel[(n // block, k // block)](
        weight.view(torch.int16),
        weight if mask is None else mask.view(torch.uint8),  # unused without a mask
        _words(packed, weight),
        _words(packed_t, weight),
        n,
        k,
        CHOOSE=choose,
        STORE_MASK=choose and mask is not None,
        NAN_BITS=_nan_bits(weight.dtype),
        ROWS=rows,
        COLUMNS=columns,
        BLOCK_ROWS=block,
        BLOCK_COLS=block,
        num_warps=WARPS[block] if warps is None else warps,
    )
    return packed, packed_t


def _outputs(weight: Tensor, rows: bool, columns: bool) -> Packed:
    n, k = weight.shape
    packed = weight.new_empty((n, k * 9 // 16)) if rows else None
    return packed, weight.new_empty((k, n * 9 // 16)) if columns else None


def _words(packed: Tensor | None, weight: Tensor) -> Tensor:
    """``packed`` as the kernels write it (16-bit words); the weight where it is not asked for
    (a pointer the kernel does not touch)."""
    return (weight if packed is None else packed).view(torch.int16)


def _check(weight: Tensor, name: str, block: int) -> None:
    if block not in WARPS:
        raise ValueError(f"block={block!r}; use one of {tuple(WARPS)}")
    if not supports(weight.shape, weight.dtype):
        raise ValueError(
            f"{name} of shape {tuple(weight.shape)} and dtype {weight.dtype}: the Triton kernels "
            f"take 2-D {' or '.join(str(d) for d in DTYPES)} weights whose dimensions are "
            f"multiples of {MULTIPLE}; pack others with torch._cslt_compress"
        )
    if not runs_on(weight.device):
        where = (
            "CPU tensors under TRITON_INTERPRET=1" if INTERPRETED else "CUDA tensors"
        )
        raise ValueError(
            f"{name} is on {weight.device}; the Triton kernels take {where}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")


def _check_mask(mask: Tensor, weight: Tensor, name: str) -> None:
    if mask.dtype != torch.bool or mask.shape != weight.shape:
        raise ValueError(
            f"{name} has dtype {mask.dtype} and shape {tuple(mask.shape)}; pass a bool "
            f"tensor shaped like the weight {tuple(weight.shape)}"
        )
    if mask.device != weight.device or not mask.is_contiguous():
        raise ValueError(
            f"pass {name} contiguous, on the weight's device {weight.device}"
        )


@triton.jit
def _block(n, k, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's block: its first row and column, and the offsets of its elements."""
    row0 = tl.program_id(0) * BLOCK_ROWS
    col0 = tl.program_id(1) * BLOCK_COLS
    rows = (row0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    return row0, col0, rows[:, None] * k + col0 + tl.arange(0, BLOCK_COLS)[None, :]


@triton.jit
def _sorted(keys):
    """The 16 tensors of ``keys`` sorted elementwise, ascending, by the sorting network."""
    for c in tl.static_range(_COMPARATORS):
        keys = _compare(keys, _LOW[c], _HIGH[c])
    return keys


@triton.jit
def _compare(keys, i: tl.constexpr, j: tl.constexpr):
    """``keys`` after the comparator ``(i, j)``: the minimum on wire ``i``, the maximum on ``j``."""
    low = tl.minimum(keys[i], keys[j])
    high = tl.maximum(keys[i], keys[j])
    return keys[:i] + (low,) + keys[i + 1 : j] + (high,) + keys[j + 1 :]


@triton.jit
def _greedy_mask(
    w_ptr,
    row0,
    col0,
    k,
    NAN_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """The block's greedy transposable 2:4 keep-mask, ``(BLOCK_ROWS, BLOCK_COLS)`` bool."""
    TILE_ROWS: tl.constexpr = BLOCK_ROWS // 4
    TILE_COLS: tl.constexpr = BLOCK_COLS // 4
    corners = (row0 + 4 * tl.arange(0, TILE_ROWS)).to(tl.int64)[:, None] * k
    corners += col0 + 4 * tl.arange(0, TILE_COLS)[None, :]
    keys = ()
    for p in tl.static_range(16):  # position p = 4 * row + column within each tile
        bits = tl.load(w_ptr + corners + (p // 4) * k + p % 4).to(tl.int32)
        keys = keys + (tl.minimum(bits & 0x7FFF, NAN_BITS) << 4 | (15 - p),)
    keys = _sorted(keys)
    rows = tl.zeros([TILE_ROWS, TILE_COLS], tl.int32)  # kept per tile row, 2 bits each
    cols = tl.zeros([TILE_ROWS, TILE_COLS], tl.int32)  # kept per tile column
    kept = tl.zeros([TILE_ROWS, TILE_COLS], tl.int32)  # bit p: position p kept
    for s in tl.static_range(16):  # by decreasing key
        p = 15 - (keys[15 - s] & 15)
        row, col = p >> 2, p & 3
        room = ((rows >> 2 * row) & 3) < 2
        room &= ((cols >> 2 * col) & 3) < 2
        take = room.to(tl.int32)
        rows += take << 2 * row
        cols += take << 2 * col
        kept |= take << p
    flags = (kept[:, :, None] >> tl.arange(0, 16)[None, None, :]) & 1
    tiles = tl.reshape(flags, [TILE_ROWS, TILE_COLS, 4, 4])
    return tl.reshape(tl.permute(tiles, (0, 2, 1, 3)), [BLOCK_ROWS, BLOCK_COLS]) != 0


@triton.jit
def _quarters(x):
    """``x[:, :, 0]`` to ``x[:, :, 3]`` of a ``(rows, groups, 4)`` tensor."""
    even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2]))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _pack_block(
    bits,
    keep,
    out_ptr,
    row0,
    col0,
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Write the share of the ``(BLOCK_ROWS, BLOCK_COLS)`` block at ``(row0, col0)`` of an
    ``(n_rows, n_cols)`` matrix (``bits``: its 16-bit words, ``keep``: the positions to store)
    into its compressed form at ``out_ptr``."""
    GROUPS: tl.constexpr = BLOCK_COLS // 4
    w0, w1, w2, w3 = _quarters(tl.reshape(bits, [BLOCK_ROWS, GROUPS, 4]))
    m0, m1, m2, m3 = _quarters(tl.reshape(keep.to(tl.int8), [BLOCK_ROWS, GROUPS, 4]))
    m0, m1, m2, m3 = m0 != 0, m1 != 0, m2 != 0, m3 != 0
    two = m0.to(tl.int8) + m1.to(tl.int8) + m2.to(tl.int8) + m3.to(tl.int8) == 2
    # stored positions (idx0, idx1): the two kept; one kept at a < 3: (a, 3); else (2, 3)
    idx0 = tl.where(m0, 0, tl.where(m1, 1, 2))
    idx1 = tl.where(m3 | ~two, 3, tl.where(m2, 2, 1))
    zero = tl.zeros_like(w0)  # padding is +0
    v0 = tl.where(m0, w0, tl.where(m1, w1, tl.where(m2, w2, zero)))
    v1 = tl.where(m3, w3, tl.where(two, tl.where(m2, w2, w1), zero))
    rows = (row0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    values = tl.reshape(tl.join(v0, v1), [BLOCK_ROWS, BLOCK_COLS // 2])
    at = (
        rows[:, None] * (n_cols // 2)
        + col0 // 2
        + tl.arange(0, BLOCK_COLS // 2)[None, :]
    )
    tl.store(out_ptr + at, values)
    # the group of row 64R + 16a + 8b + c, group column 8C + 4d + e: nibble 2d + b of word
    # 128 (R n_cols/32 + C) + 32a + 4c + e of the metadata
    nibbles = tl.reshape(
        idx0 | idx1 << 2, [BLOCK_ROWS // 64, 4, 2, 8, BLOCK_COLS // 32, 2, 4]
    )
    nibbles = tl.permute(nibbles, (0, 4, 1, 3, 6, 5, 2))  # (R, C, a, c, e, d, b)
    low, high = tl.split(nibbles)
    byte0, byte1 = tl.split(low | high << 4)
    words = tl.reshape(byte0 | byte1 << 8, [BLOCK_ROWS // 64, BLOCK_COLS // 32, 128])
    regions = (row0 // 64 + tl.arange(0, BLOCK_ROWS // 64)).to(tl.int64) * (
        n_cols // 32
    )
    regions = regions[:, None] + col0 // 32 + tl.arange(0, BLOCK_COLS // 32)[None, :]
    at = regions[:, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    metadata = out_ptr + n_rows.to(tl.int64) * n_cols // 2
    tl.store(metadata + at, words.to(tl.int16))


@triton.jit
def _pack_kernel(
    w_ptr,
    mask_ptr,
    out_ptr,
    out_t_ptr,
    n,
    k,
    CHOOSE: tl.constexpr,
    STORE_MASK: tl.constexpr,
    NAN_BITS: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """One block: its mask chosen (``CHOOSE``; written to ``mask_ptr`` with ``STORE_MASK``) or
    read from ``mask_ptr``, and its share of packed ``W`` (``ROWS``) and ``W.T`` (``COLUMNS``)."""
    row0, col0, offsets = _block(n, k, BLOCK_ROWS, BLOCK_COLS)
    bits = tl.load(w_ptr + offsets)
    if CHOOSE:
        keep = _greedy_mask(w_ptr, row0, col0, k, NAN_BITS, BLOCK_ROWS, BLOCK_COLS)
        if STORE_MASK:
            tl.store(mask_ptr + offsets, keep.to(tl.int8))
        keep = keep & ((bits & 0x7FFF) != 0)  # the non-zeros of W * mask
    else:
        keep = tl.load(mask_ptr + offsets) != 0
    if ROWS:
        _pack_block(bits, keep, out_ptr, row0, col0, n, k, BLOCK_ROWS, BLOCK_COLS)
    if COLUMNS:
        keep_t, bits_t = tl.trans(keep), tl.trans(bits)
        _pack_block(bits_t, keep_t, out_t_ptr, col0, row0, k, n, BLOCK_COLS, BLOCK_ROWS)
