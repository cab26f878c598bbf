"""Cerebras-format sparsity configs, translated into :class:`~lightning_sparse.SparsityCallback`
arguments (use :meth:`SparsityCallback.from_config <lightning_sparse.SparsityCallback.from_config>`).

The input is the sparsity block of a Cerebras Model Zoo config (a mapping, a list of groups or
a bare number), a whole params file that holds it (under ``trainer.init.sparsity`` since release
2.4, under a top-level ``sparsity`` before; every other key of the file is ignored), or the path
of a YAML file with either. Each group becomes one callback; a parameter belongs to the first
group whose patterns match it (later groups exclude the patterns of earlier ones).

Three forms of a group translate (``docs/cerebras.md`` has an example of each):

- the current form (2.2+): ``algorithm`` (``type`` is its old name), ``sparsity`` (``schedule``
  is its alias), ``init_method``, ``seed``, ``update: {freq, start, stop}`` (or ``{steps}``),
  ``drop_fraction``, ``param_filter`` (globs);
- the 2.0-2.1 form: ``type``, ``sparsity``, ``schedule`` (there the *update* schedule: a
  mapping ``{freq, start, stop}``, a frequency or a list of steps), ``sparsity_schedule``
  (``[[step, sparsity], ...]``), ``init_method``, ``seed``, ``drop_fraction`` and
  ``param_name_patterns`` (a regex, a list of regexes, or a mapping from a regex to its own
  settings). A group is read in this form when it has ``param_name_patterns`` or
  ``sparsity_schedule``, or ``schedule`` next to ``sparsity`` or shaped like an update schedule;
- the sideband form (1.x, static): ``type: sideband``, ``sparsity``, ``init_method``, ``seed``,
  ``param_name_patterns``.

Translation: steps count optimizer steps; ``stop`` is exclusive, so the last update is the last
``start + j * freq`` below it, and evenly spaced update steps become that grid. ``start > 0``
trains dense until ``start`` and chooses the first mask there (``init_method``; for ``gmp`` by
magnitude, as cstorch's first update there does). Without
``stop``, ``set``/``rigl`` update until the end of the run; ``gmp`` needs ``stop``. A ``gmp``
sparsity schedule is followed as cstorch evaluates it: the phase start and the ``j``-th update
use its value there (a list or ``cycling`` takes ``values[j % len]``), clamped to [0, 1], and
the last update's value holds after it; the phase's sparsity is the schedule's peak. A schedule
that goes down regrows pruned weights at zero, with zeroed optimizer state (see
:class:`~lightning_sparse.algorithms.GradualMagnitudePruning`). A number as ``drop_fraction``
stays constant; schedules are evaluated at the absolute optimizer step (see
:mod:`lightning_sparse.algorithms.step_values`). Regexes use ``re.search``; globs may match a
dotted suffix of the name, so patterns written for the bare model also match inside a
LightningModule. Without patterns the default selection applies.

Differences from Cerebras hardware: there, pruned weights are marked as NaN; here they are stored
as zeros (with masked gradients and optimizer state), so checkpoints hold zeros, not NaNs.
Unknown or untranslatable keys (``balance_in_groups``, ``init_method: checkerboard``, a key of
one form used in another...) are errors that name the key and, where there is one, the key to
use instead.

Example:
    >>> [group["phases"] for group in translate({"type": "sideband", "sparsity": 0.3})]
    [[{'sparsity': 0.3, 'init': 'topk'}]]
    >>> translate({"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 100, "stop": 1000}})[0]
    ... # doctest: +NORMALIZE_WHITESPACE
    {'name': 'sparsity', 'params': None, 'exclude': None,
     'phases': [{'sparsity': 0.9, 'algorithm': 'rigl', 'init': 'random', 'update_every': 100,
                 'update_stop': 900, 'drop_fraction': 0.3, 'drop_fraction_decay': 'constant'}]}
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_sparse.formats.cerebras_phases import (
    UPDATE_KEYS,
    Group,
    group_phases,
    static_phase,
)

ALGORITHMS = ("static", "gmp", "set", "rigl")
SIDEBAND_KEYS = frozenset(
    {"type", "sparsity", "init_method", "seed", "param_name_patterns"}
)
SIDEBAND_GROUP_KEYS = frozenset({"sparsity", "init_method", "seed"})
KEYS = frozenset(
    {
        "algorithm",
        "type",
        "sparsity",
        "schedule",
        "init_method",
        "seed",
        "update",
        "drop_fraction",
        "param_filter",
    }
)
V20_GROUP_KEYS = frozenset(
    {
        "sparsity",
        "sparsity_schedule",
        "schedule",
        "init_method",
        "seed",
        "drop_fraction",
    }
)
V20_KEYS = V20_GROUP_KEYS | {"type", "param_name_patterns"}
# keys of the current form and what the 2.0-2.1 form calls them
V20_NAMES = {
    "algorithm": "type",
    "update": "schedule",
    "param_filter": "param_name_patterns",
}
# Sibling keys of ``sparsity`` in a Model Zoo params file before release 2.4.
PARAMS_FILE_KEYS = frozenset(
    {"model", "optimizer", "train_input", "eval_input", "runconfig", "trainer"}
)

Config = Mapping[str, Any] | list[Any] | float | str | os.PathLike[str]


def load(config: Config) -> Any:
    """The sparsity block: read a YAML file if given a path, unwrap a params file."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(
                f"sparsity config {str(path)!r} is not a file: give a YAML path, or the "
                f"'sparsity' block itself as a dict"
            )
        config = yaml.safe_load(path.read_text())
    if isinstance(config, Mapping) and "trainer" in config:
        return _trainer_block(config)
    if (
        isinstance(config, Mapping)
        and "sparsity" in config
        and not set(config) & (KEYS | V20_KEYS | SIDEBAND_KEYS) - {"sparsity"}
        and (
            isinstance(config["sparsity"], (Mapping, list))
            or set(config) & PARAMS_FILE_KEYS
        )
    ):
        return config["sparsity"]
    return config


