"""cuSPARSELt's compressed 2:4 format, written with torch ops: the bytes of ``torch._cslt_compress``.

The layout was measured on an H100 (sm90) with cuSPARSELt 0.8.0 for 16-bit weights whose
dimensions are multiples of 128; :func:`supports` says which weights that covers. Another GPU or
library version may lay its format out differently, so compare :func:`compress` with
``torch._cslt_compress`` on the running GPU before using it there.

The compressed ``(n, k)`` weight is ``(n, 9k/16)`` elements of its dtype, read flat:

- the ``n*k/2`` stored values in row-major order, two per group of 4 consecutive elements of a
  row: its non-zeros, padded to two (a group keeping one value at position ``a < 3`` stores
  positions ``(a, 3)``, one at position 3 or none stores ``(2, 3)``; padded values are ``+0``);
- then one 4-bit nibble per group, ``idx0 | idx1 << 2`` (its two stored positions), in 16-bit
  words of 4 nibbles, at an interleaved position: the group of row ``64R + 16a + 8b + c`` and
  group column ``8C + 4d + e`` has nibble ``512 (R k/32 + C) + 128a + 16c + 4e + 2d + b``.

- :func:`compress`: a 2:4 weight to the bytes ``torch._cslt_compress`` writes.
- :func:`packing` and :meth:`Packing.compress`: for a stored mask, the metadata once per mask
  update and, each step, only the values.
- :func:`unpack`: the compressed weight back to the dense 2:4 weight.

Example:
    >>> import torch
    >>> from lightning_sparse.backends import cusparselt_packer
    >>> w = torch.zeros(128, 256, dtype=torch.bfloat16)
    >>> w[:, 1::4] = 1.5  # one value kept in each group of 4: padded with position 3
    >>> packed = cusparselt_packer.compress(w)
    >>> packed.shape, hex(packed.view(-1)[-1].view(torch.int16).item() & 0xFFFF)
    (torch.Size([128, 144]), '0xdddd')
    >>> torch.equal(cusparselt_packer.unpack(packed, w.shape), w)
    True
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes whose layout is known (int8 and float8 lay theirs out otherwise, not measured)."""
MULTIPLE = 128
"""Both dimensions must be multiples of this: the shapes whose layout was measured."""

# The 4 bool bytes of a group read as one int32 are distinct modulo 18 over all 16 patterns,
# so one remainder turns a group of a bool mask into a key for a small table.
_KEYS = 18


