"""Mask algorithms and their registry. Importing this package registers the built-in ones."""

from lightning_sparse.algorithms.base import (
    UNKNOWN_RUN,
    MaskContext,
    RunLength,
    SparsityAlgorithm,
    algorithm_class,
    register_algorithm,
    registered_algorithms,
)
from lightning_sparse.algorithms.drop_grow import SET, DropAndGrow, RigL
from lightning_sparse.algorithms.gmp import GradualMagnitudePruning
from lightning_sparse.algorithms.magnitude import Magnitude
from lightning_sparse.algorithms.runtime import Runtime
from lightning_sparse.algorithms.static import Static
from lightning_sparse.core.schedule import ResolvedPhase


def build_algorithm(
    phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN
) -> SparsityAlgorithm:
    """Instantiate the algorithm a (sparse) phase names, validating its options."""
    cls = algorithm_class(phase.spec.algorithm, f"phases[{phase.index}].algorithm")
    return cls(phase, run)


__all__ = [
    "SET",
    "DropAndGrow",
    "GradualMagnitudePruning",
    "Magnitude",
    "MaskContext",
    "RigL",
    "RunLength",
    "Runtime",
    "SparsityAlgorithm",
    "Static",
    "algorithm_class",
    "build_algorithm",
    "register_algorithm",
    "registered_algorithms",
]
