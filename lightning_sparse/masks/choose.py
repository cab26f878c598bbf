"""Keep-masks chosen by score: ``True`` keeps a weight.

:func:`target_mask` keeps the highest scores so that a target holds exactly (a fraction of
zeros, or N of every M along the input dimension); :func:`row_target_mask` compares scores
within each output row only (as Wanda does); :func:`smallest_kept` and
:func:`prune_smallest_` find and prune the kept weights of smallest magnitude; and
:func:`from_zeros_mask` continues from a pruned weight. Ties go to the lower flat index.

Example:
    >>> import torch
    >>> from lightning_sparse.masks import NM
    >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -1.0, 0.2]])
    >>> target_mask(w.abs(), NM(2, 4)).int().tolist()
    [[0, 1, 1, 0], [1, 0, 1, 0]]
    >>> target_mask(w.abs(), 0.75).int().tolist()
    [[0, 1, 0, 0], [1, 0, 0, 0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_sparse.masks.elementwise import scratch_mask
from lightning_sparse.masks.patterns import NM, Sparsity, describe, nm_groups, num_kept
from lightning_sparse.masks.top_k import mark_top_k


def target_mask(score: Tensor, target: Sparsity) -> Tensor:
    """A new mask that keeps the highest-``score`` entries so that ``target`` holds exactly.

    Unstructured: exactly ``num_kept(numel, sparsity)`` entries survive, ties to the lower flat
    index. N:M: exactly ``n`` of every group of ``m`` along the input dimension.
    """
    if isinstance(target, NM):
        groups = nm_groups(score, target.m)
        keep = groups.topk(target.n, dim=-1, sorted=False).indices
        mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
        return mask.reshape(score.shape)
    return mark_top_k(score, num_kept(score.numel(), float(target)))


def row_target_mask(score: Tensor, sparsity: float) -> Tensor:
    """A new mask that keeps the highest ``score`` entries of each row (the first axis), so that
    an unstructured ``sparsity`` holds exactly over the whole tensor: of the
    ``K = num_kept(numel, sparsity)`` kept entries, every row keeps ``K // rows`` and the first
    ``K % rows`` rows one more (a whole number per row whenever ``sparsity * row_length`` is).
    Ties go to the lower index within a row.

    >>> row_target_mask(torch.tensor([[1.0, 3.0, 2.0, 2.0], [9.0, 8.0, 0.0, 7.0]]), 0.5).int().tolist()
    [[0, 1, 1, 0], [1, 1, 0, 0]]
    """
    rows = score.reshape(score.shape[0], -1)
    kept = num_kept(rows.numel(), float(sparsity))
    per_row = torch.full((rows.shape[0], 1), kept // rows.shape[0], device=rows.device)
    per_row[: kept % rows.shape[0]] += 1
    order = torch.sort(rows, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    mask = torch.zeros_like(rows, dtype=torch.bool)
    return mask.scatter_(1, order, ranks < per_row).reshape(score.shape)


def smallest_kept(
    weight: Tensor, mask: Tensor, n: int, n_active: int | None = None
) -> Tensor:
    """The ``n`` entries set in ``mask`` with the smallest ``|weight|`` (ties: the lower flat
    index first; ``n_active``: how many ``mask`` has set, if known), as a bool tensor shaped
    like ``mask``. It is a reused buffer (:func:`~lightning_sparse.masks.elementwise.scratch_mask`
    slot 0), valid until the next call on this thread.

    >>> smallest_kept(torch.tensor([3.0, -0.5, 2.0, 0.1]), torch.tensor([True, True, True, False]), 1).tolist()
    [False, True, False, False]
    """
    return mark_top_k(
        weight,
        n,
        largest=False,
        magnitude=True,
        among=mask,
        n_eligible=n_active,
        out=scratch_mask(mask.numel(), mask.device, slot=0),
    ).view(mask.shape)


def prune_smallest_(
    weight: Tensor, mask: Tensor, n: int, n_active: int | None = None
) -> Tensor:
    """Clear, in ``mask``, its ``n`` kept entries of smallest ``|weight|`` and return them (the
    buffer :func:`smallest_kept` returns).

    >>> mask = torch.tensor([True, True, True, False])
    >>> pruned = prune_smallest_(torch.tensor([3.0, -0.5, 2.0, 9.0]), mask, 2)
    >>> mask.tolist(), pruned.tolist()
    ([True, False, False, False], [False, True, True, False])
    """
    pruned = smallest_kept(weight, mask, n, n_active)
    mask ^= pruned
    return pruned


def from_zeros_mask(
    weight: Tensor,
    target: Sparsity,
    name: str = "weight",
    select: Callable[[Tensor, Sparsity], Tensor] = target_mask,
) -> Tensor:
    """A keep-mask that prunes every zero of ``weight``, then the smallest non-zero magnitudes
    until ``target`` holds exactly (``init='from_zeros'``: fine-tuning a pruned model keeps it
    pruned). ``select`` chooses the highest scores (an algorithm's own ``select``).

    Raises:
        ValueError: the zeros alone exceed ``target`` (more zeros than an unstructured target
            prunes, or an N:M group with more than M-N zeros), so meeting it would revive
            zeros; the message names the parameter and a sparsity that fits.

    >>> w = torch.tensor([[0.0, 2.0, -1.0, 0.5]])
    >>> from_zeros_mask(w, 0.5).int().tolist()
    [[0, 1, 1, 0]]
    """
    nonzero = weight != 0
    score = torch.where(nonzero, weight.abs(), torch.full_like(weight, -1.0))
    mask = select(score, target)
    if not bool((mask & ~nonzero).any()):
        return mask
    zeros = int((~nonzero).sum())
    if isinstance(target, NM):
        crowded = nm_groups(~nonzero, target.m).sum(-1) > target.m - target.n
        detail = (
            f"{int(crowded.sum())} of its groups of {target.m} hold more than "
            f"{target.m - target.n} zeros, which the pattern {target} cannot keep pruned"
        )
    else:
        detail = (
            f"{zeros} of its {weight.numel()} weights are zero, more than the target "
            f"{describe(target)} prunes"
        )
    if zeros == weight.numel():
        fix = (
            "every weight is zero, so no sparsity below 1 keeps them pruned: use "
            "init='topk' or init='random', or exclude the parameter"
        )
    else:
        fix = (
            f"use a sparsity of at least {_fitting_sparsity(zeros, weight.numel())} (for "
            f"gmp: initial_sparsity), or init='topk' to choose the mask by magnitude"
        )
    raise ValueError(f"init='from_zeros': parameter {name!r}: {detail}; {fix}")


def _fitting_sparsity(zeros: int, numel: int) -> float:
    """The shortest decimal sparsity below 1 (4 digits or more) that prunes at least ``zeros``
    of ``numel`` weights (``0 < numel - zeros``)."""
    digits = 4
    while True:
        scale = 10**digits
        fits = math.ceil(zeros * scale / numel) / scale
        if fits < 1.0 and num_kept(numel, fits) <= numel - zeros:
            return fits
        digits += 1
