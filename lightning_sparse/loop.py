"""``SparseTraining``: weight sparsity on a schedule of phases, for a training loop you write.

The engine of :class:`~lightning_sparse.SparsityCallback` without Lightning: the same phases,
parameter selection, algorithms (``learned`` too), backends, kernel check, ``verify_speed``,
checkpoint state and export, driven by a few calls at the points every loop has:

- after the model and optimizer are built (under Fabric: after ``fabric.setup``):
  ``sparsity = SparseTraining(model, optimizer, phases=..., total_steps=...)``;
- after each ``optimizer.step()``: ``sparsity.step()`` (once per optimizer step, never per
  micro-batch);
- at a checkpoint save: ``sparsity.state_dict()`` into the checkpoint (under Fabric, the object
  itself in ``fabric.save``'s ``state``); at a load: ``sparsity.load_state_dict(...)``;
- at the end: ``sparsity.end()``, then ``sparsity.export_state_dict()`` for a dense state dict.

What runs between the final gradients and the optimizer's update (the gradients of pruned
weights masked, a due mask update, a learned phase's logits stepped) runs inside
``optimizer.step()``, through a step pre-hook on each optimizer: gradient accumulation, a
``GradScaler`` and gradient clipping need no call of their own. Importing this module imports
no Lightning.

Example (plain PyTorch):
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse import SparseTraining
    >>> torch.manual_seed(0) and None
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    >>> sparsity = SparseTraining(net, opt, phases=[{"sparsity": 0.5, "until": 5}, {"sparsity": 0.0}],
    ...                           total_steps=10, verbose=False)
    >>> for step in range(10):
    ...     net(torch.randn(4, 8)).sum().backward()
    ...     opt.step(); sparsity.step(); opt.zero_grad()
    ...     if step == 3: print((net[0].weight == 0).float().mean().item())
    0.5
    >>> sparsity.end()
    >>> sorted(sparsity.export_state_dict())
    ['0.bias', '0.weight', '2.bias', '2.weight']
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_sparse import rng_state
from lightning_sparse.algorithms import RunLength
from lightning_sparse.backends.cuda_graphs import compiled_with_cuda_graphs
from lightning_sparse.backends.speed import CUDA_GRAPHS
from lightning_sparse.core.schedule import Phase
from lightning_sparse.core.selection import Selection
from lightning_sparse.engine.flips import FlipRate
from lightning_sparse.engine.ranks import rank, world_size
from lightning_sparse.engine.report import plan_table, summary
from lightning_sparse.engine.sharding import gather_full
from lightning_sparse.engine.sparsifier import PhaseChange
from lightning_sparse.formats.fold import fold_masks
from lightning_sparse.settings import GroupSettings

DEFAULT_LOG_EVERY = 50
"""How often (in optimizer steps) a loop's flip rate is measured without ``log_every_n_steps``."""


