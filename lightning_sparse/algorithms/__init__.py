"""Mask algorithms and their registry. Importing this package registers the built-in ones."""

from collections.abc import Sequence

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
from lightning_sparse.algorithms.learned import Learned
from lightning_sparse.algorithms.magnitude import Magnitude
from lightning_sparse.algorithms.runtime import Runtime
from lightning_sparse.algorithms.static import Static
from lightning_sparse.core.schedule import Phase, ResolvedPhase


def build_algorithm(
    phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN
) -> SparsityAlgorithm:
    """Instantiate the algorithm a (sparse) phase names, validating its options."""
    cls = algorithm_class(phase.spec.algorithm, f"phases[{phase.index}].algorithm")
    return cls(phase, run)


def check_phases(phases: Sequence[Phase]) -> None:
    """Check every sparse phase's algorithm name and options (types, ranges, which options
    apply) without the run length, as :class:`~lightning_sparse.SparsityCallback` does when it
    is built; errors name the phase and the option."""
    for i, phase in enumerate(phases):
        if not phase.is_dense:
            where = f"phases[{i}]"
            algorithm_class(phase.algorithm, f"{where}.algorithm").validate(
                phase, where
            )
            if i and hands_over(phases[i - 1], phase) and phase.init is not None:
                raise ValueError(
                    f"{where}: init={phase.init!r} does nothing: the phase starts from the "
                    f"{phase.target} masks phases[{i - 1}] learned (algorithm "
                    f"{phases[i - 1].algorithm!r}); remove init, or give the phases different "
                    f"sparsities"
                )


def hands_over(before: Phase, after: Phase) -> bool:
    """Whether phase ``after``, following ``before``, starts from the masks ``before``
    learned: ``before`` is learned (:attr:`SparsityAlgorithm.learns`) and both keep the same
    N:M pattern. A ``static`` phase then keeps those masks fixed, ``magnitude``, ``set`` and
    ``rigl`` update them by their own rules, and ``runtime`` re-derives its masks at every
    forward as always; a dense phase drops them.

    >>> hands_over(Phase(sparsity="2:4", algorithm="learned"), Phase(sparsity="2:4", algorithm="static"))
    True
    """
    if before.is_dense or after.is_dense or before.target != after.target:
        return False
    return algorithm_class(str(before.algorithm)).learns


__all__ = [
    "SET",
    "DropAndGrow",
    "GradualMagnitudePruning",
    "Learned",
    "Magnitude",
    "MaskContext",
    "RigL",
    "RunLength",
    "Runtime",
    "SparsityAlgorithm",
    "Static",
    "algorithm_class",
    "build_algorithm",
    "check_phases",
    "hands_over",
    "register_algorithm",
    "registered_algorithms",
]
