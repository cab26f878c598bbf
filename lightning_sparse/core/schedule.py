"""Phases and their boundaries: parsing, eager validation and resolution to optimizer steps.

Pure Python: nothing here touches a model or a trainer. A :class:`Phase` is what a user writes
(YAML scalars); :func:`resolve_phases` turns a list of them into :class:`ResolvedPhase` objects
with half-open step ranges ``[start, end)`` counted in optimizer steps.

Example:
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> phases = [Phase(sparsity="2:4", until=0.7), Phase(sparsity=0.0)]
    >>> [(p.start, p.end, str(p.target)) for p in resolve_phases(phases, total_steps=1000)]
    [(0, 700, '2:4'), (700, 1000, '0.0')]
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from lightning_sparse.core.closest import closest
from lightning_sparse.masks import NM, Sparsity, describe

_NM_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_INT_RE = re.compile(r"^\s*[-+]?\d+\s*$")
_BOUNDARY_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>%|steps?|epochs?|ep|)\s*$",
    re.IGNORECASE,
)
_BOUNDARY_FORMS = (
    "a fraction of the run in (0, 1] such as 0.7, a percentage such as '70%', "
    "epochs such as '3 epochs' or '3ep', or optimizer steps such as '1500 steps' or 1500"
)
RUN_LENGTH_ADVICE = "set Trainer(max_steps=...) or Trainer(max_epochs=...) with a sized train dataloader"
"""What makes an unknown run length known, for messages (a trainer that knows why its run has
no length says more precisely: see ``RunLength.advice``)."""


def parse_sparsity(value: Any, where: str = "sparsity") -> Sparsity:
    """Parse a sparsity value: a float in [0, 1) or an ``"N:M"`` string (a number written as
    a string, as a command line may pass it, counts as the number).

    >>> parse_sparsity("2:4"), parse_sparsity(0.7), parse_sparsity("0.7")
    (NM(n=2, m=4), 0.7, 0.7)
    """
    if isinstance(value, NM):
        return value
    if isinstance(value, str) and _NM_RE.match(value) is None:
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, str):
        match = _NM_RE.match(value)
        if match is None:
            raise ValueError(
                f"{where}={value!r} is not a sparsity: use a float in [0, 1) such as 0.7 "
                f"(fraction of weights pruned) or an 'N:M' pattern such as '2:4'"
            )
        try:
            return NM(int(match.group(1)), int(match.group(2)))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{where}={value!r} has type {type(value).__name__}: use a float in [0, 1) "
            f"or an 'N:M' string such as '2:4'"
        )
    if not math.isfinite(value):
        raise ValueError(
            f"{where}={value!r} is not a finite number: use a float in [0, 1) such as 0.7 "
            f"(fraction of weights pruned) or an 'N:M' pattern such as '2:4'"
        )
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"{where}={value!r} is outside [0, 1): it is the fraction of weights pruned, "
            f"so use e.g. 0.7 for 70% zeros, 0.0 for dense, or an 'N:M' pattern such as '2:4'"
            f"{_what_was_meant(value)}"
        )
    return float(value)


def parse_int(value: Any, where: str, minimum: int | None = None) -> int:
    """Parse a whole-number option (``seed``, ``update_every``): an int, or a string of digits
    such as ``'1'`` (as YAML or a command line may pass it), which counts as the number.

    >>> parse_int("7", "seed"), parse_int(100, "update_every", minimum=1)
    (7, 100)
    """
    if isinstance(value, str) and _INT_RE.match(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}={value!r} has type {type(value).__name__}: use an integer such as "
            f"{max(minimum or 0, 1)} (a string of digits such as '1' counts as the number)"
        )
    if minimum is not None and value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{where}={value!r}: use {wanted}")
    return value


def _what_was_meant(value: float) -> str:
    """What a sparsity of 1 or more most likely meant: YAML 1.1 (PyYAML, jsonargparse) reads
    an unquoted ``2:4`` as the base-60 number 124, so a whole number that reads back as an N:M
    pattern (M a power of two, as N:M kernels group weights) came from YAML; a number up to 100
    may be a percentage.

    >>> _what_was_meant(124), _what_was_meant(90)
    (" (124 is how YAML 1.1 reads an unquoted 2:4, as a base-60 number: quote it, sparsity: '2:4')", ' (for 90% zeros, write 0.9)')
    """
    hints = []
    n, m = divmod(int(value), 60)
    if value == int(value) and 0 < n < m and m & (m - 1) == 0:
        hints.append(
            f"{value:g} is how YAML 1.1 reads an unquoted {n}:{m}, as a base-60 number: "
            f"quote it, sparsity: '{n}:{m}'"
        )
    if 1 < value < 100:
        hints.append(f"for {value:g}% zeros, write {value / 100:g}")
    return f" ({'; '.join(hints)})" if hints else ""


def parse_decay(value: Any, where: str = "decay") -> float:
    """Parse a masked-decay factor: a finite number >= 0 (a number written as a string, as
    YAML 1.1 reads ``2e-4``, counts as the number).

    >>> parse_decay(2e-4), parse_decay("2e-4"), parse_decay(0)
    (0.0002, 0.0002, 0.0)
    """
    fix = "use a finite number >= 0 such as 2.0e-4 (SR-STE's value), or 0 for no decay"
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{where}={value!r} is not a number: {fix}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"{where}={value!r} has type {type(value).__name__}: {fix}")
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{where}={value!r}: {fix}")
    return float(number)


@dataclass(frozen=True)
class Boundary:
    """Where something ends: ``kind`` is ``"fraction"``, ``"epochs"`` or ``"steps"``."""

    kind: Literal["fraction", "epochs", "steps"]
    value: float
    raw: int | float | str  #: as the user wrote it (for messages)

    def resolve(
        self,
        total_steps: float,
        steps_per_epoch: float,
        where: str,
        advice: str = RUN_LENGTH_ADVICE,
    ) -> int:
        """The optimizer step this boundary names (an exclusive end); ``advice`` says what
        makes an unknown run length known."""
        if self.kind == "steps":
            return int(self.value)
        if self.kind == "fraction":
            if not math.isfinite(total_steps):
                raise ValueError(
                    f"{where}={self.raw!r} is a fraction of the run, but the trainer does not know "
                    f"the run length: {advice}, or give the boundary in steps ('1500 steps')"
                )
            return round(self.value * total_steps)
        if not math.isfinite(steps_per_epoch):
            raise ValueError(
                f"{where}={self.raw!r} counts epochs, but the train dataloader has no length, so "
                f"an epoch has no known number of steps: give the boundary in steps ('1500 steps') "
                f"or set Trainer(limit_train_batches=<int>)"
            )
        return round(self.value * steps_per_epoch)


def parse_boundary(value: Any, where: str = "until") -> Boundary:
    """Parse a boundary: float fraction, ``"70%"``, ``"3 epochs"``/``"3ep"``, ``"1500 steps"``, int.

    >>> parse_boundary("3ep"), parse_boundary(0.7).kind, parse_boundary(1500).kind
    (Boundary(kind='epochs', value=3.0, raw='3ep'), 'fraction', 'steps')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{where}={value!r} has type {type(value).__name__}: use {_BOUNDARY_FORMS}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(
                f"{where}={value!r}: a step boundary must be a positive integer"
            )
        return Boundary("steps", float(value), value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{where}={value!r} is not a finite number: use {_BOUNDARY_FORMS}"
            )
        if not 0.0 < value <= 1.0:
            hint = (
                f" (for a step count write {int(value)} or '{int(value)} steps')"
                if value > 1
                else ""
            )
            raise ValueError(
                f"{where}={value!r}: a float boundary is a fraction of the run and must be in "
                f"(0, 1]{hint}"
            )
        return Boundary("fraction", value, value)
    match = _BOUNDARY_RE.match(value)
    if match is None:
        raise ValueError(f"{where}={value!r} is not a boundary: use {_BOUNDARY_FORMS}")
    num, unit = float(match.group("num")), match.group("unit").lower()
    if unit == "%":
        if not 0.0 < num <= 100.0:
            raise ValueError(
                f"{where}={value!r}: a percentage boundary must be in (0%, 100%]"
            )
        return Boundary("fraction", num / 100.0, value)
    if unit in ("epoch", "epochs", "ep"):
        if num <= 0:
            raise ValueError(f"{where}={value!r}: an epoch boundary must be positive")
        return Boundary("epochs", num, value)
    if not num.is_integer() or num <= 0:
        raise ValueError(
            f"{where}={value!r}: a step boundary must be a positive whole number"
        )
    return Boundary("steps", num, value)


