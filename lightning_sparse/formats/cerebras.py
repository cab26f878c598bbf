"""Cerebras-format sparsity configs, translated into :class:`~lightning_sparse.SparsityCallback`
arguments (use :meth:`SparsityCallback.from_config <lightning_sparse.SparsityCallback.from_config>`).

The input is the ``sparsity:`` block of a Cerebras Model Zoo config (a mapping, a list of groups
or a bare number), a mapping that holds it under ``sparsity`` (a whole params file), or the path
of a YAML file with either. Each group becomes one callback; a parameter belongs to the first
group whose patterns match it (later groups exclude the patterns of earlier ones).

Legacy form (static sparsity)::

    sparsity:
      type: sideband
      sparsity: 0.5
      init_method: topk          # or random or from_zeros; default topk
      seed: 1
      param_name_patterns: ".*mlp.*weight"   # a regex, a list of regexes, or a mapping
      # param_name_patterns: {".*attn.*weight": {sparsity: 0.3}, ".*mlp.*weight": {init_method: random}}

Newer form::

    sparsity:
      algorithm: rigl            # static | gmp | set | rigl (``type`` is accepted as an alias)
      sparsity: 0.9              # gmp: a schedule, e.g. {type: linear, init: 0.0, slope: 0.001}
      init_method: random        # or topk; default random, as in the Cerebras API
      update: {freq: 100, start: 0, stop: 10000}
      drop_fraction: {type: cosine, init: 0.3, half_period: 10000}   # set/rigl; default 0.3
      param_filter: ["*.mlp.*.weight"]                               # globs

Translation: ``freq``/``start``/``stop`` count optimizer steps; ``stop`` is exclusive, so the last
update is the last ``start + j * freq`` below it. ``start > 0`` trains dense until ``start`` and
chooses the first mask there (``init_method``). Without ``stop``, ``set``/``rigl`` update until
the end of the run; ``gmp`` needs ``stop`` (its last value is the phase's sparsity). A number as
``drop_fraction`` stays constant; schedules are evaluated at the absolute optimizer step (see
:mod:`lightning_sparse.algorithms.step_values`). Regexes (legacy) use ``re.search``; globs
(``param_filter``) may match a dotted suffix of the name, so patterns written for the bare model
also match inside a LightningModule. Without patterns the default selection applies.

Differences from Cerebras hardware: there, pruned weights are marked as NaN; here they are stored
as zeros (with masked gradients and optimizer state), so checkpoints hold zeros, not NaNs.
Unsupported keys (``update.steps``, ``balance_in_groups``, ``init_method: checkerboard``...)
are errors that name the key.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_sparse.algorithms.step_values import parse_step_value

ALGORITHMS = ("static", "gmp", "set", "rigl")
INIT_METHODS = ("random", "topk", "from_zeros")
LEGACY_KEYS = frozenset(
    {"type", "sparsity", "init_method", "seed", "param_name_patterns"}
)
LEGACY_GROUP_KEYS = frozenset({"sparsity", "init_method", "seed"})
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
UPDATE_KEYS = frozenset({"freq", "start", "stop"})
# Sibling keys of ``sparsity`` in a Model Zoo params file.
PARAMS_FILE_KEYS = frozenset(
    {"model", "optimizer", "train_input", "eval_input", "runconfig", "trainer"}
)

Config = Mapping[str, Any] | list[Any] | float | str | os.PathLike[str]


def load(config: Config) -> Any:
    """The ``sparsity`` block: read a YAML file if given a path, unwrap a params file."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(
                f"sparsity config {str(path)!r} is not a file: give a YAML path, or the "
                f"'sparsity' block itself as a dict"
            )
        config = yaml.safe_load(path.read_text())
    if (
        isinstance(config, Mapping)
        and "sparsity" in config
        and not set(config) & (KEYS | LEGACY_KEYS) - {"sparsity"}
        and (
            isinstance(config["sparsity"], (Mapping, list))
            or set(config) & PARAMS_FILE_KEYS
        )
    ):
        return config["sparsity"]
    return config


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
            specs += _legacy(group, where)
        else:
            specs.append(_algorithmic(group, where))
    earlier: list[str] = []
    for i, spec in enumerate(specs):
        spec["name"] = name if len(specs) == 1 else f"{name}_{i}"
        spec["exclude"] = list(earlier) if earlier else None
        earlier += spec["params"] or []
    return [
        {k: spec[k] for k in ("name", "params", "exclude", "phases")} for spec in specs
    ]