def _trainer_block(config: Mapping[str, Any]) -> Any:
    """``trainer.init.sparsity`` of a params file (release 2.4 and later)."""
    if "sparsity" in config:
        raise ValueError(
            "the params file has both a top-level 'sparsity' and a 'trainer': since release "
            "2.4 the block lives under trainer.init.sparsity, so remove the top-level one"
        )
    trainer = config["trainer"]
    if isinstance(trainer, list):
        if len(trainer) != 1:
            raise ValueError(
                f"the params file lists {len(trainer)} trainers, each a run of its own: "
                f"translate one, e.g. SparsityCallback.from_config(params['trainer'][0]) "
                f"with params = yaml.safe_load(open(path))"
            )
        trainer = trainer[0]
        if isinstance(trainer, Mapping) and set(trainer) == {"trainer"}:
            trainer = trainer["trainer"]
    init = trainer.get("init") if isinstance(trainer, Mapping) else None
    if not isinstance(init, Mapping):
        raise TypeError(
            "the params file's 'trainer' has no 'init' mapping; since release 2.4 the "
            "sparsity block lives under trainer.init.sparsity"
        )
    if init.get("sparsity") is None:
        raise ValueError(
            "the params file has no sparsity block (trainer.init.sparsity): nothing to "
            "translate"
        )
    return init["sparsity"]