@dataclass
class Phase:
    """One span of training with one sparsity setting (all fields are YAML scalars).

    Args:
        sparsity: fraction of weights pruned in [0, 1) (unstructured) or ``"N:M"``. ``0.0`` = dense.
        until: where the phase ends: fraction of the run (0.7), ``"70%"``, ``"3 epochs"``,
            ``"1500 steps"`` or an int optimizer step. Only the last phase may leave it out.
        algorithm: mask rule (``"static"``, ``"magnitude"``, ``"gmp"``, ``"set"``, ``"rigl"``,
            ``"runtime"``, ``"learned"`` or a registered name).
            Default: ``"static"`` for a float sparsity, ``"runtime"`` for N:M when available.
        init: how the first mask is chosen: ``"topk"`` (largest magnitude), ``"random"``,
            ``"from_zeros"`` (the weight's existing zeros stay pruned: fine-tuning a pruned model),
            or ``"wanda"`` (``|W_ij| * ||X_j||_2``: the magnitude times the norm of the input it
            multiplies, over ``calibration_batches`` batches of the training data).
        seed: seed for random choices (a whole number; a string of digits such as ``'1'``
            counts as the number); derived per parameter name, so identical on every rank.
        update_every: optimizer steps between mask updates (dynamic algorithms); a whole
            number of at least 1 (a string of digits counts as the number).
        update_start: where updates start (same forms as ``until``); default: phase start.
        update_stop: where updates stop (same forms as ``until``); default: algorithm-specific.
        drop_fraction: fraction of active weights swapped per update (``set``, ``rigl``), or a
            schedule mapping such as ``{"type": "cosine", "init": 0.3, "half_period": 1000}``.
        drop_fraction_decay: ``"cosine"`` (default), ``"linear"`` or ``"constant"``.
        ramp: sparsity ramp of ``gmp``: ``"cubic"``, ``"linear"``, ``"cosine"`` or a schedule
            mapping of the optimizer step.
        initial_sparsity: where the ``gmp`` ramp starts.
        distribution: how the target spreads over layers: ``"uniform"``, ``"erk"`` or
            ``"global"``.
        decay: masked decay of straight-through algorithms (SR-STE): every optimizer step,
            the gradient of each pruned weight gains ``decay * weight``, pulling the weights
            the forward leaves out toward zero (e.g. ``2e-4``); default off.
        calibration_batches: batches the ``wanda`` input norms are gathered over (default 8).
        temperature: Gumbel-softmax temperature of ``learned`` masks: ``[start, end]``,
            annealed linearly over the phase (default ``[4.0, 0.05]``), or one number.
        logit_scale: what ``learned`` multiplies its logits by: ``[start, end]`` (default
            ``[100.0, 500.0]``) or one number.
        prior_strength: how strongly ``learned`` logits start at the prior mask (default 3.0;
            0: no prior).
        mask_lr: the Adam learning rate of ``learned`` logits (default 5e-4).
        weight_reg: ``learned``'s sparse-weight regulariser, favouring patterns that keep
            large weights (default 1e-5, decaying to 0 over the phase).
        hard: ``learned`` forwards use the sampled pattern itself, with the soft sample's
            gradient (straight-through Gumbel), instead of the soft sample (default false).
        train_weights: whether the selected weights train during a ``learned`` phase: true
            (default: with the gradient of the masked weight), ``"dense"`` (with the dense
            gradient, straight-through, so weights the mask leaves out keep learning) or
            false (only the masks learn, as in MaskLLM).
        transposable: whether a 2:4 ``learned`` phase hands the next phase a transposable
            mask (2:4 along the rows and columns of every 4x4 tile, which the 2:4 kernels
            run): ``"tiles"`` (learn over the 90 transposable tiles), ``"project"`` (learn
            the 6-pattern form, project it onto transposable tiles at the phase's end),
            true (the recommended form) or false (default: the learned patterns as they are).
        options: extra options for a custom algorithm.

    Example:
        >>> Phase(sparsity=0.7, until="3 epochs", algorithm="gmp").algorithm
        'gmp'
        >>> Phase.from_any({"sparsity": "2:4", "until": 0.7}).target
        NM(n=2, m=4)
    """

    sparsity: str | float = 0.0
    until: int | float | str | None = None
    algorithm: str | None = None
    init: str | None = None
    seed: int | None = None
    update_every: int | None = None
    update_start: int | float | str | None = None
    update_stop: int | float | str | None = None
    drop_fraction: float | dict[str, Any] | list[float] | None = None
    drop_fraction_decay: str | None = None
    ramp: str | dict[str, Any] | list[float] | None = None
    initial_sparsity: float | None = None
    distribution: str | None = None
    decay: float | None = None
    calibration_batches: int | None = None
    temperature: float | list[float] | None = None
    logit_scale: float | list[float] | None = None
    prior_strength: float | None = None
    mask_lr: float | None = None
    weight_reg: float | None = None
    hard: bool | None = None
    train_weights: bool | str | None = None
    transposable: bool | str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.target: Sparsity = parse_sparsity(self.sparsity)
        self.end = None if self.until is None else parse_boundary(self.until)
        if self.init not in (None, "topk", "random", "from_zeros", "wanda"):
            raise ValueError(
                f"init={self.init!r}: use 'topk' (largest magnitude), 'random', 'from_zeros' "
                f"(keep the weight's existing zeros pruned) or 'wanda' (magnitude times input "
                f"norm, from calibration batches)"
            )
        if self.seed is not None:
            self.seed = parse_int(self.seed, "seed")
        if self.update_every is not None:
            self.update_every = parse_int(self.update_every, "update_every", minimum=1)
        if not isinstance(self.options, dict):
            raise TypeError(
                f"options={self.options!r}: give a custom algorithm's options as a dict "
                f"such as {{'my_option': 1}}"
            )
        if self.calibration_batches is not None:
            self.calibration_batches = parse_int(
                self.calibration_batches, "calibration_batches", minimum=1
            )
            if self.init != "wanda":
                raise ValueError(
                    f"calibration_batches={self.calibration_batches!r} does nothing without "
                    f"init='wanda' (init={self.init!r}): add init: wanda or remove it"
                )
        for name in ("update_start", "update_stop"):
            if getattr(self, name) is not None:
                parse_boundary(getattr(self, name), name)
        if self.decay is not None:
            self.decay = parse_decay(self.decay)
        if self.is_dense:
            given = sorted(self.explicit_options()) + (
                ["algorithm"] if self.algorithm else []
            )
            if given:
                raise ValueError(
                    f"sparsity=0.0 makes this phase dense, so {given} would do nothing: remove "
                    f"them or give the phase a sparsity"
                )
        elif self.algorithm is None:
            self.algorithm = "runtime" if isinstance(self.target, NM) else "static"
        elif not isinstance(self.algorithm, str):
            raise TypeError(
                f"algorithm={self.algorithm!r}: use the name of a registered algorithm"
            )

    @property
    def is_dense(self) -> bool:
        return self.target == 0.0

    @classmethod
    def from_any(cls, value: Phase | dict[str, Any], where: str = "phases[0]") -> Phase:
        """Build a phase from a ``Phase`` or a dict (as written in YAML); errors name ``where``."""
        if isinstance(value, Phase):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                f"{where}={value!r}: a phase is a dict such as {{'sparsity': '2:4', 'until': 0.7}} "
                f"or a lightning_sparse.Phase"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(value) - known))
        if unknown:
            meant = [
                f"{m[0]!r} for {key!r}" for key in unknown if (m := closest(key, known))
            ]
            hint = f" (did you mean {', '.join(meant)}?)" if meant else ""
            raise ValueError(
                f"{where}: unknown key(s) {unknown}{hint}; a phase accepts {sorted(known)} "
                f"(options of a custom algorithm go under 'options')"
            )
        try:
            return cls(**value)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from None

    def explicit_options(self) -> dict[str, Any]:
        """The algorithm options the user set (fields other than sparsity/until/algorithm)."""
        skip = {"sparsity", "until", "algorithm", "options"}
        return {
            k: v for k, v in asdict(self).items() if k not in skip and v is not None
        }

    def describe(self) -> str:
        """Short text such as ``'2:4 runtime'`` or ``'70% static'``."""
        return "dense" if self.is_dense else f"{describe(self.target)} {self.algorithm}"


