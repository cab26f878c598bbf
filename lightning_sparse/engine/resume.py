"""The checkpoint state of one group, and the rules for restoring it.

A :class:`~lightning_sparse.engine.sparsifier.Sparsifier` saves its phase, last update step,
history of phase changes, masks as ``<param>_mask`` bool tensors (whole tensors on the CPU,
whatever the sharding) and a record of its schedule
(:mod:`~lightning_sparse.engine.schedule_record`).

Restoring reads a state from a file, so everything in it is checked before anything changes: a
malformed state raises a ``ValueError`` naming the group and the parameter, and so does a mask
that breaks its phase's pattern (N:M groups, transposable 2:4 tiles). A state saved with another
schedule or other parameters is refused with the differences listed, or, with
``on_schedule_change="reselect"``, the group's schedule applies from the resume step with masks
chosen afresh there (:func:`plan_restore`). A run of another length only moves fractional and
open-ended boundaries: the state is restored, and the log says where the phases now lie.

Example:
    >>> import torch
    >>> state = pack_state(0, -1, [(0, 0)], {"w_mask": torch.ones(2, dtype=torch.bool)})
    >>> saved = SavedState.read("demo", state)
    >>> saved.phase, saved.history, list(saved.masks), saved.schedule
    (0, [(0, 0)], ['w_mask'], None)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_sparse.algorithms import SparsityAlgorithm
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.core.selection import ParamTarget
from lightning_sparse.engine.schedule_record import (
    describe_phase,
    is_record,
    moved_phases,
    schedule_changes,
    schedule_record,
)
from lightning_sparse.masks import NM, is_nm
from lightning_sparse.masks.patterns import not_a_mask
from lightning_sparse.masks.tiles import is_transposable_2to4

STATE_VERSION = 1


ON_SCHEDULE_CHANGE = ("error", "reselect")
"""What a resume does when the checkpoint's schedule or parameters differ from the group's:
stop with an error naming each difference, or apply the group's schedule at the resume step
(masks chosen afresh there for the phase it has at that step)."""


def pack_state(
    phase: int | None,
    last_update_step: int,
    history: Sequence[tuple[int, int | None]],
    masks: Mapping[str, Tensor],
    schedule: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A group's state as saved in checkpoints (``masks``: whole tensors, on the CPU;
    ``schedule``: :func:`schedule_record`)."""
    state = {
        "version": STATE_VERSION,
        "phase": phase,
        "last_update_step": last_update_step,
        "history": list(history),
        "masks": dict(masks),
    }
    if schedule is not None:
        state["schedule"] = dict(schedule)
    return state


def changed_schedule_error(
    name: str, changes: Sequence[str], saved: Mapping[str, Any], step: int | None
) -> ValueError:
    """The error of a resume that refuses a changed schedule: each difference, the
    checkpoint's phases, and the two ways on."""
    phases = ", ".join("{" + describe_phase(p["spec"]) + "}" for p in saved["phases"])
    at = "the resume step" if step is None else f"the resume step ({step})"
    return ValueError(
        f"[{name}] the checkpoint was trained with another schedule: {'; '.join(changes)}. "
        f"Resume with the phases it was trained with ([{phases}]) and the same params/exclude, "
        f"or pass on_schedule_change='reselect' to apply this schedule from {at}, where the "
        f"masks are chosen afresh for the phase it has there"
    )


