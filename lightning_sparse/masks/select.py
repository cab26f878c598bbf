"""Pure mask functions: scores in, boolean keep-masks out (``True`` = weight kept).

Every function works on any device and never modifies its input. Structured (N:M) masks group
``M`` consecutive weights along the input dimension, i.e. along the last axis of the weight
viewed as ``(out_features, -1)`` (for a convolution: input channels times kernel positions).

Example:
    >>> import torch
    >>> from lightning_sparse.masks import NM, topk_mask
    >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -1.0, 0.2]])
    >>> topk_mask(w.abs(), NM(2, 4)).int().tolist()
    [[0, 1, 1, 0], [1, 0, 1, 0]]
    >>> topk_mask(w.abs(), 0.75).int().tolist()
    [[0, 1, 0, 0], [1, 0, 0, 0]]
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_sparse.masks.elementwise import flat_nonzero, scratch_mask
from lightning_sparse.masks.patterns import NM, Sparsity, describe, nm_groups, num_kept
from lightning_sparse.masks.top_k import top_k_mask


def topk_mask(score: Tensor, target: Sparsity) -> Tensor:
    """Keep the highest-``score`` entries so that ``target`` holds exactly.

    Unstructured: exactly ``num_kept(numel, sparsity)`` entries survive. N:M: exactly ``n`` of
    every group of ``m`` along the input dimension. Ties are broken by position (deterministic).
    """
    if isinstance(target, NM):
        groups = nm_groups(score, target.m)
        keep = groups.topk(target.n, dim=-1, sorted=False).indices
        mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
        return mask.reshape(score.shape)
    return keep_top(score, num_kept(score.numel(), float(target)))


def keep_top(score: Tensor, k: int) -> Tensor:
    """Keep exactly the ``k`` highest-``score`` entries of ``score`` (any shape); among equal
    scores, the lower flat index is kept (see :func:`~lightning_sparse.masks.top_k.top_k_mask`: one
    pass over the scores, however large).

    >>> keep_top(torch.tensor([[0.5, 2.0], [1.0, -1.0]]), 2).tolist()
    [[False, True], [True, False]]
    """
    if not 0 <= k <= score.numel():
        raise ValueError(f"cannot keep {k} of {score.numel()} entries")
    return top_k_mask(score, k)


def top_indices(
    score: Tensor, k: int, largest: bool = True, exclude: Tensor | None = None
) -> Tensor:
    """Ascending flat indices of the ``k`` highest (``largest=False``: lowest) entries of
    ``score``, leaving out the entries where ``exclude`` (a bool tensor shaped like ``score``)
    is set; ties go to the lower index.

    >>> score = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    >>> top_indices(score, 1, largest=False).tolist()
    [3]
    >>> top_indices(score, 1, exclude=torch.tensor([[False, True], [False, False]])).tolist()
    [2]
    """
    return flat_nonzero(top_k_mask(score, k, largest=largest, excluding=exclude))


def drop_smallest(weight: Tensor, mask: Tensor, n_drop: int) -> Tensor:
    """A copy of ``mask`` without its ``n_drop`` kept entries of smallest ``|weight|`` (ties: the
    lower flat index is dropped first).

    >>> drop_smallest(torch.tensor([3.0, -0.5, 2.0, 9.0]), torch.tensor([True, True, True, False]), 2).tolist()
    [True, False, False, False]
    """
    survivors = mask.clone()
    drop_smallest_(weight, survivors, n_drop)
    return survivors


def drop_smallest_(
    weight: Tensor, mask: Tensor, n_drop: int, n_active: int | None = None
) -> Tensor:
    """:func:`drop_smallest` in place: clears those entries in ``mask`` (``n_active``: how
    many it has set, if known) and returns them (see :func:`smallest_active`)."""
    dropped = smallest_active(weight, mask, n_drop, n_active)
    mask ^= dropped
    return dropped


def smallest_active(
    weight: Tensor, mask: Tensor, n: int, n_active: int | None = None
) -> Tensor:
    """The ``n`` entries set in ``mask`` with the smallest ``|weight|`` (ties: the lower flat
    index first; ``n_active``: how many ``mask`` has set, if known), as a bool tensor shaped
    like ``mask`` that is a reused buffer (:func:`~lightning_sparse.masks.elementwise.scratch_mask`
    slot 0), valid until the next call on this thread.

    >>> smallest_active(torch.tensor([3.0, -0.5, 2.0, 0.1]), torch.tensor([True, True, True, False]), 1).tolist()
    [False, True, False, False]
    """
    return top_k_mask(
        weight,
        n,
        largest=False,
        magnitude=True,
        among=mask,
        n_eligible=n_active,
        out=scratch_mask(mask.numel(), mask.device, slot=0),
    ).view(mask.shape)


def name_seed(seed: int, name: str, step: int = 0) -> int:
    """A seed that depends only on (seed, parameter name, step): the same on every rank and
    for every parameter order, and reproducible across resumes."""
    return zlib.crc32(f"{seed}|{name}|{step}".encode()) ^ (seed & 0xFFFFFFFF)


def random_score(like: Tensor, seed: int) -> Tensor:
    """Uniform random scores shaped like ``like``, from a private generator seeded by ``seed``.

    Drawn on the CPU and moved, so the same seed gives the same scores on every device.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(like.shape, generator=gen).to(like.device)


def from_zeros_mask(
    weight: Tensor,
    target: Sparsity,
    name: str = "weight",
    select: Callable[[Tensor, Sparsity], Tensor] = topk_mask,
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
    fits = math.ceil(zeros / weight.numel() * 1e4) / 1e4
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
    raise ValueError(
        f"init='from_zeros': parameter {name!r}: {detail}; use a sparsity of at least {fits} "
        f"(for gmp: initial_sparsity), or init='topk' to choose the mask by magnitude"
    )
