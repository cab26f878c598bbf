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


def _exp(t: int, init: float, gamma: float, final: float) -> float:
    if final == init:
        return final
    try:
        return final - (final - init) * math.exp(gamma * t)
    except OverflowError:  # the value runs off to an infinity, as torch's exp would
        return -math.copysign(math.inf, final - init)


def _power(t: int, init: float, beta: float) -> float:
    try:
        return init * beta**t
    except OverflowError:  # |beta| > 1 and a large t: an infinity of the product's sign
        if init == 0:
            return 0.0
        return math.copysign(math.inf, init * (1.0 if beta > 0 or t % 2 == 0 else -1.0))


_FORMULAS: dict[str, tuple[tuple[str, ...], dict[str, float], Callable[..., float]]] = {
    # type: (required parameters, optional parameters with defaults, value(t, **parameters))
    "constant": (("value",), {}, lambda t, value: value),
    "linear": (("init", "slope"), {}, lambda t, init, slope: init + slope * t),
    "exp": (("init", "gamma"), {"final": 1.0}, _exp),
    "power": (("init", "beta"), {}, _power),
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

    def peak(self, first: int, every: int, count: int) -> tuple[float, int | None]:
        """``(value, step)``: the largest value among ``count`` mask choices at steps
        ``first + j * every`` (choice ``j``) and the first step that takes it, found without
        evaluating every choice: a ``cycling`` list takes its values in turn; ``constant``,
        ``linear``, ``exp`` and ``power`` are monotone along the choices (``power`` with a
        negative ``beta`` alternates in sign, hence two choices at either end); a ``cosine`` is
        bounded by its value at a crest (``step`` is then ``None``), which no choice exceeds."""
        params = dict(self.parameters)
        if self.kind == "cycling":
            values = params["values"][:count]
            j = max(range(len(values)), key=lambda i: (values[i], -i))
            return float(values[j]), first + j * every
        if self.kind == "cosine":
            crest = 0 if params["init"] >= params["minimum"] else params["half_period"]
            return self(crest), None  # type: ignore[arg-type]
        choices = sorted({0, 1, count - 2, count - 1} & set(range(count)))
        j = max(choices, key=lambda i: (self(first + i * every, i), -i))
        return self(first + j * every, j), first + j * every


def is_schedule(value: Any) -> bool:
    """Whether ``value`` has the shape of a schedule (a mapping or a list), not of a number or
    a name."""
    return isinstance(value, (Mapping, Sequence)) and not isinstance(value, str)


def parse_step_value(value: Any, where: str = "value") -> StepValue:
    """Parse a number, a list to cycle through, or a ``{"type": ..., ...}`` mapping; errors name
    ``where``, the bad key and the accepted ones."""
    if isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: use a number or a schedule mapping")
    if isinstance(value, (int, float)):
        _check_finite(value, where)
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
    if not isinstance(kind, str):
        raise TypeError(
            f"{where}: a schedule mapping needs a 'type' (one of {list(STEP_VALUE_TYPES)}), "
            f"not {kind!r}"
        )
    if kind == "cycling":
        unknown = sorted(map(str, set(spec) - {"values"}))
        if unknown or "values" not in spec:
            raise ValueError(
                f"{where}: a cycling schedule takes exactly the key 'values' (a list of numbers); "
                f"got keys {sorted(map(str, spec))}"
            )
        return _cycling(spec["values"], where)
    if kind not in _FORMULAS:
        raise ValueError(
            f"{where}: schedule type={kind!r} is unknown; use one of {list(STEP_VALUE_TYPES)}"
        )
    required, optional, _ = _FORMULAS[kind]
    unknown = sorted(map(str, set(spec) - set(required) - set(optional)))
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
        _check_finite(number, f"{where}.{key}")
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
    for i, number in enumerate(values):
        _check_finite(number, f"{where}[{i}]")
    return StepValue("cycling", (("values", tuple(float(v) for v in values)),))


def _check_finite(number: float, where: str) -> None:
    if not math.isfinite(number):
        raise ValueError(f"{where}={number!r} is not a finite number")
