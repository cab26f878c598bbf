"""Optional compiled CPU loops for mask updates: ``pip install "lightning-sparse[cpu]"``.

The torch operations in :mod:`lightning_sparse.masks` define every result. On plain,
contiguous float32/float64 CPU tensors (and their bool masks), a few of them have a faster twin
here, with the same bits: loops compiled by Numba (:mod:`~lightning_sparse.kernels.loops`) that
make one pass where torch makes several, and the NumPy calls Numba comes with for counting,
listing, scattering and partitioning, which run several times faster than torch's CPU kernels
for them. This module is the one place that decides whether a twin runs
(:func:`accepts`), and it imports Numba only then, on the first mask update that can use it.
Without Numba, or inside ``with compiled(False):``, the torch operations run.

Example:
    >>> import torch
    >>> values = torch.tensor([1.5, -2.0, 3.0])
    >>> with compiled(False):
    ...     accepts(values)
    False
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

_FLOATS = (torch.float32, torch.float64)
_enabled = os.environ.get("LIGHTNING_SPARSE_CPU_KERNELS", "1") != "0"


@functools.cache
def installed() -> bool:
    """Whether Numba is installed (the ``[cpu]`` extra); nothing is imported to find out."""
    return importlib.util.find_spec("numba") is not None


@contextlib.contextmanager
def compiled(enabled: bool) -> Iterator[None]:
    """Run mask updates with (``True``) or without (``False``) the compiled loops inside the
    block, on every thread; ``LIGHTNING_SPARSE_CPU_KERNELS=0`` turns them off for a process."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def accepts(*tensors: Tensor) -> bool:
    """Whether the compiled loops take these tensors: the loops are enabled and installed, the
    machine is little-endian (they read bool flags as words), and every tensor is a plain,
    contiguous CPU tensor, the floating ones all float32 or all float64, the rest bool."""
    if not (_enabled and sys.byteorder == "little" and installed()):
        return False
    floats = set()
    for t in tensors:
        if type(t) not in (Tensor, torch.nn.Parameter) or t.device.type != "cpu":
            return False
        if not t.is_contiguous():
            return False
        if t.dtype != torch.bool:
            floats.add(t.dtype)
    return len(floats) <= 1 and floats <= set(_FLOATS)


@functools.cache
def _compiled() -> ModuleType:
    """The compiled loops (imports Numba; call only after :func:`accepts`)."""
    return importlib.import_module("lightning_sparse.kernels.loops")


def _array(tensor: Tensor, as_bytes: bool = False):
    """A flat NumPy view of ``tensor``'s memory (bool as ``uint8`` with ``as_bytes``)."""
    array = tensor.detach().reshape(-1).numpy()
    return array.view("uint8") if as_bytes else array


def count_true(mask: Tensor) -> int:
    """How many entries of the bool ``mask`` are set."""
    return int(np.count_nonzero(_array(mask)))


def flat_nonzero(mask: Tensor) -> Tensor:
    """Ascending flat indices (int64) of the set entries of the bool ``mask``."""
    return torch.from_numpy(np.flatnonzero(_array(mask)))


def set_at_(target: Tensor, index: Tensor, values: Tensor | bool) -> None:
    """``target.view(-1)[index] = values`` (valid int64 ``index``, on the CPU)."""
    flat = _array(target)
    flat[index.numpy()] = values if isinstance(values, bool) else _array(values)


def distinct_sorted(values: Tensor) -> Tensor:
    """The distinct entries of the int64 CPU tensor ``values``, ascending."""
    ordered = np.sort(values.numpy())
    distinct = np.empty(ordered.size, dtype=bool)
    distinct[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=distinct[1:])
    return torch.from_numpy(ordered[distinct])