@dataclass
class ResolvedPhase:
    """A phase placed on the step axis: active for optimizer steps in ``[start, end)``."""

    index: int
    spec: Phase
    start: int
    end: int | None  # None: runs to the end of training (or forever if unknown)

    @property
    def target(self) -> Sparsity:
        return self.spec.target

    def contains(self, step: int) -> bool:
        return self.start <= step and (self.end is None or step < self.end)

    def span(self) -> str:
        """``'steps 0-699'`` (inclusive) or ``'steps 700-end'``."""
        last = "end" if self.end is None else str(self.end - 1)
        return f"steps {self.start}-{last}"


def validate_phase_list(phases: list[Phase]) -> None:
    """Checks that need no trainer: open-ended phases last, same-kind boundaries increasing."""
    if not phases:
        raise ValueError("phases=[]: give at least one phase, e.g. [{'sparsity': 0.7}]")
    for i, phase in enumerate(phases[:-1]):
        if phase.end is None:
            raise ValueError(
                f"phases[{i}] has no 'until', so it runs to the end of training and "
                f"phases[{i + 1}] would never start: give phases[{i}] an 'until' "
                f"(e.g. until: 0.7) or remove the phases after it"
            )
    for i in range(1, len(phases)):
        prev, cur = phases[i - 1].end, phases[i].end
        if (
            prev is not None
            and cur is not None
            and prev.kind == cur.kind
            and cur.value <= prev.value
        ):
            raise ValueError(
                f"phase boundaries must increase: phases[{i}].until={cur.raw!r} is not after "
                f"phases[{i - 1}].until={prev.raw!r}"
            )


