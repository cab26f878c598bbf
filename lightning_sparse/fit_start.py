"""What the callback reads from a ``Trainer`` when a fit starts: the run length in optimizer
steps, and whether the strategy's parameters can take masks.

Example:
    >>> import lightning as L
    >>> trainer = L.Trainer(max_steps=12, max_epochs=-1, logger=False)
    >>> run = fit_run_length(trainer)  # no boundary counts epochs: no data is loaded
    >>> run.total_steps, run.steps_per_epoch
    (12.0, inf)
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy

from lightning_sparse.algorithms import RunLength


def fit_run_length(trainer: pl.Trainer, epochs: bool = False) -> RunLength:
    """The run as fit counts it: ``trainer.estimated_stepping_batches`` optimizer steps, and
    an epoch's optimizer steps from this rank's train batches (after ``limit_train_batches``)
    and ``accumulate_grad_batches``. With ``epochs`` (a boundary counts epochs) the train
    dataloader is loaded now if it is not yet, as ``estimated_stepping_batches`` itself loads it
    when ``max_epochs`` bounds the run; under ``max_steps`` alone it would not be."""
    total = float(trainer.estimated_stepping_batches)
    if epochs and trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    batches = float(trainer.num_training_batches)
    per_epoch = (
        math.ceil(batches / trainer.accumulate_grad_batches)
        if math.isfinite(batches)
        else math.inf
    )
    if total >= 0:
        return RunLength(total, per_epoch)
    # a train dataloader without a length under max_epochs: Lightning returns max_steps (-1)
    return RunLength(
        math.inf,
        per_epoch,
        advice=(
            f"set Trainer(max_steps=...) (the train dataloader has no length, so "
            f"max_epochs={trainer.max_epochs} counts no optimizer steps)"
        ),
    )


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise for a strategy whose parameters cannot take masks (FSDP1)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        raise TypeError(
            "SparsityCallback does not support Lightning's FSDPStrategy (strategy='fsdp', FSDP1): "
            "it flattens parameters into 1-D shards, so a layer's mask has no weight of its "
            "shape to apply to. Use ModelParallelStrategy (FSDP2: call fully_shard in "
            "LightningModule.configure_model), which keeps each parameter a sharded DTensor, or "
            "strategy='ddp'"
        )
