"""The sparsity engine for one parameter group, independent of Lightning.

A :class:`Sparsifier` owns the selected parameters and their masks, enters and leaves phases,
runs an algorithm's mask updates, masks gradients and optimizer state for hard-mask phases, and
saves/restores its state. :class:`~lightning_sparse.SparseTraining` drives it from a loop you
write (Fabric or plain PyTorch), and :class:`~lightning_sparse.SparsityCallback` through that
same object from Lightning hooks; the example below drives it directly.

Example (plain PyTorch):
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.core.selection import select_parameters
    >>> from lightning_sparse.engine.sparsifier import Sparsifier
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    >>> phases = resolve_phases([Phase(sparsity=0.5, until=5), Phase(sparsity=0.0)], total_steps=10)
    >>> sp = Sparsifier("demo", select_parameters(net).targets, phases)
    >>> for step in range(10):
    ...     _ = sp.on_step_start(step, [opt])
    ...     net(torch.randn(4, 8)).sum().backward()
    ...     _ = sp.before_optimizer_step(step, opt, [opt])
    ...     opt.step(); opt.zero_grad()
    ...     if step == 4: print((net[0].weight == 0).float().mean().item())
    0.5
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.algorithms import (
    UNKNOWN_RUN,
    Learned,
    MaskContext,
    RunLength,
    SparsityAlgorithm,
    build_algorithm,
    hands_over,
)
from lightning_sparse.backends import BackendChoice
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.core.schedule import ResolvedPhase, phase_at
from lightning_sparse.core.selection import ParamTarget
from lightning_sparse.engine.forwards import LayerForwards, projection
from lightning_sparse.engine.gradients import (
    all_finite,
    average_over_ranks,
    decay_gradients,
    mask_gradients,
    owned_by,
)
from lightning_sparse.engine.input_norms import InputNorms
from lightning_sparse.engine.layer_threads import (
    for_each_layer,
    update_threads,
)
from lightning_sparse.engine.learning import (
    LearnedReports,
    describe_projection,
    describe_start,
    layer_statistics,
    overall,
    read_reports,
    summarize,
)
from lightning_sparse.engine.logit_shards import RankShards
from lightning_sparse.engine.optim_state import state_tensors, zero_optimizer_state
from lightning_sparse.engine.resume import (
    broken_pattern,
    pack_state,
    plan_restore,
    schedule_record,
)
from lightning_sparse.engine.sharding import OneAtATime, gather_full, shard_like
from lightning_sparse.masks import name_seed, sparsity_fraction
from lightning_sparse.masks.elementwise import (
    apply_mask_change_,
    free_scratch,
    multiply_by_mask_,
)
from lightning_sparse.masks.patterns import not_a_mask


@dataclass
class PhaseChange:
    """What happened at a phase boundary (for logging)."""

    step: int
    old: ResolvedPhase | None
    new: ResolvedPhase | None


class Sparsifier:
    """Masks for one group of parameters over a phase schedule.

    Args:
        name: group name (used in messages and logs).
        targets: the parameters to sparsify (see :func:`~lightning_sparse.core.selection.select_parameters`).
        phases: the resolved schedule.
        run: run length, used by algorithms to place update windows.
        backend: ``"auto"``, ``"masked"`` or ``"semi_structured"`` (see
            :mod:`lightning_sparse.backends`); chosen per parameter and phase at construction.
        log: called with a message whenever the group changes phase or skips an update.
        compute_dtype: the autocast dtype of the matmuls (``None``: the weights' own dtype).
        verify_speed: with ``backend="auto"``, time each distinct layer shape once (``True``
            or ``"eager"``: eagerly; ``"cuda_graphs"``: replayed as CUDA graphs), sparse
            against dense, and keep dense math where the sparse kernel is slower.
        verify_speed_tokens: the token count it times (``None``: the default).
        verify_on_gpus_only: time weights on a CUDA device only (``verify_speed``'s default).
        gpu: choose backends for this GPU instead of the weights' device (a plan for another
            machine: the choices are predictions, and ``verify_speed`` measures nothing).
        calibration_forwards: for phases with ``init='wanda'``: called as ``(batches, seed)``
            at the phase start, it runs up to ``batches`` forwards of the model on training data
            without gradients (any random choice seeded by ``seed``, and the RNG state restored
            afterwards) and returns how many it ran; the selected layers' input norms are
            gathered from them (:mod:`~lightning_sparse.engine.input_norms`).
            :class:`~lightning_sparse.SparsityCallback` runs its ``training_step`` on the train
            loader.
        allow_skipped_layers: a layer whose sparse forward did not run in the first sparse
            step is logged, not an error (for models that skip layers on purpose).

    Sharded parameters (FSDP2 DTensors) get masks chosen on the whole tensor and stored as
    shards like the parameter (see :mod:`lightning_sparse.engine.sharding`); call every method on
    every rank, as the gathers are collectives.

    A learned phase (:class:`~lightning_sparse.algorithms.Learned`) starts its logits at the
    phase start, steps them in :meth:`before_optimizer_step` (their gradients averaged over the
    ranks), saves them in :meth:`state_dict`, and hands its most likely masks to the next
    phase when :func:`~lightning_sparse.algorithms.hands_over` says so.
    """

    def __init__(
        self,
        name: str,
        targets: Sequence[ParamTarget],
        phases: Sequence[ResolvedPhase],
        run: RunLength = UNKNOWN_RUN,
        backend: str = "auto",
        log: Callable[[str], None] = lambda message: None,
        compute_dtype: torch.dtype | None = None,
        verify_speed: bool | str = False,
        gpu: GpuTarget | None = None,
        calibration_forwards: Callable[[int, int], int] | None = None,
        allow_skipped_layers: bool = False,
        verify_speed_tokens: int | None = None,
        verify_on_gpus_only: bool = False,
    ) -> None:
        self.name = name
        self.allow_skipped_layers = allow_skipped_layers
        self.calibration_forwards = calibration_forwards
        self.targets = list(targets)
        self.phases = list(phases)
        self.log = log
        self.algorithms: dict[int, SparsityAlgorithm] = {
            p.index: build_algorithm(p, run) for p in self.phases if not p.spec.is_dense
        }
        for algo in self.algorithms.values():
            if isinstance(algo, Learned):  # a rank that skips a layer skips its gather
                algo.shards = RankShards(split=not allow_skipped_layers)
        self.forwards = LayerForwards(
            name,
            self.targets,
            self.phases,
            self.algorithms,
            backend,
            compute_dtype,
            verify_speed,
            gpu,
            log,
            verify_speed_tokens,
            verify_on_gpus_only,
        )
        self.current: ResolvedPhase | None = None  # the scheduled phase (may be dense)
        self.masks: dict[str, Tensor] = {}
        # each stored mask's version, as last written here
        self._mask_versions: dict[str, int] = {}
        self.last_update_step = -1
        self.history: list[
            tuple[int, int | None]
        ] = []  # (step entered, phase index or None)
        self._grad_lists: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        #: the phases whose first masks are the learned masks of the phase before
        self.handed = {
            p.index
            for before, p in zip(self.phases, self.phases[1:])
            if hands_over(before.spec, p.spec)
        }
        #: those whose first masks are N:M groups only (learned without ``transposable``),
        #: so their masks are checked as groups, not as transposable tiles
        self.handed_groups = {
            index
            for index in self.handed
            if not getattr(self.algorithms[index - 1], "transposable", False)
        }
        #: per learned phase that ended (or was saved), each layer's statistics then
        self.learned_reports: LearnedReports = {}
        self._learned_step = -1  # the step whose forwards the logits last learned from

    @property
    def backends(self) -> dict[tuple[int, str], BackendChoice]:
        """The backend of each (sparse phase index, parameter name)."""
        return self.forwards.choices

    def schedule_warnings(self) -> list[str]:
        """What is wrong with each sparse phase's update schedule for its length (too few
        updates for a ``gmp`` ramp, ``set`` or ``rigl``), with the numbers and the fix; see
        :meth:`~lightning_sparse.algorithms.SparsityAlgorithm.schedule_warning`."""
        warnings = []
        for phase in self.phases:
            algo = self.algorithms.get(phase.index)
            warning = None if algo is None else algo.schedule_warning()
            if warning is not None:
                warnings.append(
                    f"[{self.name}] phase {phase.index + 1} ({phase.spec.describe()}, "
                    f"{phase.span()}): {warning}"
                )
        return warnings

    # -- phases ---------------------------------------------------------------------------------
    @property
    def algorithm(self) -> SparsityAlgorithm | None:
        """The current phase's algorithm; ``None`` when dense."""
        return None if self.current is None else self.algorithms.get(self.current.index)

    def on_step_start(
        self, step: int, optimizers: Sequence[torch.optim.Optimizer]
    ) -> PhaseChange | None:
        """Call before the first forward of optimizer step ``step``; enters a new phase if due.
        Raises ``RuntimeError`` if a stored mask was changed in place since it was written
        (use :meth:`set_masks`)."""
        self._refuse_masks_edited_in_place()
        new = phase_at(self.phases, step)
        if _index(new) == _index(self.current) and self.history:
            if isinstance(self.algorithm, Learned):
                self.algorithm.step = step  # the forwards draw this step's samples
            return None
        old = self.current
        self.enter(new, step, optimizers)
        return PhaseChange(step, old, new)

    def enter(
        self,
        phase: ResolvedPhase | None,
        step: int,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        """Leave the current phase and start ``phase`` (``None`` or a dense phase: no masks)."""
        handed = self._hand_over(phase, step)
        self._leave()
        self.current = phase
        self.history.append((step, _index(phase)))
        algo = self.algorithm
        if algo is None:
            return
        rows = handed if handed is not None else self._first_masks(algo, step)
        if isinstance(algo, Learned):
            rows = dict(rows)  # its priors, all at once
            algo.begin(step, rows)
            self.log(describe_start(self.name, algo, step))
        targets = {t.name: t for t in self.targets}
        self._apply(
            OneAtATime(targets, lambda name: _stored(targets[name], rows[name])),
            optimizers,
        )

    def _first_masks(self, algo: SparsityAlgorithm, step: int) -> Mapping[str, Tensor]:
        """The phase's first masks, as rows, chosen by its algorithm at ``step``, each when it
        is read (:class:`~lightning_sparse.engine.sharding.OneAtATime`: one layer's whole
        weight gathered at a time)."""
        norms = self._calibrate(algo, step) if algo.calibrates else {}
        weights = self._whole_rows()
        # input_norms only for init='wanda': a custom layer_targets may not take them
        extra = {"input_norms": norms} if norms else {}
        targets = algo.layer_targets(step, weights, None, **extra)

        def choose(name: str) -> Tensor:
            context = MaskContext(name, step, algo.seed, input_norm=norms.get(name))
            return algo.initial_mask(weights[name], targets[name], context)

        return OneAtATime(weights, choose)

    def _whole_rows(self, masks: bool = False) -> OneAtATime:
        """Each target's whole weight (``masks``: its stored mask) as rows, gathered when read
        and not kept: algorithms see rows, each weight as its layer computes, inputs last
        (:mod:`~lightning_sparse.core.layers`)."""
        targets = {t.name: t for t in self.targets}

        def whole(name: str) -> Tensor:
            t = targets[name]
            tensor = self.masks[name] if masks else t.param.detach()
            return _rows(t, gather_full(tensor))

        shapes = {name: t.rows_shape for name, t in targets.items()}
        return OneAtATime(targets, whole, shapes)

    def _hand_over(
        self, new: ResolvedPhase | None, step: int
    ) -> dict[str, Tensor] | None:
        """Leaving a learned phase for ``new`` at ``step``: keep its layers' statistics, and
        return its most likely masks (rows) if ``new`` starts from them, else ``None``."""
        old = self.algorithm
        if not isinstance(old, Learned):
            return None
        index = old.phase.index
        report = self.learned_reports[index] = layer_statistics(old)
        line = summarize(self.name, index, report, step)
        if new is None or new.index != index + 1 or new.index not in self.handed:
            self.log(line)
            return None
        masks = {t.name: old.handover(t.name).clone() for t in self.targets}
        self.log(
            f"{line}; phase {new.index + 1} starts from these masks"
            f"{describe_projection(old)}"
        )
        return masks

    def _calibrate(self, algo: SparsityAlgorithm, step: int) -> dict[str, Tensor]:
        """The input norms of every target over the phase's calibration forwards (run with
        the model as it is now: stored weights, no mask of this group installed)."""
        assert self.current is not None
        if self.calibration_forwards is None:
            raise ValueError(
                f"[{self.name}] phases[{self.current.index}]: init='wanda' gathers input norms "
                f"with calibration forwards, and none were given: SparsityCallback runs them on "
                f"the train loader; a Sparsifier driven directly needs "
                f"calibration_forwards=(batches, seed) -> batches run"
            )
        seed = name_seed(algo.seed, "calibration", step)
        with InputNorms(self.targets) as norms:
            ran = self.calibration_forwards(algo.calibration_batches, seed)
        self.log(
            f"[{self.name}] step {step}: input norms for init='wanda' from {ran} "
            f"calibration batch(es)"
        )
        return norms.result()

    def _leave(self) -> None:
        if isinstance(self.algorithm, Learned):
            self.algorithm.release()
        self.forwards.uninstall(self.targets)
        self.masks = {}
        self._mask_versions = {}
        free_scratch()
        self._grad_lists.clear()
        self.current = None

    def close(self) -> None:
        """Remove every installed forward and drop the masks (weights stay as they are)."""
        self._leave()

    def belongs_to(self, module: nn.Module) -> bool:
        """Whether the group's parameters are ``module``'s (a group of none belongs nowhere)."""
        params = {id(p) for p in module.parameters()}
        return any(id(t.param) in params for t in self.targets)

    # -- masks ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _apply(
        self,
        masks: Mapping[str, Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        zero_state: bool = True,
    ) -> None:
        """Make new ``masks`` (whole-tensor masks, identical on every rank; each read once, in
        the targets' order, so a :class:`~lightning_sparse.engine.sharding.OneAtATime` chooses
        one layer's at a time) take effect: pruned weights become zeros and, with
        ``zero_state``, so does their optimizer state. Stored masks are laid out like their
        parameters (sharded for a DTensor); a straight-through forward keeps the whole mask,
        since it runs on the gathered weight."""
        algo = self.algorithm
        assert algo is not None
        assert self.current is not None
        for t in self.targets:
            whole = masks[t.name]
            mask = self.masks[t.name] = shard_like(whole, t.param)
            if not algo.straight_through:
                multiply_by_mask_(t.param.detach(), mask)
                if zero_state:
                    zero_optimizer_state(optimizers, t.param, ~mask)
            self.forwards.install(self.current.index, t, algo, whole)
            del whole, mask  # before the next layer's is chosen
        self.forwards.installed()
        self._grad_lists.clear()
        self._written()

    @torch.no_grad()
    def _apply_change(
        self,
        t: ParamTarget,
        mask: Tensor,
        changed: Tensor | None,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        """Store ``t``'s updated (whole-tensor) ``mask`` and make it take effect on the weight
        and optimizer state where ``changed`` (bool, or ``None``: nowhere) says it changed:
        there the weight is multiplied by the mask (a dropped weight becomes a zero of its sign,
        bit for bit what multiplying the whole weight gives) and the optimizer state is zeroed
        (a regrown weight starts clean). The caller installs the forward."""
        algo = self.algorithm
        assert algo is not None
        stored = self.masks[t.name] = shard_like(mask, t.param)
        if algo.straight_through or changed is None:
            return
        weight = t.param.detach()
        if type(weight) is not torch.Tensor:  # sharded: this rank's part of the change
            multiply_by_mask_(weight, stored)
            zero_optimizer_state(optimizers, t.param, shard_like(changed, t.param))
            return
        apply_mask_change_(weight, stored, changed, state_tensors(optimizers, t.param))

    def current_mask(self, target: ParamTarget) -> Tensor | None:
        """The mask the next forward uses (projected from the weight for ``runtime``), laid out
        like the parameter."""
        algo = self.algorithm
        if algo is None:
            return None
        if algo.projects:
            weight = target.param.detach()
            return shard_like(projection(target, algo)(gather_full(weight)), weight)
        if isinstance(algo, Learned):
            mask = _stored(target, algo.most_likely(target.name))
            return shard_like(mask, target.param.detach())
        return self.masks[target.name]

    def set_masks(
        self,
        masks: Mapping[str, Tensor],
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Replace the stored masks of some of the group's parameters in the current phase, by
        parameter name: whole-tensor bool masks of the parameters' shapes that keep the
        phase's pattern (its N:M groups; transposable 4x4 tiles where its algorithm lays 2:4
        out so). They take effect as a mask update's do: with a hard mask the pruned weights
        become zeros and so does their state in ``optimizers``; the next forward uses them,
        eagerly or in a compiled graph (a 2:4 kernel's packing of the mask is refreshed in
        place, where the graph reads it). A ``ValueError`` names what does not fit, before
        anything changes. A collective for sharded parameters: call it on every rank.

        Example:
            >>> from lightning_sparse.core.schedule import Phase, resolve_phases
            >>> from lightning_sparse.core.selection import select_parameters
            >>> net = nn.Linear(4, 2, bias=False)
            >>> phases = resolve_phases([Phase(sparsity=0.5)], total_steps=4)
            >>> sp = Sparsifier("demo", select_parameters(net, params=["weight"]).targets, phases)
            >>> _ = sp.on_step_start(0, [])
            >>> sp.set_masks({"weight": torch.tensor([[True, False] * 2, [False, True] * 2])})
            >>> sp.masks["weight"].int().tolist(), bool((net.weight[~sp.masks["weight"]] == 0).all())
            ([[1, 0, 1, 0], [0, 1, 0, 1]], True)
        """
        whole = self._checked_masks(masks)
        for t in self.targets:
            whole.setdefault(t.name, gather_full(self.masks[t.name]))
        self._apply(whole, optimizers)

    def _checked_masks(self, masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``masks`` by name, on their parameters' devices, or a ``ValueError`` that says
        which one does not fit this group's current phase and why."""
        algo, phase = self.algorithm, self.current
        where = f"[{self.name}] set_masks"
        if algo is None or phase is None:
            raise ValueError(
                f"{where}: the current phase is dense, so it has no masks to set"
            )
        if algo.projects or algo.learns:
            raise ValueError(
                f"{where}: phase {phase.index + 1} ({phase.spec.describe()}) does not store "
                f"masks: its algorithm {algo.name!r} derives them at every forward; set masks "
                f"in a phase with stored masks (static, magnitude, gmp, set, rigl)"
            )
        targets = {t.name: t for t in self.targets}
        checked = {}
        for name, mask in masks.items():
            t = targets.get(name)
            if t is None:
                raise ValueError(
                    f"{where}: {name!r} is not a parameter of this group; it has "
                    f"{sorted(targets)[:5]}"
                )
            problem = not_a_mask(mask)
            if problem is None and tuple(mask.shape) != tuple(t.param.shape):
                problem = f"of shape {tuple(mask.shape)}, not {tuple(t.param.shape)}"
            if problem is None:
                mask = mask.to(t.param.device)
                groups_only = phase.index in self.handed_groups
                broken = broken_pattern(t, mask, phase, algo, groups_only)
                problem = None if broken is None else f"not {broken}"
            if problem is not None:
                raise ValueError(
                    f"{where}: the mask for {name!r} is {problem}, which phase "
                    f"{phase.index + 1} ({phase.spec.describe()}) needs"
                )
            checked[name] = mask
        return checked

    def _written(self) -> None:
        """Record the stored masks' versions: they were written here."""
        self._mask_versions = {name: mask._version for name, mask in self.masks.items()}

    def _refuse_masks_edited_in_place(self) -> None:
        edited = [
            name
            for name, mask in self.masks.items()
            if mask._version != self._mask_versions.get(name)
        ]
        if edited:
            raise RuntimeError(
                f"[{self.name}] the stored masks of {edited[:5]} were changed in place, which "
                f"the installed forwards (a compiled graph, a 2:4 kernel's packing of the mask), "
                f"the pruned weights and their optimizer state do not follow; give new masks to "
                f"Sparsifier.set_masks({{name: mask}}, optimizers) instead (with the callback: "
                f"callback.sparsifier.set_masks)"
            )

    def before_optimizer_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> bool:
        """Call after gradients are final (accumulated, synced, unscaled) and before the
        optimizer applies them. Adds the phase's masked ``decay`` to the gradients of
        straight-through parameters (with the mask this step's forward used), runs a due mask
        update, then masks the gradients of hard-mask parameters. Returns whether masks were
        updated."""
        algo = self.algorithm
        if algo is None:
            return False
        self.forwards.verify(self.targets, self.allow_skipped_layers)
        if isinstance(algo, Learned):
            self._learn(step, algo, optimizer)
        decay = self.current.spec.decay if self.current is not None else None
        if decay and algo.straight_through:
            self.decay_gradients(optimizer, decay)
        updated = False
        if step != self.last_update_step and algo.is_update_step(step):
            updated = self._update(step, algo, optimizer, optimizers)
        if not algo.straight_through:
            self.mask_gradients(optimizer)
        return updated

    def _update(
        self,
        step: int,
        algo: SparsityAlgorithm,
        optimizer: torch.optim.Optimizer,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> bool:
        if not self._finite(optimizer):
            self.log(
                f"[{self.name}] step {step}: mask update skipped: non-finite weights or gradients"
            )
            return False
        # one layer's whole weight and mask at a time; plain tensors as rows: for a Linear,
        # the stored masks themselves, which the algorithm edits in place; for other layers
        # (and sharded ones), copies laid out as rows, each read once below
        weights, masks = self._whole_rows(), self._whole_rows(masks=True)
        targets = algo.layer_targets(step, weights, masks)
        stored: dict[str, Tensor] = {}

        def update_layer(t: ParamTarget) -> None:  # on a worker thread, perhaps
            weight, rows = weights[t.name], masks[t.name]
            grad = None if t.param.grad is None else gather_full(t.param.grad.detach())
            changed = algo.update_mask_(
                weight,
                rows,
                targets[t.name],
                MaskContext(
                    t.name, step, algo.seed, None if grad is None else _rows(t, grad)
                ),
            )
            mask = _stored(t, rows)
            changed = None if changed is None else _stored(t, changed)
            self._apply_change(t, mask, changed, optimizers)
            if workers == 1:  # before the next layer is gathered
                self.forwards.install(phase, t, algo, mask)
            else:
                stored[t.name] = mask

        assert self.current is not None
        phase = self.current.index
        params = [t.param for t in self.targets]
        workers = update_threads(algo.layers_in_parallel, params)
        sizes = [p.numel() for p in params]
        for_each_layer(update_layer, self.targets, sizes, workers)
        # worker threads leave the forwards to this thread: layers may share a module
        for t in self.targets:
            if t.name in stored:
                self.forwards.install(phase, t, algo, stored[t.name])
        self._grad_lists.clear()
        self._written()
        self.last_update_step = step
        return True

    def _learn(
        self, step: int, algo: Learned, optimizer: torch.optim.Optimizer
    ) -> None:
        """A learned phase's work before ``optimizer`` steps: with ``train_weights: false``
        the selected weights it updates lose their gradients (so it leaves them, and their
        state, as they are); once per training step (the first optimizer step of its forwards,
        however many optimizers follow), the logits' gradients are averaged over the ranks
        and the logits take their step (skipped, and logged, if a gradient is not finite, as
        a GradScaler skips the run's step)."""
        if algo.train_weights is False:
            for t in owned_by(self.targets, optimizer):
                t.param.grad = None
        if algo.step == self._learned_step:
            return
        self._learned_step = algo.step
        params = list(algo.parameters())
        if not algo.shards.splits:  # split logits: averaged in the forwards' backward
            average_over_ranks(params)
        if not all_finite([p.grad for p in params if p.grad is not None]):
            algo.skip()
            self.log(
                f"[{self.name}] step {step}: learned masks not updated: non-finite gradients"
            )
            return
        weights = None
        if algo.weight_reg_at(step) > 0:  # the regulariser reads the weights
            weights = self._whole_rows()
        algo.learn(step, weights)

    def learned_statistics(self) -> dict[str, float]:
        """In a learned phase: the fraction of the group's N:M groups whose most likely
        pattern differs from the prior's (``changed_from_prior``) and the mean entropy of
        their pattern distributions in nats (``pattern_entropy``); empty otherwise."""
        algo = self.algorithm
        if not isinstance(algo, Learned):
            return {}
        changed, groups, entropy = overall(layer_statistics(algo))
        return {"changed_from_prior": changed / groups, "pattern_entropy": entropy}

    def _finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the group's weights and every gradient the optimizer will apply are finite: a
        step that a GradScaler skips (any non-finite gradient) never updates a mask."""
        weights = [t.param for t in self.targets]
        in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
        grads = {id(p): p.grad for p in weights + in_optimizer if p.grad is not None}
        return all_finite([*weights, *grads.values()])

    def mask_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the gradients of pruned weights that ``optimizer`` updates
        (:func:`~lightning_sparse.engine.gradients.mask_gradients`)."""
        key = id(optimizer)
        if key not in self._grad_lists:
            chosen = owned_by(self.targets, optimizer)
            self._grad_lists[key] = (
                [t.param for t in chosen],
                [self.masks[t.name] for t in chosen],
            )
        mask_gradients(*self._grad_lists[key])

    def decay_gradients(self, optimizer: torch.optim.Optimizer, decay: float) -> None:
        """Masked decay of the gradients ``optimizer`` applies, with :meth:`current_mask`: the
        stored mask, or for a projecting algorithm the projection of the weights, which have
        not changed since this step's forwards
        (:func:`~lightning_sparse.engine.gradients.decay_gradients`)."""
        decay_gradients(owned_by(self.targets, optimizer), self.current_mask, decay)

    # -- observability --------------------------------------------------------------------------
    def target_sparsity(self, step: int) -> float:
        algo = self.algorithm
        return 0.0 if algo is None else sparsity_fraction(algo.target_at(step))

    @torch.no_grad()
    def actual_sparsity(self) -> float:
        """Fraction of zeros in the weights the forward sees, over the whole group."""
        zeros = total = 0
        for t in self.targets:
            weight = t.param.detach()
            mask = self.current_mask(t)
            nonzero = weight.ne(0) if mask is None else weight.ne(0) & mask
            # a sharded sum is partial (each rank's part): gathered, it is the whole count
            zeros += weight.numel() - int(gather_full(nonzero.sum()))
            total += weight.numel()
        return zeros / total if total else 0.0

    @torch.no_grad()
    def layer_sparsity(self) -> dict[str, float]:
        result = {}
        for t in self.targets:
            mask = self.current_mask(t)
            nonzero = t.param.ne(0) if mask is None else t.param.ne(0) & mask
            result[t.name] = 1.0 - float(gather_full(nonzero.float().mean()))
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Phase, last update step, masks as ``<param>_mask`` bool tensors (on the CPU) and the
        schedule (see :mod:`~lightning_sparse.engine.resume`).

        Masks of sharded parameters are gathered (a collective: call on every rank), so the
        saved masks are whole tensors whatever the strategy."""
        masks = {}
        if self.algorithm is not None:
            for t in self.targets:
                mask = gather_full(self.current_mask(t))
                masks[f"{t.name}_mask"] = mask.detach().to("cpu", copy=True)
        record = schedule_record(self.phases, self.targets)
        state = pack_state(
            _index(self.current), self.last_update_step, self.history, masks, record
        )
        if isinstance(self.algorithm, Learned):
            state["learned"] = self.algorithm.state_dict()
        if self.learned_reports:
            state["learned_reports"] = {
                index: {name: list(stats) for name, stats in layers.items()}
                for index, layers in self.learned_reports.items()
            }
        return state

    def load_state_dict(
        self,
        state: dict[str, Any],
        optimizers: Sequence[torch.optim.Optimizer],
        step: int | None = None,
        on_schedule_change: str = "error",
    ) -> PhaseChange | None:
        """Restore a saved state exactly. Saved masks are whole tensors, so a checkpoint resumes
        on any number of ranks, sharded or not. A malformed state (a phase this schedule lacks,
        a mask missing, extra, mis-shaped, not bool or breaking its phase's N:M pattern) raises
        a ``ValueError`` naming the parameter before anything changes.

        A state saved with another schedule or other parameters (see
        :func:`~lightning_sparse.engine.resume.schedule_changes`) raises a ``ValueError`` that
        lists the differences, unless ``on_schedule_change="reselect"``: then this schedule
        applies from ``step``, the step training resumes at, where the masks are chosen afresh
        for the phase it has there; the phase change is returned, and the history starts
        there."""
        restore = plan_restore(
            self.name,
            state,
            self.phases,
            self.algorithms,
            self.targets,
            step,
            on_schedule_change,
            self.handed_groups,
        )
        learned = self._learned_state(restore.saved.phase, restore.masks, state)
        reports = (  # another schedule's phases have no report here
            {}
            if restore.masks is None
            else read_reports(self.name, state.get("learned_reports"), self.phases)
        )
        if restore.note is not None:
            self.log(restore.note)
        self._leave()
        self.learned_reports = reports
        if restore.masks is None:  # a changed schedule, applied from the resume step
            assert step is not None
            self.history = []  # the saved one counts another schedule's phases
            self.last_update_step = step  # masks chosen at this step: no update on top
            phase = phase_at(self.phases, step)
            self.enter(phase, step, optimizers)
            return PhaseChange(step, None, phase)
        index = restore.saved.phase
        self.history = list(restore.saved.history)
        self.last_update_step = restore.saved.last_update_step
        self.current = None if index is None else self.phases[index]
        if index is not None and index in self.algorithms:
            self._apply(restore.masks, optimizers, zero_state=False)
        if learned is not None:
            algo = self.algorithms[index]  # type: ignore[index]
            assert isinstance(algo, Learned)
            algo.restore(learned, algo.phase.start if step is None else step)
            self.log(describe_start(self.name, algo, algo.step, resumed=True))
        return None

    def _learned_state(
        self, index: int | None, masks: dict[str, Tensor] | None, state: Any
    ) -> dict[str, Any] | None:
        """The logits and optimizer state a state saved in learned phase ``index`` holds,
        checked (a ``ValueError`` names what is wrong); ``None`` for any other phase."""
        algo = None if index is None or masks is None else self.algorithms.get(index)
        if not isinstance(algo, Learned):
            return None
        shapes = {t.name: t.rows_shape for t in self.targets}
        devices = {t.name: t.param.device for t in self.targets}
        try:
            return algo.check_state(state.get("learned"), shapes, devices)
        except ValueError as err:
            raise ValueError(
                f"[{self.name}] the checkpoint was saved in phase {index + 1} "  # type: ignore[operator]
                f"(algorithm {algo.name!r}), but {err}; the checkpoint is damaged or was not "
                f"written by SparsityCallback"
            ) from None


def _rows(t: ParamTarget, tensor: Tensor) -> Tensor:
    """``tensor`` (laid out like ``t``'s parameter) as rows: ``t``'s weight as its layer
    computes with it, inputs last; the tensor itself for a Linear weight."""
    return t.layer.to_rows(tensor).contiguous()


def _stored(t: ParamTarget, rows: Tensor) -> Tensor:
    """Rows back in the layout of ``t``'s parameter (the tensor itself for a Linear)."""
    return t.layer.from_rows(rows).contiguous()


def _index(phase: ResolvedPhase | None) -> int | None:
    return None if phase is None else phase.index
