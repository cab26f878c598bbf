"""The ranks of a distributed run, as the engine talks to them: how many there are, sums over
them in one collective, and an error on one rank raised on all of them. Outside a distributed
run (or with one process) nothing is sent.

Example:
    >>> import torch
    >>> world_size()
    1
    >>> [t.tolist() for t in sum_over_ranks([torch.ones(2), torch.zeros(1, 1)])]
    [[1.0, 1.0], [[0.0]]]
    >>> raise_together(None, "choosing backends")  # nobody failed: nothing raised
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


def rank() -> int:
    """This process's rank in the distributed run: 0 outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


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


def collective_device() -> torch.device:
    """Where this rank's tensors for a collective live: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankFailure(RuntimeError):
    """A step that every rank runs failed on some of them; raised on every rank, with the
    same message (each failed rank's error), so that none waits for the others for ever."""


def raise_together(failure: BaseException | None, what: str) -> None:
    """Raise :class:`RankFailure` on every rank if ``what`` raised ``failure`` on any rank
    (``None``: it did not here); with one process, ``failure`` itself. A collective: every
    rank calls it, after ``what`` and before the next collective, which a failed rank would
    never reach."""
    if world_size() == 1:
        if failure is not None:
            raise failure
        return
    failed = torch.tensor(
        [failure is not None], dtype=torch.int32, device=collective_device()
    )
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    errors: list[str | None] = [None] * world_size()
    mine = None if failure is None else _described(failure)
    dist.all_gather_object(errors, mine)
    told = "; ".join(
        f"on rank {rank}, {error}" for rank, error in enumerate(errors) if error
    )
    raise RankFailure(
        f"{what} failed {told}. Every rank stops here, so that none waits for the others"
    ) from failure


def _described(error: BaseException) -> str:
    """``error``'s message, led by its type unless the message already names it."""
    kind = type(error).__name__
    return str(error) if str(error).startswith(kind) else f"{kind}: {error}"


__all__ = [
    "RankFailure",
    "collective_device",
    "raise_together",
    "sum_over_ranks",
    "world_size",
]
