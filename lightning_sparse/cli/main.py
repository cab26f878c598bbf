"""``lightning-sparse``: LightningCLI with ``fit``, ``validate`` and ``plan``.

The same YAML recipes as any LightningCLI script (``model``, ``data``, ``trainer`` with its
``callbacks``), any LightningModule and LightningDataModule by ``class_path``::

    lightning-sparse fit --config recipes/vit/cpu_demo.yaml
    lightning-sparse fit --config base.yaml --config recipes/overlays/sparsity_24_70pct.yaml
    lightning-sparse validate --config recipes/vit/cpu_demo.yaml --ckpt_path last.ckpt
    lightning-sparse plan --config recipes/gpt/gpt2_24_70pct.yaml

``fit`` ends with the task metrics (the ``val*`` entries of ``trainer.callback_metrics``) and
the wall time, after each ``SparsityCallback``'s summary (phases with their step ranges, final
sparsity). ``plan`` is a dry run: it instantiates the model, data and trainer of the config,
builds every ``SparsityCallback`` as fit start would, prints which parameters each group
selects, their sparsity in each phase, the backend each would get on this machine and why, and
the theoretical FLOP savings (:mod:`lightning_sparse.cli.plan`), then writes a PNG of the schedule
next to the (first) config, or to ``--plot_path``.

Example:
    >>> sorted(SparseCLI.subcommands())
    ['fit', 'plan', 'validate']
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning_sparse.cli.plan import SchedulePlan, format_plan, plan_schedule
from lightning_sparse.cli.plot import PLOT_HINT, plot_schedule


class SparseTrainer(pl.Trainer):
    """A ``Trainer`` that can also :meth:`plan` its sparsity schedule (a dry run)."""

    def plan(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        plot: bool = True,
        plot_path: str | None = None,
    ) -> SchedulePlan:
        """Dry run of the sparsity schedule: print what each ``SparsityCallback`` would do in
        ``fit`` (parameters, per-layer sparsity per phase, backend and why, FLOP savings)
        without training, and plot the schedule.

        Args:
            model: the model ``fit`` would train.
            datamodule: its data (set up only if the run length is counted in epochs).
            plot: write a PNG of the schedule (needs matplotlib, ``lightning-sparse[plot]``).
            plot_path: where; default ``<default_root_dir>/sparsity_plan.png`` (the command
                line: next to the config).
        """
        plan = plan_schedule(self, model, datamodule)
        print(format_plan(plan))
        if plot:
            path = plot_path or os.path.join(self.default_root_dir, "sparsity_plan.png")
            try:
                plot_schedule(plan, path)
                print(f"Schedule plot: {path}")
            except ModuleNotFoundError as err:
                if PLOT_HINT not in str(err):
                    raise
                print(f"No schedule plot: {PLOT_HINT}")
        return plan


class SparseCLI(LightningCLI):
    """LightningCLI with subcommands ``fit``, ``validate`` and ``plan`` (see the module
    docstring); models and datamodules are any subclasses, given by ``class_path``."""

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", SparseTrainer)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self._fit_started = 0.0
        super().__init__(
            pl.LightningModule, pl.LightningDataModule, args=args, **kwargs
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "plan": {"model", "datamodule"},
        }

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(fit_summary(self.trainer, time.perf_counter() - self._fit_started))

    def plan(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        plot: bool = True,
        plot_path: str | None = None,
    ) -> None:
        """Run :meth:`SparseTrainer.plan`, the plot next to the config by default; a
        configuration error ends the command with its message."""
        if plot_path is None:
            plot_path = self._plot_path_beside_config()
        try:
            self.trainer.plan(model, datamodule, plot=plot, plot_path=plot_path)
        except ValueError as err:
            sys.exit(f"lightning-sparse plan: {err}")

    def _plot_path_beside_config(self) -> str | None:
        """``<config stems joined by +>_plan.png`` beside the first config; ``None`` without a
        config (the trainer's default then)."""
        configs = [Path(str(c)) for c in self.config["plan"].get("config") or []]
        if not configs:
            return None
        stem = "+".join(c.stem for c in configs)
        return str(configs[0].parent / f"{stem}_plan.png")


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
    SparseCLI(args=args)


if __name__ == "__main__":
    main()
