"""One group of a Cerebras sparsity block as :class:`~lightning_sparse.SparsityCallback` phases.

:mod:`~lightning_sparse.formats.cerebras` reads the three forms of the block into a
:class:`Group` (the settings under their current meaning, plus the names the user wrote them
under, so that errors name the user's keys); :func:`group_phases` places it on the step axis:
the update schedule becomes a grid ``start + j * freq`` below ``stop``, a ``gmp`` sparsity
schedule becomes the ramp of a phase whose sparsity is the schedule's peak (its ceiling), and
``drop_fraction`` passes through.

Example:
    >>> group = Group("sparsity", "gmp", [0.3, 0.5], update={"freq": 100, "stop": 1000})
    >>> group_phases(group)  # doctest: +NORMALIZE_WHITESPACE
    [{'sparsity': 0.5, 'algorithm': 'gmp', 'init': 'random', 'ramp': [0.3, 0.5],
      'update_every': 100, 'update_stop': 900}]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_sparse.algorithms.step_values import is_schedule, parse_step_value
from lightning_sparse.core.schedule import parse_int, parse_sparsity
from lightning_sparse.masks import NM

INIT_METHODS = ("random", "topk", "from_zeros")
UPDATE_KEYS = frozenset({"freq", "start", "stop"})
DEFAULT_DROP_FRACTION = 0.3


@dataclass
class Group:
    """One Cerebras sparsity group, whatever form it came in."""

    where: str  #: where the group sits in the config, e.g. ``sparsity[1]``
    algorithm: str  #: static, gmp, set or rigl
    sparsity: Any  #: a number, or a schedule (``gmp``)
    init_method: Any = None
    seed: Any = None
    drop_fraction: Any = None
    update: Any = (
        None  #: the update schedule: a mapping, a frequency or a list of steps
    )
    params: list[str] | None = None  #: globs or ``re:`` regexes; ``None``: the default
    default_init: str = "random"
    sparsity_key: str = "sparsity"  #: the names the user wrote, for messages
    update_key: str = "update"


def group_phases(group: Group) -> list[dict[str, Any]]:
    """The phases of one group (a dense phase first when updates start after step 0)."""
    where, algorithm = group.where, group.algorithm
    if algorithm == "static":
        for key, value in (
            (group.update_key, group.update),
            ("drop_fraction", group.drop_fraction),
        ):
            if value is not None:
                raise ValueError(
                    f"{where}: '{key}' does nothing for algorithm 'static'"
                )
        return [static_phase(group, group.sparsity)]
    if algorithm == "gmp" and group.drop_fraction is not None:
        raise ValueError(f"{where}: 'drop_fraction' does nothing for algorithm 'gmp'")
    freq, start, last = update_grid(group, needs_stop=algorithm == "gmp")
    if algorithm == "gmp":
        assert last is not None
        phase = static_phase(group, ceiling(group, freq, start, last))
        phase["ramp"] = group.sparsity
    else:
        phase = static_phase(group, group.sparsity)
    phase = {
        "sparsity": phase.pop("sparsity"),
        "algorithm": algorithm,
        **phase,
        "update_every": freq,
    }
    if start:
        phase["update_start"] = start
        if (
            algorithm == "gmp"
        ):  # cstorch's first mask there is its first update: by magnitude
            phase["init"] = "topk"
    phase["update_stop"] = 1.0 if last is None else last
    if algorithm != "gmp":
        phase.update(_drop_fraction(group))
    return [{"sparsity": 0.0, "until": start}, phase] if start else [phase]


def static_phase(group: Group, sparsity: Any) -> dict[str, Any]:
    """A phase with a float ``sparsity`` and the group's ``init_method`` and ``seed``."""
    where, key = group.where, group.sparsity_key
    if sparsity is None:
        raise ValueError(f"{where}: give a 'sparsity' (a float in (0, 1), e.g. 0.5)")
    if is_schedule(sparsity):
        raise TypeError(
            f"{where}.{key}: a sparsity schedule ({sparsity!r}) needs algorithm 'gmp'; "
            f"algorithm {group.algorithm!r} takes a float sparsity in (0, 1)"
        )
    value = parse_sparsity(sparsity, f"{where}.{key}")
    if isinstance(value, NM):
        raise TypeError(
            f"{where}.{key}={sparsity!r}: Cerebras sparsity is a fraction of weights such "
            f"as 0.5; for N:M patterns use SparsityCallback(sparsity={sparsity!r})"
        )
    if value == 0.0:
        raise ValueError(
            f"{where}.{key}={sparsity!r} leaves the parameters dense: give a sparsity in "
            f"(0, 1) such as 0.5, or remove the group"
        )
    init = group.default_init if group.init_method is None else group.init_method
    if not isinstance(init, str) or init not in INIT_METHODS:
        raise ValueError(
            f"{where}.init_method={init!r} is not supported; use one of {list(INIT_METHODS)}"
        )
    phase: dict[str, Any] = {"sparsity": value, "init": init}
    if group.seed is not None:
        phase["seed"] = parse_int(group.seed, f"{where}.seed")
    return phase


