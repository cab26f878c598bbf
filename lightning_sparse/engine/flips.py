"""Flip rate: the fraction of a group's mask entries that one optimizer step changed.

The diagnostic of straight-through N:M training (Hu et al., ICML 2024): masks re-derived from
the dense weights flip in and out as the weights move, and a healthy run sees the rate fall. A
:class:`FlipRate` measures it on demand only: :meth:`FlipRate.snapshot` keeps a copy of the masks
the forwards of an optimizer step use (one byte per selected weight), :meth:`FlipRate.measure`
compares it with the masks the next forward will use and frees it. Between the two, within one
optimizer step, only that copy is held; on other steps nothing is computed or kept.

A mask update of the step counts (an update at step ``s`` shows in the rate of step ``s``); a
phase boundary does not (phases change between optimizer steps).

Example (plain PyTorch):
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.core.selection import select_parameters
    >>> from lightning_sparse.engine.sparsifier import Sparsifier
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> sp = Sparsifier("demo", select_parameters(net).targets, resolve_phases([Phase(sparsity=0.5)], 10))
    >>> _ = sp.on_step_start(0, [])
    >>> flips = FlipRate()
    >>> flips.snapshot(sp, step=0)
    >>> # ... the forwards, backward and optimizer step of step 0 ...
    >>> flips.measure(sp)  # a static mask never flips
    0.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.engine.sharding import gather_full
from lightning_sparse.engine.sparsifier import Sparsifier

_RECORDS = ("first", "last", "peak")


class FlipRate:
    """Measures a group's flip rate over chosen optimizer steps and keeps the first, last and
    peak values (with their steps) for the end-of-fit summary and the checkpoint."""

    def __init__(self) -> None:
        self._before: dict[str, Tensor] | None = None
        self.snapshot_step = -1  #: the step of the last snapshot
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None
        self.peak: tuple[int, float] | None = None

    @property
    def pending(self) -> bool:
        """Whether a snapshot waits for :meth:`measure`."""
        return self._before is not None

    def snapshot(self, sparsifier: Sparsifier, step: int) -> None:
        """Keep the masks the forwards of optimizer step ``step`` use (nothing in a dense
        phase). Call once the step's phase is entered, before its first forward."""
        self.snapshot_step = step
        self._before = None
        if sparsifier.algorithm is not None:
            self._before = {
                t.name: sparsifier.current_mask(t).clone() for t in sparsifier.targets
            }

    @torch.no_grad()
    def measure(self, sparsifier: Sparsifier) -> float | None:
        """After the snapshot's optimizer step (before the next step's phase change): the
        fraction of the group's selected weights whose mask that step changed; ``None``
        without a snapshot or in a dense phase. Frees the snapshot."""
        before, self._before = self._before, None
        if before is None or sparsifier.algorithm is None:
            return None
        changed = total = 0
        for t in sparsifier.targets:
            now = sparsifier.current_mask(t)
            # whole masks: a sharded sum is a partial one (int() would read this rank's part),
            # and older torch has no sharded bool comparison
            changed += int(gather_full(now).ne(gather_full(before[t.name])).sum())
            total += now.numel()
        rate = changed / total if total else 0.0
        step = self.snapshot_step
        self.first = self.first or (step, rate)
        self.last = (step, rate)
        if self.peak is None or rate > self.peak[1]:
            self.peak = (step, rate)
        return rate

    def describe(self) -> str | None:
        """``'first 3.1% (step 50), last 0.4% (step 1000), peak 3.1% (step 50)'``, or ``None``
        if nothing was measured."""
        if self.first is None:
            return None
        return ", ".join(
            f"{name} {rate:.2%} (step {step})"
            for name in _RECORDS
            for step, rate in [getattr(self, name)]
        )

    def state_dict(self) -> dict[str, Any]:
        """The first, last and peak ``[step, rate]`` (a snapshot lives within one optimizer
        step, between two checkpoints, and is taken again after a resume: it is not saved)."""
        return {
            name: None if getattr(self, name) is None else list(getattr(self, name))
            for name in _RECORDS
        }

    def load_state_dict(self, state: Any, where: str) -> None:
        """Restore :meth:`state_dict` (``None``: a checkpoint from before flip rates, nothing
        measured); a malformed state raises a ``ValueError`` that names ``where``."""
        self._before = None
        self.first = self.last = self.peak = None
        if state is None:
            return
        records = {}
        for name in _RECORDS:
            value = state.get(name) if isinstance(state, Mapping) else ()
            if value is not None and not _is_record(value):
                raise ValueError(
                    f"{where} the checkpoint's flip_rate state has {name}={value!r}, not a "
                    f"[step, rate] pair; the checkpoint is damaged or was not written by "
                    f"SparsityCallback"
                )
            records[name] = None if value is None else (int(value[0]), float(value[1]))
        self.first, self.last, self.peak = (records[name] for name in _RECORDS)


def _is_record(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and isinstance(value[1], float)
        and 0.0 <= value[1] <= 1.0
    )
