"""Eager argument checks whose messages name the argument, the bad value and the fix."""

from __future__ import annotations

import math
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an int >= 1, else raise a ValueError naming ``name``."""
    if not _is_int(value) or value < 1:
        raise ValueError(
            f"{name}={value!r} is invalid: it must be a positive integer (e.g. {name}=32)"
        )
    return value


def check_non_negative_int(name: str, value: Any) -> int:
    """Return ``value`` if it is an int >= 0, else raise a ValueError naming ``name``."""
    if not _is_int(value) or value < 0:
        raise ValueError(
            f"{name}={value!r} is invalid: it must be an integer >= 0 (e.g. {name}=0)"
        )
    return value


def check_positive_float(name: str, value: Any) -> float:
    """Return ``float(value)`` if it is a finite number > 0, else raise a ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0")
    return float(value)


def check_non_negative_float(name: str, value: Any) -> float:
    """Return ``float(value)`` if it is a finite number >= 0, else raise a ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"{name}={value!r} is invalid: it must be a finite number >= 0"
        )
    return float(value)


def check_fraction(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` if it lies in (0, 1) (or [0, 1) with ``allow_zero``), else raise."""
    low_ok = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (low_ok(value) and value < 1)
    ):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(
            f"{name}={value!r} is invalid: it must be a fraction in {interval} (e.g. {name}=0.1)"
        )
    return float(value)


def check_range(name: str, value: Any) -> tuple[float, float]:
    """Return a ``(low, high)`` pair with ``0 < low <= high <= 1`` (e.g. crop scales), else raise."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}={value!r} is invalid: it must be a pair [low, high], e.g. {name}=[0.4, 1.0]"
        ) from None
    if not 0 < low <= high <= 1:
        raise ValueError(
            f"{name}={value!r} is invalid: it needs 0 < low <= high <= 1, e.g. {name}=[0.4, 1.0]"
        )
    return low, high


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ValueError listing them."""
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is invalid: choose one of {', '.join(map(repr, choices))}"
        )
    return value


def resolve_steps(name: str, value: float, total_steps: int) -> int:
    """Turn ``value`` into a number of optimizer steps: a number in [0, 1) is a fraction of
    ``total_steps``; a whole number >= 1 (``500`` or ``500.0``, as YAML may give it) is a count.

    >>> resolve_steps("warmup_steps", 0.1, 500), resolve_steps("warmup_steps", 20, 500)
    (50, 20)
    """
    valid = isinstance(value, (int, float)) and not isinstance(value, bool)
    if valid and 0 <= value < 1:
        return int(value * total_steps)
    if valid and value >= 1 and float(value).is_integer():
        return int(value)
    raise ValueError(
        f"{name}={value!r} is invalid: pass a fraction of the run in [0, 1) (e.g. {name}=0.1) "
        f"or a whole number of optimizer steps (e.g. {name}=100)"
    )