def resolve_phases(
    phases: list[Phase],
    total_steps: float = math.inf,
    steps_per_epoch: float = math.inf,
    advice: str = RUN_LENGTH_ADVICE,
) -> list[ResolvedPhase]:
    """Place phases on the optimizer-step axis, checking that every phase is non-empty.

    ``total_steps`` is the run length in optimizer steps (``inf`` if unknown); the last phase
    without ``until`` ends there. ``advice`` says what makes an unknown run length known.
    """
    validate_phase_list(phases)
    resolved: list[ResolvedPhase] = []
    start = 0
    for i, phase in enumerate(phases):
        where = f"phases[{i}].until"
        if phase.end is None:
            end = None if not math.isfinite(total_steps) else int(total_steps)
        else:
            end = phase.end.resolve(total_steps, steps_per_epoch, where, advice)
        if end is not None and end <= start:
            if phase.end is None:
                raise ValueError(
                    f"phases[{i}] (the last, open-ended phase) would be empty: the run has "
                    f"{end} optimizer steps and the phases before it end at step {start}: make the "
                    f"run longer (max_steps/max_epochs), end earlier phases sooner, or remove it"
                )
            raise ValueError(
                f"{where}={phase.until!r} resolves to optimizer step {end}, but the phase starts "
                f"at step {start}, so it would be empty (run length: {total_steps:g} steps): move "
                f"the boundary later or remove the phase"
            )
        resolved.append(ResolvedPhase(i, phase, start, end))
        start = end if end is not None else start
    return resolved


def counts_epochs(phases: list[Phase]) -> bool:
    """Whether a boundary of ``phases`` (``until``, ``update_start``, ``update_stop``) is given
    in epochs, so that resolving it needs the optimizer steps of an epoch.

    >>> counts_epochs([Phase(sparsity=0.5, until="2ep"), Phase()]), counts_epochs([Phase()])
    (True, False)
    """
    return any(
        parse_boundary(value).kind == "epochs"
        for phase in phases
        for value in (phase.until, phase.update_start, phase.update_stop)
        if value is not None
    )


def phase_at(resolved: list[ResolvedPhase], step: int) -> ResolvedPhase | None:
    """The phase active at optimizer ``step``; ``None`` after the last bounded phase ends
    (training then continues dense)."""
    for phase in resolved:
        if phase.contains(step):
            return phase
    return None
