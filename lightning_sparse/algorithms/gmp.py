"""``gmp``: gradual magnitude pruning (Zhu & Gupta, 2017) with a cubic, linear or cosine ramp,
or the sparsity given step by step as a schedule (the Cerebras form), which may also go down."""

from __future__ import annotations

import math

from torch import Tensor

from lightning_sparse.algorithms.base import (
    UNKNOWN_RUN,
    MaskContext,
    RunLength,
    SparsityAlgorithm,
    register_algorithm,
)
from lightning_sparse.algorithms.regrowth import AtRandom, ByScore, Regrowth
from lightning_sparse.algorithms.step_values import (
    StepValue,
    is_schedule,
    parse_step_value,
)
from lightning_sparse.core.schedule import Phase, ResolvedPhase, parse_sparsity
from lightning_sparse.masks import NM, Sparsity, num_kept, prune_smallest_
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
    steps. ``ramp`` is ``"cubic"`` (default), ``"linear"`` or ``"cosine"``, or a schedule that
    gives the sparsity of every mask choice (a mapping such as
    ``{"type": "linear", "init": 0.0, "slope": 0.001}`` or a list to cycle through, see
    :mod:`~lightning_sparse.algorithms.step_values`): the phase start and each update use the
    schedule's value there, clamped to ``[0, sparsity]`` (the phase's ``sparsity`` is its
    ceiling), and from ``update_stop`` on the value chosen at ``update_stop`` holds.

    A schedule may go down (a list that cycles, ``cycling``, ``cosine``, a ``linear`` with a
    negative slope). An update that lowers the sparsity regrows pruned weights: they restart at
    zero with zeroed optimizer state, and the survivors all stay. The regrown entries are those
    with the largest dense gradient magnitude (ties: the lower flat index), the gradient the
    update step sees (accumulated, all-reduced, unscaled), so every rank and every resumed run
    regrows the same ones; a parameter without a gradient at that step regrows uniformly at
    random from the phase's ``seed``, its name and the step.

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

    @classmethod
    def validate(cls, spec: Phase, where: str) -> None:
        super().validate(spec, where)
        ramp = spec.ramp or "cubic"
        if is_schedule(ramp):
            parse_step_value(ramp, f"{where}.ramp")
            if spec.initial_sparsity is not None:
                raise ValueError(
                    f"{where}: initial_sparsity does nothing when ramp is a schedule (the "
                    f"schedule gives the sparsity at every step): remove it"
                )
            return
        if not isinstance(ramp, str) or ramp not in RAMPS:
            raise ValueError(
                f"{where}: ramp={ramp!r}; use one of {sorted(RAMPS)} or a schedule "
                f"mapping such as {{'type': 'linear', 'init': 0.0, 'slope': 0.001}}"
            )
        initial = _initial(spec, where)
        if initial >= float(spec.target):
            raise ValueError(
                f"{where}: initial_sparsity={initial} must be below the target "
                f"sparsity={spec.target} (gmp ramps up to it)"
            )

    def __init__(self, phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN) -> None:
        super().__init__(phase, run)
        where = f"phases[{phase.index}]"
        spec = phase.spec
        self.ramp = spec.ramp or "cubic"
        self.schedule: StepValue | None = None
        if is_schedule(self.ramp):
            self.schedule = parse_step_value(self.ramp, f"{where}.ramp")
        self.initial = _initial(spec, where)
        if self.update_stop is None:
            raise ValueError(
                f"{where}: the phase has no known end, so gmp cannot place its ramp: set "
                f"update_stop (e.g. '5000 steps') or {run.advice}"
            )

    def target_at(self, step: int) -> Sparsity:
        final = float(self.phase.target)
        if self.schedule is not None:
            step = min(step, self.update_stop)  # the last update's choice holds
            return min(final, max(0.0, self.schedule(step, self.update_index(step))))
        start, stop = self.update_start, self.update_stop
        if step <= start or stop == start:
            return self.initial if step < stop else float(self.phase.target)
        progress = min(1.0, (step - start) / (stop - start))
        return self.initial + (float(self.phase.target) - self.initial) * RAMPS[
            self.ramp
        ](progress)

    def schedule_warning(self) -> str | None:
        """A ramp of a built-in shape that does not fit the phase: it ends after the phase
        (never reaching the target), or its largest single update prunes more than half of it
        (too few updates: the ramp is a jump)."""
        steps = self.update_steps()
        if self.schedule is not None or steps is None:
            return None  # a schedule gives every value itself
        target = float(self.phase.target)
        ramp = f"its ramp from {self.initial:.0%} to {target:.0%}"
        reached = float(self.target_at(max([self.phase.start, *steps])))
        if not math.isclose(reached, target):
            return (
                f"{ramp} reaches only {reached:.0%} before the phase ends "
                f"({self._update_window()}): end the ramp inside the phase (update_stop)"
            )
        half = (target - self.initial) / 2
        jump, at = self._largest_jump(steps)
        if jump <= half:
            return None
        count = f"{len(steps)} mask update{'s' if len(steps) != 1 else ''}"
        return (
            f"{ramp} has {count} ({self._update_window()}), so the update at step {at} "
            f"prunes {jump:.0%} of the weights at once: "
            + self._update_every_fix(lambda steps: self._largest_jump(steps)[0] <= half)
        )

    def _largest_jump(self, steps: list[int]) -> tuple[float, int]:
        """The largest rise of the target from one mask choice to the next (the phase start,
        then ``steps``), and the step it happens at."""
        choices = [self.phase.start, *steps]
        values = [self.initial] + [float(self.target_at(s)) for s in choices]
        return max((b - a, step) for a, b, step in zip(values, values[1:], choices))

    def regrowth(self, ctx: MaskContext) -> Regrowth:
        """Where an update that lowers the sparsity regrows (see the class docstring)."""
        if ctx.grad is None:
            return AtRandom(self.seed, ctx.name, ctx.step)
        return ByScore(ctx.grad, magnitude=True)

    def update_mask(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor:
        new = mask.clone()
        self.update_mask_(weight, new, target, ctx)
        return new

    def update_mask_(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor | None:
        if not self.updates_in_place:
            return super().update_mask_(weight, mask, target, ctx)
        kept = num_kept(mask.numel(), float(target))
        active = count_true(mask)
        if (
            kept <= active
        ):  # pruning further: drop the smallest survivors (the usual case)
            return prune_smallest_(weight, mask, active - kept, active)
        grown = self.regrowth(ctx).pick(mask, kept - active)
        mask |= grown
        return grown


def _initial(spec: Phase, where: str) -> float:
    """The phase's ``initial_sparsity`` as a float (default 0)."""
    value = 0.0 if spec.initial_sparsity is None else spec.initial_sparsity
    initial = parse_sparsity(value, f"{where}.initial_sparsity")
    if isinstance(initial, NM):
        raise TypeError(
            f"{where}.initial_sparsity={value!r}: gmp ramps a fraction of weights, so use a "
            f"float in [0, 1) such as 0.2"
        )
    return initial
