"""The ranks of a distributed run, as the engine talks to them: how many there are, and sums
over them in one collective. Outside a distributed run (or with one process) nothing is sent.

Example:
    >>> import torch
    >>> world_size()
    1
    >>> [t.tolist() for t in sum_over_ranks([torch.ones(2), torch.zeros(1, 1)])]
    [[1.0, 1.0], [[0.0]]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def world_size() -> int:
    """How many processes the distributed run has: 1 outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@torch.no_grad()
def sum_over_ranks(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each of ``tensors`` summed over the ranks, in one all-reduce of them all (they share a
    dtype and a device); with one process, the tensors themselves. A collective: every rank
    calls it with tensors of the same shapes."""
    if world_size() == 1:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors)]


__all__ = ["sum_over_ranks", "world_size"]