def first_k(values: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    """:func:`lightning_sparse.masks.top_k` 's choice of the ``k`` first of ``values``:
    ``(strict, ties)``, those beyond the ``k``-th value and the positions of the equal ones
    that complete the ``k``."""
    x = _array(values)
    position = len(x) - k if largest else k - 1  # of the k-th, in ascending order
    kth = np.partition(x, position)[position]
    strict = x > kth if largest else x < kth
    ties = np.flatnonzero(x == kth)[: k - int(np.count_nonzero(strict))]
    return torch.from_numpy(strict), torch.from_numpy(ties)


def strided_sample(
    values: Tensor,
    eligible: Tensor | None,
    keep_set: bool,
    stride: int,
    magnitude: bool,
) -> Tensor:
    """Every ``stride``-th entry of ``values`` (``|values|`` with ``magnitude``), keeping those
    where ``eligible`` equals ``keep_set`` (all without it), in a new tensor."""
    x = _array(values)[
        ::stride
    ].copy()  # strided reads once; filtering runs on the copy
    if eligible is not None:
        flags = _array(eligible)[::stride].copy()
        x = x[flags if keep_set else ~flags]
    if magnitude:
        np.abs(x, out=x)
    return torch.from_numpy(x)


def order_statistics(values: Tensor, positions: list[int]) -> list[float]:
    """The entries at ``positions`` (each within range) of ``values`` sorted ascending, NaN
    last as :func:`torch.sort` places them; ``values`` is sorted in place."""
    x = _array(values)
    x.sort()
    return [float(x[p]) for p in positions]


def multiply_(values: Tensor, mask: Tensor) -> None:
    """``values *= mask`` (bool): a pruned value becomes a zero of its sign."""
    _compiled().multiply(_array(values), _array(mask, True))


def multiply_where_(values: Tensor, mask: Tensor, changed: Tensor) -> None:
    """``values *= mask`` where ``changed`` is set."""
    _compiled().multiply_where(
        _array(values), _array(mask, True), _array(changed, True)
    )


def zero_where_(values: Tensor, where: Tensor) -> None:
    """``values`` becomes ``+0.0`` where ``where`` is set."""
    _compiled().zero_where(_array(values), _array(where, True))


def threshold_pass(
    values: Tensor,
    eligible: Tensor | None,
    keep_set: bool,
    magnitude: bool,
    largest: bool,
    inner: float,
    outer: float | None,
    sure: Tensor,
    band_capacity: int,
) -> tuple[int, Tensor, Tensor]:
    """One pass over ``values`` (or ``|values|``): marks in ``sure`` the eligible entries beyond
    ``inner`` and lists the eligible ones at or beyond ``outer`` but not beyond ``inner`` (all
    that are not sure, if ``outer`` is ``None``). Eligible: where ``eligible`` equals
    ``keep_set`` (all without it). Returns ``(sure count, band indices, band values)``."""
    kernel = _compiled()
    x = _array(values)
    flags = None if eligible is None else _array(eligible, True)
    as_x = x.dtype.type  # the thresholds are values of x: exact in its dtype
    args = (x, flags, int(keep_set), magnitude, largest, as_x(inner))
    rest = (
        as_x(0.0 if outer is None else outer),
        outer is not None,
        _array(sure, True),
    )
    band = torch.empty(band_capacity + kernel.BLOCK, dtype=torch.int64)
    band_values = torch.empty(band.shape, dtype=values.dtype)
    n_sure, n_band, stop = kernel.threshold_pass(
        *args, *rest, band.numpy(), band_values.numpy(), 0, 0
    )
    while stop < x.shape[0]:  # the band outgrew the buffer: go on with a longer one
        band = torch.cat([band[:n_band], torch.empty_like(band)])
        band_values = torch.cat([band_values[:n_band], torch.empty_like(band_values)])
        found, n_band, stop = kernel.threshold_pass(
            *args, *rest, band.numpy(), band_values.numpy(), n_band, stop
        )
        n_sure += found
    return n_sure, band[:n_band], band_values[:n_band]


def refill_groups_(
    mask: Tensor,
    changed: Tensor,
    n: int,
    m: int,
    keys: Tensor | None,
    magnitude: bool,
    offset: int,
) -> None:
    """Refill the N:M groups (``m`` consecutive entries) of ``mask`` in place; see
    :func:`lightning_sparse.masks.refill.refill_groups_` for the rule."""
    flags = (_array(t, True).reshape(-1, m) for t in (mask, changed))
    values = None if keys is None else _array(keys).reshape(-1, m)
    _compiled().refill_groups(*flags, n, values, magnitude, _uint64(offset))


def refill_tiles_(
    mask: Tensor,
    changed: Tensor,
    keys: Tensor | None,
    magnitude: bool,
    offset: int,
    tables: tuple[Tensor, ...],
) -> int:
    """Refill a transposable 2:4 mask in place (2-D ``mask`` and ``changed``); see
    :func:`lightning_sparse.masks.refill.refill_tiles_` for the rule and ``tables``."""
    rows, cols = mask.shape
    flags = (
        _array(t, True).view("uint32").reshape(rows, cols // 4) for t in (mask, changed)
    )
    values = None if keys is None else _array(keys).reshape(rows, cols)
    return _compiled().refill_tiles(
        *flags, values, magnitude, _uint64(offset), *_compact(tables)
    )


def _uint64(value: int) -> np.uint64:
    return np.uint64(value)


_NARROW = ("int64", "uint8", "int32", "uint8", "uint8")
"""The tile tables in the narrowest dtypes that hold them (codes, count, first, completions,
completion pairs): they stay in the L2 cache."""


@functools.cache
def _compact(tables: tuple[Tensor, ...]) -> tuple[np.ndarray, ...]:
    return tuple(t.numpy().astype(kind) for t, kind in zip(tables, _NARROW))