def update_grid(group: Group, needs_stop: bool) -> tuple[int, int, int | None]:
    """``(freq, start, last update step or None)`` of the group's update schedule: a mapping
    ``{freq, start, stop}`` (``stop`` exclusive; ``freq`` defaults to 1, ``start`` to 0), a
    frequency, or evenly spaced update steps (a list, or ``{steps: [...]}``)."""
    where, key = group.where, group.update_key
    update = {} if group.update is None else group.update
    if isinstance(update, int) and not isinstance(update, bool):
        update = {"freq": update}
    elif isinstance(update, Sequence) and not isinstance(update, str):
        update = _steps_grid(update, f"{where}.{key}")
    elif isinstance(update, Mapping) and "steps" in update:
        if set(update) != {"steps"}:
            raise ValueError(
                f"{where}.{key}: give the update steps alone ({{steps: [...]}}) or a grid "
                f"{{freq, start, stop}}, not both"
            )
        update = _steps_grid(update["steps"], f"{where}.{key}.steps")
    if not isinstance(update, Mapping):
        raise TypeError(
            f"{where}.{key}={update!r}: use a mapping such as {{'freq': 100, 'stop': 1000}}"
        )
    unknown = sorted(map(str, set(update) - UPDATE_KEYS))
    if unknown:
        raise ValueError(
            f"{where}.{key}: unknown key(s) {unknown}; this form accepts {sorted(UPDATE_KEYS)}"
        )
    values = {"freq": update.get("freq", 1), "start": update.get("start", 0)}
    for name, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < int(name == "freq")
        ):
            raise ValueError(
                f"{where}.{key}.{name}={value!r}: use a whole number of steps"
            )
    freq, start = values["freq"], values["start"]
    stop = update.get("stop")
    if stop is None:
        if needs_stop:
            raise ValueError(
                f"{where}: algorithm 'gmp' needs {key}.stop (the step its sparsity schedule "
                f"ends at, exclusive) so that the sparsity's peak is known"
            )
        return freq, start, None
    if isinstance(stop, bool) or not isinstance(stop, int):
        raise TypeError(f"{where}.{key}.stop={stop!r}: use a whole number of steps")
    last = start + (stop - 1 - start) // freq * freq
    if last <= start:
        raise ValueError(
            f"{where}: {key}.stop={stop} leaves no update after {key}.start={start} with "
            f"freq={freq}; move stop later, or use algorithm 'static'"
        )
    return freq, start, last


def _steps_grid(steps: Any, where: str) -> dict[str, int]:
    """Evenly spaced update steps as ``{freq, start, stop}``."""
    if (
        not isinstance(steps, Sequence)
        or isinstance(steps, str)
        or not steps
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps)
    ):
        raise TypeError(
            f"{where}={steps!r}: give the update steps as a list of whole numbers such as "
            f"[100, 200, 300]"
        )
    grid = sorted(set(steps))
    if len(grid) == 1:
        raise ValueError(
            f"{where}={steps!r}: a single update step chooses one mask and never updates it; "
            f"use algorithm 'static'"
        )
    gaps = {b - a for a, b in itertools.pairwise(grid)}
    if len(gaps) > 1:
        raise ValueError(
            f"{where}={steps!r}: the update steps are not evenly spaced, and only a regular "
            f"grid translates: give the updates as {{freq, start, stop}}"
        )
    return {"freq": gaps.pop(), "start": grid[0], "stop": grid[-1] + 1}


def ceiling(group: Group, freq: int, start: int, last: int) -> float:
    """A ``gmp`` phase's sparsity: the peak of its schedule over the mask choices (the phase
    start and every update up to ``last``), so the phase follows the schedule exactly."""
    where, key, sparsity = group.where, group.sparsity_key, group.sparsity
    if sparsity is None or not is_schedule(sparsity):
        raise ValueError(
            f"{where}: algorithm 'gmp' needs a sparsity schedule such as "
            f"{{'type': 'linear', 'init': 0.0, 'slope': 0.001}}, not {sparsity!r}; for a "
            f"constant sparsity use algorithm 'static'"
        )
    schedule = parse_step_value(sparsity, f"{where}.{key}")
    peak, at = schedule.peak(start, freq, (last - start) // freq + 1)
    value = min(1.0, max(0.0, peak))
    if value >= 1.0:
        when = "at its crest" if at is None else f"at step {at}"
        raise ValueError(
            f"{where}.{key}: the schedule gives sparsity {peak:g} {when}, which prunes every "
            f"weight (cstorch clamps the sparsity to [0, 1]); every mask choice needs a "
            f"sparsity below 1: lower the schedule or end the updates (stop) earlier"
        )
    if value <= 0.0:
        raise ValueError(
            f"{where}.{key}: the schedule gives sparsity 0 or less at every mask choice "
            f"(steps {start} to {last}), so the parameters stay dense: raise the schedule, or "
            f"remove the group"
        )
    return value


def _drop_fraction(group: Group) -> dict[str, Any]:
    """The phase options for ``drop_fraction``: a schedule as it is, a number held constant."""
    value = (
        DEFAULT_DROP_FRACTION if group.drop_fraction is None else group.drop_fraction
    )
    where = f"{group.where}.drop_fraction"
    if is_schedule(value):
        parse_step_value(value, where)
        return {"drop_fraction": value}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{where}={value!r}: use a number in [0, 1] or a schedule mapping"
        )
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(
            f"{where}={value!r}: the fraction of active weights swapped at each update is "
            f"in [0, 1] (0.3 is the usual choice)"
        )
    return {"drop_fraction": value, "drop_fraction_decay": "constant"}
