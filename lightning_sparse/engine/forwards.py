"""Which backend each selected layer computes with in each phase, and the forward it needs.

:class:`LayerForwards` chooses a backend per parameter and sparse phase once, when the
:class:`~lightning_sparse.engine.sparsifier.Sparsifier` is built, installs the chosen forward
whenever masks change, and checks after the first sparse step that every installed forward ran.
Hard masks on the masked backend need no forward: the pruned weights are stored as zeros.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.algorithms import build_algorithm
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.core.selection import select_parameters
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> targets = select_parameters(net).targets
    >>> phases = resolve_phases([Phase(sparsity="2:4", algorithm="runtime")], total_steps=4)
    >>> algorithms = {0: build_algorithm(phases[0])}
    >>> forwards = LayerForwards("demo", targets, phases, algorithms)
    >>> forwards.choices[0, "0.weight"].name
    'masked'
    >>> forwards.install(0, targets[0], algorithms[0], None)
    >>> type(net[0]).__name__, forwards.uninstall(targets), type(net[0]).__name__
    ('MaskedLinear', None, 'Linear')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.algorithms import Learned, SparsityAlgorithm, hands_over
from lightning_sparse.algorithms.learned import RECOMMENDED_FORM
from lightning_sparse.backends import (
    BackendChoice,
    choose_backend,
    require_semi_structured,
    validate_backend,
)
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.backends.masked import (
    install_masked_forward,
    install_sparse_attribute,
    original_class,
    uninstall_forward,
)
from lightning_sparse.backends.semi_structured import (
    NotTransposableError,
    install_semi_structured_forward,
)
from lightning_sparse.backends.speed import EAGER, SpeedCheck
from lightning_sparse.core.layers import LayerType
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.core.selection import ParamTarget, read_elsewhere
from lightning_sparse.engine.feasibility import check_phase
from lightning_sparse.engine.ranks import collective_device, raise_together, world_size


class LayerForwards:
    """The backend of every (sparse phase, parameter) pair and the forwards that run it.

    Args:
        name: group name (used in messages).
        targets: the group's parameters.
        phases: the resolved schedule.
        algorithms: the algorithm of each sparse phase, by phase index.
        backend: ``"auto"``, ``"masked"`` or ``"semi_structured"`` (see
            :mod:`lightning_sparse.backends`).
        compute_dtype: the autocast dtype of the matmuls (``None``: the weights' own dtype).
        verify_speed: with ``backend="auto"``, time each distinct layer shape once (``True`` or
            ``"eager"``: eagerly; ``"cuda_graphs"``: replayed as CUDA graphs; in a distributed
            run on every rank, which then agree: :func:`agree_across_ranks`) and keep
            dense math where the sparse kernel is slower.
        verify_speed_tokens: the token count it times (``None``: the default,
            :data:`~lightning_sparse.backends.speed.VERIFY_TOKENS`).
        verify_on_gpus_only: time weights on a CUDA device only (``verify_speed``'s default).
        gpu: choose for this GPU instead of the weights' device (predictions for a plan).
        log: called with a message when a layer falls back to masked math.
    """

    def __init__(
        self,
        name: str,
        targets: Sequence[ParamTarget],
        phases: Sequence[ResolvedPhase],
        algorithms: Mapping[int, SparsityAlgorithm],
        backend: str = "auto",
        compute_dtype: torch.dtype | None = None,
        verify_speed: bool | str = False,
        gpu: GpuTarget | None = None,
        log: Callable[[str], None] = lambda message: None,
        verify_speed_tokens: int | None = None,
        verify_on_gpus_only: bool = False,
    ) -> None:
        self.name = name
        self.log = log
        self.backend = validate_backend(backend, verify_speed, verify_speed_tokens)
        timing = verify_speed if isinstance(verify_speed, str) else EAGER
        self.speed_check = (
            SpeedCheck(verify_speed_tokens, timing, verify_on_gpus_only)
            if verify_speed
            else None
        )
        """How layer shapes are timed (``None``: they are not); on a plan's GPU, nothing is."""
        speedup = self.speed_check if gpu is None else None
        self.choices: dict[tuple[int, str], BackendChoice] = {}
        for phase in phases:
            if phase.index in algorithms:
                check_phase(phase, algorithms[phase.index], targets)
        failure = None
        try:
            self._choose(targets, phases, algorithms, compute_dtype, speedup, gpu)
        except Exception as err:  # noqa: BLE001 (every rank hears of it: raise_together)
            failure = err
        if backend == "masked" or gpu is not None or world_size() == 1:
            if failure is not None:
                raise failure
        else:
            # each rank checked its own GPU (and with verify_speed timed it): an error on one
            # is raised on all, and they agree on one backend per layer (under FSDP2 they run
            # each layer's gathered weight alike)
            raise_together(
                failure,
                f"[{name}] choosing each layer's backend (the kernel check, verify_speed)",
            )
            agree_across_ranks(self.choices)
        if backend == "semi_structured":
            require_semi_structured(
                [
                    (f"phase {index + 1} {param}", choice.reason)
                    for (index, param), choice in self.choices.items()
                    if choice.name != "semi_structured"
                ]
            )
        self._unverified = False  # forwards installed, not yet seen to run

    def _choose(
        self,
        targets: Sequence[ParamTarget],
        phases: Sequence[ResolvedPhase],
        algorithms: Mapping[int, SparsityAlgorithm],
        compute_dtype: torch.dtype | None,
        speedup: SpeedCheck | None,
        gpu: GpuTarget | None,
    ) -> None:
        """Choose the backend of every (sparse phase, target) pair into :attr:`choices`: run
        the kernel checks and, with ``speedup``, time each shape (timed as the phase runs: a
        mask projected per forward, or a stored one)."""
        for phase in phases:
            if phase.index not in algorithms:
                continue
            algo = algorithms[phase.index]
            measure = (
                None
                if speedup is None
                else functools.partial(speedup, stored=not algo.projects)
            )
            for t in targets:
                choice = (
                    BackendChoice("masked", LEARNED_ON_MASKED)
                    if algo.learns
                    else choose_backend(
                        self.backend,
                        phase.target,
                        t.param,
                        t.owners,
                        compute_dtype,
                        measure,
                        gpu,
                    )
                )
                if choice.name == "semi_structured" and t.readers:
                    # a kernel forward would never run; the stored zeros are read
                    choice = BackendChoice("masked", str(read_elsewhere(t.readers)))
                handed = handed_by(phases, algorithms, phase.index)
                if (
                    choice.name == "semi_structured"
                    and handed is not None
                    and not algo.projects
                    and not handed.hands_over_tiles(t.rows_shape)
                ):
                    choice = BackendChoice("masked", untransposable_handover(handed))
                self.choices[phase.index, t.name] = choice

    def installed(self) -> None:
        """Every target's forward was just :meth:`install` ed for new masks: :meth:`verify`
        then checks that they all ran."""
        self._unverified = True

    def install(
        self,
        phase_index: int,
        t: ParamTarget,
        algo: SparsityAlgorithm,
        mask: Tensor | None,
    ) -> None:
        """Give ``t``'s layer the forward its backend needs in phase ``phase_index`` with the
        whole-tensor ``mask`` (unused by a projecting algorithm)."""
        key = (phase_index, t.name)
        if self.choices[key].name == "semi_structured":
            try:
                stored = None if algo.projects else mask
                install_semi_structured_forward(
                    t.module, self.choices[key].kernel, stored
                )
                return
            except NotTransposableError:
                self._run_masked_instead(t, algo, key)
        sample = LearnedSample(algo, t.name, t.layer) if algo.learns else None
        if t.sparse_reads:  # read as module.attr by another module's code
            if algo.straight_through:
                install_sparse_attribute(
                    t.module,
                    t.owners[0][2],
                    mask=None if algo.projects or sample else mask,
                    project=projection(t, algo) if algo.projects else None,
                    sample=sample,
                )
            return
        if sample is not None:
            install_masked_forward(t.module, sample=sample)
        elif algo.projects:
            install_masked_forward(t.module, project=projection(t, algo))
        elif algo.straight_through:
            install_masked_forward(t.module, mask=mask)

    def uninstall(self, targets: Sequence[ParamTarget]) -> None:
        """Give every module owning one of ``targets`` its own forward back."""
        for t in targets:
            for _, module, _ in t.owners:
                uninstall_forward(module)
        self._unverified = False

    def _run_masked_instead(
        self, t: ParamTarget, algo: SparsityAlgorithm, key: tuple[int, str]
    ) -> None:
        """A mask the kernels cannot run: an error if they were required, else masked math."""
        why = (
            f"algorithm {algo.name!r} gave {t.name!r} a 2:4 mask that is not transposable "
            f"(at most 2 per row and column of each 4x4 tile), which the 2:4 kernels need"
        )
        if self.backend == "semi_structured":
            raise ValueError(
                f"[{self.name}] {why}: choose masks with SparsityAlgorithm.select, or use "
                f"backend='auto' to run such masks with masked dense math"
            )
        self.choices[key] = BackendChoice("masked", why)
        self.log(f"[{self.name}] {why}; it runs with masked dense math")
        uninstall_forward(t.module)

    def verify(
        self, targets: Sequence[ParamTarget], allow_skipped: bool = False
    ) -> None:
        """After the first forwards since :meth:`installed`: raise if a layer given a sparse
        forward did not run it (a model that reads the weight some other way would train and
        evaluate it dense while the logs report it sparse); with ``allow_skipped`` (a model
        that skips layers on purpose), log them instead."""
        if not self._unverified:
            return
        self._unverified = False
        idle = [
            f"{t.name} ({t.module_name or 'model'}, {original_class(t.module).__name__})"
            for t in targets
            if t.module.__dict__.get("_ls_ran") is False
        ]
        if idle and allow_skipped:
            self.log(
                f"[{self.name}] these parameters have a sparse forward that did not run in the "
                f"first sparse step (allow_skipped_layers=True): {idle[:5]}"
            )
        elif idle:
            raise RuntimeError(
                f"[{self.name}] these parameters have a sparse forward that did not run in the "
                f"first sparse step: {idle[:5]}. The model reads them without calling their "
                f"layer (e.g. a functional call on module.weight, or an unused layer), so they "
                f"would stay dense; use a hard-mask algorithm ('static'), which stores the "
                f"zeros in the weight, or exclude them (a model that skips layers on purpose: "
                f"SparsityCallback(allow_skipped_layers=True))"
            )


@dataclass(frozen=True)
class Projection:
    """``algo.project`` on a weight in ``layer``'s stored layout (the algorithm sees rows, e.g.
    a Conv1D weight's transpose), and where it may be traced into a compiled graph.

    Example:
        >>> from lightning_sparse.algorithms import build_algorithm
        >>> from lightning_sparse.core.layers import CONV1D
        >>> from lightning_sparse.core.schedule import Phase, resolve_phases
        >>> algo = build_algorithm(resolve_phases([Phase(sparsity="2:4")], total_steps=1)[0])
        >>> w = torch.randn(16, 8)  # a Conv1D weight: 16 inputs, 8 outputs
        >>> project = Projection(algo, CONV1D)
        >>> torch.equal(project(w), algo.project(w.T).T), project.traceable(w)
        (True, False)
    """

    algo: SparsityAlgorithm
    layer: LayerType

    def __call__(self, weight: Tensor) -> Tensor:
        return self.layer.from_rows(self.algo.project(self.layer.to_rows(weight)))

    def traceable(self, weight: Tensor) -> bool:
        """Whether the projection of ``weight`` may run inside a ``torch.compile`` graph
        (:meth:`~lightning_sparse.algorithms.SparsityAlgorithm.traceable`)."""
        return self.algo.traceable(self.layer.to_rows(weight))


@dataclass(frozen=True)
class LearnedSample:
    """The mask a learned algorithm draws for parameter ``name`` at a forward
    (:meth:`~lightning_sparse.algorithms.Learned.sample`: a Gumbel sample in training, the
    most likely pattern otherwise), in ``layer``'s stored layout and the matmul's dtype. It
    runs outside any ``torch.compile`` graph (it seeds a generator of its own); the masked
    product that follows compiles as usual.

    Example:
        >>> from lightning_sparse.algorithms import MaskContext, build_algorithm
        >>> from lightning_sparse.core.layers import CONV1D
        >>> from lightning_sparse.core.schedule import Phase, resolve_phases
        >>> phase = resolve_phases([Phase(sparsity="2:4", algorithm="learned")], total_steps=5)[0]
        >>> algo = build_algorithm(phase)
        >>> w = torch.randn(16, 8)  # a Conv1D weight: 16 inputs, 8 outputs
        >>> prior = algo.initial_mask(w.T, phase.target, MaskContext("w", 0, 0))
        >>> algo.begin(0, {"w": prior})
        >>> torch.equal(LearnedSample(algo, "w", CONV1D)(False), algo.most_likely("w").T.float())
        True
    """

    algo: SparsityAlgorithm
    name: str
    layer: LayerType

    @property
    def dense_gradient(self) -> bool:
        """Whether the weight learns from the dense gradient (``train_weights: dense``)."""
        return self.algo.train_weights == "dense"  # type: ignore[attr-defined]

    @torch.compiler.disable
    def __call__(self, training: bool, dtype: torch.dtype | None = None) -> Tensor:
        mask = self.algo.sample(self.name, training, dtype)  # type: ignore[attr-defined]
        return self.layer.from_rows(mask)


def handed_by(
    phases: Sequence[ResolvedPhase],
    algorithms: Mapping[int, SparsityAlgorithm],
    index: int,
) -> Learned | None:
    """The learned algorithm whose masks phase ``index`` starts from, or ``None``."""
    before = algorithms.get(index - 1)
    if not isinstance(before, Learned) or not hands_over(
        phases[index - 1].spec, phases[index].spec
    ):
        return None
    return before


def untransposable_handover(learned: Learned) -> str:
    """Why a phase that starts from ``learned``'s masks cannot run them on 2:4 kernels."""
    number = learned.phase.index + 1
    if learned.transposable:
        return (
            f"starts from the learned masks of phase {number}, which are N:M groups here "
            f"(transposable tiles need a 2-D weight with both dimensions multiples of 4)"
        )
    return (
        f"starts from the learned masks of phase {number}, which are not transposable "
        f"2:4; give phase {number} transposable: {RECOMMENDED_FORM} (or tiles) to run "
        f"this phase on the 2:4 kernels"
    )


LEARNED_ON_MASKED = (
    "a learned mask is a differentiable sample at every training forward, which no 2:4 "
    "kernel runs"
)


def agree_across_ranks(choices: dict[tuple[int, str], BackendChoice]) -> None:
    """In a distributed run, keep a layer on its 2:4 kernel only where every rank chose it:
    ``verify_speed``'s timings differ a little from rank to rank, each rank's kernel check
    ran on its own GPU, and one rank finding a shape slower (or its kernel wrong) must not
    leave the ranks running different kernels. Called in every distributed run whose backend
    may run a kernel. A collective: in a distributed run every rank must call it,
    with the same keys (the callback builds the same engine on every rank at fit start)."""
    if world_size() == 1:
        return
    keys = sorted(choices)
    kept = torch.tensor(
        [choices[key].name == "semi_structured" for key in keys],
        dtype=torch.int32,
        device=collective_device(),
    )
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)
    for key, agreed in zip(keys, kept.tolist()):
        if choices[key].name == "semi_structured" and not agreed:
            choices[key] = BackendChoice(
                "masked",
                f"kept dense: on another rank verify_speed found 2:4 slower or the kernel "
                f"check failed, and every rank runs one backend per layer (here: "
                f"{choices[key].reason})",
            )


def projection(t: ParamTarget, algo: SparsityAlgorithm) -> Projection:
    """``algo.project`` for ``t``'s stored layout (see :class:`Projection`)."""
    return Projection(algo, t.layer)


__all__ = [
    "LayerForwards",
    "LearnedSample",
    "Projection",
    "agree_across_ranks",
    "projection",
]
