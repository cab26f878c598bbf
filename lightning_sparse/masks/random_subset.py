"""Uniformly random subsets of exact size, drawn in time proportional to their size.

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
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from lightning_sparse.masks.elementwise import count_true, numpy_view, pick_output
from lightning_sparse.masks.top_k import top_k_mask


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
        top_k_mask(scores.to(flat.device), k, excluding=flat, out=chosen)
    elif 2 * k > eligible:
        random_subset(eligible - k, excluding, seed, out=chosen)  # the ones left out
        torch.logical_or(chosen, flat, out=chosen)
        torch.logical_not(chosen, out=chosen)
    else:
        chosen.fill_(False)
        if k:
            gen = torch.Generator().manual_seed(seed)
            found = _distinct_draws(gen, n, k, eligible, _acceptor(flat))
            surplus = _distinct_draws(gen, found.size, found.size - k)
            keep = np.ones(found.size, dtype=bool)
            keep[surplus] = False
            chosen.index_fill_(0, torch.from_numpy(found[keep]).to(flat.device), True)
    return chosen.view(excluding.shape)


def _acceptor(excluding: Tensor) -> Callable[[np.ndarray], np.ndarray]:
    """positions (ascending) -> whether ``excluding`` (flat) leaves each of them eligible."""
    view = numpy_view(excluding)
    if view is not None:
        return lambda positions: ~view[positions]
    return lambda positions: (
        (~excluding.index_select(0, torch.from_numpy(positions).to(excluding.device)))
        .cpu()
        .numpy()
    )


def _distinct_draws(
    gen: torch.Generator,
    n: int,
    k: int,
    acceptable: int | None = None,
    accept: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Ascending distinct positions in ``range(n)``, at least ``k`` of them (exactly ``k``
    without ``accept``), drawn iid uniformly and kept where ``accept`` (positions -> bool)
    says so, ``acceptable`` positions being acceptable. Given its size, the set is uniformly
    random among the acceptable positions."""
    found = np.empty(0, dtype=np.int64)
    while found.size < k:
        missing = k - found.size
        if accept is None:
            # no rejection: draw exactly what is missing, so the count never exceeds k
            draws = missing
        else:
            # enough iid draws that the distinct acceptable ones exceed k with high probability
            wanted = missing + 4 * math.sqrt(missing) + 64
            fraction = min(wanted / max(1, acceptable - found.size), 0.999)
            draws = math.ceil(-n * math.log1p(-fraction)) + 64
        fresh = torch.randint(n, (draws,), generator=gen).numpy()
        merged = np.sort(np.concatenate([found, fresh]))
        distinct = np.empty(merged.size, dtype=bool)
        distinct[:1] = True
        np.not_equal(merged[1:], merged[:-1], out=distinct[1:])
        found = merged[distinct]
        if accept is not None:
            found = found[accept(found)]
    return found