class SparseTraining:
    """Train ``model`` with weight sparsity on a schedule of phases, in a loop you write.

    Args:
        model: the model, after ``fabric.setup`` under Fabric; a Fabric- or
            ``DistributedDataParallel``-wrapped model is unwrapped, so parameter names and
            ``params`` patterns are those of your own module.
        optimizer: the optimizer (or a list of them) that steps the model's parameters; each
            gets a step pre-hook that does the group's work before its update.
        total_steps: the run's length in optimizer steps; fractions and percentages in
            ``until`` resolve against it.
        steps_per_epoch: optimizer steps per epoch, for boundaries such as ``"3 epochs"``.
        compute_dtype: the autocast dtype of the model's matmuls (e.g. ``torch.bfloat16``
            under Fabric's ``precision="bf16-mixed"``): the 2:4 kernels and the kernel check
            run in it. ``None``: the weights' own dtype.
        calibration_forwards: for ``init='wanda'``: ``(batches, seed) -> batches run``, which
            runs up to ``batches`` no-grad forwards of the model on training data (see
            :class:`~lightning_sparse.engine.sparsifier.Sparsifier`).
        log_every_n_steps: how often the flip rate is measured (default 50), which
            :meth:`metrics` then reports.
        verbose: print (on rank 0) the plan table, each phase change and mask-update
            notice, and the summary at :meth:`end`; warnings go to ``warnings.warn`` either way.
        **phase_options: with ``sparsity=``, the keys of its one phase. ``sparsity``,
            ``phases``, ``params``, ``exclude``, ``backend``, ``name``, ``verify_speed``,
            ``verify_speed_tokens``, ``on_schedule_change``, ``allow_skipped_layers`` and
            ``restore_rng`` are those of :class:`~lightning_sparse.SparsityCallback`.

    The schedule starts at step 0 when the object is built (the first phase's masks apply
    then), so build it before loading a checkpoint into the model and optimizer; then
    :meth:`load_state_dict` restores masks, phase and step. Without ``params`` the output head
    is found by name (``lm_head``, ``head``...).

    Call :meth:`step` on every rank; under ``torch.distributed`` masks are chosen from the
    weights every rank holds alike, so they are the same on every rank, and the state of
    sharded (FSDP2) parameters is gathered (a collective).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        total_steps: int,
        steps_per_epoch: int | None = None,
        sparsity: str | float | None = None,
        phases: Sequence[Phase | dict[str, Any]] | None = None,
        params: Sequence[str] | str | None = None,
        exclude: Sequence[str] | str | None = None,
        backend: str = "auto",
        name: str = "sparsity",
        log_every_n_steps: int | None = None,
        verbose: bool = True,
        verify_speed: bool | str | None = None,
        verify_speed_tokens: int | None = None,
        on_schedule_change: str = "error",
        allow_skipped_layers: bool = False,
        restore_rng: bool = False,
        compute_dtype: torch.dtype | None = None,
        calibration_forwards: Callable[[int, int], int] | None = None,
        **phase_options: Any,
    ) -> None:
        settings = GroupSettings(
            "SparseTraining",
            sparsity,
            phases,
            params,
            exclude,
            backend,
            name,
            log_every_n_steps,
            verbose,
            verify_speed,
            verify_speed_tokens,
            on_schedule_change,
            allow_skipped_layers,
            restore_rng,
            **phase_options,
        )
        optimizers = _optimizers(optimizer)
        self._attach(
            settings,
            unwrap_model(model),
            loop_run_length(total_steps, steps_per_epoch),
            compute_dtype=compute_dtype,
            calibration_forwards=calibration_forwards,
            log=_print_on_rank_zero if settings.verbose else _quiet,
            warn=_warn_on_rank_zero,
        )
        self.optimizers = optimizers
        self._hooks = [
            opt.register_step_pre_hook(self._before_optimizer_step)
            for opt in optimizers
        ]
        self.activate(0, optimizers)
        self._start(0)

    @classmethod
    def from_settings(
        cls,
        settings: GroupSettings,
        model: nn.Module,
        run: RunLength,
        *,
        compute_dtype: torch.dtype | None = None,
        others: Sequence[tuple[str, Selection]] = (),
        calibration_forwards: Callable[[int, int], int] | None = None,
        example_forward: Callable[[], Any] | None = None,
        flips: FlipRate | None = None,
        pending_state: Mapping[str, Any] | None = None,
        log: Callable[[str], None] = print,
        warn: Callable[[str], None] = warnings.warn,
    ) -> SparseTraining:
        """The group built for a front end that drives it with explicit steps (the
        Lightning callback): no optimizer hooks, and nothing applied until :meth:`activate`,
        which restores ``pending_state`` (a checkpoint's) if given. Arguments as for
        :meth:`GroupSettings.build <lightning_sparse.settings.GroupSettings.build>`."""
        self = cls.__new__(cls)
        self._attach(
            settings,
            model,
            run,
            compute_dtype=compute_dtype,
            others=others,
            calibration_forwards=calibration_forwards,
            example_forward=example_forward,
            flips=flips,
            log=log,
            warn=warn,
        )
        self._pending_state = None if pending_state is None else dict(pending_state)
        return self

    def _attach(
        self,
        settings: GroupSettings,
        model: nn.Module,
        run: RunLength,
        *,
        compute_dtype: torch.dtype | None = None,
        others: Sequence[tuple[str, Selection]] = (),
        calibration_forwards: Callable[[int, int], int] | None = None,
        example_forward: Callable[[], Any] | None = None,
        flips: FlipRate | None = None,
        log: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        """Build the group on ``model`` (selection, backends, kernel check, ``verify_speed``),
        warn about its schedule and print its plan table."""
        self.settings = settings
        self.name = settings.name
        self.model = model
        self._log = log
        self._warn = warn
        self.sparsifier, self.selection = settings.build(
            model,
            run,
            compute_dtype,
            others,
            calibration_forwards=calibration_forwards,
            example_forward=example_forward,
            log=log,
        )
        for warning in self.sparsifier.schedule_warnings():
            warn(warning)
        if settings.verify_speed == CUDA_GRAPHS and not compiled_with_cuda_graphs(
            model
        ):
            warn(
                f"[{self.name}] verify_speed='cuda_graphs' times each layer replayed as a CUDA "
                f"graph, but the model is not compiled with CUDA graphs (torch.compile with "
                f"mode='reduce-overhead' or 'max-autotune'): a layer kept on 2:4 kernels may "
                f"run slower than dense eagerly; use verify_speed=True to time it as it runs"
            )
        if settings.verbose:
            log(plan_table(self.sparsifier, self.selection))
        self.flips = FlipRate() if flips is None else flips
        self._total_steps = run.total_steps
        self.active = False
        self._pending_state: dict[str, Any] | None = None
        # the loop's own bookkeeping (the callback counts steps with the trainer's)
        self.optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self.current_step = (
            0  #: optimizer steps done: the step whose forwards come next
        )
        self._stepped: set[int] = set()  # optimizers that stepped since the last step()
        self._idle_warned = False
        self._ended = False
        self._last_flip_rate: float | None = None

    # -- the calls of a loop --------------------------------------------------------------------
    def step(self) -> None:
        """Call once after each optimizer step (after every optimizer's, with several): the
        step count goes on, and the next step's phase begins if one is due."""
        self._refuse_ended("SparseTraining.step()")
        if not self._stepped and not self._idle_warned:
            self._idle_warned = True
            self._warn(
                f"[{self.name}] SparseTraining.step() was called at step {self.current_step} "
                f"with no optimizer step since the last call: call it once after each "
                f"optimizer.step(), not after each micro-batch (with gradient accumulation, "
                f"only where the optimizer steps), or the schedule runs ahead of training. A "
                f"step that a GradScaler skipped counts as a step, as in Lightning"
            )
        self._stepped.clear()
        self.current_step += 1
        rate = self.finish_step(self.current_step)
        if rate is not None:
            self._last_flip_rate = rate
        self._start(self.current_step)

    def _start(self, step: int) -> None:
        if step >= self._total_steps:
            return  # the run is over: its last phase (its masks and forwards) stays
        every = self.settings.log_every_n_steps or DEFAULT_LOG_EVERY
        self.start_step(step, self.optimizers, snapshot=step % every == 0)

    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> None:
        """The step pre-hook of each optimizer: the group's work on the final gradients."""
        if _initializing_state(optimizer):
            return
        if id(optimizer) in self._stepped:
            raise RuntimeError(
                f"[{self.name}] optimizer.step() ran twice at step {self.current_step} "
                f"without SparseTraining.step() between, so the schedule would not follow "
                f"training (phases would not begin, masks not update): call sparsity.step() "
                f"once right after each optimizer.step()"
            )
        self._stepped.add(id(optimizer))
        self.before_optimizer_step(self.current_step, optimizer, self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """The group's state for a checkpoint (``torch.save`` reads it with
        ``weights_only=True``): masks, phase, step and schedule, the flip-rate records, in a
        learned phase its logits (gathered from the ranks), and with ``restore_rng=True``
        every process's random number generator states. A collective under
        ``torch.distributed`` (sharded masks, learned logits, generators): call it on every
        rank, and save on one."""
        self._refuse_missing_step("a checkpoint is saved")
        return {**self.group_state(), "step": self.current_step}

    def load_state_dict(
        self, state: Mapping[str, Any], step: int | None = None
    ) -> None:
        """Restore :meth:`state_dict` (call on every rank): masks, phase, step, and with
        ``restore_rng=True`` the random number generators, which then draw as in the run
        that saved it. ``step``: the step to resume at, for a state without one (a
        :class:`~lightning_sparse.SparsityCallback` checkpoint's: its ``global_step``)."""
        state, rng = read_state(
            state, self.name, self.settings.restore_rng, self._warn, "SparseTraining"
        )
        saved = state.get("step", step)
        if isinstance(saved, bool) or not isinstance(saved, int) or saved < 0:
            where = "has no 'step'" if "step" not in state else f"has step {saved!r}"
            raise ValueError(
                f"[{self.name}] the sparsity state {where}: a SparsityCallback checkpoint's "
                f"state needs the step to resume at, load_state_dict(state, "
                f"step=checkpoint['global_step'])"
            )
        if rng is not None:
            rng_state.restore_rank(rng, rank(), world_size(), f"[{self.name}]")
        self.flips.load_state_dict(state.get("flip_rate"), f"[{self.name}]")
        self.restore_later(state)
        self._stepped.clear()
        self.current_step = saved
        self.activate(saved, self.optimizers)
        self._start(saved)

    def end(self) -> None:
        """Call once training is done: checks that every optimizer step had its
        :meth:`step`, prints the summary (``verbose``) and removes the optimizer hooks. The
        masks and sparse forwards stay, for evaluation and :meth:`export_state_dict`."""
        self._refuse_missing_step("training ends")
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._ended = True
        if self.settings.verbose:
            self._log(self.summary(self.current_step))

    def export_state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with the masks folded in: dense tensors, zeros where
        weights are pruned, the model's own keys (loads with ``strict=True`` into the model
        without lightning_sparse). Weights of sharded parameters are gathered (a collective:
        call on every rank)."""
        masks = self.sparsifier.state_dict()["masks"]
        state = {k: gather_full(v.detach()) for k, v in self.model.state_dict().items()}
        return fold_masks(state, masks)

    def metrics(self) -> dict[str, float]:
        """``sparsity/<name>/target``, ``/actual``, ``/phase`` (and in a learned phase the
        learned statistics) at the current step, plus ``/flip_rate`` once one was measured:
        for your logger. In a distributed run, call it on every rank: sparsity of sharded
        weights and learned statistics are summed over the ranks (a collective)."""
        values = self.metrics_at(self.current_step)
        if self._last_flip_rate is not None:
            values[f"sparsity/{self.name}/flip_rate"] = self._last_flip_rate
        return values

    def _refuse_missing_step(self, when: str) -> None:
        if self._stepped:
            raise RuntimeError(
                f"[{self.name}] {when} after optimizer.step() at step {self.current_step} "
                f"without SparseTraining.step() after it, so the saved or final state would be "
                f"a step behind training: call sparsity.step() right after each "
                f"optimizer.step(), before saving or ending"
            )

    def _refuse_ended(self, call: str) -> None:
        if self._ended:
            raise RuntimeError(
                f"[{self.name}] {call} after SparseTraining.end(): end() is the last call (it "
                f"removed the optimizer hooks); build a new SparseTraining to train on"
            )

    # -- the calls of a front end with its own step count (the Lightning callback) --------------
    def activate(
        self, step: int, optimizers: Sequence[torch.optim.Optimizer]
    ) -> PhaseChange | None:
        """Apply the masks of ``step``'s phase, or restore the pending checkpoint state at
        ``step``; once (until the next :meth:`load_state_dict`). Returns the phase change."""
        if self.active:
            return None
        self.active = True
        if self._pending_state is not None:
            change = self.sparsifier.load_state_dict(
                self._pending_state, optimizers, step, self.settings.on_schedule_change
            )
            self._pending_state = None
        else:
            change = self.sparsifier.on_step_start(step, optimizers)
        self._report(change)
        return change

    def restore_later(self, state: Mapping[str, Any]) -> None:
        """Keep a checkpoint's group ``state`` (checked by :func:`read_state`) for the next
        :meth:`activate` to restore (Lightning restores a sharded strategy's callbacks after
        fit start)."""
        self._pending_state = dict(state)
        self.active = False

    def start_step(
        self, step: int, optimizers: Sequence[torch.optim.Optimizer], snapshot: bool
    ) -> PhaseChange | None:
        """Before the first forward of optimizer step ``step``: begin a due phase; with
        ``snapshot``, keep the masks to measure the step's flip rate. Returns the change."""
        change = self.sparsifier.on_step_start(step, optimizers)
        self._report(change)
        if snapshot and step != self.flips.snapshot_step:
            self.flips.snapshot(self.sparsifier, step)
        return change

    def before_optimizer_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> bool:
        """After the gradients are final, before ``optimizer`` applies them (see
        :meth:`Sparsifier.before_optimizer_step
        <lightning_sparse.engine.sparsifier.Sparsifier.before_optimizer_step>`)."""
        return self.sparsifier.before_optimizer_step(step, optimizer, optimizers)

    def finish_step(self, steps_done: int) -> float | None:
        """After a batch, with ``steps_done`` optimizer steps done: the flip rate of the step
        a snapshot waits for, once that step is done."""
        if self.flips.pending and steps_done > self.flips.snapshot_step:
            return self.flips.measure(self.sparsifier)
        return None

    def metrics_at(self, step: int) -> dict[str, float]:
        """Target and actual sparsity, the phase number and any learned statistics."""
        sp = self.sparsifier
        metrics = {
            f"sparsity/{self.name}/target": sp.target_sparsity(step),
            f"sparsity/{self.name}/actual": sp.actual_sparsity(),
            f"sparsity/{self.name}/phase": float(self.phase_number),
        }
        for key, value in sp.learned_statistics().items():
            metrics[f"sparsity/{self.name}/{key}"] = value
        return metrics

    @property
    def phase_number(self) -> int:
        """The current phase, counted from 1 (0 after the last)."""
        current = self.sparsifier.current
        return 0 if current is None else current.index + 1

    def group_state(self) -> dict[str, Any]:
        """The group's checkpoint state, without the loop's step (the callback's state)."""
        if not self.active:
            return dict(self._pending_state or {})
        state = {**self.sparsifier.state_dict(), "flip_rate": self.flips.state_dict()}
        if self.settings.restore_rng:
            state["rng"] = rng_state.capture_ranks()
        return state

    def summary(self, step: int) -> str:
        """The end-of-run summary: phases, final sparsity, flip rates."""
        return summary(self.sparsifier, step, self.flips)

    def describe_change(self, change: PhaseChange) -> str:
        """``[name] step 70: after the last phase begins: dense``."""
        new = change.new
        what = "dense" if new is None else new.spec.describe()
        count = len(self.sparsifier.phases)
        where = (
            "after the last phase" if new is None else f"phase {new.index + 1}/{count}"
        )
        return f"[{self.name}] step {change.step}: {where} begins: {what}"

    def _report(self, change: PhaseChange | None) -> None:
        if change is not None:
            self._log(self.describe_change(change))


def read_state(
    state: Any,
    name: str,
    restore_rng: bool,
    warn: Callable[[str], None],
    owner: str = "SparsityCallback",
) -> tuple[dict[str, Any], Any]:
    """A checkpoint's group ``state`` as a dict, and its random number generator states
    (``None`` without ``restore_rng``, or with a warning if the checkpoint holds none); the
    rest is checked when the masks are restored, once the parameters are known."""
    if not isinstance(state, Mapping):
        raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
            f"[{name}] the checkpoint's sparsity state is a {type(state).__name__}, not a "
            f"dict; the checkpoint is damaged or was not written by {owner}"
        )
    rng = state.get("rng") if restore_rng else None
    if restore_rng and rng is None:
        warn(
            f"[{name}] restore_rng=True, but the checkpoint holds no random number generator "
            f"states (it was written with restore_rng=False): dropout and data order follow "
            f"this run's generators from here"
        )
    return dict(state), rng


def loop_run_length(total_steps: Any, steps_per_epoch: Any = None) -> RunLength:
    """The run of a loop: ``total_steps`` optimizer steps, ``steps_per_epoch`` a epoch (or an
    unknown epoch length), each checked."""
    for key, value in (
        ("total_steps", total_steps),
        ("steps_per_epoch", steps_per_epoch),
    ):
        if value is None and key == "steps_per_epoch":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"SparseTraining({key}={value!r}): give the number of optimizer steps "
                f"{'the run has' if key == 'total_steps' else 'an epoch has'}, a positive "
                f"integer (with gradient accumulation: batches // accumulation steps)"
            )
    per_epoch = math.inf if steps_per_epoch is None else float(steps_per_epoch)
    return RunLength(
        float(total_steps),
        per_epoch,
        advice="pass SparseTraining(steps_per_epoch=...) for boundaries counted in epochs",
    )


