"""``SparsityCallback``: weight sparsity on a phase schedule, as one Lightning callback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_sparse import rng_state
from lightning_sparse.algorithms import RunLength
from lightning_sparse.backends.capability import autocast_dtype
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.calibration import TrainLoaderForwards, example_forward
from lightning_sparse.core.schedule import Phase, counts_epochs
from lightning_sparse.core.selection import Selection
from lightning_sparse.engine.flips import FlipRate
from lightning_sparse.engine.sparsifier import PhaseChange, Sparsifier
from lightning_sparse.fit_start import check_strategy, fit_run_length
from lightning_sparse.formats import cerebras
from lightning_sparse.loop import SparseTraining, read_state
from lightning_sparse.openmp import busy_machine_notice
from lightning_sparse.settings import GroupSettings


def _setting(name: str) -> property:
    """A read-only attribute of the callback: the checked option ``name``."""
    return property(
        lambda self: getattr(self.settings, name), doc=f"The ``{name}`` option."
    )


class SparsityCallback(Callback):
    """Train with weight sparsity on a schedule of phases.

    Args:
        sparsity: shorthand for one phase over the whole run: a float in [0, 1) or ``"N:M"``,
            with that phase's other keys as keyword arguments (``**phase_options``), e.g.
            ``SparsityCallback(sparsity=0.9, algorithm="gmp", update_every=10)``.
        phases: a list of phases (dicts as in YAML, or :class:`~lightning_sparse.Phase`), e.g.
            ``[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}]``. Give ``sparsity`` or
            ``phases``, not both.
        params: glob patterns (or ``re:`` regexes) of parameter names to sparsify. Default: every
            Linear, Conv1D (Hugging Face) or ConvNd weight except embeddings, norms, the
            output head (found by a forward of ``example_input_array`` if the module has one,
            else by name), tied weights and layers that cannot hold an N:M pattern of the
            phases; the fit-start table lists each with its reason.
        exclude: patterns of parameters to leave dense.
        backend: ``"auto"`` (the fastest the hardware allows, per layer), ``"masked"`` (dense
            math on masked weights, any device) or ``"semi_structured"`` (2:4 sparse tensor
            cores; an error at fit start lists each layer that cannot run on them, and why).
        name: the group's name; it keys the logs and the checkpoint state (``state_key``), so
            several callbacks (groups) need distinct names (Lightning refuses two callbacks with
            one ``state_key`` when the Trainer is built) and disjoint parameters.
        log_every_n_steps: how often target/actual sparsity and the flip rate (the fraction of
            mask entries the last optimizer step changed) go to the loggers (default: the
            trainer's ``log_every_n_steps``); in a learned phase, also the fraction of N:M
            groups changed from the prior and the mean pattern entropy.
        verbose: print the plan table at fit start and a summary at the end.
        verify_speed: with ``backend="auto"``, time sparse against dense once per distinct
            layer shape on a 2:4 kernel at fit start (seconds), and keep dense math where the
            sparse kernel is slower. ``None`` (the default): on with ``backend="auto"``, for
            weights on a CUDA GPU (elsewhere no layer runs a kernel, and nothing is timed),
            each layer timed as the model runs: replayed as a CUDA graph where the model is
            compiled with CUDA graphs (``mode="reduce-overhead"`` or ``"max-autotune"``),
            else eagerly. ``True``: the same, and it also times the emulation of a kernel
            chosen off a GPU; ``"eager"`` or ``"cuda_graphs"``: timed that way; ``False``:
            every layer the kernel takes runs it, untimed.
        verify_speed_tokens: the rows of one layer's matmul in a training step that
            ``verify_speed`` times (batch x sequence length, e.g. 12 x 1024 = 12288 for a
            GPT-2 at batch 12): the ratio depends on it. Default: 8192, which the fit-start
            table then names.
        on_schedule_change: what ``fit(ckpt_path=...)`` does when the checkpoint was trained
            with other phases or parameters than this callback's: ``"error"`` (stop, naming
            each difference) or ``"reselect"`` (apply this schedule from the resume step,
            masks chosen afresh there for the phase it has at that step, logged as a phase
            change). A longer or shorter run is no change: its boundaries move with it.
        allow_skipped_layers: after the first sparse step, a selected layer whose sparse
            forward did not run is an error by default (the model may read its weight some
            other way, which would train it dense while the logs say sparse). ``True`` logs
            those layers instead, for models that skip layers on purpose (layer drop, routed
            experts, branches taken only for some inputs).
        restore_rng: also save the global random number generators' states in checkpoints
            (torch's CPU and CUDA generators, NumPy's, Python's ``random``; every process's)
            and set them back when ``fit(ckpt_path=...)`` starts, so that dropout and a
            shuffled loader's order go on as in the uninterrupted run: a resume from a
            checkpoint written at the end of an epoch is then bit for bit the uninterrupted
            run. Off by default, as it sets the generators of the whole process; a resume in
            the middle of an epoch also depends on the loader (Lightning restarts a plain
            ``DataLoader``'s epoch).
        **phase_options: with ``sparsity=``, the keys of its one phase (those of
            :class:`~lightning_sparse.Phase`: ``algorithm``, ``update_every``, ``init``,
            ``seed``, ``ramp``, ``until``...); with ``phases=``, an error (give them inside each
            phase).

    Steps are optimizer steps (``trainer.global_step``), so gradient accumulation is accounted for.
    Masks, the phase, the last update step and the schedule are saved in checkpoints and
    restored on ``fit(ckpt_path=...)`` (the global random number generators too with
    ``restore_rng=True``); the model's own ``state_dict`` keys never change.

    One callback may fit several models, one after another: each keeps what its fit left it
    with (a straight-through layer its masked forward). A second ``fit`` of one model with a
    new ``Trainer`` starts the schedule afresh; with the same ``Trainer``, which goes on from
    its ``global_step``, it goes on from the masks and phase the first left.

    Example:
        >>> import lightning as L
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": 0.5, "until": 0.5}, {"sparsity": 0.0}], verbose=False)
        >>> trainer = L.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(BoringModel())  # doctest: +SKIP
    """

    def __init__(
        self,
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
        **phase_options: Any,
    ) -> None:
        self.settings = GroupSettings(
            "SparsityCallback",
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
        # a checkpoint's generator states (restore_rng), until fit start sets them
        self._pending_rng: Any = None
        #: the engine of the latest fit, built at its start
        self.training: SparseTraining | None = None
        self._pending_state: dict[str, Any] | None = None
        self._last_logged_step = -1
        self._shown: int | None = None  # the phase number in the progress bar
        self.flips = FlipRate()

    phases = _setting("phases")
    params = _setting("params")
    exclude = _setting("exclude")
    backend = _setting("backend")
    name = _setting("name")
    log_every_n_steps = _setting("log_every_n_steps")
    verbose = _setting("verbose")
    verify_speed = _setting("verify_speed")
    verify_speed_tokens = _setting("verify_speed_tokens")
    on_schedule_change = _setting("on_schedule_change")
    allow_skipped_layers = _setting("allow_skipped_layers")
    restore_rng = _setting("restore_rng")

    @property
    def sparsifier(self) -> Sparsifier | None:
        """The engine of the latest fit (``None`` before one starts)."""
        return None if self.training is None else self.training.sparsifier

    @property
    def selection(self) -> Selection | None:
        """The parameters the latest fit selected (``None`` before one starts)."""
        return None if self.training is None else self.training.selection

    @classmethod
    def from_config(
        cls, config: cerebras.Config, name: str = "sparsity", **kwargs: Any
    ) -> list[SparsityCallback]:
        """Callbacks from a Cerebras Model Zoo sparsity block: a dict, a list of groups, a whole
        params file, or the path of a YAML file with either (see
        :mod:`lightning_sparse.formats.cerebras` for the forms and how they translate). One callback per group, named ``name`` (several: ``name_0``, ``name_1``...);
        ``kwargs`` (``backend``, ``verbose``...) go to every callback.

        Example:
            >>> [cb.name for cb in SparsityCallback.from_config(
            ...     {"type": "sideband", "sparsity": 0.5,
            ...      "param_name_patterns": {"fc1": {"sparsity": 0.3}, "fc2": None}})]
            ['sparsity_0', 'sparsity_1']
        """
        return [cls(**spec, **kwargs) for spec in cerebras.translate(config, name=name)]

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    # -- set-up ---------------------------------------------------------------------------------
    def setup(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str
    ) -> None:
        if stage != "fit":
            return
        check_strategy(trainer)
        previous = self.sparsifier
        # another model keeps the forwards and masks its own fit left it with; this one,
        # fit again by the same trainer (which goes on from its global_step), goes on from
        # its state, and by a new trainer starts its schedule afresh
        mine = previous is not None and previous.belongs_to(pl_module)
        state = self.state_dict() if mine and trainer.global_step > 0 else None
        if mine and state is None:
            previous.close()
        self.training = None
        self.flips = FlipRate()
        if state is not None:  # the same trainer goes on: so does the flip-rate summary
            self.flips.load_state_dict(state.get("flip_rate"), f"[{self.name}]")
        self._pending_state = state  # a checkpoint's state, if any, arrives after setup
        self._last_logged_step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._shown = None
        if isinstance(trainer.accelerator, CPUAccelerator):
            notice = busy_machine_notice(torch.get_num_threads())
            if notice is not None:
                rank_zero_info(notice)
        states, self._pending_rng = self._pending_rng, None
        if states is not None:
            # before the train loader's first iterator draws from the generators (the run
            # length below may load it; Lightning isolates the sanity check's draws)
            where = f"[{self.name}]"
            rng_state.restore_rank(
                states, trainer.global_rank, trainer.world_size, where
            )
        others = [
            (cb.name, cb.selection)
            for cb in trainer.callbacks
            if isinstance(cb, SparsityCallback)
            and cb is not self
            and cb.selection is not None
        ]
        self.training = SparseTraining.from_settings(
            self.settings,
            pl_module,
            fit_run_length(trainer, counts_epochs(self.phases)),
            compute_dtype=autocast_dtype(trainer.precision),
            others=others,
            calibration_forwards=TrainLoaderForwards(trainer),
            example_forward=example_forward(pl_module, trainer),
            flips=self.flips,
            pending_state=self._pending_state,
            log=rank_zero_info,
            warn=rank_zero_warn,
        )
        self._pending_state = None

    def build(
        self,
        pl_module: nn.Module,
        run: RunLength,
        compute_dtype: torch.dtype | None = None,
        others: Sequence[tuple[str, Selection]] = (),
        gpu: GpuTarget | None = None,
        calibration_forwards: Callable[[int, int], int] | None = None,
        example_forward: Callable[[], Any] | None = None,
    ) -> tuple[Sparsifier, Selection]:
        """Select this group's parameters and build its engine for a run of ``run`` optimizer
        steps: what fit start does, without touching the model (no mask is applied), so it also
        serves dry runs (``lightning-sparse plan``). ``others`` are the ``(name, selection)`` of
        the other groups, which must own disjoint parameters; ``gpu`` chooses the backends for
        that GPU instead of the parameters' device (a prediction); ``calibration_forwards``
        runs the forwards ``init='wanda'`` gathers input norms from (fit start passes
        :class:`~lightning_sparse.calibration.TrainLoaderForwards`); ``example_forward``, a
        forward of the model's ``example_input_array``, finds the output head of a default
        selection by the layers it calls (fit start and ``plan`` pass
        :func:`~lightning_sparse.calibration.example_forward`; it runs only without ``params``).

        Example:
            >>> from torch import nn
            >>> from lightning_sparse.algorithms import RunLength
            >>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
            >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
            >>> sparsifier, selection = cb.build(net, RunLength(total_steps=100))
            >>> [(p.start, p.end) for p in sparsifier.phases], [t.name for t in selection.targets]
            ([(0, 70), (70, 100)], ['0.weight'])
        """
        return self.settings.build(
            pl_module,
            run,
            compute_dtype,
            others,
            gpu,
            calibration_forwards,
            example_forward,
            log=rank_zero_info,
        )

    def _activate(self, trainer: pl.Trainer) -> None:
        """Apply masks once everything is restored (before the first forward of the fit)."""
        if self.training is None:
            return
        change = self.training.activate(trainer.global_step, trainer.optimizers)
        self._report_change(trainer, change)

    def on_sanity_check_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> None:
        self._activate(trainer)

    def on_train_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> None:
        self._activate(trainer)

    # -- training -------------------------------------------------------------------------------
    def on_train_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.training is not None
        step = trainer.global_step
        # only a logged step keeps a copy of its masks, from its first micro-batch to its end,
        # to count what it changed (for the loggers and the summary)
        snapshot = step % self._every(trainer) == 0 and bool(
            trainer.loggers or self.verbose
        )
        change = self.training.start_step(step, trainer.optimizers, snapshot)
        self._report_change(trainer, change)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        assert self.training is not None
        self.training.before_optimizer_step(
            trainer.global_step, optimizer, trainer.optimizers
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.training is not None
        phase = self.training.phase_number
        if phase != self._shown:  # the bar keeps the value; `log` costs ~1 ms a call
            self._shown = phase
            pl_module.log(
                f"{self.name}_phase",
                float(phase),
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
            )
        step = trainer.global_step
        rate = self.training.finish_step(step)
        if rate is not None:
            flips = {f"sparsity/{self.name}/flip_rate": rate}
            for logger in trainer.loggers:
                logger.log_metrics(flips, step=self.flips.snapshot_step)
        if step != self._last_logged_step and step % self._every(trainer) == 0:
            self._log_sparsity(trainer, step)

    def _every(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps or trainer.log_every_n_steps

    def _log_sparsity(self, trainer: pl.Trainer, step: int) -> None:
        assert self.training is not None
        self._last_logged_step = step
        if not trainer.loggers:
            return  # nothing would record it (counting the zeros reads every weight)
        metrics = self.training.metrics_at(step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _report_change(self, trainer: pl.Trainer, change: PhaseChange | None) -> None:
        """Send the sparsity at a phase change to the loggers (the engine printed it)."""
        if change is not None:
            self._log_sparsity(trainer, change.step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.training is not None and self.verbose:
            rank_zero_info(self.training.summary(trainer.global_step))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fit with no step left to train still ends with the engine in its state
        self._activate(trainer)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.training is None:
            return dict(self._pending_state or {})
        return self.training.group_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, rng = read_state(state_dict, self.name, self.restore_rng, rank_zero_warn)
        self.flips.load_state_dict(state.get("flip_rate"), f"[{self.name}]")
        self._pending_rng = rng
        if self.training is None:  # before fit start: it takes the state when built
            self._pending_state = state
        else:  # a sharded strategy restores callbacks after fit start
            self.training.restore_later(state)


def check_distinct_names(callbacks: Sequence[Callback]) -> None:
    """Raise a ``ValueError`` naming two ``SparsityCallback`` of ``callbacks`` (a trainer's,
    in order) that share a ``name``, and the fix. The name keys each group's logs and checkpoint
    state, so Lightning refuses two of one name when the ``Trainer`` is built.

    Example:
        >>> check_distinct_names([SparsityCallback(sparsity=0.5), SparsityCallback(sparsity="2:4")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: trainer.callbacks[0] (phases: 50% static) and trainer.callbacks[1] (phases: 2:4 runtime) are both SparsityCallback named 'sparsity': ...
    """
    seen: dict[str, tuple[int, SparsityCallback]] = {}
    for index, cb in enumerate(callbacks):
        if not isinstance(cb, SparsityCallback):
            continue
        if cb.name in seen:
            first, other = seen[cb.name]
            raise ValueError(
                f"trainer.callbacks[{first}] ({_describe(other)}) and trainer.callbacks[{index}] "
                f"({_describe(cb)}) are both SparsityCallback named {cb.name!r}: the name keys "
                f"each group's logs and checkpoint state, so it must be unique. Give one a "
                f"distinct name (init_args: {{name: {cb.name}_2}}, and disjoint params), or "
                f"remove one (a sparsity overlay such as recipes/overlays/sparsity_24_70pct.yaml "
                f"adds a callback to a base recipe that may already have one)"
            )
        seen[cb.name] = (index, cb)


def _describe(cb: SparsityCallback) -> str:
    """``params=..., phases: ...`` of a callback, for messages."""
    params = "" if cb.params is None else f"params={cb.params!r}, "
    return params + "phases: " + ", ".join(p.describe() for p in cb.phases)
