"""Calibration forwards under Lightning: the batches ``init='wanda'`` gathers input norms from,
and the forward of ``example_input_array`` the default selection finds the output head by.

:class:`TrainLoaderForwards` runs the LightningModule's ``training_step`` on the first batches
of the train loader at a phase start, and leaves the training run exactly as it would have been
without it:

- the batches come from a DataLoader of its own, without workers, over the train loader's dataset,
  batch sampler (so each rank reads its own shard) and collate function: the trainer's
  iterator is never touched;
- every random number generator is seeded for the calibration (so the calibration batches are
  the same in a run and in its resume) and restored afterwards: torch (CPU and CUDA), NumPy,
  Python's ``random``, and the loader's and sampler's own generators; so are samplers and
  datasets that keep a ``state_dict``;
- the model runs in eval mode (no dropout, no BatchNorm statistics updated), without
  gradients, under the trainer's precision, with ``self.log`` calls ignored; each module's mode
  is restored afterwards. A metric object that ``training_step`` updates itself does see the
  calibration batches.

:func:`example_forward` runs ``model(example_input_array)`` the same way (eval mode, no
gradients, every generator restored, ``self.log`` ignored), as Lightning's model summary does.

Example:
    >>> from lightning_sparse import SparsityCallback
    >>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "algorithm": "static", "init": "wanda"}])
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.seed import isolate_rng
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader, IterableDataset


class TrainLoaderForwards:
    """``(batches, seed) -> batches run``: up to ``batches`` no-grad ``training_step`` calls on
    the first batches of ``trainer``'s train loader (see the module docstring); the
    ``calibration_forwards`` of a :class:`~lightning_sparse.engine.sparsifier.Sparsifier`."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def __call__(self, batches: int, seed: int) -> int:
        trainer = self.trainer
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                f"init='wanda' gathers input norms by running training_step without gradients, "
                f"but {type(module).__name__} sets automatic_optimization = False, so its "
                f"training_step steps the optimizers itself: use init: topk, or compute the "
                f"masks with a Sparsifier given calibration_forwards"
            )
        source = train_loader(trainer)
        loader = own_loader(source)
        # as Lightning's loop does: batch_idx only for a training_step that takes it
        takes_index = is_param_in_hook_signature(
            module.training_step, "batch_idx", min_args=2
        )
        ran = 0
        with ExitStack() as stack:
            stack.enter_context(isolate_rng())
            stack.enter_context(_seeded(seed, source))
            stack.enter_context(_eval_mode(module))
            stack.enter_context(_logging_ignored(module))
            stack.enter_context(torch.no_grad())
            for index, batch in enumerate(itertools.islice(loader, batches)):
                batch = trainer.strategy.batch_to_device(batch, dataloader_idx=0)
                with trainer.precision_plugin.train_step_context():
                    module.training_step(*(batch, index)[: 1 + takes_index])
                ran += 1
        if ran == 0:
            raise ValueError(
                "init='wanda' needs calibration batches, but the train loader gave none"
            )
        return ran


def example_forward(
    module: torch.nn.Module, trainer: pl.Trainer | None = None
) -> Callable[[], Any] | None:
    """A forward of ``module.example_input_array`` that leaves the run as it was (see the module
    docstring), or ``None`` if the module has none. The input goes to the module's device (by
    ``trainer``'s strategy, as a batch, when given) and runs under ``trainer``'s precision."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None

    def forward() -> Any:
        if trainer is None:
            device = next(module.parameters(), torch.empty(0)).device
            inputs = move_data_to_device(example, device)
        else:
            inputs = trainer.strategy.batch_to_device(example)
        with ExitStack() as stack:
            stack.enter_context(isolate_rng())
            stack.enter_context(_eval_mode(module))
            if isinstance(module, pl.LightningModule):
                stack.enter_context(_logging_ignored(module))
            stack.enter_context(torch.no_grad())
            if trainer is not None:
                stack.enter_context(trainer.precision_plugin.forward_context())
            if isinstance(inputs, (list, tuple)):
                return module(*inputs)
            if isinstance(inputs, dict):
                return module(**inputs)
            return module(inputs)

    return forward


def train_loader(trainer: pl.Trainer) -> DataLoader:
    """The trainer's train DataLoader, loaded as ``estimated_stepping_batches`` would if fit
    has not loaded it yet."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        raise ValueError(  # noqa: TRY004 (what fit was given, not an argument of ours)
            f"init='wanda' draws calibration batches from the train DataLoader, but the "
            f"trainer's train_dataloader is a {type(loader).__name__}: give fit a single "
            f"DataLoader (or a datamodule whose train_dataloader returns one), or use init: topk"
        )
    return loader


def own_loader(loader: DataLoader) -> DataLoader:
    """A DataLoader without workers that yields what a fresh iterator of ``loader`` would: the
    same dataset, batch sampler (or sampler and batch size) and collate function."""
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
        )
    if loader.batch_sampler is not None:
        return DataLoader(
            loader.dataset,
            batch_sampler=loader.batch_sampler,
            collate_fn=loader.collate_fn,
        )
    return DataLoader(
        loader.dataset,
        sampler=loader.sampler,
        batch_size=None,
        collate_fn=loader.collate_fn,
    )


def _parts(loader: DataLoader) -> list[Any]:
    """The loader and what its iteration may change: dataset, sampler, batch sampler."""
    batch_sampler = loader.batch_sampler
    parts = [loader, loader.dataset, loader.sampler, batch_sampler]
    parts.append(getattr(batch_sampler, "sampler", None))
    unique = {id(p): p for p in parts if p is not None}
    return list(unique.values())


@contextmanager
def _seeded(seed: int, loader: DataLoader) -> Iterator[None]:
    """Seed the global generators and the loader's own ones with ``seed``; afterwards restore
    the loader's generators and the ``state_dict`` of its parts (``isolate_rng`` restores the
    global generators)."""
    parts = _parts(loader)
    generators = {
        id(g): g
        for p in parts
        if isinstance(g := getattr(p, "generator", None), torch.Generator)
    }
    saved = {key: g.get_state() for key, g in generators.items()}
    states = [
        (p, copy.deepcopy(p.state_dict()))
        for p in parts
        if not isinstance(p, DataLoader)
        and callable(getattr(p, "state_dict", None))
        and callable(getattr(p, "load_state_dict", None))
    ]
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    for g in generators.values():
        g.manual_seed(seed)
    try:
        yield
    finally:
        for key, g in generators.items():
            g.set_state(saved[key])
        for part, state in states:
            part.load_state_dict(state)


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode inside; every submodule's own mode restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _logging_ignored(module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing inside: a calibration batch is no training
    step, and Lightning refuses logging outside its own loop."""
    module.log = module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