def _check_keys(group: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(group) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown}; this form accepts {sorted(allowed)}"
        )


def _init(value: Any, default: str, where: str) -> str:
    value = default if value is None else value
    if value not in INIT_METHODS:
        raise ValueError(
            f"{where}.init_method={value!r} is not supported; use one of {list(INIT_METHODS)}"
        )
    return str(value)


def _phase(
    settings: Mapping[str, Any], sparsity: Any, default_init: str, where: str
) -> dict[str, Any]:
    """A phase with a float ``sparsity`` and the settings' ``init_method`` and ``seed``."""
    if sparsity is None:
        raise ValueError(f"{where}: give a 'sparsity' (a float in [0, 1), e.g. 0.5)")
    if isinstance(sparsity, (Mapping, list)):
        raise TypeError(
            f"{where}: a sparsity schedule ({sparsity!r}) needs algorithm 'gmp'; this "
            f"algorithm takes a float sparsity in [0, 1)"
        )
    phase = {
        "sparsity": sparsity,
        "init": _init(settings.get("init_method"), default_init, where),
    }
    if settings.get("seed") is not None:
        phase["seed"] = settings["seed"]
    return phase


def _legacy(group: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    _check_keys(group, LEGACY_KEYS, where)
    defaults = {k: group[k] for k in LEGACY_GROUP_KEYS if k in group}
    patterns = group.get("param_name_patterns")
    if patterns is None or isinstance(patterns, (str, list)):
        regexes = [patterns] if isinstance(patterns, str) else patterns
        params = None if regexes is None else [f"re:{r}" for r in regexes]
        phase = _phase(defaults, defaults.get("sparsity"), "topk", where)
        return [{"params": params, "phases": [phase]}]
    if not isinstance(patterns, Mapping):
        raise TypeError(
            f"{where}.param_name_patterns={patterns!r}: use a regex, a list of regexes, or a "
            f"mapping from a regex to its settings"
        )
    specs = []
    for regex, override in patterns.items():
        at = f"{where}.param_name_patterns[{regex!r}]"
        override = override or {}
        if not isinstance(override, Mapping):
            raise TypeError(
                f"{at}={override!r}: give a mapping such as {{'sparsity': 0.5}}"
            )
        _check_keys(override, LEGACY_GROUP_KEYS, at)
        settings = {**defaults, **override}
        phase = _phase(settings, settings.get("sparsity"), "topk", at)
        specs.append({"params": [f"re:{regex}"], "phases": [phase]})
    return specs


def _algorithmic(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    _check_keys(group, KEYS, where)
    if "algorithm" in group and "type" in group:
        raise ValueError(f"{where}: give 'algorithm' or its old name 'type', not both")
    algorithm = str(group.get("algorithm", group.get("type", "static"))).lower()
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{where}: algorithm={algorithm!r} is not supported; use one of {list(ALGORITHMS)} "
            f"(or 'type: sideband' for the legacy form)"
        )
    if "sparsity" in group and "schedule" in group:
        raise ValueError(f"{where}: give 'sparsity' or its alias 'schedule', not both")
    sparsity = group.get("sparsity", group.get("schedule"))
    filters = group.get("param_filter")
    params = [filters] if isinstance(filters, str) else filters
    spec: dict[str, Any] = {"params": None if params is None else list(params)}
    if algorithm == "static":
        for key in ("update", "drop_fraction"):
            if key in group:
                raise ValueError(
                    f"{where}: '{key}' does nothing for algorithm 'static'"
                )
        spec["phases"] = [_phase(group, sparsity, "random", where)]
        return spec
    if algorithm == "gmp" and "drop_fraction" in group:
        raise ValueError(f"{where}: 'drop_fraction' does nothing for algorithm 'gmp'")
    freq, start, last = _update(
        group.get("update"), where, needs_stop=algorithm == "gmp"
    )
    if algorithm == "gmp":
        final, ramp = _gmp_sparsity(sparsity, freq, start, last, where)
        phase = _phase(group, final, "random", where)
        phase["ramp"] = ramp
    else:
        phase = _phase(group, sparsity, "random", where)
    phase = {
        "sparsity": phase.pop("sparsity"),
        "algorithm": algorithm,
        **phase,
        "update_every": freq,
    }
    if start:
        phase["update_start"] = start
    phase["update_stop"] = 1.0 if last is None else last
    if algorithm != "gmp":
        drop = group.get("drop_fraction", 0.3)
        if isinstance(drop, (Mapping, list)):
            phase["drop_fraction"] = drop
        else:
            phase.update(drop_fraction=drop, drop_fraction_decay="constant")
    spec["phases"] = [{"sparsity": 0.0, "until": start}, phase] if start else [phase]
    return spec


def _update(update: Any, where: str, needs_stop: bool) -> tuple[int, int, int | None]:
    """(freq, start, last update step or None) from an ``update`` mapping."""
    update = {} if update is None else update
    if not isinstance(update, Mapping):
        raise TypeError(
            f"{where}.update={update!r}: use a mapping such as {{'freq': 100}}"
        )
    if "steps" in update:
        raise ValueError(
            f"{where}.update.steps: a list of update steps is not supported; use "
            f"{{freq, start, stop}}"
        )
    _check_keys(update, UPDATE_KEYS, f"{where}.update")
    values = {"freq": update.get("freq", 1), "start": update.get("start", 0)}
    for key, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < int(key == "freq")
        ):
            raise ValueError(
                f"{where}.update.{key}={value!r}: use a whole number of steps"
            )
    freq, start = values["freq"], values["start"]
    stop = update.get("stop")
    if stop is None:
        if needs_stop:
            raise ValueError(
                f"{where}: algorithm 'gmp' needs update.stop (the step its sparsity schedule "
                f"ends at, exclusive) so that the final sparsity is known"
            )
        return freq, start, None
    if isinstance(stop, bool) or not isinstance(stop, int):
        raise TypeError(f"{where}.update.stop={stop!r}: use a whole number of steps")
    last = start + (stop - 1 - start) // freq * freq
    if last <= start:
        raise ValueError(
            f"{where}: update.stop={stop} leaves no update after update.start={start} with "
            f"freq={freq}; move stop later, or use algorithm 'static'"
        )
    return freq, start, last


def _gmp_sparsity(
    sparsity: Any, freq: int, start: int, last: int | None, where: str
) -> tuple[float, Any]:
    """The final sparsity (at the last update) and the schedule, for a gmp phase."""
    if sparsity is None or isinstance(sparsity, (int, float)):
        raise ValueError(
            f"{where}: algorithm 'gmp' needs a sparsity schedule such as "
            f"{{'type': 'linear', 'init': 0.0, 'slope': 0.001}}, not {sparsity!r}; for a "
            f"constant sparsity use algorithm 'static'"
        )
    assert last is not None
    schedule = parse_step_value(sparsity, f"{where}.sparsity")
    final = min(1.0, max(0.0, schedule(last, (last - start) // freq)))
    if not 0.0 < final < 1.0:
        raise ValueError(
            f"{where}.sparsity: the schedule gives sparsity {final:g} at the last update (step "
            f"{last}); it must end in (0, 1)"
        )
    return final, sparsity
