"""``gmp``: gradual magnitude pruning (Zhu & Gupta, 2017) with a cubic, linear or cosine ramp,
or the sparsity given step by step as a schedule (the Cerebras form)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import Tensor

from lightning_sparse.algorithms.base import (
    UNKNOWN_RUN,
    MaskContext,
    RunLength,
    SparsityAlgorithm,
    register_algorithm,
)
from lightning_sparse.algorithms.step_values import StepValue, parse_step_value
from lightning_sparse.core.schedule import ResolvedPhase, parse_sparsity
from lightning_sparse.masks import Sparsity, num_kept, prune_smallest_
from lightning_sparse.masks.elementwise import count_true

RAMPS = {
    "cubic": lambda x: 1.0 - (1.0 - x) ** 3,
    "linear": lambda x: x,
    "cosine": lambda x: 0.5 * (1.0 - math.cos(math.pi * x)),
}


@register_algorithm("gmp")
class GradualMagnitudePruning(SparsityAlgorithm):
    """Hard mask whose sparsity ramps from ``initial_sparsity`` (default 0) to the phase target.

    The ramp runs from ``update_start`` (default: phase start) to ``update_stop`` (default: 75%
    of the way through the phase), pruning the smallest surviving weights every ``update_every``
    steps; pruned weights never come back. ``ramp`` is ``"cubic"`` (default), ``"linear"`` or
    ``"cosine"``, or a schedule that gives the sparsity at each optimizer step (a mapping such as
    ``{"type": "linear", "init": 0.0, "slope": 0.001}``, see
    :mod:`~lightning_sparse.algorithms.step_values`); the phase's ``sparsity`` then caps the
    schedule and holds from ``update_stop`` on.

    Example:
        >>> from lightning_sparse.core.schedule import Phase, resolve_phases
        >>> phase = resolve_phases([Phase(sparsity=0.8, algorithm="gmp", update_every=10)], 100)[0]
        >>> algo = GradualMagnitudePruning(phase)
        >>> [round(algo.target_at(s), 3) for s in (0, 10, 75, 99)]
        [0.0, 0.279, 0.8, 0.8]
    """

    layers_in_parallel = True
    updates_in_place = True
    dynamic = True
    supports_nm = False
    option_names = SparsityAlgorithm.option_names | {"ramp", "initial_sparsity"}
    default_update_stop_fraction = 0.75

    def __init__(self, phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN) -> None:
        super().__init__(phase, run)
        where = f"phases[{phase.index}]"
        spec = phase.spec
        self.ramp = spec.ramp or "cubic"
        self.schedule: StepValue | None = None
        if isinstance(self.ramp, (Mapping, Sequence)) and not isinstance(
            self.ramp, str
        ):
            self.schedule = parse_step_value(self.ramp, f"{where}.ramp")
            if spec.initial_sparsity is not None:
                raise ValueError(
                    f"{where}: initial_sparsity does nothing when ramp is a schedule (the "
                    f"schedule gives the sparsity at every step): remove it"
                )
        elif self.ramp not in RAMPS:
            raise ValueError(
                f"{where}: ramp={self.ramp!r}; use one of {sorted(RAMPS)} or a schedule "
                f"mapping such as {{'type': 'linear', 'init': 0.0, 'slope': 0.001}}"
            )
        initial = spec.initial_sparsity if spec.initial_sparsity is not None else 0.0
        self.initial = float(parse_sparsity(initial, f"{where}.initial_sparsity"))
        if self.schedule is None and self.initial >= float(phase.target):
            raise ValueError(
                f"{where}: initial_sparsity={self.initial} must be below the target "
                f"sparsity={phase.target} (gmp ramps up to it)"
            )
        if self.update_stop is None:
            raise ValueError(
                f"{where}: the phase has no known end, so gmp cannot place its ramp: set "
                f"update_stop (e.g. '5000 steps') or {run.advice}"
            )

    def target_at(self, step: int) -> Sparsity:
        final = float(self.phase.target)
        if self.schedule is not None:
            if step >= self.update_stop:
                return final
            return min(final, max(0.0, self.schedule(step, self.update_index(step))))
        start, stop = self.update_start, self.update_stop
        if step <= start or stop == start:
            return self.initial if step < stop else float(self.phase.target)
        progress = min(1.0, (step - start) / (stop - start))
        return self.initial + (float(self.phase.target) - self.initial) * RAMPS[
            self.ramp
        ](progress)

    def update_mask(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor:
        kept = num_kept(mask.numel(), float(target))
        active = count_true(mask)
        if (
            kept <= active
        ):  # pruning further: drop the smallest survivors (the usual case)
            survivors = mask.clone()
            prune_smallest_(weight, survivors, active - kept, active)
            return survivors
        # a schedule that goes down: pruned weights score -1, so they come back last
        return self.select(self.selection_score(weight, mask, ctx), target)

    def update_mask_(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor | None:
        kept = num_kept(mask.numel(), float(target))
        active = count_true(mask)
        if not self.updates_in_place or kept > active:
            return super().update_mask_(weight, mask, target, ctx)
        return prune_smallest_(weight, mask, active - kept, active)
