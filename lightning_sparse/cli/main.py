"""``lightning-sparse``: LightningCLI with ``fit``, ``validate`` and ``plan``.

The same YAML recipes as any LightningCLI script (``model``, ``data``, ``trainer`` with its
``callbacks``), any LightningModule and LightningDataModule by ``class_path``::

    lightning-sparse fit --config recipes/vit/cpu_demo.yaml
    lightning-sparse fit --config base.yaml --config recipes/overlays/sparsity_24_70pct.yaml
    lightning-sparse validate --config recipes/vit/cpu_demo.yaml --ckpt_path last.ckpt
    lightning-sparse plan --config recipes/gpt/gpt2_24_70pct.yaml
    lightning-sparse fit --config recipes/gpt/prune_finetune_cpu.yaml --init_from dense.ckpt

``--init_from`` (or ``init_from:`` in a config) loads a model's weights before ``fit`` or
``validate`` (a Lightning checkpoint, its masks folded in, or a :func:`~lightning_sparse.save_compressed`
file), without any trainer state: the step counter, optimizer and schedule start afresh, which
is how a trained model is pruned and fine-tuned; ``init_from_command`` (a recipe's) is the
command that writes that file, which a missing file's error gives. With ``--ckpt_path`` as well,
the checkpoint is resumed and its weights win. ``--export_to`` (``fit`` only) writes the trained model's
compressed safetensors file (:func:`~lightning_sparse.save_compressed`) when ``fit`` ends.
``fit`` ends with the task metrics (the ``val*`` entries of ``trainer.callback_metrics``) and
the wall time, after each ``SparsityCallback``'s summary (phases with their step ranges, final
sparsity), both through Lightning's rank-zero logger (one stream, as Lightning's own messages). ``plan`` is a dry run that works on any machine: it builds the model on the meta device
(shapes without weights, so any size fits) and a CPU
trainer (never the configured accelerator, devices, strategy or loggers) and, only when the run
length is counted in epochs, the data; it builds every ``SparsityCallback`` as fit start would,
prints which parameters each group selects, their sparsity in each phase, the backend each would
get (on this machine, or predicted for ``--gpu h100``) and why, and the theoretical FLOP savings
(:mod:`lightning_sparse.cli.plan`), then writes a PNG of the schedule into the run's directory
(the trainer's ``default_root_dir``), or to ``--plot_path``. A configuration error ends any
subcommand with a short message, not a traceback (two ``SparsityCallback`` of one ``name`` among
them).

Example:
    >>> sorted(SparseCLI.subcommands())
    ['fit', 'plan', 'validate']
"""

from __future__ import annotations

import os
import sys
import time
from argparse import ArgumentError
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_sparse.backends.gpus import parse_gpu
from lightning_sparse.callback import check_distinct_names
from lightning_sparse.cli.config_errors import explain_parse_error
from lightning_sparse.cli.plan import SchedulePlan, format_plan, plan_schedule
from lightning_sparse.cli.plot import PLOT_HINT, plot_schedule
from lightning_sparse.core.schedule import parse_boundary
from lightning_sparse.formats.compressed import load_compressed, save_compressed
from lightning_sparse.formats.export import export_state_dict

# The command needs jsonargparse (main says so); the module imports without it, so that the
# tests collect on a GPU machine that has only torch, Lightning and pytest.
try:
    from jsonargparse import Namespace
except ModuleNotFoundError:
    Namespace = None  # type: ignore[assignment,misc]

NEEDS_JSONARGPARSE = (
    "lightning-sparse's command line needs jsonargparse, which is not installed: "
    "pip install 'jsonargparse[signatures]>=4.27' (SparsityCallback in your own script "
    "does not need it)"
)


