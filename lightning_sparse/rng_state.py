"""The states of the random number generators a training step draws from, as checkpoint data.

:func:`capture` reads torch's CPU generator, every CUDA device's, NumPy's global one and Python's
``random`` into tensors, lists and numbers (what ``torch.load(weights_only=True)`` reads), and
:func:`restore` sets them back after checking each, so that a run resumed from a checkpoint
draws the same dropout masks (and any other global random number) as the run that wrote it.
Generators a user creates themselves (``torch.Generator``, ``numpy.random.default_rng``) are
theirs to save.

Example:
    >>> import torch
    >>> state = capture()
    >>> first = torch.rand(3)
    >>> restore(state, "demo")
    >>> torch.equal(torch.rand(3), first)
    True
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.engine.ranks import world_size


def capture() -> dict[str, Any]:
    """The global generators' states (see the module docstring)."""
    version, mt, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            position,
            has_gauss,
            cached,
        ],
        "python": [version, list(mt), gauss],
    }


def capture_ranks() -> list[dict[str, Any]]:
    """:func:`capture` of every process, in rank order (a collective under
    ``torch.distributed``: call it on every rank)."""
    mine = capture()
    ranks = world_size()
    if ranks == 1:
        return [mine]
    states: list[Any] = [None] * ranks
    dist.all_gather_object(states, mine)
    return states


def restore_rank(states: Any, rank: int, world_size: int, where: str) -> None:
    """:func:`restore` this process's state of ``states`` (from :func:`capture_ranks`); a
    checkpoint of another number of processes raises a ``ValueError`` with the fix."""
    if not isinstance(states, list) or len(states) != world_size:
        saved = len(states) if isinstance(states, list) else "an unknown number of"
        raise ValueError(
            f"{where}: restore_rng=True, and the checkpoint holds the random number generator "
            f"states of {saved} processes, but this run has {world_size}: resume on as many "
            f"processes as wrote it, or pass restore_rng=False (the masks and schedule still "
            f"resume exactly; dropout and data order then follow this run's generators)"
        )
    restore(states[rank], where)


def restore(state: Any, where: str) -> None:
    """Set the global generators to ``state`` (from :func:`capture`, read from a checkpoint);
    a state that is not one raises a ``ValueError`` naming ``where``, before any generator
    changes. CUDA states are restored when the device count is the one they were saved on."""

    def bad(what: str) -> ValueError:
        return ValueError(
            f"{where}: the checkpoint's random number generator states {what}; the checkpoint "
            f"is damaged or was not written with restore_rng=True"
        )

    if not isinstance(state, Mapping) or set(state) != {
        "torch",
        "cuda",
        "numpy",
        "python",
    }:
        raise bad("are not a dict of 'torch', 'cuda', 'numpy' and 'python' states")
    cpu, cuda = state["torch"], state["cuda"]
    if not _is_bytes(cpu) or not (
        isinstance(cuda, list) and all(_is_bytes(s) for s in cuda)
    ):
        raise bad("hold a torch state that is not a uint8 tensor")
    numpy_state, python_state = state["numpy"], state["python"]
    try:
        kind, keys, position, has_gauss, cached = numpy_state
        numpy_tuple = (
            kind,
            keys.numpy().astype(np.uint32),
            position,
            has_gauss,
            cached,
        )
        version, mt, gauss = python_state
        python_tuple = (version, tuple(mt), gauss)
        probe = random.Random()
        probe.setstate(python_tuple)
        np.random.RandomState().set_state(numpy_tuple)
    except (TypeError, ValueError, AttributeError, IndexError) as err:
        raise bad(f"hold a NumPy or Python state that does not load ({err})") from None
    torch.set_rng_state(cpu)
    if cuda and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(numpy_tuple)
    random.setstate(python_tuple)


def _is_bytes(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1
