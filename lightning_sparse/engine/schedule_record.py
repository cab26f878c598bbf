"""What a checkpoint records of a group's schedule, and how two records differ.

The record holds each phase as written, normalized so that equal settings read alike (``0.5``
and ``"50%"`` are one boundary, ``"2:4"`` one pattern), with the step range it resolved to, and
the names of the group's parameters; plain strings and integers only, since checkpoints are
read with ``torch.load(weights_only=True)``. Two records differ in *what* the phases are or
which parameters they cover (:func:`schedule_changes`: a changed schedule), or only in *where*
the phases lie, as a run of another length moves fractional and open-ended boundaries
(:func:`moved_phases`).

Example:
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> phases = resolve_phases([Phase(sparsity="2:4", until="70%"), Phase()], total_steps=10)
    >>> schedule_record(phases, [])["phases"][0]
    {'spec': {'sparsity': '2:4', 'until': '0.7', 'algorithm': 'runtime'}, 'steps': [0, 7]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_sparse.core.schedule import Phase, ResolvedPhase, parse_boundary
from lightning_sparse.core.selection import ParamTarget


def schedule_record(
    phases: Sequence[ResolvedPhase], targets: Sequence[ParamTarget]
) -> dict[str, Any]:
    """The schedule as a checkpoint records it: plain strings and integers only (a checkpoint
    is read with ``torch.load(weights_only=True)``)."""
    return {
        "phases": [
            {"spec": _spec_text(p.spec), "steps": [p.start, p.end]} for p in phases
        ],
        "params": [t.name for t in targets],
    }


def schedule_changes(
    saved: Mapping[str, Any], now: Mapping[str, Any], masks: bool = False
) -> list[str]:
    """How schedule record ``now`` differs from ``saved`` in what the phases are (not where
    they lie) and in the parameters, one line each; empty if they agree. ``masks``: the
    state saved with ``saved`` holds masks (the parameters' lines then say so).

    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> def record(*phases):
    ...     return schedule_record(resolve_phases(list(phases), total_steps=10), [])
    >>> saved = record(Phase(sparsity=0.5, until=0.5), Phase())
    >>> schedule_changes(saved, record(Phase(sparsity=0.8, until="50%"), Phase()))
    ['phases[0].sparsity: 0.5 in the checkpoint, 0.8 now']
    """
    changes = []
    old, new = saved["phases"], now["phases"]
    for i in range(max(len(old), len(new))):
        if i >= len(old):
            changes.append(f"phases[{i}] ({describe_phase(new[i]['spec'])}) is new")
        elif i >= len(new):
            changes.append(f"phases[{i}] ({describe_phase(old[i]['spec'])}) is gone")
        else:
            a, b = old[i]["spec"], new[i]["spec"]
            for key in [*a, *(k for k in b if k not in a)]:
                if a.get(key) != b.get(key):
                    changes.append(
                        f"phases[{i}].{key}: {a.get(key, 'unset')} in the checkpoint, "
                        f"{b.get(key, 'unset')} now"
                    )
    before, after = set(saved["params"]), set(now["params"])
    held = "has masks for" if masks else "was saved for"
    if before - after:
        changes.append(
            f"the checkpoint {held} parameters this group does not select: "
            f"{_names(before - after)}"
        )
    if after - before:
        missing = "has no mask for them" if masks else "was not saved for them"
        changes.append(
            f"this group selects parameters {_names(after - before)}; the checkpoint "
            f"{missing}"
        )
    return changes


def moved_phases(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """Where the phases of ``now`` lie when a run of another length moved them from where
    ``saved`` had them (same phases), for the log; ``None`` if none moved."""
    old = [tuple(p["steps"]) for p in saved["phases"]]
    new = [tuple(p["steps"]) for p in now["phases"]]
    if old == new:
        return None

    def spans(steps: list[tuple[int, int | None]]) -> str:
        return ", ".join(
            f"{start}-{'end' if end is None else end - 1}" for start, end in steps
        )

    return f"steps {spans(new)} (before: {spans(old)})"


def _spec_text(spec: Phase) -> dict[str, str]:
    """What phase ``spec`` sets, as text normalized so that equal settings read alike: the
    sparsity as a number or ``N:M``, boundaries as a fraction, ``N steps`` or ``N epochs``."""
    text = {"sparsity": str(spec.target)}
    for key in ("until", "update_start", "update_stop"):
        value = getattr(spec, key)
        if value is not None:
            boundary = parse_boundary(value, key)
            text[key] = (
                repr(boundary.value)
                if boundary.kind == "fraction"
                else f"{boundary.value:g} {boundary.kind}"
            )
    if spec.algorithm is not None:
        text["algorithm"] = spec.algorithm
    for key, value in spec.explicit_options().items():
        if key not in text:
            text[key] = _plain(value)
    if spec.options:
        text["options"] = _plain(spec.options)
    return text


def _plain(value: Any) -> str:
    """``repr`` with mapping keys sorted, so that equal settings read alike."""
    if isinstance(value, Mapping):
        items = ", ".join(
            f"{k!r}: {_plain(v)}" for k, v in sorted(value.items(), key=str)
        )
        return "{" + items + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    return repr(value)


def describe_phase(spec: Mapping[str, str]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in spec.items())


def _names(names: set[str]) -> str:
    listed = sorted(names)
    return str(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")


def is_record(schedule: Any) -> bool:
    """Whether ``schedule`` has the shape of a :func:`schedule_record`."""
    if not isinstance(schedule, Mapping):
        return False
    phases, params = schedule.get("phases"), schedule.get("params")
    return (
        isinstance(phases, (list, tuple))
        and all(_is_phase_record(p) for p in phases)
        and isinstance(params, (list, tuple))
        and all(isinstance(name, str) for name in params)
    )


def _is_phase_record(phase: Any) -> bool:
    if not isinstance(phase, Mapping):
        return False
    spec, steps = phase.get("spec"), phase.get("steps")
    return (
        isinstance(spec, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in spec.items())
        and isinstance(steps, (list, tuple))
        and len(steps) == 2
        and type(steps[0]) is int
        and (steps[1] is None or type(steps[1]) is int)
    )
