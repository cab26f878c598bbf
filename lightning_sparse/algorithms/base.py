"""The algorithm interface: how masks are chosen and when they change.

An algorithm is a pure rule ``(weight, current mask, target, context) -> new mask``. It never
touches kernels, optimizers or modules: the :class:`~lightning_sparse.engine.sparsifier.Sparsifier`
applies what it returns. Three families (see ``straight_through`` and ``learns``):

- hard masks: pruned weights are stored as zeros, their gradients and optimizer state are masked;
- straight-through: stored weights stay dense and learn from the dense gradient; every forward
  uses the masked weight;
- learned (:mod:`~lightning_sparse.algorithms.learned`): the algorithm owns trainable logits
  over each group's N:M patterns, with their own optimizer; every forward uses a
  differentiable sample of the mask, and the most likely pattern is what the next phase starts
  from.

Custom algorithms subclass :class:`SparsityAlgorithm`, override :meth:`update_mask` (and set
``dynamic = True`` so it gets called), and register with :func:`register_algorithm`; the name
then works in Python and YAML phases alike::

    from lightning_sparse import SparsityAlgorithm, register_algorithm

    @register_algorithm("weight_times_grad")
    class WeightTimesGrad(SparsityAlgorithm):
        straight_through = True  # weights stay dense, so every |w * g| stays meaningful
        dynamic = True
        needs_grad = True
        def update_mask(self, weight, mask, target, ctx):
            return self.select((weight * ctx.grad).abs(), target)

Per-layer targets come from the phase's ``distribution`` (:meth:`SparsityAlgorithm.layer_targets`,
called once per mask choice for the whole group), so a custom algorithm works with ``uniform``,
``erk`` and ``global`` without extra code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from lightning_sparse.algorithms.distributions import check_distribution, spread
from lightning_sparse.core.schedule import (
    RUN_LENGTH_ADVICE,
    Phase,
    ResolvedPhase,
    parse_boundary,
)
from lightning_sparse.masks import (
    NM,
    Sparsity,
    from_zeros_mask,
    name_seed,
    random_score,
    row_target_mask,
    target_mask,
)
from lightning_sparse.masks.tiles import has_4x4_tiles, optimal_transposable_2to4_mask


@dataclass
class MaskContext:
    """What an algorithm may look at besides the weight and mask."""

    name: str  #: parameter name (stable across ranks and runs)
    step: int  #: optimizer step the new mask takes effect at
    seed: int  #: the phase's seed
    grad: Tensor | None = (
        None  #: dense (unmasked, accumulated, unscaled) gradient, if captured
    )
    #: at a phase start with ``init='wanda'``: the root mean square of each input the weight
    #: multiplies, over the calibration batches, shaped to broadcast against the weight's rows
    input_norm: Tensor | None = None

    def random_score(self, like: Tensor) -> Tensor:
        """Uniform scores seeded by (seed, name, step): identical on every rank and resume."""
        return random_score(like, name_seed(self.seed, self.name, self.step))


@dataclass(frozen=True)
class RunLength:
    """What the schedule knows about the run, in optimizer steps (``inf``: unknown), and what
    makes an unknown run length known (for messages): used to resolve boundaries."""

    total_steps: float = math.inf
    steps_per_epoch: float = math.inf
    advice: str = RUN_LENGTH_ADVICE


UNKNOWN_RUN = RunLength()

DEFAULT_CALIBRATION_BATCHES = 8
"""Batches ``init='wanda'`` gathers input norms over when a phase does not say: a few thousand
input vectors per layer for a typical batch, a few forwards' worth of compute at the phase
start (Wanda's masks change little beyond a handful of calibration samples)."""


class SparsityAlgorithm:
    """Base class for mask algorithms; one instance per phase.

    Class attributes a subclass may set:
        straight_through: ``True`` if stored weights stay dense and the forward masks them.
        dynamic: ``True`` if masks change during the phase (:meth:`update_mask` is called every
            ``update_every`` steps between ``update_start`` and ``update_stop``).
        supports_nm: ``False`` if the algorithm cannot produce N:M masks.
        option_names: the :class:`~lightning_sparse.Phase` fields the algorithm reads (the
            update window of a dynamic algorithm and ``decay`` of a straight-through one come
            with them, see :meth:`accepted_options`); setting any other option in a phase
            using this algorithm is an error.
        default_update_every: update period when the phase does not give one.
        needs_grad: ``True`` if :meth:`update_mask` needs ``ctx.grad`` (the dense gradient).
        projects: ``True`` if every forward derives the mask from the weight (:meth:`project`);
            implies ``straight_through``.
        learns: ``True`` for the learned family (:class:`~lightning_sparse.algorithms.Learned`):
            the algorithm owns trainable parameters and their optimizer, its forwards draw a
            differentiable mask, and the next sparse phase of the same target starts from its
            most likely masks; implies ``straight_through``.
        layers_in_parallel: ``True`` if :meth:`update_mask_` (with everything it calls) may run
            for several layers at once on worker threads (CPU weights, when torch uses more
            than one thread; see :mod:`~lightning_sparse.engine.layer_threads`). Not inherited: a
            subclass runs its layers one after another unless it sets this itself.
        updates_in_place: ``True`` if :meth:`update_mask_` edits the mask in place by the rule
            of :meth:`update_mask` (the built-in dynamic algorithms). A subclass that defines
            its own :meth:`update_mask` turns it off, so its rule is the one used.
        custom_select: ``True`` if :meth:`select` is a subclass's own (set automatically when
            a subclass defines it); refills after a drop then rank the whole mask through it.

    Example:
        >>> import torch
        >>> from lightning_sparse.core.schedule import Phase, resolve_phases
        >>> from lightning_sparse.algorithms import build_algorithm
        >>> phase = resolve_phases([Phase(sparsity=0.5)], total_steps=10)[0]
        >>> algo = build_algorithm(phase)
        >>> mask = algo.initial_mask(torch.tensor([[1.0, -4.0], [3.0, 0.5]]), algo.target_at(0),
        ...                          MaskContext("w", 0, 0))
        >>> mask.tolist()
        [[False, True], [True, False]]
    """

    name: ClassVar[str] = ""
    straight_through: ClassVar[bool] = False
    dynamic: ClassVar[bool] = False
    supports_nm: ClassVar[bool] = True
    needs_grad: ClassVar[bool] = False
    projects: ClassVar[bool] = False
    learns: ClassVar[bool] = False
    option_names: ClassVar[frozenset[str]] = frozenset(
        {"init", "seed", "distribution", "calibration_batches"}
    )
    default_update_every: ClassVar[int] = 100
    default_update_stop_fraction: ClassVar[float] = 1.0  # of the phase length
    layers_in_parallel: ClassVar[bool] = False
    updates_in_place: ClassVar[bool] = False
    custom_select: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        # a subclass's own code may not be thread-safe
        if "layers_in_parallel" not in own:
            cls.layers_in_parallel = False
        if "update_mask" in own and "updates_in_place" not in own:
            cls.updates_in_place = False
        if "select" in own and "custom_select" not in own:
            cls.custom_select = True

    @classmethod
    def validate(cls, spec: Phase, where: str) -> None:
        """Check ``spec``'s options for this algorithm (which apply, their types and ranges)
        without the run length: :class:`~lightning_sparse.SparsityCallback` calls it when it is
        built, so a mistake surfaces before ``fit``; ``__init__`` calls it again. A subclass
        with options of its own extends it (calling ``super().validate``)."""
        allowed = cls.accepted_options()
        for option in spec.explicit_options():
            if option not in allowed:
                hint = (
                    " (it derives the mask from the weights at every forward; for a mask "
                    "chosen once at the phase start, use algorithm: static)"
                    if cls.projects and option in SparsityAlgorithm.option_names
                    else ""
                )
                raise ValueError(
                    f"{where}: option {option!r} does nothing for algorithm {cls.name!r}; "
                    f"it accepts {sorted(allowed)}{hint}{_accepted_elsewhere(option)}"
                )
        if isinstance(spec.target, NM) and not cls.supports_nm:
            raise ValueError(
                f"{where}: algorithm {cls.name!r} does not support N:M sparsity "
                f"({spec.target}); use a float sparsity or another algorithm"
            )
        check_distribution(spec.distribution, spec.target, where)

    def __init__(self, phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN) -> None:
        spec = phase.spec
        where = f"phases[{phase.index}]"
        self.validate(spec, where)
        self.distribution = check_distribution(spec.distribution, phase.target, where)
        self.phase = phase
        self.seed = spec.seed if spec.seed is not None else 0
        self.init = spec.init or "topk"
        self.calibration_batches = (
            spec.calibration_batches or DEFAULT_CALIBRATION_BATCHES
        )
        self.update_every = spec.update_every or self.default_update_every
        self.update_start = self._resolve(
            spec.update_start, phase.start, run, f"{where}.update_start"
        )
        default_stop = None
        if phase.end is not None:
            length = phase.end - phase.start
            default_stop = phase.start + round(
                self.default_update_stop_fraction * length
            )
        self.update_stop = self._resolve(
            spec.update_stop, default_stop, run, f"{where}.update_stop"
        )
        if (
            self.dynamic
            and self.update_stop is not None
            and self.update_stop < self.update_start
        ):
            raise ValueError(
                f"{where}: update_stop (step {self.update_stop}) is before update_start "
                f"(step {self.update_start})"
            )

    @classmethod
    def require_nm(cls, spec: Phase, where: str, does: str, fix: str) -> NM:
        """``spec``'s target, which must be N:M for this algorithm (which ``does`` so);
        otherwise a ``TypeError`` that ends with ``fix``."""
        if not isinstance(spec.target, NM):
            raise TypeError(
                f"{where}: algorithm {cls.name!r} {does}, but sparsity={spec.target}; {fix}"
            )
        return spec.target

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        """The phase options this algorithm reads: :attr:`option_names`, the update window of
        a dynamic one, and ``decay`` for a straight-through one (its pruned weights stay
        stored, so the engine can pull them toward zero; a hard mask stores zeros)."""
        window = (
            {"update_every", "update_start", "update_stop"} if cls.dynamic else set()
        )
        decay = {"decay"} if cls.straight_through else set()
        return cls.option_names | window | decay

    @staticmethod
    def _resolve(
        value: object, default: int | None, run: RunLength, where: str
    ) -> int | None:
        if value is None:
            return default
        return parse_boundary(value, where).resolve(
            run.total_steps, run.steps_per_epoch, where, run.advice
        )

    # -- schedule ---------------------------------------------------------------------------
    def target_at(self, step: int) -> Sparsity:
        """The target the masks should meet at ``step`` (ramping algorithms override this)."""
        return self.phase.target

    def is_update_step(self, step: int) -> bool:
        """Whether :meth:`update_mask` runs at ``step`` (never at the phase's first step)."""
        if not self.dynamic or step <= self.phase.start or step < self.update_start:
            return False
        if self.update_stop is not None and step > self.update_stop:
            return False
        return (
            step - self.update_start
        ) % self.update_every == 0 or step == self.update_stop

    def update_index(self, step: int) -> int:
        """Which mask choice of the phase happens at ``step``: 0 at the phase start, ``j`` at
        the ``j``-th update (counting the updates before ``step``, plus one)."""
        if step <= self.phase.start:
            return 0
        low = max(self.phase.start + 1, self.update_start)
        high = step - 1 if self.update_stop is None else min(step - 1, self.update_stop)
        if high < low:
            return 1
        # the first step of the grid update_start + j * update_every at or after low
        first = low + (self.update_start - low) % self.update_every
        count = 0 if first > high else (high - first) // self.update_every + 1
        stop = self.update_stop
        if (
            stop is not None
            and low <= stop <= high
            and (stop - self.update_start) % self.update_every
        ):
            count += 1
        return count + 1

    def update_steps(self, every: int | None = None) -> list[int] | None:
        """The steps of the phase at which :meth:`update_mask` runs (with ``every`` instead of
        ``update_every``: where it would run); ``None`` when neither the phase nor its updates
        have a known end."""
        if not self.dynamic:
            return []
        every = every or self.update_every
        last = None if self.phase.end is None else self.phase.end - 1
        known = [end for end in (self.update_stop, last) if end is not None]
        if not known:
            return None
        low, high = max(self.phase.start + 1, self.update_start), min(known)
        # the first step of the grid update_start + j * every at or after low
        first = low + (self.update_start - low) % every
        steps = list(range(first, high + 1, every))
        stop = self.update_stop
        if stop is not None and low <= stop <= high and stop not in steps[-1:]:
            steps.append(stop)
        return steps

    def schedule_warning(self) -> str | None:
        """What is wrong with the phase's update schedule for its length, said with the
        numbers and the fix (the built-in ``gmp``, ``set`` and ``rigl``: too few updates), or
        ``None``. Fit start warns with it and ``plan`` prints it."""
        return None

    def _update_every_fix(self, fits: Callable[[list[int]], bool]) -> str:
        """The fix for an update schedule that ``fits`` (given the update steps) refuses: an
        ``update_every`` that gives about ten updates, or a longer phase."""
        stop = self.update_stop if self.update_stop is not None else self.phase.end
        span = (stop or self.update_start) - self.update_start
        every = max(1, span // 10)
        steps = self.update_steps(every)
        if span > 0 and steps is not None and fits(steps):
            return (
                f"set update_every={every}{' or less' if every > 1 else ''} ({len(steps)} "
                f"updates over the {span} steps from update_start to update_stop)"
            )
        return (
            f"the updates have only {max(span, 0)} steps between update_start and "
            f"update_stop: lengthen the phase (until) or move update_stop later"
        )

    def _update_window(self) -> str:
        """``update_every=N, from step a to update_stop (step b)``, for messages."""
        stop = self.update_stop
        until = "" if stop is None else f" to update_stop (step {stop})"
        return f"update_every={self.update_every}, from step {self.update_start}{until}"

    @property
    def calibrates(self) -> bool:
        """Whether the first mask needs input norms (``init='wanda'``): the engine then runs
        ``calibration_batches`` calibration forwards at the phase start."""
        return self.init == "wanda"

    # -- masks ------------------------------------------------------------------------------
    def select(self, score: Tensor, target: Sparsity) -> Tensor:
        """Keep the highest-scoring weights so that ``target`` holds exactly.

        ``2:4`` on a 2-D weight whose dimensions are multiples of 4 is *transposable*: in every
        4x4 tile exactly 2 per row and 2 per column, the pattern with the highest total score
        (so ``W.T`` is 2:4 too and 2:4 kernels can also run the backward matmul). Other N:M
        targets and shapes: N of every M along the input dimension.
        """
        if isinstance(target, NM) and self.nm_layout(score, target) == "tiles":
            return best_tiles(score)
        return target_mask(score, target)

    def nm_layout(self, like: Tensor, target: NM) -> str | None:
        """How :meth:`select` lays out ``target`` on a weight shaped like ``like``:
        ``"tiles"`` (transposable 2:4 tiles), ``"groups"`` (N of every M along the input
        dimension), or ``None`` for a custom :meth:`select`."""
        if self.custom_select:
            return None
        return "tiles" if target == NM(2, 4) and has_4x4_tiles(like) else "groups"

    def selection_score(
        self, weight: Tensor, mask: Tensor | None, ctx: MaskContext
    ) -> Tensor:
        """What masks are chosen by. At the phase start (``mask`` is ``None``): the magnitude
        (``init='topk'``), a seeded random score (``init='random'``), the magnitude with the
        weight's zeros scoring -1 (``init='from_zeros'``), or the magnitude times the input
        norm (``init='wanda'``, from ``ctx.input_norm``). At an update: the magnitude of the
        kept weights, pruned ones scoring -1 (so pruning only removes). The ``global``
        distribution ranks the whole group by this score."""
        if mask is None and self.init == "random":
            return ctx.random_score(weight)
        if mask is None and self.init == "wanda":
            if ctx.input_norm is None:
                raise ValueError(
                    f"init='wanda' for parameter {ctx.name!r} needs its input norms "
                    f"(MaskContext.input_norm), which the Sparsifier gathers with calibration "
                    f"forwards"
                )
            return weight.detach().abs() * ctx.input_norm
        if mask is None and self.init == "topk":
            return weight.detach().abs()
        keep = weight != 0 if mask is None else mask
        return torch.where(keep, weight.detach().abs(), -1.0)

    def layer_targets(
        self,
        step: int,
        weights: Mapping[str, Tensor],
        masks: Mapping[str, Tensor] | None,
        input_norms: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Sparsity]:
        """Each layer's target for the masks chosen at ``step`` (``masks`` is ``None`` at the
        phase start; ``input_norms``: those of ``init='wanda'``): :meth:`target_at` spread
        over the layers by the phase's ``distribution``. Called once per mask choice, for the
        whole group, before the per-layer :meth:`initial_mask` / :meth:`update_mask` calls
        that receive these targets."""

        def score(name: str) -> Tensor:
            mask = None if masks is None else masks[name]
            norm = None if input_norms is None else input_norms[name]
            return self.selection_score(
                weights[name],
                mask,
                MaskContext(name, step, self.seed, input_norm=norm),
            )

        # the engine's weights know their shapes (OneAtATime.shapes) without gathering; others
        # are read by name, not items(): a loop variable would keep the last weight while the
        # next is read
        shapes = getattr(weights, "shapes", None) or {
            name: weights[name].shape for name in weights
        }
        return spread(self.distribution, self.target_at(step), shapes, score)

    def initial_mask(
        self, weight: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor:
        """The mask at phase start: the top of :meth:`selection_score`: largest magnitude
        (``init='topk'``), seeded random, the weight's own zeros (``init='from_zeros'``, see
        :func:`~lightning_sparse.masks.from_zeros_mask`), or the Wanda score
        (``init='wanda'``), compared within each output row for an unstructured target, as
        Wanda does (:func:`~lightning_sparse.masks.row_target_mask`)."""
        if self.init == "from_zeros":
            return from_zeros_mask(weight.detach(), target, ctx.name, self.select)
        score = self.selection_score(weight, None, ctx)
        if self.init == "wanda" and not isinstance(target, NM):
            return row_target_mask(score, target)
        return self.select(score, target)

    def update_mask(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor:
        """The mask after an update step; the base class keeps the current mask."""
        return mask

    def update_mask_(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor | None:
        """The in-place form the :class:`~lightning_sparse.engine.sparsifier.Sparsifier` calls: turn
        ``mask`` into what :meth:`update_mask` returns and say where it changed (a bool tensor
        shaped like ``mask``, possibly a reused buffer: read it before the next update), or
        return ``None`` if it did not change.

        The default calls :meth:`update_mask` and compares; the built-in dynamic algorithms
        edit ``mask`` directly (no copy of the mask, no comparison of the whole mask). A
        subclass that overrides :meth:`update_mask` gets its rule used either way.
        """
        new = self.update_mask(weight, mask, target, ctx)
        if new is mask:
            return None
        changed = new ^ mask
        mask.copy_(new)
        return changed

    def project(self, weight: Tensor) -> Tensor:
        """The mask derived from ``weight`` at every forward (only when ``projects`` is set)."""
        raise NotImplementedError(
            f"algorithm {self.name!r} does not project masks per forward"
        )

    def traceable(self, weight: Tensor) -> bool:
        """Whether ``project(weight)`` may run inside a ``torch.compile`` graph, i.e. runs ops
        that trace to a fixed graph (such as custom ops). The default, ``False``, runs every
        projection eagerly between graphs, so that Python loops are not retraced."""
        return False


_REGISTRY: dict[str, type[SparsityAlgorithm]] = {}
_A = TypeVar("_A", bound=type[SparsityAlgorithm])


def register_algorithm(name: str) -> Callable[[_A], _A]:
    """Class decorator: make a :class:`SparsityAlgorithm` usable as ``algorithm: <name>``."""

    def decorator(cls: _A) -> _A:
        if not (isinstance(cls, type) and issubclass(cls, SparsityAlgorithm)):
            raise TypeError(
                f"@register_algorithm({name!r}) decorates a SparsityAlgorithm subclass, not {cls!r}"
            )
        existing = _REGISTRY.get(name)
        if (
            existing is not None
            and existing is not cls
            and existing.__qualname__ != cls.__qualname__
        ):
            raise ValueError(
                f"algorithm name {name!r} is already registered by {existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def algorithm_class(name: str, where: str = "algorithm") -> type[SparsityAlgorithm]:
    """Look up a registered algorithm; the error lists the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"{where}={name!r} is not a registered algorithm; known: {sorted(_REGISTRY)} "
            f"(register your own with @lightning_sparse.register_algorithm)"
        ) from None


def _accepted_elsewhere(option: str) -> str:
    """For an error message: which registered algorithms accept ``option``."""
    names = sorted(
        n for n, cls in _REGISTRY.items() if option in cls.accepted_options()
    )
    if not names:
        return ""
    why = (
        " (straight-through algorithms: their pruned weights stay stored and are decayed; "
        "a hard mask stores them as zeros, so there is nothing to decay)"
        if option == "decay"
        else ""
    )
    return f"; {option!r} is accepted by {names}{why}"


def registered_algorithms() -> list[str]:
    """The names a phase's ``algorithm`` may take (built-in and registered), sorted."""
    return sorted(_REGISTRY)


def best_tiles(score: Tensor) -> Tensor:
    """The transposable 2:4 mask of the highest total ``score`` per 4x4 tile (exactly 2 per
    row and per column), for scores of any sign."""
    # every candidate pattern keeps 8 of 16, so shifting the scores keeps the argmax
    return optimal_transposable_2to4_mask(score - score.amin())
