"""Exact top-k masks of large tensors in one pass, ties broken by position.

:func:`mark_top_k` marks the ``k`` entries with the largest (or smallest) values, or magnitudes,
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
    >>> mark_top_k(x, 2).tolist()
    [False, False, True, True, False]
    >>> mark_top_k(x, 1, magnitude=True).tolist()
    [False, True, False, False, False]
    >>> mark_top_k(x, 1, largest=False, magnitude=True, excluding=x == 0).tolist()
    [True, False, False, False, False]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse import kernels
from lightning_sparse.masks.elementwise import (
    count_true,
    flat_nonzero,
    pick_output,
    set_at_,
)

SAMPLED = (1 << 14, 1 << 18)
"""How many entries (eligible or not) the strided sample that places the thresholds visits:
1/256 of the tensor, within these bounds (strided reads cost a cache miss each)."""
LARGE = 1 << 16
"""Tensors with at most this many entries are ranked by a sort."""
CHUNK = 1 << 18
"""Entries per chunk of the threshold pass on the CPU: 1 MiB of float32, which stays in the L2
cache with the chunk's bool temporaries."""


@dataclass(frozen=True)
class _Choice:
    """What to choose: ``k`` of the eligible entries of ``flat`` (see :func:`mark_top_k`)."""

    flat: Tensor
    k: int
    largest: bool
    magnitude: bool
    flags: Tensor | None  # eligibility: where set (keep_set) or where not set
    keep_set: bool
    n_eligible: int


@torch.no_grad()
def mark_top_k(
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
        raise ValueError("give mark_top_k either among or excluding, not both")
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


def _thresholds(c: _Choice) -> tuple[float | None, float | None] | None:
    """``(inner, outer)`` from a strided sample of the eligible values: about ``k`` entries lie
    beyond each, fewer beyond ``inner`` and more beyond ``outer``, by a margin of 4 standard
    deviations of the sample's count. ``None`` stands for a threshold beyond every value."""
    n = c.flat.numel()
    stride = max(1, n // min(max(n // 256, SAMPLED[0]), SAMPLED[1]))
    fast = kernels.accepts(*(t for t in (c.flat, c.flags) if t is not None))
    if fast:
        sample = kernels.strided_sample(
            c.flat, c.flags, c.keep_set, stride, c.magnitude
        )
    else:
        sample = c.flat[::stride]
        if c.flags is not None:
            sampled = c.flags[::stride]
            sample = sample[sampled if c.keep_set else ~sampled]
        if c.magnitude:
            sample = sample.abs()
    m = sample.shape[0]
    if m == 0:
        return None
    fraction = c.k / c.n_eligible
    margin = 4.0 * math.sqrt(m * fraction * (1.0 - fraction)) + 16
    ranks = [math.floor(fraction * m - margin), math.floor(fraction * m + margin)]
    # rank r counted from the chosen end is position r (smallest) or m - 1 - r (largest)
    positions = [r if not c.largest else m - 1 - r for r in ranks]
    inside = [p for p in positions if 0 <= p < m]
    if fast:
        found = kernels.order_statistics(sample, inside)
    else:
        ordered = torch.sort(sample).values
        found = [float(ordered[p]) for p in inside]
    at = dict(zip(inside, found))
    inner, outer = (at.get(p) for p in positions)
    return inner, outer


def _bracketed(c: _Choice, chosen: Tensor) -> bool:
    """The choice through the sampled thresholds, into ``chosen``; ``False`` if they do not
    bracket the ``k``-th value (the caller then sorts)."""
    thresholds = _thresholds(c)
    if thresholds is None:
        return False
    inner, outer = thresholds
    if kernels.accepts(*(t for t in (c.flat, chosen, c.flags) if t is not None)):
        if inner is None:  # nothing is beyond an infinite threshold (NaN never is)
            inner = math.inf if c.largest else -math.inf
        args = (c.magnitude, c.largest, inner, outer, chosen, c.n_eligible // 16)
        n_sure, index, values = kernels.threshold_pass(
            c.flat, c.flags, c.keep_set, *args
        )
    else:
        n_sure, index, values = _threshold_pass(c, chosen, inner, outer)
    missing = c.k - n_sure
    if not 0 <= missing <= len(index):
        return False
    if missing == 0 or inner is not None and inner == outer:
        set_at_(
            chosen, index[:missing], True
        )  # (a band of equal values: the first ones)
        return True
    strict, ties = _first_k(values, missing, c.largest)
    set_at_(
        chosen, index, strict
    )  # band entries beyond the k-th value; the others unset
    set_at_(chosen, index[ties], True)
    return True


def _chunks(n: int, device: torch.device) -> Iterator[slice]:
    """Slices covering ``range(n)``: cache-sized on the CPU, one slice elsewhere."""
    step = CHUNK if device.type == "cpu" else max(n, 1)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _threshold_pass(
    c: _Choice, sure: Tensor, inner: float | None, outer: float | None
) -> tuple[int, Tensor, Tensor]:
    """Marks the eligible entries beyond ``inner`` in ``sure`` and lists the eligible band (at
    or beyond ``outer``, not beyond ``inner``), chunk by chunk: ``(count of sure, band
    indices, band values)``."""
    beyond, beyond_or_at = (torch.gt, torch.ge) if c.largest else (torch.lt, torch.le)
    band_index, band_value, n_sure = [], [], 0
    for part in _chunks(c.flat.numel(), c.flat.device):
        a = c.flat[part].abs() if c.magnitude else c.flat[part]
        s = sure[part]
        if inner is None:
            s.fill_(False)
        else:
            beyond(a, inner, out=s)
        b = torch.ones_like(s) if outer is None else beyond_or_at(a, outer)
        b ^= s  # the band: at or beyond outer, not beyond inner
        if c.flags is not None:
            eligible = c.flags[part] if c.keep_set else ~c.flags[part]
            s &= eligible
            b &= eligible
        n_sure += count_true(s)
        index = flat_nonzero(b)
        band_index.append(index + part.start)
        band_value.append(a[index])
    return n_sure, torch.cat(band_index), torch.cat(band_value)


def _first_k(values: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    """Which ``k`` of ``values`` come first, the largest (or smallest), ties to the earlier
    entries: ``(strict, ties)``, a bool tensor of those beyond the ``k``-th value and the
    positions of the equal ones that complete the ``k``."""
    if kernels.accepts(values):
        return kernels.first_k(values, k, largest)
    position = len(values) - k if largest else k - 1  # of the k-th, in ascending order
    kth = values.kthvalue(position + 1).values
    strict = values > kth if largest else values < kth
    ties = flat_nonzero(values == kth)[: k - count_true(strict)]
    return strict, ties