def translate(config: Config, name: str = "sparsity") -> list[dict[str, Any]]:
    """Keyword arguments (``name``, ``phases``, ``params``, ``exclude``) of one
    :class:`~lightning_sparse.SparsityCallback` per group of a Cerebras sparsity config."""
    block = load(config)
    if isinstance(block, list):
        groups = [(group, f"sparsity[{i}]") for i, group in enumerate(block)]
    else:
        groups = [(block, "sparsity")]
    specs: list[dict[str, Any]] = []
    for group, where in groups:
        if isinstance(group, bool) or not isinstance(group, (int, float, Mapping)):
            raise TypeError(
                f"{where}={group!r}: a sparsity group is a mapping such as "
                f"{{'algorithm': 'rigl', 'sparsity': 0.9}}, or a number (static sparsity)"
            )
        if not isinstance(group, Mapping):
            group = {"sparsity": group}
        if group.get("type") == "sideband":
            specs += _sideband(group, where)
        elif _is_v20(group):
            specs += _v20(group, where)
        else:
            specs.append(_current(group, where))
    earlier: list[str] = []
    for i, spec in enumerate(specs):
        spec["name"] = name if len(specs) == 1 else f"{name}_{i}"
        spec["exclude"] = list(earlier) if earlier else None
        earlier += spec["params"] or []
    return [
        {k: spec[k] for k in ("name", "params", "exclude", "phases")} for spec in specs
    ]


def _is_v20(group: Mapping[str, Any]) -> bool:
    """Whether a group is in the 2.0-2.1 form (see the module docstring)."""
    if "param_name_patterns" in group or "sparsity_schedule" in group:
        return True
    schedule = group.get("schedule")
    update_shaped = isinstance(schedule, int) and not isinstance(schedule, bool)
    if isinstance(schedule, Mapping):
        update_shaped = bool(schedule) and set(schedule) <= UPDATE_KEYS | {"steps"}
    return "schedule" in group and ("sparsity" in group or update_shaped)


def _check_keys(
    group: Mapping[str, Any], allowed: frozenset[str], where: str, form: str
) -> None:
    unknown = sorted(map(str, set(group) - allowed))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown}; the {form} accepts {sorted(allowed)}"
        )


def _algorithm(value: Any, where: str, key: str) -> str:
    algorithm = value.lower() if isinstance(value, str) else value
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{where}: {key}={value!r} is not supported; use one of {list(ALGORITHMS)} "
            f"(or 'type: sideband' for the legacy form)"
        )
    return algorithm


def _regexes(patterns: Any, where: str) -> list[str]:
    """``re:`` patterns from a regex or a list of them, each checked to compile."""
    regexes = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(regexes, list) or not all(isinstance(r, str) for r in regexes):
        raise TypeError(
            f"{where}={patterns!r}: use a regex, a list of regexes, or a mapping from a regex "
            f"to its settings"
        )
    for regex in regexes:
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(f"{where}: {regex!r} is not a regex: {err}") from None
    return [f"re:{r}" for r in regexes]


