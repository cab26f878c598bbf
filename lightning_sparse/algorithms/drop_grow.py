"""``set`` and ``rigl``: dynamic sparse training that drops and regrows connections.

At every update, a :class:`DropAndGrow` algorithm drops the ``drop_fraction`` of each layer's
active weights with the smallest magnitude and regrows as many where :meth:`~DropAndGrow.grow_score`
is largest among the weights that are not active after the drop: ``set`` (Mocanu et al., 2018)
uniformly at random, ``rigl`` (Evci et al., 2020) where the dense gradient's magnitude is
largest. Equal magnitudes (or scores) are broken by position: the lower flat index is dropped,
or regrown, first. Each layer keeps its number of active weights (the phase's ``distribution``
sets the numbers at the phase start), so the target holds exactly after every update. In an
``"N:M"`` phase the drop picks the smallest active weights of the whole layer and every group of
M regrows as many as it lost, inside the group, so exactly N stay in every group and the masks
keep running on N:M kernels. The regrowth follows the algorithm's ``select``, so a ``"2:4"``
weight with both dimensions multiples of 4 stays transposable (2 per row and per column of every
4x4 tile: each tile regrows, among the patterns that keep its survivors, the one with the
highest total grow score, or under ``set`` one drawn uniformly; see
:mod:`~lightning_sparse.masks.refill`).

Semantics of an update step (the sparsifier runs it before the optimizer step):

1. the update sees the dense gradient: accumulated over micro-batches, all-reduced, unscaled,
   not yet masked;
2. weights are multiplied by the new mask and the optimizer state is zeroed wherever the mask
   changed, so regrown weights start at zero with zeroed state (a weight dropped and regrown in
   the same update keeps its value, as if never dropped);
3. the gradients are masked with the new mask, so the optimizer step that follows trains the
   regrown weights from zero with the gradient that chose them and leaves dropped ones at zero.

``drop_fraction`` (default 0.3) decays to zero at ``update_stop`` (default: 75% of the phase) as
``drop_fraction_decay`` says: ``"cosine"`` (default, as in RigL), ``"linear"`` or ``"constant"``;
the decay runs from ``update_start`` to ``update_stop``. ``drop_fraction`` may instead be a
schedule of the optimizer step (:mod:`~lightning_sparse.algorithms.step_values`).

Example:
    >>> import torch
    >>> from lightning_sparse.masks import NM
    >>> mask = torch.tensor([[True, True, False, False]])
    >>> weight = torch.tensor([[0.9, -0.1, 0.0, 0.0]])
    >>> grow = torch.tensor([[0.0, 0.0, 0.2, 0.7]])
    >>> drop_and_grow(weight, grow, mask, n_drop=1, target=NM(2, 4)).tolist()
    [[True, False, False, True]]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from lightning_sparse.algorithms.base import (
    UNKNOWN_RUN,
    MaskContext,
    RunLength,
    SparsityAlgorithm,
    register_algorithm,
)
from lightning_sparse.algorithms.regrowth import AtRandom, ByScore, Regrowth, Select
from lightning_sparse.algorithms.step_values import (
    StepValue,
    is_schedule,
    parse_step_value,
)
from lightning_sparse.core.schedule import Phase, ResolvedPhase
from lightning_sparse.masks import (
    NM,
    Sparsity,
    num_kept,
    prune_smallest_,
    smallest_kept,
    sparsity_fraction,
)
from lightning_sparse.masks.elementwise import count_true, scratch_mask

DECAYS = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "constant": lambda progress: 1.0,
}


@torch.no_grad()
def drop_and_grow(
    weight: Tensor,
    grow_score: Tensor,
    mask: Tensor,
    n_drop: int,
    target: Sparsity,
    layout: str | None = "groups",
    select: Select | None = None,
) -> Tensor:
    """Drop the ``n_drop`` active entries of ``mask`` with the smallest ``|weight|`` and regrow
    the highest-``grow_score`` entries that are not active after the drop, so that ``target``
    holds exactly (ties: the lower flat index is dropped, or regrown, first). N:M: every group
    regrows as many as it lost, in the ``layout`` of
    :meth:`~lightning_sparse.algorithms.SparsityAlgorithm.nm_layout` (``"tiles"``: a
    transposable 2:4 mask stays transposable; ``None``: through a custom ``select``).
    ``mask`` is not modified."""
    new = mask.clone()
    drop_and_grow_(weight, new, n_drop, target, ByScore(grow_score), layout, select)
    return new


@torch.no_grad()
def drop_and_grow_(
    weight: Tensor,
    mask: Tensor,
    n_drop: int,
    target: Sparsity,
    regrowth: Regrowth,
    layout: str | None = "groups",
    select: Select | None = None,
    n_active: int | None = None,
) -> Tensor:
    """:func:`drop_and_grow` in place, with the regrowth rule given: edits ``mask`` and
    returns a bool tensor of the entries that changed (dropped and not regrown, or regrown and
    not dropped; a reused buffer, valid until the next call). ``n_active``: how many entries
    ``mask`` has set, if known (else counted)."""
    if n_active is None:
        n_active = count_true(mask)
    if isinstance(target, NM):
        # drop and refill in place: the dropped entries become the changed ones
        changed = smallest_kept(weight, mask, n_drop, n_active)  # slot 0
        regrowth.refill_(mask, changed, target, layout, select)
        return changed
    kept = num_kept(mask.numel(), float(target))
    n_survivors = max(0, min(n_active, kept) - n_drop)
    changed = prune_smallest_(weight, mask, n_active - n_survivors, n_active)  # slot 0
    out = scratch_mask(mask.numel(), mask.device, slot=1)
    grown = regrowth.pick(mask, kept - n_survivors, out=out).view(mask.shape)
    mask |= grown
    changed ^= grown  # a dropped entry that regrows is unchanged
    return changed


class DropAndGrow(SparsityAlgorithm):
    """Base class of dynamic sparse training by drop and regrowth (``set``, ``rigl``).

    A subclass implements :meth:`grow_score` (with ``grow_by_magnitude = True``, the entries
    of largest ``|grow_score|`` regrow; ``regrows_at_random = True`` regrows uniformly at
    random instead, as ``set`` does); everything else (drop by magnitude, exact counts, N:M
    groups, the ``drop_fraction`` schedule, distributions) comes from here.

    Example:
        >>> from lightning_sparse import register_algorithm
        >>> @register_algorithm("grow_where_gradient_is_negative")
        ... class GrowWhereGradientIsNegative(DropAndGrow):
        ...     needs_grad = True
        ...     def grow_score(self, weight, mask, ctx):
        ...         return None if ctx.grad is None else -ctx.grad
    """

    dynamic = True
    option_names = SparsityAlgorithm.option_names | {
        "drop_fraction",
        "drop_fraction_decay",
    }
    default_update_stop_fraction = 0.75
    default_drop_fraction: ClassVar[float] = 0.3
    grow_by_magnitude: ClassVar[bool] = False
    regrows_at_random: ClassVar[bool] = False
    updates_in_place = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "grow_score" in vars(cls) and "regrows_at_random" not in vars(cls):
            cls.regrows_at_random = (
                False  # a subclass with its own scores regrows by them
            )

    @classmethod
    def validate(cls, spec: Phase, where: str) -> None:
        super().validate(spec, where)
        value = (
            cls.default_drop_fraction
            if spec.drop_fraction is None
            else spec.drop_fraction
        )
        if is_schedule(value):
            if spec.drop_fraction_decay is not None:
                raise ValueError(
                    f"{where}: drop_fraction_decay does nothing when drop_fraction is a "
                    f"schedule (the schedule gives the fraction at every step): remove it"
                )
            parse_step_value(value, f"{where}.drop_fraction")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"{where}: drop_fraction={value!r}; use a number in [0, 1] or a schedule such "
                f"as {{'type': 'cosine', 'init': 0.3, 'half_period': 1000}}"
            )
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"{where}: drop_fraction={value!r} is the fraction of active weights swapped "
                f"at each update, so it must be in [0, 1] (0.3 is the usual choice)"
            )
        decay = spec.drop_fraction_decay or "cosine"
        if not isinstance(decay, str) or decay not in DECAYS:
            raise ValueError(
                f"{where}: drop_fraction_decay={decay!r}; use one of {sorted(DECAYS)}"
            )

    def __init__(self, phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN) -> None:
        super().__init__(phase, run)
        where = f"phases[{phase.index}]"
        spec = phase.spec
        value = (
            self.default_drop_fraction
            if spec.drop_fraction is None
            else spec.drop_fraction
        )
        self.drop_schedule: StepValue | None = None
        self.decay = spec.drop_fraction_decay or "cosine"
        if is_schedule(value):
            self.drop_schedule = parse_step_value(value, f"{where}.drop_fraction")
            return
        self.drop_fraction = float(value)
        if self.decay != "constant" and self.update_stop is None:
            raise ValueError(
                f"{where}: the phase has no known end, so drop_fraction cannot decay to zero "
                f"at update_stop: set update_stop (e.g. '5000 steps'), {run.advice}, or use "
                f"drop_fraction_decay: constant"
            )

    def schedule_warning(self) -> str | None:
        """Fewer than two drop-and-regrow updates in the phase."""
        steps = self.update_steps()
        if steps is None or len(steps) >= 2:
            return None
        what = (
            "no mask update, so its mask stays as chosen at the phase start (as static)"
            if not steps
            else f"one mask update (step {steps[0]}), so it drops and regrows once"
        )
        return (
            f"{self.name} has {what} ({self._update_window()}): "
            + self._update_every_fix(lambda steps: len(steps) >= 2)
        )

    def drop_fraction_at(self, step: int) -> float:
        """The fraction of each layer's active weights dropped (and regrown) at ``step``."""
        if self.drop_schedule is not None:
            value = self.drop_schedule(step, self.update_index(step))
            return min(1.0, max(0.0, value))
        if self.decay == "constant":
            return self.drop_fraction
        assert self.update_stop is not None
        span = self.update_stop - self.update_start
        progress = 1.0 if span <= 0 else (step - self.update_start) / span
        return self.drop_fraction * DECAYS[self.decay](min(1.0, max(0.0, progress)))

    def layer_targets(
        self,
        step: int,
        weights: Mapping[str, Tensor],
        masks: Mapping[str, Tensor] | None,
        input_norms: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Sparsity]:
        """At the phase start: the distribution's targets; at an update: each layer keeps the
        number of active weights it has (drop and regrowth swap weights, they never move the
        sparsity between layers)."""
        target = self.target_at(step)
        if masks is None or isinstance(target, NM):
            return super().layer_targets(step, weights, masks, input_norms)
        return {
            name: _inactive_fraction(masks[name]) for name in masks
        }  # one at a time

    def grow_score(
        self, weight: Tensor, mask: Tensor, ctx: MaskContext
    ) -> Tensor | None:
        """Where to regrow: the highest scores among the inactive weights win. Return a
        tensor shaped like ``weight``, or ``None`` to keep the layer's mask at this update."""
        raise NotImplementedError(
            f"algorithm {self.name!r} subclasses DropAndGrow, so it must implement grow_score"
        )

    def regrowth(
        self, weight: Tensor, mask: Tensor, ctx: MaskContext
    ) -> Regrowth | None:
        """How this update regrows (``None``: keep the layer's mask): by :meth:`grow_score`."""
        score = self.grow_score(weight, mask, ctx)
        return None if score is None else ByScore(score, self.grow_by_magnitude)

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
        # layer_targets keeps each layer's count, so the target says how many are active
        n_active = num_kept(mask.numel(), sparsity_fraction(target))
        n_drop = round(self.drop_fraction_at(ctx.step) * n_active)
        if n_drop == 0:
            return None
        regrowth = self.regrowth(weight, mask, ctx)
        if regrowth is None:
            return None
        layout = self.nm_layout(mask, target) if isinstance(target, NM) else None
        return drop_and_grow_(
            weight, mask, n_drop, target, regrowth, layout, self.select, n_active
        )