@dataclass(frozen=True)
class SavedState:
    """A state read from a checkpoint, checked for type and range (not yet against a group)."""

    phase: int | None
    last_update_step: int
    history: list[tuple[int, int | None]]
    masks: Mapping[str, Any]
    schedule: (
        Mapping[str, Any] | None
    )  #: :func:`schedule_record`; ``None`` if not recorded

    @classmethod
    def read(cls, name: str, state: Any) -> SavedState:
        """Check ``state`` (of group ``name``) field by field; a ``ValueError`` names what is
        wrong."""

        def bad(what: str) -> ValueError:
            return ValueError(
                f"[{name}] the checkpoint's sparsity state {what}; the checkpoint is damaged or "
                f"was not written by SparsityCallback"
            )

        if not isinstance(state, Mapping):
            raise bad(f"is a {type(state).__name__}, not a dict")
        version = state.get("version", STATE_VERSION)
        if not (_is_int(version) and 1 <= version <= STATE_VERSION):
            if _is_int(version) and version > STATE_VERSION:
                raise ValueError(
                    f"[{name}] the checkpoint's sparsity state has version {version}, but this "
                    f"lightning_sparse reads versions 1 to {STATE_VERSION}: upgrade "
                    f"lightning_sparse"
                )
            raise bad(f"has version {version!r}, not 1 to {STATE_VERSION}")
        index = state.get("phase")
        if index is not None and not (_is_int(index) and index >= 0):
            raise bad(f"has phase {index!r}, not a phase index (0, 1, ...) or None")
        step = state.get("last_update_step", -1)
        if not (_is_int(step) and step >= -1):
            raise bad(f"has last_update_step {step!r}, not a step (-1 for none)")
        history = state.get("history", [])
        pairs = isinstance(history, (list, tuple)) and all(
            isinstance(h, (list, tuple))
            and len(h) == 2
            and _is_int(h[0])
            and (h[1] is None or _is_int(h[1]))
            for h in history
        )
        if not pairs:
            raise bad(
                f"has history {str(history)[:80]}, not a list of (step, phase) pairs"
            )
        masks = state.get("masks", {})
        if not isinstance(masks, Mapping):
            raise bad(f"has masks of type {type(masks).__name__}, not a dict")
        schedule = state.get("schedule")
        if schedule is not None and not is_record(schedule):
            raise bad(
                f"has schedule {str(schedule)[:80]}, not a record of phases and parameters"
            )
        if (
            schedule is not None
            and index is not None
            and index >= len(schedule["phases"])
        ):
            raise bad(
                f"has phase {index}, but its schedule has {len(schedule['phases'])} phase(s)"
            )
        return cls(index, step, [tuple(h) for h in history], masks, schedule)


@dataclass(frozen=True)
class Restore:
    """What restoring a saved state does to a group: set back its ``masks`` (by parameter name,
    on their devices; empty in a dense phase), or, with ``masks=None``, apply the group's
    changed schedule from the resume step; ``note``: a line for the log, if any."""

    saved: SavedState
    masks: dict[str, Tensor] | None
    note: str | None = None


def plan_restore(
    name: str,
    state: Any,
    phases: Sequence[ResolvedPhase],
    algorithms: Mapping[int, SparsityAlgorithm],
    targets: Sequence[ParamTarget],
    step: int | None = None,
    on_schedule_change: str = "error",
    handed: Collection[int] = (),
) -> Restore:
    """How to restore ``state`` into group ``name`` (its ``phases``, the ``algorithms`` of its
    sparse phases, its ``targets``) at optimizer ``step``, the resume step; everything checked
    first: a ``ValueError`` for a malformed state, and for a changed schedule unless
    ``on_schedule_change`` is ``"reselect"``. ``handed``: the phases that start from the
    N:M groups the phase before learned (not transposable, so checked as groups)."""
    if on_schedule_change not in ON_SCHEDULE_CHANGE:
        raise ValueError(
            f"on_schedule_change={on_schedule_change!r}: use one of {list(ON_SCHEDULE_CHANGE)}"
        )
    if on_schedule_change == "reselect" and step is None:
        raise ValueError(
            "on_schedule_change='reselect' applies a changed schedule at the resume step: "
            "pass step=<the optimizer step training resumes at>"
        )
    saved = SavedState.read(name, state)
    if saved.schedule is None:  # not recorded: restored as saved, checked by its masks
        masks = restored_masks(name, saved, phases, algorithms, targets, handed)
        return Restore(saved, masks)
    now = schedule_record(phases, targets)
    changes = schedule_changes(saved.schedule, now, bool(saved.masks))
    if changes and on_schedule_change == "error":
        raise changed_schedule_error(name, changes, saved.schedule, step)
    if changes:
        return Restore(
            saved,
            None,
            f"[{name}] step {step}: the schedule differs from the checkpoint's "
            f"({'; '.join(changes)}); it applies from this step, masks chosen afresh "
            f"(on_schedule_change='reselect')",
        )
    masks = restored_masks(name, saved, phases, algorithms, targets, handed)
    moved = moved_phases(saved.schedule, now)
    note = (
        None
        if moved is None
        else f"[{name}] the run is longer or shorter than the one the state was saved in, "
        f"so its fractional and open-ended boundaries moved: the phases span {moved}"
    )
    return Restore(saved, masks, note)


