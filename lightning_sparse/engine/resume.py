"""The checkpoint state of one group, and the rules for restoring it.

A :class:`~lightning_sparse.engine.sparsifier.Sparsifier` saves its phase, last update step,
history of phase changes and masks as ``<param>_mask`` bool tensors (whole tensors on the CPU,
whatever the sharding). Restoring reads a state from a file, so everything in it is checked
before anything changes: a malformed state raises a ``ValueError`` naming the group and the
parameter.

Example:
    >>> import torch
    >>> state = pack_state(0, -1, [(0, 0)], {"w_mask": torch.ones(2, dtype=torch.bool)})
    >>> saved = SavedState.read("demo", state)
    >>> saved.phase, saved.history, list(saved.masks)
    (0, [(0, 0)], ['w_mask'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_sparse.algorithms import SparsityAlgorithm
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.core.selection import ParamTarget
from lightning_sparse.masks.patterns import not_a_mask

STATE_VERSION = 1


def pack_state(
    phase: int | None,
    last_update_step: int,
    history: Sequence[tuple[int, int | None]],
    masks: Mapping[str, Tensor],
) -> dict[str, Any]:
    """A group's state as saved in checkpoints (``masks``: whole tensors, on the CPU)."""
    return {
        "version": STATE_VERSION,
        "phase": phase,
        "last_update_step": last_update_step,
        "history": list(history),
        "masks": dict(masks),
    }


@dataclass(frozen=True)
class SavedState:
    """A state read from a checkpoint, checked for type and range (not yet against a group)."""

    phase: int | None
    last_update_step: int
    history: list[tuple[int, int | None]]
    masks: Mapping[str, Any]

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
        return cls(index, step, [tuple(h) for h in history], masks)


def restored_masks(
    name: str,
    saved: SavedState,
    phases: Sequence[ResolvedPhase],
    algorithms: Mapping[int, SparsityAlgorithm],
    targets: Sequence[ParamTarget],
) -> dict[str, Tensor]:
    """The masks of ``saved`` by parameter name, on their parameters' devices, checked against
    group ``name`` (its ``phases``, the ``algorithms`` of its sparse phases and its
    ``targets``): empty when the saved phase is dense. A ``ValueError`` names what does not fit."""
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
        masks[t.name] = mask.to(device=t.param.device)
    return masks


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
