"""Masks for sharded parameters (FSDP2 ``fully_shard``, tensor parallelism): DTensor in, DTensor out.

Algorithms are pure rules on whole tensors, so a sharded parameter is gathered before a mask is
chosen (:func:`gather_full`), and the chosen mask is cut back to the parameter's own shards
(:func:`shard_like`) without communication: every rank computes the same full mask from the same
gathered values, so each rank keeps its slice. A per-layer top-k therefore sees the global
threshold of the layer, exactly as on one device (ties are broken by global position), at the
cost of one all-gather of the layer per mask update (the size of one FSDP forward all-gather).

Plain tensors pass through both functions unchanged, so single-device and DDP runs pay nothing.
A mask choice reads the layers through :class:`OneAtATime`, so that it holds one layer's whole
weight (and mask) at a time, not the whole group's.

Example:
    >>> import torch
    >>> w = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    >>> gather_full(w) is w, shard_like(w > 1, w).tolist()
    (True, [[False, False], [False, True]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, distribute_tensor
else:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_sharded(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a DTensor (its values are spread over ranks)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def gather_full(tensor: Tensor | None) -> Tensor | None:
    """The whole tensor on every rank (an all-gather for a DTensor; a collective call, so every
    rank must make it); a plain tensor is returned as it is."""
    if is_sharded(tensor):
        return tensor.full_tensor()  # type: ignore[union-attr]
    return tensor


def shard_like(full: Tensor, reference: Tensor) -> Tensor:
    """``full`` laid out like ``reference``: for a DTensor ``reference``, a DTensor with the same
    mesh and placements holding this rank's slice of ``full`` (no communication: ``full`` must
    be identical on every rank); otherwise ``full`` itself. A DTensor ``full`` is returned as is."""
    if not is_sharded(reference) or is_sharded(full):
        return full
    return distribute_tensor(
        full.to(reference.device),
        reference.device_mesh,  # type: ignore[attr-defined]
        reference.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )


class OneAtATime(Mapping[str, Tensor]):
    """Tensors by name, each made by ``make(name)`` when read and not kept: a loop that reads
    one name at a time holds one at a time (a gathered layer is freed before the next is
    gathered). ``make`` may gather (a collective): every rank must read the same names in the
    same order; read each name once where its value is changed in place. ``shapes``, where
    given, are the tensors' shapes, known without making them.

    Example:
        >>> made = []
        >>> rows = OneAtATime(["a", "b"], lambda name: made.append(name) or torch.ones(2))
        >>> [tuple(t.shape) for t in rows.values()], made
        ([(2,), (2,)], ['a', 'b'])
    """

    def __init__(
        self,
        names: Sequence[str],
        make: Callable[[str], Tensor],
        shapes: Mapping[str, torch.Size] | None = None,
    ) -> None:
        self._names = list(names)
        self._make = make
        self.shapes = None if shapes is None else dict(shapes)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