@register_algorithm("set")
class SET(DropAndGrow):
    """Sparse Evolutionary Training: regrow uniformly at random among the inactive weights
    (seeded by the phase's ``seed``, the parameter name and the step: identical on every rank
    and after a resume; drawing costs about as many random numbers as weights regrow).

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": 0.9, "algorithm": "set", "update_every": 100}])
    """

    layers_in_parallel = True
    regrows_at_random = True

    def regrowth(
        self, weight: Tensor, mask: Tensor, ctx: MaskContext
    ) -> Regrowth | None:
        if not self.regrows_at_random:
            return super().regrowth(weight, mask, ctx)
        return AtRandom(self.seed, ctx.name, ctx.step)


@register_algorithm("rigl")
class RigL(DropAndGrow):
    """Rigging the Lottery: regrow where the dense gradient's magnitude is largest. A layer
    without a gradient at an update step (unused in that step) keeps its mask.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": 0.9, "algorithm": "rigl", "distribution": "erk"}])
    """

    layers_in_parallel = True
    needs_grad = True
    grow_by_magnitude = True

    def grow_score(
        self, weight: Tensor, mask: Tensor, ctx: MaskContext
    ) -> Tensor | None:
        return ctx.grad  # ranked by magnitude: |grad| is never materialized


def _inactive_fraction(mask: Tensor) -> float:
    return (mask.numel() - count_true(mask)) / mask.numel()
