"""Bytes of live tensors, counted by their storages: what a rank holds, on any device.

Two counts, both by storage (a view or a second name for the same storage counts once; a
DTensor counts its local shard; a storage freed in place, as FSDP2 frees a gathered parameter
with ``resize_(0)``, counts 0):

- :func:`storage_bytes`: the bytes of the storages of some tensors now (a census: parameters,
  masks, optimizer state);
- :class:`HeldBytes`: the most bytes held at once by chosen tensors, counted as each is added;
- :class:`PeakBytes`: inside the block, the largest number of bytes held at once by tensors
  that operators made inside it (a new storage: not one of the operator's inputs', so views and
  in-place results do not count), checked after each operator; ``held`` is what is still alive
  at the end.

On a GPU ``torch.cuda.max_memory_allocated`` measures the same peak; these counts also run on
the CPU, where the allocator keeps no statistics.

Example:
    >>> import torch
    >>> w = torch.zeros(256, 128)
    >>> storage_bytes([w, w.t(), w[:8]])  # one storage
    131072
    >>> with PeakBytes() as peak:
    ...     a = torch.ones(1024)           # 4096 bytes
    ...     b = a * 2                      # 4096 more
    ...     del a
    ...     c = b.view(32, 32)             # a view: nothing new
    >>> peak.peak, peak.held
    (8192, 4096)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_sparse.engine.sharding import is_sharded


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """The bytes of the distinct storages of ``tensors`` (``None`` skipped; a DTensor's local
    shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = _storage(tensor)
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _counted(leaves: list) -> list[Tensor]:
    """The tensors among ``leaves`` that hold a storage: plain tensors and DTensors (not other
    wrapper subclasses, such as a collective's result before it is waited for, which holds
    none yet)."""
    return [
        t
        for t in leaves
        if isinstance(t, Tensor) and (is_sharded(t) or not _is_wrapper(t))
    ]


def _is_wrapper(tensor: Tensor) -> bool:
    return type(tensor) not in (Tensor, torch.nn.Parameter)


def _storage(tensor: Tensor) -> torch.UntypedStorage:
    """The storage of ``tensor`` (of its local shard for a DTensor)."""
    local = tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[union-attr]
    return local.untyped_storage()


class HeldBytes:
    """The most bytes held at once by the tensors given to :meth:`add` (each counted by its
    storage while a tensor using it is alive), counted at each :meth:`add`: for the bytes that
    some chosen tensors (gathered weights, new masks) hold together, without the scratch of the
    code between.

    Example:
        >>> held = HeldBytes()
        >>> a = held.add(torch.zeros(100))                   # 400 bytes
        >>> b = held.add(torch.zeros(10, dtype=torch.bool))  # 10 more
        >>> del a
        >>> _ = held.add(b.view(2, 5))                       # the same storage: still 10
        >>> held.peak, held.held
        (410, 10)
    """

    def __init__(self) -> None:
        self.peak = 0
        self.held = 0
        self._refs: list[weakref.ref[Tensor]] = []

    def add(self, tensor: Tensor) -> Tensor:
        """Count ``tensor`` from now on (while it is alive); returns it."""
        self._refs = [ref for ref in self._refs if ref() is not None]
        self._refs.append(weakref.ref(tensor))
        alive = [t for t in (ref() for ref in self._refs) if t is not None]
        self.held = storage_bytes(alive)
        self.peak = max(self.peak, self.held)
        return tensor


class PeakBytes(TorchDispatchMode):
    """The peak and the end count of bytes held by tensors made inside the block (see the
    module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.held = 0
        self._made: dict[int, list[weakref.ref[Tensor]]] = {}  # storage -> its tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t).data_ptr() for t in _counted(tree_leaves((args, kwargs)))}
        for t in _counted(tree_leaves(out)):
            self._add(t, inputs)
        self._count()
        return out

    def _add(self, tensor: Tensor, inputs: set[int]) -> None:
        key = _storage(tensor).data_ptr()
        refs = [ref for ref in self._made.get(key, []) if ref() is not None]
        if not refs and key in inputs:
            return  # a view or an in-place result of a tensor made before the block
        self._made[key] = [*refs, weakref.ref(tensor)]

    def _count(self) -> None:
        held = 0
        for key, refs in list(self._made.items()):
            alive = [t for t in (ref() for ref in refs) if t is not None]
            if not alive:
                del self._made[key]
                continue
            held += max(_storage(t).nbytes() for t in alive)
        self.held = held
        self.peak = max(self.peak, held)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._count()


__all__ = ["HeldBytes", "PeakBytes", "storage_bytes"]
