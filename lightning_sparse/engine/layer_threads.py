"""Running the per-layer part of a mask update on several CPU threads at once.

A mask update works layer by layer, and on the CPU nearly all of a layer's work runs in torch
operations and compiled loops that release the GIL, so layers given to different threads
overlap. The optimizer step it is compared with uses every thread torch has
(``torch.get_num_threads()``), so the update uses as many.

Threads are used only where that is safe and useful (:func:`update_threads`): an algorithm that
declares its per-layer code thread-safe (``layers_in_parallel``, set on the built-in ones),
weights that are plain CPU tensors (sharded ones gather over the network, in the same order on
every rank; GPU work is asynchronous already). The largest layers start first, so the threads
finish together. Each thread has its own scratch buffers
(:func:`~lightning_sparse.masks.elementwise.scratch_mask`), so every layer's result is the one a single
thread computes, bit for bit.

Example:
    >>> done = []
    >>> for_each_layer(done.append, ["small", "large"], sizes=[1, 100], workers=2)
    >>> sorted(done)
    ['large', 'small']
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from lightning_sparse.masks.elementwise import free_scratch

T = TypeVar("T")

_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool)
_POOL_LOCK = threading.Lock()


def update_threads(layers_in_parallel: bool, params: Sequence[torch.Tensor]) -> int:
    """How many threads a mask update over ``params`` uses: ``torch.get_num_threads()`` (at
    most one per layer) when the algorithm allows ``layers_in_parallel`` and every parameter
    is a plain CPU tensor, else 1."""
    if not layers_in_parallel or len(params) < 2 or not plain_cpu(params):
        return 1
    return max(1, min(torch.get_num_threads(), len(params)))


def plain_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a plain CPU tensor: not sharded (a DTensor's gathers must run
    in the same order on every rank), not on a GPU (whose work is asynchronous already)."""
    return all(
        type(t.detach()) is torch.Tensor and t.device.type == "cpu" for t in tensors
    )


def for_each_layer(
    work: Callable[[T], None], items: Sequence[T], sizes: Sequence[int], workers: int
) -> None:
    """Call ``work(item)`` for every item, on ``workers`` threads (largest ``sizes`` first), or
    in order on this thread when ``workers`` is 1. Returns when all are done; the first error
    raised by a call is raised here (after the calls already running have finished)."""
    if workers <= 1:
        for item in items:
            work(item)
        return
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    pool = _pool(workers)
    futures = [pool.submit(work, items[i]) for i in order]
    errors = [f.exception() for f in futures]  # waits for every call
    for error in errors:
        if error is not None:
            raise error


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's worker threads, kept between updates (so are their scratch buffers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != workers:
            if _POOL is not None:
                _POOL[1].shutdown(wait=True)
                free_scratch()  # the old threads' buffers
            _POOL = (
                workers,
                ThreadPoolExecutor(workers, thread_name_prefix="lightning_sparse"),
            )
        return _POOL[1]


def _forget_pool_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the parent's threads."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
