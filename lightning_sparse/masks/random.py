"""Randomness that is the same on every device, rank and resume: seeds, scores, subsets.

:func:`name_seed` derives a seed from ``(seed, parameter name, step)``; :func:`random_score`
draws scores from it on the CPU and moves them, so every device sees the same scores.

:func:`random_subset` marks ``k`` entries chosen uniformly at random among those a bool tensor
leaves eligible. It costs about ``k`` random integers rather than one random score per entry
(regrowing 3% of a layer at random would otherwise draw a score for every weight), and it is
reproducible from its seed on any device: every random number comes from a CPU generator, and
only integer arithmetic turns them into positions.

Example:
    >>> import torch
    >>> taken = torch.tensor([True, False, False, True, False, False])
    >>> chosen = random_subset(2, taken, seed=7)
    >>> int(chosen.sum()), bool((chosen & taken).any()), torch.equal(chosen, random_subset(2, taken, seed=7))
    (2, False, True)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_sparse import kernels
from lightning_sparse.masks.elementwise import count_true, pick_output
from lightning_sparse.masks.top_k import mark_top_k


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


@torch.no_grad()
def random_subset(
    k: int, excluding: Tensor, seed: int, out: Tensor | None = None
) -> Tensor:
    """A bool mask shaped like ``excluding`` with exactly ``k`` entries set, drawn uniformly
    among the entries where ``excluding`` is not set (every such ``k``-subset is equally
    likely), reproducibly from ``seed``. With ``out`` (a contiguous bool tensor of as many
    entries), the mask is written there.

    How: iid uniform positions are drawn, and the eligible ones are kept once each, until at
    least ``k`` distinct ones are in hand (a uniformly random set, given its size); then a few
    of them, drawn the same way, are put back. When ``k`` is more than half of the eligible
    entries, the ones left out are drawn instead; when either is more than 1/16 of the tensor,
    every entry gets a random score and the ``k`` best eligible ones are kept.

    Raises:
        ValueError: ``k`` is negative or more than the eligible entries.
    """
    flat = excluding.reshape(-1)
    n = flat.numel()
    eligible = n - count_true(flat)
    chosen = pick_output(k, eligible, n, flat.device, out)
    if 16 * min(k, eligible - k) > n:
        # a large share of the tensor: one random score per entry costs less
        scores = torch.rand(n, generator=torch.Generator().manual_seed(seed))
        mark_top_k(scores.to(flat.device), k, excluding=flat, out=chosen)
    elif 2 * k > eligible:
        random_subset(eligible - k, excluding, seed, out=chosen)  # the ones left out
        torch.logical_or(chosen, flat, out=chosen)
        torch.logical_not(chosen, out=chosen)
    else:
        chosen.fill_(False)
        if k:
            gen = torch.Generator().manual_seed(seed)
            found = _distinct_draws(gen, n, k, eligible, _acceptor(flat))
            surplus = _distinct_draws(gen, len(found), len(found) - k)
            keep = torch.ones(len(found), dtype=torch.bool)
            keep[surplus] = False
            chosen.index_fill_(0, found[keep].to(flat.device), True)
    return chosen.view(excluding.shape)


def _acceptor(excluding: Tensor) -> Callable[[Tensor], Tensor]:
    """positions (ascending, on the CPU) -> whether ``excluding`` (flat) leaves each eligible."""
    return lambda positions: (
        ~excluding.index_select(0, positions.to(excluding.device)).cpu()
    )


def _distinct_draws(
    gen: torch.Generator,
    n: int,
    k: int,
    acceptable: int | None = None,
    accept: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Ascending distinct positions in ``range(n)`` (int64, on the CPU), at least ``k`` of them
    (exactly ``k`` without ``accept``), drawn iid uniformly and kept where ``accept``
    (positions -> bool) says so, ``acceptable`` positions being acceptable. Given its size,
    the set is uniformly random among the acceptable positions."""
    found = torch.empty(0, dtype=torch.int64)
    while len(found) < k:
        missing = k - len(found)
        if accept is None:
            # no rejection: draw exactly what is missing, so the count never exceeds k
            draws = missing
        else:
            # enough iid draws that the distinct acceptable ones exceed k with high probability
            wanted = missing + 4 * math.sqrt(missing) + 64
            fraction = min(wanted / max(1, acceptable - len(found)), 0.999)
            draws = math.ceil(-n * math.log1p(-fraction)) + 64
        fresh = torch.randint(n, (draws,), generator=gen)
        merged = torch.cat([found, fresh])
        if kernels.accepts():  # (a faster sort on the CPU)
            found = kernels.distinct_sorted(merged)
        else:
            found = torch.unique(merged, sorted=True)
        if accept is not None:
            found = found[accept(found)]
    return found
