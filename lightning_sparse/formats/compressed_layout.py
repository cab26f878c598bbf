"""The compressed safetensors format: its names, its constants and its bit-level pieces.

A sparse tensor ``<name>`` is stored as ``<name>::values`` (its non-zero values, row-major)
and ``<name>::bitmask`` (1 bit per element, little-endian in bytes); the ``sparse`` metadata
entry gives its shape, its N:M pattern along its layer's inputs, and (format version 2) which
stored dimension those inputs are where it is not the last. Writer
(:mod:`~lightning_sparse.formats.compressed`) and checks
(:mod:`~lightning_sparse.formats.compressed_checks`) share what is here.

Example:
    >>> import torch
    >>> mask = torch.tensor([[True, False, True, False]] * 2)
    >>> torch.equal(unpack_bits(pack_bits(mask), 8).view(2, 4), mask)
    True
    >>> nm_pattern(mask), nm_pattern(~mask | mask)
    ('2:4', None)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sparse.masks import NM, is_nm

VERSION = 2
"""The newest format version, read and written here. Version 2 adds a sparse tensor's
``inputs`` entry; a file that has none is written as version 1."""
FORMAT = f"lightning_sparse.compressed/{VERSION}"
"""The ``format`` metadata entry of a file that needs version 2: ``<name>/<version>``."""
FORMAT_NAMES = ("lightning_sparse.compressed", "lightning_sparse.formats.compressed")
"""Names :func:`~lightning_sparse.formats.compressed.load_compressed` reads; the second was written for a while after the module
moved into ``formats/``, with the same layout."""
VALUE_DTYPES = frozenset(
    {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ"}
)
"""safetensors dtypes a sparse tensor's values may have: the floating types with a zero."""
SPARSE_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    *(
        getattr(torch, f"float8_{t}", None)
        for t in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")
    ),
} - {None}  # the same types as torch dtypes (float8_e8m0fnu has no zero to prune to)
MAX_DIMS = 64
"""The most dimensions a sparse tensor's shape may have."""
LAYOUT = (
    "sparse tensor <name>: '<name>::values' (the non-zero values, row-major) and "
    "'<name>::bitmask' (uint8; bit j of byte i is element 8*i+j of the flattened tensor, "
    "1 = non-zero); shapes and N:M patterns in the 'sparse' metadata entry (groups along the "
    "dimension 'inputs' where given, else along the last axis of the (shape[0], -1) view)"
)
SEP = "::"
DAMAGED = (
    "; the file is damaged or was not written by save_compressed: export it again with "
    "save_compressed"
)
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as packed bytes (little-endian bit order, padded with zeros).

    >>> pack_bits(torch.tensor([True, False, False, True, False, False, False, False, True])).tolist()
    [9, 1]
    """
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _BITS.to(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` bits of :func:`pack_bits` output, as a flat bool tensor."""
    bits = packed.reshape(-1, 1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:numel]


def along_inputs(tensor: Tensor, inputs: int | None) -> Tensor:
    """``tensor`` with the stored dimension ``inputs`` last (as is, for ``None``)."""
    return tensor if inputs is None else tensor.movedim(inputs, -1)


def nm_pattern(nonzero: Tensor, inputs: int | None = None) -> str | None:
    """``"2:4"`` if ``nonzero`` keeps at most 2 of every 4 along the inputs, else ``None``."""
    target = NM(2, 4)
    rows = along_inputs(nonzero, inputs)
    if has_no_groups(list(nonzero.shape), target.m, inputs):
        return None
    return str(target) if is_nm(rows, target) else None


def has_no_groups(shape: list[int], m: int, inputs: int | None) -> bool:
    """Whether a tensor of ``shape`` has no whole groups of ``m`` along its inputs."""
    if len(shape) < 2:
        return True
    along = math.prod(shape[1:]) if inputs is None else shape[inputs]
    return along % m != 0