def _sideband(group: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    _check_keys(group, SIDEBAND_KEYS, where, "sideband form")
    defaults = {k: group[k] for k in SIDEBAND_GROUP_KEYS if k in group}
    return [
        {
            "params": params,
            "phases": [static_phase(_static(settings, at), settings.get("sparsity"))],
        }
        for params, settings, at in _pattern_groups(
            group, defaults, SIDEBAND_GROUP_KEYS, where
        )
    ]


def _static(settings: Mapping[str, Any], where: str) -> Group:
    return Group(
        where,
        "static",
        settings.get("sparsity"),
        init_method=settings.get("init_method"),
        seed=settings.get("seed"),
        default_init="topk",
    )


def _pattern_groups(
    group: Mapping[str, Any],
    defaults: dict[str, Any],
    override_keys: frozenset[str],
    where: str,
) -> list[tuple[list[str] | None, dict[str, Any], str]]:
    """``(params, settings, where)`` per ``param_name_patterns`` entry: one for a regex or a
    list of them (or none given), one per regex of a mapping, its settings over the defaults."""
    patterns = group.get("param_name_patterns")
    key = f"{where}.param_name_patterns"
    if patterns is None or not isinstance(patterns, Mapping):
        params = None if patterns is None else _regexes(patterns, key)
        return [(params, defaults, where)]
    found = []
    for regex, override in patterns.items():
        at = f"{key}[{regex!r}]"
        override = override or {}
        if not isinstance(override, Mapping):
            raise TypeError(
                f"{at}={override!r}: give a mapping such as {{'sparsity': 0.5}}"
            )
        _check_keys(override, override_keys, at, "per-pattern setting")
        found.append((_regexes(regex, key), {**defaults, **override}, at))
    return found


def _v20(group: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """A group in the 2.0-2.1 form: ``schedule`` is its update schedule."""
    for key, old in V20_NAMES.items():
        if key in group:
            raise ValueError(
                f"{where}: '{key}' is a key of the current form, but this group is in the "
                f"2.0-2.1 form (it has 'param_name_patterns', 'sparsity_schedule', or "
                f"'schedule' as its update schedule), which calls it '{old}': rename it, or "
                f"write the whole group in the current form (algorithm, sparsity, update, "
                f"param_filter)"
            )
    _check_keys(group, V20_KEYS, where, "2.0-2.1 form")
    if "type" not in group:
        raise ValueError(
            f"{where}: the 2.0-2.1 form needs 'type' (one of {list(ALGORITHMS)})"
        )
    algorithm = _algorithm(group["type"], where, "type")
    defaults = {k: group[k] for k in V20_GROUP_KEYS if k in group}
    return [
        {"params": params, "phases": group_phases(_v20_group(algorithm, settings, at))}
        for params, settings, at in _pattern_groups(
            group, defaults, V20_GROUP_KEYS, where
        )
    ]


def _v20_group(algorithm: str, settings: Mapping[str, Any], where: str) -> Group:
    sparsity, update = settings.get("sparsity"), settings.get("schedule")
    sparsity_key = update_key = "sparsity_schedule"
    if "sparsity_schedule" in settings:
        for key in ("sparsity", "schedule"):
            if key in settings:
                raise ValueError(
                    f"{where}: 'sparsity_schedule' gives both the update steps and the "
                    f"sparsity at each; remove '{key}'"
                )
        pairs = settings["sparsity_schedule"]
        if (
            not isinstance(pairs, list)
            or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)
            or not pairs
        ):
            raise TypeError(
                f"{where}.sparsity_schedule={pairs!r}: give [step, sparsity] pairs such as "
                f"[[0, 0.1], [100, 0.3], [200, 0.5]]"
            )
        update, sparsity = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
        sparsity_key, update_key = "sparsity", "schedule"
    return Group(
        where,
        algorithm,
        sparsity,
        init_method=settings.get("init_method"),
        seed=settings.get("seed"),
        drop_fraction=settings.get("drop_fraction"),
        update=update,
        sparsity_key=sparsity_key,
        update_key=update_key,
    )


def _current(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A group in the current form (2.2 and later)."""
    _check_keys(group, KEYS, where, "current form")
    if "algorithm" in group and "type" in group:
        raise ValueError(f"{where}: give 'algorithm' or its old name 'type', not both")
    algorithm = _algorithm(
        group.get("algorithm", group.get("type", "static")),
        where,
        "algorithm" if "algorithm" in group else "type",
    )
    filters = group.get("param_filter")
    params = [filters] if isinstance(filters, str) else filters
    if params is not None and (
        not isinstance(params, list) or not all(isinstance(p, str) for p in params)
    ):
        raise TypeError(
            f"{where}.param_filter={filters!r}: use a glob or a list of globs such as "
            f"['*.mlp.*.weight']"
        )
    alias = "schedule" in group and "sparsity" not in group
    spec = Group(
        where,
        algorithm,
        group.get("schedule") if alias else group.get("sparsity"),
        init_method=group.get("init_method"),
        seed=group.get("seed"),
        drop_fraction=group.get("drop_fraction"),
        update=group.get("update"),
        params=None if params is None else list(params),
        sparsity_key="schedule" if alias else "sparsity",
    )
    return {"params": spec.params, "phases": group_phases(spec)}
