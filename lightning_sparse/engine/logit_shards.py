"""A learned phase's logits split over the ranks of a distributed run, so that no rank holds
them all (with their gradient and Adam state, 24 bytes a weight for 2:4).

Each rank learns one contiguous run of every weight's units (its N:M groups or 4x4 tiles, in
row order): ``ceil(units / ranks)`` of them, the last ranks fewer (possibly none), as FSDP2
splits a weight's rows. A training forward gathers the ranks' soft masks into the whole mask
once, in the dtype the matmul multiplies in; its backward reduce-scatters the whole mask's
gradient (in float32) and averages it over the ranks, so that every rank's logits get the
gradient that averaging the replicated logits' gradients would give. DDP and FSDP2 runs learn
the same way, bit for bit.

Every rank must run every learned layer's forward the same number of times, as FSDP2 requires
of its layers. A run that skips layers on some ranks (``allow_skipped_layers``) keeps whole
logits on every rank instead, their gradients averaged before each step. With one process
nothing is split or sent.

Example:
    >>> import torch
    >>> shards = RankShards()
    >>> shards.owned(10), shards.splits  # one process: every unit
    (slice(0, 10, None), False)
    >>> shards.gather(torch.ones(10, 4), 10, torch.bfloat16).dtype
    torch.bfloat16
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.algorithms.learned import Unsplit
from lightning_sparse.engine.ranks import collective_device, rank, world_size


class RankShards(Unsplit):
    """The units of a weight that this rank learns, and the collectives that make the ranks'
    shares whole (see the module docstring); ``split=False`` keeps every unit on every rank.
    """

    def __init__(self, split: bool = True) -> None:
        self.split = split

    @property
    def splits(self) -> bool:
        """Whether the units are split over more than one rank."""
        return self.split and world_size() > 1

    def owned(self, units: int) -> slice:
        if not self.splits:
            return super().owned(units)
        chunk = -(-units // world_size())
        start = min(rank() * chunk, units)
        return slice(start, min(start + chunk, units))

    def gather(
        self, local: Tensor, units: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        if not self.splits:
            return super().gather(local, units, dtype)
        return _GatherUnits.apply(local, units, dtype or local.dtype)

    def sum(self, values: Sequence[float]) -> list[float]:
        if not self.splits:
            return super().sum(values)
        total = torch.tensor(values, dtype=torch.float64, device=collective_device())
        dist.all_reduce(total)
        return total.tolist()


class _GatherUnits(torch.autograd.Function):
    """Every rank's units in rank order (``(units, ...)`` in ``dtype``); the gradient: this
    rank's part of the whole gradient's mean over the ranks, in ``local``'s dtype."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, units: int, dtype: torch.dtype) -> Tensor:
        ranks = world_size()
        chunk = -(-units // ranks)
        padded = local.new_zeros((chunk, *local.shape[1:]), dtype=dtype)
        padded[: len(local)] = local
        whole = padded.new_empty((chunk * ranks, *local.shape[1:]))
        dist.all_gather_into_tensor(whole, padded)
        ctx.owned, ctx.units, ctx.dtype = len(local), units, local.dtype
        return whole[:units]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ranks = world_size()
        chunk = -(-ctx.units // ranks)
        whole = grad.new_zeros((chunk * ranks, *grad.shape[1:]), dtype=torch.float32)
        whole[: ctx.units] = grad
        mine = whole.new_empty((chunk, *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, whole)
        return (mine[: ctx.owned] / ranks).to(ctx.dtype), None, None