def unwrap_model(model: Any) -> nn.Module:
    """The user's own module inside a Fabric or ``DistributedDataParallel`` wrapper (whose
    parameters are the same tensors, named without the wrapper's prefix)."""
    # Fabric's wrappers module is loaded only where Fabric is in use: never imported here
    wrappers = sys.modules.get("lightning.fabric.wrappers")
    if wrappers is not None and wrappers.is_wrapped(model):
        model = model.module
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"SparseTraining(model=...) takes the model (an nn.Module, or what fabric.setup "
            f"returned); got a {type(model).__name__}"
        )
    return model


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers to hook, Fabric's wrappers unwrapped (they share the hooks)."""
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    optimizers = [getattr(opt, "optimizer", opt) for opt in given]
    if not optimizers or not all(
        isinstance(o, torch.optim.Optimizer) for o in optimizers
    ):
        raise TypeError(
            f"SparseTraining(model, optimizer, ...) takes the optimizer (or a list of them) "
            f"that steps the model, to mask gradients and update masks before each step; got "
            f"{optimizer!r}"
        )
    return optimizers


def _initializing_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this ``optimizer.step()`` only creates the optimizer's state: what
    ``torch.distributed.checkpoint`` does before loading into an optimizer without state (FSDP2
    checkpoints), a step of all-zero gradients at learning rate 0, which trains nothing."""
    if optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(float(group.get("lr", 1.0)) != 0.0 for group in groups):
        return False
    grads = [p.grad for group in groups for p in group["params"] if p.requires_grad]
    return all(g is not None and not g.any() for g in grads)


def _print_on_rank_zero(message: str) -> None:
    if rank() == 0:
        print(message)


def _quiet(message: str) -> None:
    """Print nothing (``verbose=False``)."""


def _warn_on_rank_zero(message: str) -> None:
    if rank() == 0:
        warnings.warn(message, stacklevel=3)
