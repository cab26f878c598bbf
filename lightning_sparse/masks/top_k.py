"""Exact top-k masks of large tensors in one pass, ties broken by position.

:func:`top_k_mask` marks the ``k`` entries with the largest (or smallest) values, or magnitudes,
among the eligible ones. Ties go to the lower flat index, so the mask depends on the values
alone: the same on every device, rank and run.

How: a strided sample of the eligible values brackets the ``k``-th value between an inner and an
outer threshold. One pass over the tensor, in cache-sized chunks, marks the entries beyond the
inner threshold (surely chosen) and lists those between the two thresholds (the band, about 1%
of the entries); ranking the band alone gives the exact ``k``-th value and how many of its ties
to take. If the sample misleads (an adversarial order, NaN values) or the tensor is small, a
stable sort of the eligible values decides instead.

Example:
    >>> import torch
    >>> x = torch.tensor([0.5, -3.0, 2.0, 2.0, 0.0])
    >>> top_k_mask(x, 2).tolist()
    [False, False, True, True, False]
    >>> top_k_mask(x, 1, magnitude=True).tolist()
    [False, True, False, False, False]
    >>> top_k_mask(x, 1, largest=False, magnitude=True, excluding=x == 0).tolist()
    [True, False, False, False, False]
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from lightning_sparse.kernels import loops as cpu_kernels
from lightning_sparse.masks.elementwise import (
    abs_into,
    backend,
    chunks,
    count_true,
    fill,
    flat_nonzero,
    nonzero_of,
    pick_output,
    scratch,
)

SAMPLED = (1 << 14, 1 << 18)
"""How many entries (eligible or not) the strided sample that places the thresholds visits:
1/256 of the tensor, within these bounds (strided reads cost a cache miss each)."""
LARGE = 1 << 16
"""Tensors with at most this many entries are ranked by a sort."""


@dataclass(frozen=True)
class _Choice:
    """What to choose: ``k`` of the eligible entries of ``flat`` (see :func:`top_k_mask`)."""

    flat: Tensor
    k: int
    largest: bool
    magnitude: bool
    flags: Tensor | None  # eligibility: where set (keep_set) or where not set
    keep_set: bool
    n_eligible: int


@torch.no_grad()
def top_k_mask(
    values: Tensor,
    k: int,
    *,
    largest: bool = True,
    magnitude: bool = False,
    among: Tensor | None = None,
    excluding: Tensor | None = None,
    n_eligible: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """A bool mask shaped like ``values`` that marks exactly ``k`` eligible entries: those with
    the largest (``largest=False``: smallest) values, or ``|values|`` with ``magnitude=True``.

    Eligible are the entries where the bool tensor ``among`` is set, or those where
    ``excluding`` is not set (at most one of the two; neither: all); a caller that knows how
    many there are may say so in ``n_eligible``. Ties go to the lower flat index. ``values`` is
    not modified; ``|values|`` is never materialized. With ``out`` (a contiguous bool tensor
    of as many entries), the mask is written there.

    Raises:
        ValueError: ``k`` is negative or more than the eligible entries.
    """
    if among is not None and excluding is not None:
        raise ValueError("give top_k_mask either among or excluding, not both")
    flat = values.detach().reshape(-1)
    n = flat.numel()
    restriction = among if among is not None else excluding
    flags = None if restriction is None else restriction.reshape(-1)
    if n_eligible is None:
        n_eligible = n if flags is None else count_true(flags)
        if excluding is not None:
            n_eligible = n - n_eligible
    chosen = pick_output(k, n_eligible, n, flat.device, out)
    if k == n_eligible:
        if flags is None:
            chosen.fill_(True)
        elif among is not None:
            chosen.copy_(flags)
        else:
            torch.logical_not(flags, out=chosen)
        return chosen.view(values.shape)
    choice = _Choice(flat, k, largest, magnitude, flags, excluding is None, n_eligible)
    if not (0 < k and n > LARGE and _bracketed(choice, chosen)):
        _sorted(choice, chosen)
    return chosen.view(values.shape)


def _sorted(c: _Choice, chosen: Tensor) -> None:
    """The exact choice, into ``chosen``, by a stable sort of the eligible values (equal values
    keep their order, so the lower index comes first)."""
    chosen.fill_(False)
    if c.k == 0:
        return
    if c.flags is None:
        index = torch.arange(c.flat.numel(), device=c.flat.device)
    else:
        index = flat_nonzero(c.flags if c.keep_set else ~c.flags)
    scores = c.flat[index]
    if c.magnitude:
        scores = scores.abs()
    order = torch.sort(scores, descending=c.largest, stable=True).indices[: c.k]
    chosen[index[order]] = True


def _thresholds(
    c: _Choice,
    xp: ModuleType,
    x,
    flags,
) -> tuple[float | None, float | None] | None:
    """``(inner, outer)`` from a strided sample of the eligible values: about ``k`` entries lie
    beyond each, fewer beyond ``inner`` and more beyond ``outer``, by a margin of 4 standard
    deviations of the sample's count. ``None`` stands for a threshold beyond every value."""
    n = c.flat.numel()
    stride = max(1, n // min(max(n // 256, SAMPLED[0]), SAMPLED[1]))
    sample = (
        x[::stride].copy() if xp is np else x[::stride]
    )  # gathered once, then filtered
    if flags is not None:
        sampled = flags[::stride].copy() if xp is np else flags[::stride]
        sample = sample[sampled if c.keep_set else ~sampled]
    m = sample.shape[0]
    if m == 0:
        return None
    if c.magnitude:
        sample = abs(sample)
    fraction = c.k / c.n_eligible
    margin = 4.0 * math.sqrt(m * fraction * (1.0 - fraction)) + 16
    ranks = [math.floor(fraction * m - margin), math.floor(fraction * m + margin)]
    # rank r counted from the chosen end is position r (smallest) or m - 1 - r (largest)
    positions = [r if not c.largest else m - 1 - r for r in ranks]
    ordered = np.sort(sample) if xp is np else torch.sort(sample).values
    inner, outer = (float(ordered[p]) if 0 <= p < m else None for p in positions)
    return inner, outer


def _bracketed(c: _Choice, chosen: Tensor) -> bool:
    """The choice through the sampled thresholds, into ``chosen``; ``False`` if they do not
    bracket the ``k``-th value (the caller then sorts)."""
    tensors = [c.flat, chosen] if c.flags is None else [c.flat, chosen, c.flags]
    xp, arrays = backend(*tensors)
    x, sure = arrays[0], arrays[1]
    eligible = arrays[2] if c.flags is not None else None
    thresholds = _thresholds(c, xp, x, eligible)
    if thresholds is None:
        return False
    inner, outer = thresholds
    # (the compiled pass reads 8 flags as a little-endian word)
    if xp is np and sys.byteorder == "little" and cpu_kernels.accepts(x):
        n_sure, index, values = _kernel_pass(c, x, sure, eligible, inner, outer)
    else:
        n_sure, index, values = _chunked_pass(c, xp, x, sure, eligible, inner, outer)
    missing = c.k - n_sure
    if not 0 <= missing <= len(index):
        return False
    if missing == 0 or inner is not None and inner == outer:
        sure[index[:missing]] = True  # (a band of equal values: the first ones)
        return True
    strict, ties = _first_k(xp, values, missing, c.largest)
    sure[index] = strict  # band entries beyond the k-th value; the others stay unset
    sure[index[ties]] = True
    return True


def _chunked_pass(c: _Choice, xp: ModuleType, x, sure, eligible, inner, outer):
    """Marks the entries beyond ``inner`` in ``sure`` and lists the band (at or beyond
    ``outer``, not beyond ``inner``), chunk by chunk with NumPy or torch ops: ``(count of
    sure, band indices, band values)``."""
    beyond, beyond_or_at = (
        (xp.greater, xp.greater_equal) if c.largest else (xp.less, xp.less_equal)
    )
    size = next(iter(chunks(c.flat.numel(), c.flat.device))).stop
    magnitudes = scratch(xp, x, size) if c.magnitude else None
    band = scratch(xp, x, size, boolean=True)
    band_index, band_value, n_sure = [], [], 0
    for part in chunks(c.flat.numel(), c.flat.device):
        length = part.stop - part.start
        a = x[part]
        if magnitudes is not None:
            a = abs_into(xp, a, magnitudes[:length])
        s, b = sure[part], band[:length]
        if inner is None:
            fill(xp, s, False)
        else:
            beyond(a, inner, out=s)
        if outer is None:
            fill(xp, b, True)
        else:
            beyond_or_at(a, outer, out=b)
        xp.bitwise_xor(b, s, out=b)  # the band: at or beyond outer, not beyond inner
        if eligible is not None:
            # (a & ~e) is (a > e) on bools
            combine = xp.logical_and if c.keep_set else xp.greater
            combine(s, eligible[part], out=s)
            combine(b, eligible[part], out=b)
        n_sure += int(xp.count_nonzero(s))
        index = nonzero_of(xp, b)
        band_index.append(index + part.start)
        band_value.append(a[index])
    return n_sure, xp.concatenate(band_index), xp.concatenate(band_value)


def _kernel_pass(c: _Choice, x: np.ndarray, sure: np.ndarray, eligible, inner, outer):
    """:func:`_chunked_pass` in one compiled loop (see
    :func:`~lightning_sparse.kernels.loops.threshold_pass`) over float32/float64 NumPy arrays."""
    if inner is None:  # nothing is beyond an infinite threshold (NaN never is)
        inner = math.inf if c.largest else -math.inf
    as_x = x.dtype.type  # the thresholds are values of x: exact in its dtype
    flags = None if eligible is None else eligible.view(np.uint8)
    args = (x, flags, int(c.keep_set), c.magnitude, c.largest, as_x(inner))
    has_outer = outer is not None
    rest = (as_x(outer if has_outer else 0.0), has_outer, sure.view(np.uint8))
    band = np.empty(c.n_eligible // 16 + cpu_kernels.BLOCK, dtype=np.int64)
    values = np.empty(band.shape, dtype=x.dtype)
    n_sure, n_band, stop = cpu_kernels.threshold_pass(*args, *rest, band, values, 0, 0)
    while stop < x.shape[0]:  # the band outgrew the buffer: go on with a longer one
        band = np.concatenate([band[:n_band], np.empty_like(band)])
        values = np.concatenate([values[:n_band], np.empty_like(values)])
        found, n_band, stop = cpu_kernels.threshold_pass(
            *args, *rest, band, values, n_band, stop
        )
        n_sure += found
    return n_sure, band[:n_band], values[:n_band]


def _first_k(xp: ModuleType, values, k: int, largest: bool):
    """Which ``k`` of ``values`` come first, the largest (or smallest), ties to the earlier
    entries: ``(strict, ties)``, a bool array of those beyond the ``k``-th value and the
    positions of the equal ones that complete the ``k`` (NumPy arrays or tensors)."""
    position = len(values) - k if largest else k - 1  # of the k-th, in ascending order
    if xp is np:
        kth = np.partition(values, position)[position]
    else:
        kth = values.kthvalue(position + 1).values
    strict = values > kth if largest else values < kth
    ties = nonzero_of(xp, values == kth)[: k - int(strict.sum())]
    return strict, ties
