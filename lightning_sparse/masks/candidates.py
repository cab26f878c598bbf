"""The candidate patterns of an N:M group, and masks as one pattern index per group.

An N:M group of ``M`` weights along the input dimension keeps one of ``C(M, N)`` candidate
patterns (6 for 2:4). :func:`candidate_patterns` lists them in a fixed order (the kept positions
in lexicographic order: for 2:4, ``1100, 1010, 1001, 0110, 0101, 0011``); a valid N:M mask is then
one pattern index per group (:func:`pattern_indices`) and back (:func:`patterns_to_mask`).
A learned N:M mask keeps one logit per candidate, so the table's size bounds what it may learn
(:data:`MAX_CANDIDATES`).

Example:
    >>> import torch
    >>> candidate_patterns(NM(2, 4)).int().tolist()[:3]
    [[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    >>> mask = torch.tensor([[True, False, False, True, False, True, True, False]])
    >>> pattern_indices(mask, NM(2, 4)).tolist()
    [2, 3]
    >>> torch.equal(patterns_to_mask(pattern_indices(mask, NM(2, 4)), NM(2, 4), mask.shape), mask)
    True
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from lightning_sparse.masks.patterns import NM, nm_groups

MAX_CANDIDATES = 70
"""The most candidate patterns per group a learned mask keeps logits for: ``C(8, 4) = 70``, so
every N:M with M up to 8 (a 4:8 group then holds 70 logits for 8 weights)."""


def candidate_count(target: NM) -> int:
    """``C(M, N)``: how many patterns an N:M group may keep."""
    return math.comb(target.m, target.n)


def candidates_unsupported(target: NM) -> str | None:
    """Why a table of ``target``'s candidate patterns is too large to learn over, or ``None``.

    >>> candidates_unsupported(NM(2, 4)) is None, candidates_unsupported(NM(2, 16))[:31]
    (True, '2:16 has C(16, 2) = 120 candida')
    """
    count = candidate_count(target)
    if count <= MAX_CANDIDATES:
        return None
    return (
        f"{target} has C({target.m}, {target.n}) = {count} candidate patterns per group, more "
        f"than the {MAX_CANDIDATES} a learned mask keeps one logit each for (every N:M with "
        f"M <= 8 fits)"
    )


def candidate_patterns(target: NM, device: torch.device | str | None = None) -> Tensor:
    """The ``(C(M, N), M)`` bool table of ``target``'s patterns, kept positions in
    lexicographic order."""
    table = torch.zeros(candidate_count(target), target.m, dtype=torch.bool)
    for index, kept in enumerate(itertools.combinations(range(target.m), target.n)):
        table[index, list(kept)] = True
    return table.to(device)


def pattern_indices(mask: Tensor, target: NM) -> Tensor:
    """The index (in :func:`candidate_patterns`) of each group's pattern in ``mask``, a bool
    tensor viewed as rows with groups of ``M`` along its last axis, as a flat ``int64``
    tensor of one entry per group (in row order); a ``ValueError`` if a group does not keep
    exactly ``N``."""
    groups = nm_groups(mask, target.m).reshape(-1, target.m)
    powers = 2 ** torch.arange(target.m, device=mask.device)
    codes = (groups.long() * powers).sum(-1)
    table = torch.full((2**target.m,), -1, dtype=torch.long, device=mask.device)
    table[(candidate_patterns(target, mask.device).long() * powers).sum(-1)] = (
        torch.arange(candidate_count(target), device=mask.device)
    )
    indices = table[codes]
    if bool((indices < 0).any()):
        raise ValueError(
            f"a mask of shape {tuple(mask.shape)} has groups of {target.m} that do not keep "
            f"exactly {target.n}, so they match no {target} pattern"
        )
    return indices


def patterns_to_mask(
    indices: Tensor, target: NM, shape: torch.Size | tuple[int, ...]
) -> Tensor:
    """The bool mask of ``shape`` (rows, groups along the last axis) whose groups keep the
    patterns ``indices`` (one per group, in row order)."""
    return candidate_patterns(target, indices.device)[indices].reshape(shape)
