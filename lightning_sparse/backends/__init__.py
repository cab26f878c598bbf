"""Backends decide how a masked weight is executed; they never decide which weights to drop.

``"masked"``: dense math on a masked weight, any device. ``"semi_structured"``: 2:4 sparse tensor
cores. ``"auto"``: per layer, the best backend the hardware, dtype and shape allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sparse.masks import NM, Sparsity, describe

BACKEND_NAMES = ("auto", "masked", "semi_structured")


@dataclass(frozen=True)
class BackendChoice:
    """The backend one parameter runs on in one phase, and why."""

    name: str
    reason: str


def validate_backend(name: object) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend={name!r}; use one of {list(BACKEND_NAMES)}")
    if name == "semi_structured":
        raise ValueError(
            "backend='semi_structured' is not available in this version: the 2:4 sparse "
            "tensor-core backend has not landed yet; use backend='auto' or backend='masked', "
            "which compute the same function with masked dense math"
        )
    return name


def choose_backend(requested: str, target: Sparsity) -> BackendChoice:
    """The backend for one parameter in a sparse phase with ``target`` sparsity."""
    if requested == "masked":
        return BackendChoice("masked", "requested")
    if target != NM(2, 4):
        return BackendChoice("masked", f"{describe(target)} has no sparse kernel")
    return BackendChoice("masked", "2:4 kernel backend not available yet")
