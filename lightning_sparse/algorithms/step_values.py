"""Values that change with the optimizer step, in the form the Cerebras sparsity API uses.

A step value is a number (constant), a list (cycled through: the ``j``-th mask choice of a phase
uses ``values[j % len(values)]``), or a mapping with a ``type`` and that type's parameters,
evaluated at the absolute optimizer step ``t`` (``trainer.global_step``):

=========  ==========================================  =================================
type       value at step ``t``                         parameters
=========  ==========================================  =================================
constant   ``value``                                   ``value``
linear     ``init + slope * t``                        ``init``, ``slope``
exp        ``final - (final - init) * exp(gamma * t)``  ``init``, ``gamma``, ``final`` (1)
power      ``init * beta ** t``                        ``init``, ``beta``
cosine     ``o + a * cos(pi * t / half_period)``       ``init``, ``half_period``,
           with ``o = (init + minimum) / 2``,          ``minimum`` (0)
           ``a = init - o``
cycling    ``values[j % len(values)]``                 ``values``
=========  ==========================================  =================================

Example:
    >>> drop = parse_step_value({"type": "cosine", "init": 0.3, "half_period": 1000})
    >>> [round(drop(t), 3) for t in (0, 500, 1000)]
    [0.3, 0.15, 0.0]
    >>> parse_step_value([0.1, 0.2])(123, choice=3)
    0.2
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_FORMULAS: dict[str, tuple[tuple[str, ...], dict[str, float], Callable[..., float]]] = {
    # type: (required parameters, optional parameters with defaults, value(t, **parameters))
    "constant": (("value",), {}, lambda t, value: value),
    "linear": (("init", "slope"), {}, lambda t, init, slope: init + slope * t),
    "exp": (
        ("init", "gamma"),
        {"final": 1.0},
        lambda t, init, gamma, final: final - (final - init) * math.exp(gamma * t),
    ),
    "power": (("init", "beta"), {}, lambda t, init, beta: init * beta**t),
    "cosine": (
        ("init", "half_period"),
        {"minimum": 0.0},
        lambda t, init, half_period, minimum: (
            (init + minimum) / 2
            + (init - (init + minimum) / 2) * math.cos(math.pi * t / half_period)
        ),
    ),
}
STEP_VALUE_TYPES = (*sorted(_FORMULAS), "cycling")


@dataclass(frozen=True)
class StepValue:
    """A value of the optimizer step (and of the mask-choice index, for ``cycling``)."""

    kind: str
    parameters: tuple[tuple[str, Any], ...]

    def __call__(self, step: int, choice: int = 0) -> float:
        """The value at optimizer ``step``; ``choice`` is the index of the mask choice in the
        phase (0 at the phase start, ``j`` at its ``j``-th update), used by ``cycling``."""
        params = dict(self.parameters)
        if self.kind == "cycling":
            values = params["values"]
            return float(values[choice % len(values)])
        return float(_FORMULAS[self.kind][2](step, **params))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.parameters)
        return f"{self.kind}({args})"


def parse_step_value(value: Any, where: str = "value") -> StepValue:
    """Parse a number, a list to cycle through, or a ``{"type": ..., ...}`` mapping; errors name
    ``where``, the bad key and the accepted ones."""
    if isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: use a number or a schedule mapping")
    if isinstance(value, (int, float)):
        return StepValue("constant", (("value", float(value)),))
    if isinstance(value, Sequence) and not isinstance(value, str):
        return _cycling(list(value), where)
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}={value!r}: use a number, a list of numbers to cycle through, or a mapping "
            f"such as {{'type': 'cosine', 'init': 0.3, 'half_period': 1000}}"
        )
    spec = dict(value)
    kind = spec.pop("type", None)
    if kind == "cycling":
        unknown = sorted(set(spec) - {"values"})
        if unknown or "values" not in spec:
            raise ValueError(
                f"{where}: a cycling schedule takes exactly the key 'values' (a list of numbers); "
                f"got keys {sorted(spec)}"
            )
        return _cycling(spec["values"], where)
    if kind not in _FORMULAS:
        raise ValueError(
            f"{where}: schedule type={kind!r} is unknown; use one of {list(STEP_VALUE_TYPES)}"
        )
    required, optional, _ = _FORMULAS[kind]
    unknown = sorted(set(spec) - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown} for a {kind!r} schedule; it takes "
            f"{list(required)} and optionally {sorted(optional)}"
        )
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValueError(
            f"{where}: a {kind!r} schedule needs {list(required)}; missing {missing}"
        )
    params = {**optional, **spec}
    for key, number in params.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(f"{where}.{key}={number!r}: use a number")
    if kind == "cosine" and params["half_period"] <= 0:
        raise ValueError(
            f"{where}.half_period={params['half_period']!r}: use a positive number of steps"
        )
    return StepValue(kind, tuple((k, float(params[k])) for k in sorted(params)))


def _cycling(values: Any, where: str) -> StepValue:
    if (
        not isinstance(values, Sequence)
        or isinstance(values, str)
        or not values
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values)
    ):
        raise TypeError(
            f"{where}: cycle through a non-empty list of numbers, not {values!r}"
        )
    return StepValue("cycling", (("values", tuple(float(v) for v in values)),))