class SparseTrainer(pl.Trainer):
    """A ``Trainer`` that can also :meth:`plan` its sparsity schedule (a dry run)."""

    def plan(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        plot: bool = True,
        plot_path: str | None = None,
        gpu: str | None = None,
    ) -> SchedulePlan:
        """Dry run of the sparsity schedule: what fit would sparsify, where, and a plot.

        Prints what each ``SparsityCallback`` would do in ``fit`` (parameters, per-layer
        sparsity per phase, backend and why, FLOP savings) without training, and plots the
        schedule.

        Args:
            model: the model ``fit`` would train.
            datamodule: its data (set up only if the run length is counted in epochs).
            plot: write a PNG of the schedule (needs matplotlib, ``lightning-sparse[plot]``).
            plot_path: where; default ``<default_root_dir>/sparsity_plan.png``.
            gpu: predict each layer's backend for this GPU (``h100``, ``a100``, ``l4``,
                ``sm80``, ...) instead of this machine.
        """
        return print_plan(self, model, datamodule, plot, plot_path, gpu)


class SparseCLI(LightningCLI):
    """LightningCLI with subcommands ``fit``, ``validate`` and ``plan`` (see the module
    docstring); models and datamodules are any subclasses, given by ``class_path``."""

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", SparseTrainer)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"exit_on_error": False})
        self._fit_started = 0.0
        self._assumed: dict[str, Any] = {}
        self._epoch_boundaries = False  # a phase boundary counts epochs (plan)
        super().__init__(
            pl.LightningModule, pl.LightningDataModule, args=args, **kwargs
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--init_from``, ``--init_from_command`` and ``--export_to`` (see the module
        docstring)."""
        parser.add_argument(
            "--init_from",
            type=str | None,
            default=None,
            help="load the model's weights from this Lightning checkpoint (masks folded in) or "
            "compressed .safetensors file before fit/validate; no trainer state is restored",
        )
        parser.add_argument(
            "--init_from_command",
            type=str | None,
            default=None,
            help="the command that writes init_from's file (a recipe that loads one names it); "
            "the error for a missing file gives it",
        )
        parser.add_argument(
            "--export_to",
            type=str | None,
            default=None,
            help="fit: write the trained model as a compressed .safetensors file at the end",
        )

    def parse_arguments(self, parser: Any, args: ArgsType) -> None:
        """Parse the command line; an error in it or in a config ends with a message."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            argv = list(sys.argv[1:] if args is None else args)
            sys.exit(
                f"lightning-sparse: {explain_parse_error(str(err), argv, self._keys(argv))}"
            )

    def _keys(self, argv: list[str]) -> list[str]:
        """The dotted keys the command line's subcommand takes (none before one is named),
        from the subcommand parsers LightningCLI keeps."""
        subcommand = next((a for a in argv if a in self.subcommands()), None)
        parser = getattr(self, "_subcommand_parsers", {}).get(subcommand)
        return list(parser.get_defaults().keys()) if parser is not None else []

    def instantiate_classes(self) -> None:
        """Build the config's objects (for ``plan``: on this CPU, see :meth:`_plan_here`, and
        on the meta device, see :meth:`_instantiate_on_meta`); a configuration error ends with
        its message instead of a traceback."""
        without_data = self.subcommand == "plan" and self._plan_here()
        try:
            if self.subcommand == "plan":
                self._instantiate_on_meta()
            else:
                config = self.config[self.subcommand]
                # before the data and the model are built, whose own errors would come first
                check_start(config.get("init_from"), config.get("init_from_command"))
                super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError) as err:
            explain = (
                _plan_error(err, self._epoch_boundaries)
                if self.subcommand == "plan"
                else _innermost(err)
            )
            sys.exit(f"lightning-sparse {self.subcommand}: {explain}")
        if without_data:
            self.datamodule = None

    def _instantiate_on_meta(self) -> None:
        """Build ``plan``'s objects with tensors on the meta device: shapes, dtypes and the
        modules' structure, which is all a plan reads, without allocating or initialising a
        weight, so a model of any size plans in seconds and little memory. A model whose
        ``__init__`` needs real values (it reads a weight back) is built again, for real,
        and the plan says so."""
        try:
            with torch.device("meta"):
                super().instantiate_classes()
            built = "on the meta device (shapes and dtypes, no weights)"
        except (NotImplementedError, RuntimeError, ValueError) as err:
            # jsonargparse reports what a class raised as a ValueError caused by it
            if not isinstance(_root(err), (NotImplementedError, RuntimeError)):
                raise
            super().instantiate_classes()
            built = (
                f"with its weights: its __init__ cannot run on the meta device "
                f"({_root(err)})"
            )
        self._assumed["note"] += f" The model was built {built}."

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Build the trainer once its callbacks are checked: two ``SparsityCallback`` of one
        ``name`` are named with the fix (Lightning would refuse them with a traceback)."""
        callbacks = self.config_init[self.subcommand]["trainer"].get("callbacks") or []
        check_distinct_names(callbacks if isinstance(callbacks, list) else [callbacks])
        return super().instantiate_trainer(**kwargs)

    def _plan_here(self) -> bool:
        """Change the ``plan`` config so that it builds on any machine: a CPU trainer (the
        configured accelerator, devices, strategy and loggers are recorded, not built), and no
        data when ``max_steps`` gives the run length and no phase boundary counts epochs (then
        ``True``: the config's data module is replaced by an empty one, never built)."""
        trainer = self.config["plan"]["trainer"]
        self._epoch_boundaries = _counts_epochs(trainer.get("callbacks"))
        configured = {
            key: trainer.get(key)
            for key in ("accelerator", "devices", "num_nodes", "strategy", "precision")
        }
        precision = str(configured["precision"] or "32-true")
        world_size = _world_size(configured["devices"], configured["num_nodes"])
        trainer["accelerator"], trainer["devices"], trainer["num_nodes"] = "cpu", 1, 1
        trainer["strategy"], trainer["logger"] = "auto", False
        if precision in (
            "16-mixed",
            "16",
        ):  # Lightning swaps it for bf16-mixed on the CPU
            trainer["precision"] = "32-true"
        max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
        steps_only = max_steps not in (None, -1) and max_epochs in (None, -1)
        if steps_only and not self._epoch_boundaries:
            self.config["plan"]["data"] = Namespace(
                class_path="lightning.pytorch.LightningDataModule",
                init_args=Namespace(),
            )
        strategy = configured["strategy"]
        strategy = getattr(strategy, "class_path", strategy) or "auto"
        self._assumed = {
            "precision": precision,
            "world_size": world_size,
            "sharded": str(strategy).endswith("ModelParallelStrategy"),
            "note": (
                f"Planned on this machine's CPU; the config's trainer settings are assumed, "
                f"not built: accelerator={configured['accelerator'] or 'auto'}, "
                f"devices={configured['devices'] or 'auto'}, "
                f"num_nodes={configured['num_nodes'] or 1}, strategy={strategy}, "
                f"precision={precision}. "
                + (
                    "No data was read (max_steps gives the run length)."
                    if steps_only and not self._epoch_boundaries
                    else "The data module was built to count the batches of an epoch."
                )
            ),
        }
        return steps_only and not self._epoch_boundaries

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "plan": {"model", "datamodule"},
        }

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a configuration error that the sparsity code raises once the run starts (a
        pattern that matches nothing, a phase the model cannot take) ends with its message.
        ``LIGHTNING_SPARSE_TRACEBACK=1`` shows the traceback instead."""
        try:
            super()._run_subcommand(subcommand)
        except (ValueError, TypeError) as err:
            if os.environ.get("LIGHTNING_SPARSE_TRACEBACK") or not _raised_here(err):
                raise
            sys.exit(f"lightning-sparse {subcommand}: {err}")

    def before_fit(self) -> None:
        self._load_initial_weights()
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        seconds = time.perf_counter() - self._fit_started
        path = self.config["fit"].get("export_to")
        if path:
            state = export_state_dict(
                self.trainer
            )  # every rank: sharded weights gather
            if self.trainer.is_global_zero:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                save_compressed(state, path)
        rank_zero_info(fit_summary(self.trainer, seconds))

    def before_validate(self) -> None:
        if self.config["validate"].get("export_to"):
            raise ValueError(
                "export_to writes the model that fit trained; validate trains nothing: unset "
                "it for validate (--export_to=null on the command line), or export a checkpoint "
                "with lightning_sparse.save_compressed('path/to.ckpt', 'model.safetensors')"
            )
        self._load_initial_weights()

    def _load_initial_weights(self) -> None:
        """Load ``init_from`` into the model (weights only; see the module docstring)."""
        path = self.config[self.subcommand].get("init_from")
        if not path:
            return
        command = self.config[self.subcommand].get("init_from_command")
        self.model.load_state_dict(
            initial_weights(path, self.model.state_dict(), command)
        )
        if self.trainer.is_global_zero:
            print(
                f"Loaded the model's weights from {path} (init_from: no trainer state)"
            )

    def plan(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        plot: bool = True,
        plot_path: str | None = None,
        gpu: str | None = None,
    ) -> None:
        """Run :meth:`SparseTrainer.plan`; a configuration error ends the command with its
        message."""
        try:
            print_plan(
                self.trainer, model, datamodule, plot, plot_path, gpu, **self._assumed
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            sys.exit(
                f"lightning-sparse plan: {_plan_error(err, self._epoch_boundaries)}"
            )


def check_start(path: str | None, command: str | None = None) -> None:
    """Raise a ``ValueError`` if ``init_from`` names no file: with the ``command`` that writes
    it (``init_from_command``) where the config names one."""
    if path and not Path(path).is_file():
        if command:
            raise ValueError(
                f"init_from={path!r}: no such file yet. The config names the command that "
                f"writes it (init_from_command); run it first, from this directory: "
                f"{' '.join(command.split())}"
            )
        raise ValueError(
            f"init_from={path!r}: no such file: give the path of a Lightning checkpoint or a "
            f"compressed .safetensors file of this model (fit --export_to=PATH writes one)"
        )


def initial_weights(
    path: str, expected: dict[str, Tensor], command: str | None = None
) -> dict[str, Tensor]:
    """The weights ``init_from`` names: a compressed ``.safetensors`` file, or a Lightning
    checkpoint with its masks folded in; a ``ValueError`` says which keys or shapes do not
    fit a model whose state dict is ``expected``, or, for a missing file, the ``command``
    that writes it (:func:`check_start`)."""
    check_start(path, command)
    if path.endswith(".safetensors"):
        state = load_compressed(path)
    else:
        state = export_state_dict(path)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: {tuple(state[k].shape)} in the file, {tuple(v.shape)} in the model"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"init_from={path!r} holds the weights of another model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, other shapes {shapes[:3]}; load a file written for "
            f"this model (same class and init_args)"
        )
    return state


def print_plan(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None,
    plot: bool,
    plot_path: str | None,
    gpu: str | None,
    precision: str | None = None,
    world_size: int | None = None,
    note: str | None = None,
    sharded: bool | None = None,
) -> SchedulePlan:
    """Plan (:func:`~lightning_sparse.cli.plan.plan_schedule`), print it after ``note`` and
    plot it (see :meth:`SparseTrainer.plan`); ``precision``, ``world_size`` and ``sharded``
    (FSDP2) are the run's when ``trainer`` was built otherwise."""
    target = None if gpu is None else parse_gpu(gpu)
    plan = plan_schedule(
        trainer, model, datamodule, target, precision, world_size, sharded
    )
    if note:
        print(note)
    print(format_plan(plan))
    if plot:
        path = plot_path or os.path.join(trainer.default_root_dir, "sparsity_plan.png")
        try:
            plot_schedule(plan, path)
            print(f"Schedule plot: {path}")
        except ModuleNotFoundError as err:
            if PLOT_HINT not in str(err):
                raise
            print(f"No schedule plot: {PLOT_HINT}")
    return plan