def supports(shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether :func:`compress` knows cuSPARSELt's layout for a weight of this shape and dtype.

    Example:
        >>> supports((4096, 1024), torch.bfloat16), supports((4096, 1000), torch.bfloat16)
        (True, False)
    """
    return _known_shape(shape) and dtype in DTYPES


@dataclass(frozen=True, eq=False)
class Packing:
    """What a 2:4 keep-mask fixes of the compressed format: each group's stored positions and
    the metadata bytes. Build it with :func:`packing` once per mask update."""

    shape: tuple[int, int]
    keys: Tensor
    """``(n, k/4)`` int32: each group's kept pattern, as a key of the packer's tables."""
    metadata: Tensor
    """``(n*k/8,)`` uint8: the metadata region of the compressed weight."""

    def compress(self, weight: Tensor) -> Tensor:
        """``weight`` compressed at the mask's positions: its values there, zeros where a group
        keeps fewer than 2, and the mask's metadata.

        Equals ``compress(weight * keep)`` where the mask keeps no exact zeros of ``weight``;
        where it does, only the padding may differ (which zero is stored where), never the
        weight it unpacks to nor any product with it.

        Example:
            >>> keep = torch.zeros(128, 128, dtype=torch.bool)
            >>> keep[:, 0::4] = keep[:, 2::4] = True
            >>> weight = torch.randn(128, 128, dtype=torch.float16)
            >>> torch.equal(packing(keep).compress(weight), compress(weight * keep))
            True
        """
        _check(weight, "weight")
        if tuple(weight.shape) != self.shape:
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} for a packing of shape {self.shape}; "
                f"build the packing from this weight's mask"
            )
        out = weight.new_empty((self.shape[0], self.shape[1] * 9 // 16))
        values, metadata = _regions(out)
        _gather_values(weight, self.keys, values)
        metadata.copy_(self.metadata)
        return out


def positive_zeros(weight: Tensor) -> Tensor:
    """``weight`` with every ``-0.0`` made ``+0.0`` (``-0.0 + 0.0`` is ``+0.0``), other values
    unchanged: what ``torch._cslt_compress`` is given, as a compressor may count a negative
    zero as a kept value.

    Example:
        >>> positive_zeros(torch.tensor([-0.0, 1.5, -2.0])).tolist()
        [0.0, 1.5, -2.0]
    """
    return weight + 0.0


def canonical_words(compressed: Tensor) -> Tensor:
    """The 16-bit words of a compressed weight, flat, with ``-0.0`` stored values read as
    ``+0.0`` (the metadata words as they are): what two packings must share to hold the same
    weight, whichever zero a compressor writes into padding.

    Example:
        >>> w24 = torch.zeros(128, 128, dtype=torch.bfloat16)
        >>> w24[:, 0::4] = 1.0
        >>> signed = compress(w24)
        >>> signed.view(-1)[1] = -0.0  # a group's padding, written as -0.0
        >>> torch.equal(canonical_words(signed), canonical_words(compress(w24)))
        True
    """
    words = compressed.contiguous().view(-1).view(torch.int16).clone()
    values, _ = _regions(words.view(compressed.dtype))
    values.masked_fill_(values == -0x8000, 0)
    return words


def packing(keep: Tensor) -> Packing:
    """The :class:`Packing` of a bool keep-mask with at most 2 True in each group of 4 of a row
    (not checked: the check would synchronize the GPU).

    Example:
        >>> keep = torch.zeros(128, 128, dtype=torch.bool)
        >>> keep[:, 2::4] = keep[:, 3::4] = True
        >>> hex(packing(keep).metadata[0].item())
        '0xee'
    """
    if keep.dtype != torch.bool:
        raise TypeError(f"keep has dtype {keep.dtype}; pass a bool mask (True = kept)")
    keys = _keys(keep)
    return Packing(tuple(keep.shape), keys, _metadata(keys))


def compress(w24: Tensor) -> Tensor:
    """``torch._cslt_compress(w24)``, same shape, dtype and bytes, on any device.

    ``w24`` is a float16/bfloat16 weight of a shape :func:`supports`, with at most 2 non-zeros
    in each group of 4 consecutive elements of a row (not checked: the check would synchronize
    the GPU; ``-0.0`` counts as zero). Raises ``ValueError`` for other shapes and dtypes.

    Example:
        >>> w24 = torch.zeros(128, 128, dtype=torch.bfloat16)
        >>> w24[:, 0::4] = torch.arange(1, 129, dtype=torch.bfloat16).view(128, 1)
        >>> w24[:, 3::4] = -1.0
        >>> compress(w24).view(-1)[:4].tolist()
        [1.0, -1.0, 1.0, -1.0]
    """
    _check(w24, "w24")
    keys = _keys(w24 != 0)
    out = w24.new_empty((w24.shape[0], w24.shape[1] * 9 // 16))
    values, metadata = _regions(out)
    _gather_values(w24, keys, values)
    _metadata(keys, out=metadata)
    return out


def unpack(compressed: Tensor, shape: Sequence[int]) -> Tensor:
    """The dense ``shape`` weight that ``compressed`` (cuSPARSELt's format) holds.

    Example:
        >>> w24 = torch.zeros(128, 128, dtype=torch.float16)
        >>> w24[:, 1::4] = 2.0
        >>> torch.equal(unpack(compress(w24), (128, 128)), w24)
        True
    """
    _check_shape(tuple(shape), "shape")
    if compressed.dtype not in DTYPES:
        raise ValueError(
            f"compressed has dtype {compressed.dtype}; expected one of {DTYPES}"
        )
    n, k = shape
    flat = compressed.contiguous().view(-1)
    if flat.numel() != n * k * 9 // 16:
        raise ValueError(
            f"compressed has {flat.numel()} elements; a ({n}, {k}) weight compresses to "
            f"{n * k * 9 // 16}"
        )
    metadata = flat[n * k // 2 :].view(torch.uint8)
    nibbles = torch.stack((metadata & 0xF, metadata >> 4), dim=-1)
    nibbles = _from_nibble_order(nibbles.view(-1), n, k // 4).reshape(-1, 1).long()
    positions = torch.cat((nibbles & 3, nibbles >> 2), dim=1)
    dense = flat.new_zeros((n * k // 4, 4))
    dense.scatter_(1, positions, flat[: n * k // 2].view(-1, 2))
    return dense.view(n, k)


def _keys(keep: Tensor) -> Tensor:
    """``(n, k/4)`` int32: each group's pattern in a bool mask, as a key of the tables."""
    _check_shape(tuple(keep.shape), "keep")
    # a group's 4 bool bytes read as one int32
    return keep.contiguous().view(torch.uint8).view(torch.int32) % _KEYS


def _metadata(keys: Tensor, out: Tensor | None = None) -> Tensor:
    """The metadata bytes of the groups with these keys (into ``out`` when given)."""
    # a byte holds two nibbles, b = 0 (low) and b = 1: one pair of keys each
    pairs = _to_nibble_order(keys).view(-1, 2)
    byte_keys = torch.add(pairs[:, 0], pairs[:, 1], alpha=_KEYS)
    return torch.index_select(_tables(keys)[2], 0, byte_keys, out=out)


def _gather_values(weight: Tensor, keys: Tensor, out: Tensor) -> None:
    """Each group's two stored values into ``out`` (int16, two per group), padding as +0."""
    pairs, padded, _ = _tables(keys)
    keys = keys.view(-1)
    # 16-bit integer views copy the values' bits as they are (and gather faster on the CPU)
    groups = weight.contiguous().view(torch.int16).view(-1, 4)
    torch.gather(groups, 1, pairs.index_select(0, keys), out=out)
    out.masked_fill_(padded.index_select(0, keys), 0)


def _regions(compressed: Tensor) -> tuple[Tensor, Tensor]:
    """The values (int16, two per group) and metadata (uint8) regions of ``compressed``."""
    flat = compressed.view(-1).view(torch.int16)
    values = flat[: flat.numel() * 8 // 9]
    return values.view(-1, 2), flat[values.numel() :].view(torch.uint8)


def _to_nibble_order(groups: Tensor) -> Tensor:
    """``(n, k/4)`` per-group data, copied into the order of the metadata's nibbles."""
    n, q = groups.shape
    # row 64R + 16a + 8b + c, group column 8C + 4d + e -> nibble (R, C, a, c, e, d, b)
    tiled = groups.view(n // 64, 4, 2, 8, q // 8, 2, 4)
    return tiled.permute(0, 4, 1, 3, 6, 5, 2).contiguous()


def _from_nibble_order(nibbles: Tensor, n: int, q: int) -> Tensor:
    """The inverse of :func:`_to_nibble_order`: ``(n, q)`` per-group data."""
    tiled = nibbles.view(n // 64, q // 8, 4, 8, 4, 2, 2)
    return tiled.permute(0, 2, 6, 3, 1, 5, 4).reshape(n, q)


def _stored_positions(kept: Sequence[bool]) -> tuple[list[int], list[bool]]:
    """A group's two stored positions, ascending, and which of them are padding: its first two
    kept positions, padded with 3 and then 2 (as cuSPARSELt does)."""
    positions = [i for i in range(4) if kept[i]][:2]
    padding = [p for p in (3, 2) if p not in positions][: 2 - len(positions)]
    stored = sorted(positions + padding)
    return stored, [p in padding for p in stored]


def _table_rows() -> tuple[list[list[int]], list[list[bool]], list[int]]:
    """Per key: the 2 stored positions and which are padding; per pair of keys ``(a, b)`` at
    ``a + 18 b``: the metadata byte of the two groups."""
    pairs, padded, nibbles = [[0, 0]] * _KEYS, [[False, False]] * _KEYS, [0] * _KEYS
    for kept in itertools.product((False, True), repeat=4):
        # the int32 that _keys reads from 4 bool bytes: little-endian on every torch device
        key = int.from_bytes(bytes(kept), "little") % _KEYS
        pairs[key], padded[key] = _stored_positions(kept)
        nibbles[key] = pairs[key][0] | pairs[key][1] << 2
    pair_bytes = [
        nibbles[a] | nibbles[b] << 4 for b in range(_KEYS) for a in range(_KEYS)
    ]
    return pairs, padded, pair_bytes


_TABLE_ROWS = _table_rows()


def _tables(like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The tables on ``like``'s device: cached for a plain tensor in eager mode; built afresh
    while tracing (fake tensors need fake tables, and a compiled graph holds them as constants)."""
    if type(like) is Tensor and not torch.compiler.is_compiling():
        return _cached_tables(like.device)
    return _build_tables(like.device)


def _build_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    pairs, padded, pair_bytes = _TABLE_ROWS
    return (
        torch.tensor(pairs, dtype=torch.int64, device=device),
        torch.tensor(padded, dtype=torch.bool, device=device),
        torch.tensor(pair_bytes, dtype=torch.uint8, device=device),
    )


_cached_tables = functools.cache(_build_tables)


def _check(weight: Tensor, name: str) -> None:
    if weight.dtype not in DTYPES:
        raise ValueError(
            f"{name} has dtype {weight.dtype}; the packer knows cuSPARSELt's layout for float16 "
            f"and bfloat16 only: compress other dtypes with torch._cslt_compress"
        )
    _check_shape(tuple(weight.shape), name)


def _known_shape(shape: Sequence[int]) -> bool:
    return len(shape) == 2 and all(size > 0 and size % MULTIPLE == 0 for size in shape)


def _check_shape(shape: tuple[int, ...], name: str) -> None:
    if not _known_shape(shape):
        raise ValueError(
            f"{name} has shape {shape}; the packer knows cuSPARSELt's layout for 2-D weights "
            f"whose dimensions are multiples of {MULTIPLE} only (measured on sm90, cuSPARSELt "
            f"0.8): compress other shapes with torch._cslt_compress"
        )