def restored_masks(
    name: str,
    saved: SavedState,
    phases: Sequence[ResolvedPhase],
    algorithms: Mapping[int, SparsityAlgorithm],
    targets: Sequence[ParamTarget],
    handed: Collection[int] = (),
) -> dict[str, Tensor]:
    """The masks of ``saved`` by parameter name, on their parameters' devices, checked against
    group ``name`` (its ``phases``, the ``algorithms`` of its sparse phases and its
    ``targets``; ``handed``: the phases that start from learned N:M groups): empty when the saved
    phase is dense. A ``ValueError`` names what does not fit."""
    index, saved_masks = saved.phase, saved.masks
    if index is not None and index >= len(phases):
        raise ValueError(
            f"[{name}] the checkpoint was saved in phase {index + 1}, but this schedule "
            f"has {len(phases)} phase(s): resume with the schedule it was trained with"
        )
    sparse = index is not None and index in algorithms
    if saved_masks and not sparse:
        raise ValueError(
            f"[{name}] the checkpoint holds masks, but phase {index} of this schedule "
            f"is dense: resume with the schedule the checkpoint was trained with"
        )
    masks = {}
    names = {f"{t.name}_mask" for t in targets}
    extra = sorted(map(str, set(saved_masks) - names)) if sparse else []
    if extra:
        raise ValueError(
            f"[{name}] the checkpoint has masks for parameters this group does not "
            f"select: {extra[:5]}: resume with the same params/exclude"
        )
    for t in targets if sparse else ():
        key = f"{t.name}_mask"
        if key not in saved_masks:
            raise ValueError(
                f"[{name}] the checkpoint has no mask for parameter {t.name!r} ({key}); "
                f"it has masks for {sorted(map(str, saved_masks))[:5]}...: resume with the "
                f"same params/exclude"
            )
        mask = saved_masks[key]
        problem = not_a_mask(mask)
        if problem is not None:
            raise ValueError(
                f"[{name}] the checkpoint's mask for parameter {t.name!r} is "
                f"{problem}; the checkpoint is damaged or was not written by "
                f"SparsityCallback"
            )
        if tuple(mask.shape) != tuple(t.param.shape):
            raise ValueError(
                f"[{name}] the checkpoint's mask for parameter {t.name!r} has shape "
                f"{tuple(mask.shape)}, but the parameter has shape {tuple(t.param.shape)}"
            )
        mask = masks[t.name] = mask.to(
            device=t.param.device
        )  # checked where it is fastest
        broken = broken_pattern(
            t, mask, phases[index], algorithms[index], index in handed
        )
        if broken is not None:
            raise ValueError(
                f"[{name}] the checkpoint's mask for parameter {t.name!r} is not {broken}, "
                f"which phase {index + 1} ({phases[index].spec.describe()}) keeps; the "
                f"checkpoint is damaged or was trained with another schedule"
            )
    return masks


def broken_pattern(
    t: ParamTarget,
    mask: Tensor,
    phase: ResolvedPhase,
    algorithm: SparsityAlgorithm,
    handed: bool = False,
) -> str | None:
    """The pattern of ``phase`` that ``t``'s ``mask`` breaks, or ``None``: N:M groups along
    the layer's inputs, and transposable 4x4 tiles where the (built-in) algorithm lays 2:4 out
    so, unless the phase started from learned masks that are not transposable (``handed``:
    groups only)."""
    target = phase.target
    if not isinstance(target, NM):
        return None
    rows = t.layer.to_rows(mask)
    tiles = (
        algorithm.nm_layout(rows, target) == "tiles"
        and _built_in(algorithm)
        and not handed
    )
    if tiles and is_transposable_2to4(rows):  # which implies 2:4 along the inputs
        return None
    if not is_nm(rows, target):
        return (
            f"{target} (at most {target.n} kept of every {target.m} along its inputs)"
        )
    if tiles:
        return (
            "transposable 2:4 (at most 2 kept per row and per column of each 4x4 tile)"
        )
    return None


def _built_in(algorithm: SparsityAlgorithm) -> bool:
    """Whether ``algorithm`` chooses masks by this package's rules only (which lay 2:4 out as
    transposable tiles where :meth:`~lightning_sparse.algorithms.SparsityAlgorithm.nm_layout`
    says so); a custom rule is held to the N:M groups of its phase alone."""
    rules = ("initial_mask", "update_mask", "update_mask_", "select", "project")
    return all(
        getattr(type(algorithm), rule).__module__.startswith("lightning_sparse.")
        for rule in rules
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