def _world_size(devices: Any, num_nodes: Any) -> int:
    """The processes a run on ``devices`` x ``num_nodes`` would have (1 when not a count)."""
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif isinstance(devices, str) and devices.isdigit():
        count = int(devices)
    else:
        count = 1
    return count * (num_nodes if isinstance(num_nodes, int) and num_nodes > 0 else 1)


def _root(err: BaseException) -> BaseException:
    """The error that caused ``err`` (jsonargparse wraps the one a class raised while being
    built)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _innermost(err: BaseException) -> str:
    """The message of the error that caused ``err`` (see :func:`_root`)."""
    return str(_root(err))


def _plan_error(err: BaseException, epoch_boundaries: bool = False) -> str:
    """A plan error, with what to change when the run length needs data it could not read
    (``epoch_boundaries``: a phase boundary counts epochs)."""
    message = _innermost(err)
    if _raised_by_data(err) or "dataloader" in message.lower():
        if epoch_boundaries:
            return (
                f"{message}. A phase boundary counts epochs, so plan reads the train loader's "
                f"length; to plan without the data, give the boundaries in steps ('1500 steps') "
                f"and bound the run with steps: --trainer.max_steps=N --trainer.max_epochs=-1"
            )
        return (
            f"{message}. The run length is counted in epochs, so plan reads the train "
            f"loader's length; to plan without the data, bound the run with steps: "
            f"--trainer.max_steps=N --trainer.max_epochs=-1"
        )
    return message


def _counts_epochs(config: Any) -> bool:
    """Whether a ``until``, ``update_start`` or ``update_stop`` anywhere in ``config`` (the
    trainer's callbacks as configured: namespaces, dicts and lists) is given in epochs."""
    if isinstance(config, Namespace):
        config = vars(config)
    if isinstance(config, dict):
        return any(
            (key in _BOUNDARY_KEYS and _is_epochs(value)) or _counts_epochs(value)
            for key, value in config.items()
        )
    if isinstance(config, (list, tuple)):
        return any(_counts_epochs(item) for item in config)
    return False


_BOUNDARY_KEYS = ("until", "update_start", "update_stop")


def _is_epochs(value: Any) -> bool:
    try:
        return parse_boundary(value).kind == "epochs"
    except (TypeError, ValueError):  # reported when the callback is built
        return False


_PACKAGE = str(Path(__file__).resolve().parents[1])


def _raised_here(err: BaseException) -> bool:
    """Whether ``err`` was raised by this package's own code (its validation)."""
    traceback = err.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and traceback.tb_frame.f_code.co_filename.startswith(
        _PACKAGE
    )


def _raised_by_data(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) was raised inside a data module's method."""
    while err is not None:
        traceback = err.__traceback__
        while traceback is not None:
            owner = traceback.tb_frame.f_locals.get("self")
            if isinstance(owner, pl.LightningDataModule):
                return True
            traceback = traceback.tb_next
        err = err.__cause__ or err.__context__
    return False


def fit_summary(trainer: pl.Trainer, seconds: float) -> str:
    """The end of a ``fit``: steps, epochs, the validation metrics and the wall time.

    Example:
        >>> import lightning as L, torch
        >>> trainer = L.Trainer(logger=False, accelerator="cpu")
        >>> trainer.callback_metrics.update({"val/acc": torch.tensor(0.95), "train/loss": torch.tensor(0.1)})
        >>> print(fit_summary(trainer, 83.2))
        Finished: 0 optimizer steps, 0 epochs in 83 s (1.4 min) wall time
          val/acc: 0.9500
    """
    metrics = {
        name: float(value)
        for name, value in sorted(trainer.callback_metrics.items())
        if name.startswith("val")
    }
    lines = [
        (
            f"Finished: {trainer.global_step} optimizer steps, {trainer.current_epoch} "
            f"epochs in {seconds:.0f} s ({seconds / 60:.1f} min) wall time"
        )
    ]
    lines += [f"  {name}: {value:.4f}" for name, value in metrics.items()]
    if not metrics:
        lines.append("  (no validation metrics: the run had no validation loop)")
    return "\n".join(lines)


def main(args: ArgsType = None) -> None:
    """The ``lightning-sparse`` command (``args``: the command line, default ``sys.argv``)."""
    if Namespace is None:
        sys.exit(NEEDS_JSONARGPARSE)
    SparseCLI(args=args)


if __name__ == "__main__":
    main()
