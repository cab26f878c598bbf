"""Run lengths from any train loader: epoch boundaries under ``max_steps``, loaders without a
length under ``max_epochs``, and errors whose suggested fix, applied, runs (in fit and in
``lightning-sparse plan``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, TinyModule, fast_trainer, random_loader
from torch.utils.data import DataLoader, IterableDataset

from lightning_sparse import SparsityCallback
from lightning_sparse.cli.main import SparseCLI
from lightning_sparse.cli.plan import plan_schedule

pytestmark = FEW_UPDATES

EPOCH_PHASES = [{"sparsity": 0.5, "until": "1 epoch"}, {"sparsity": 0.0}]
VIT_DEMO = Path(__file__).resolve().parents[1] / "recipes" / "vit" / "cpu_demo.yaml"


class Stream(IterableDataset):
    """A finite stream without a length: 16 samples."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(16):
            yield torch.randn(8, generator=gen), torch.randn(4, generator=gen)


def stream() -> DataLoader:
    return DataLoader(Stream(), batch_size=4)  # 4 batches an epoch


class Epochs(L.Callback):
    """The epoch of every optimizer step (at its first batch)."""

    def __init__(self) -> None:
        self.epoch_at: dict[int, int] = {}

    def on_train_batch_start(self, trainer, *args) -> None:
        self.epoch_at.setdefault(trainer.global_step, trainer.current_epoch)


def fit(phases, loader, **trainer_kwargs) -> tuple[SparsityCallback, Epochs]:
    cb = SparsityCallback(phases=phases, verbose=False)
    epochs = Epochs()
    fast_trainer(callbacks=[cb, epochs], **trainer_kwargs).fit(TinyModule(), loader)
    return cb, epochs


@pytest.mark.parametrize(
    ("accumulate", "limit", "steps_per_epoch"),
    [(1, 1.0, 8), (3, 1.0, 3), (1, 5, 5), (2, 0.5, 2)],
)
def test_an_epoch_boundary_under_max_steps_ends_where_the_second_epoch_starts(
    accumulate, limit, steps_per_epoch
):
    cb, epochs = fit(
        EPOCH_PHASES,
        random_loader(n=64, batch_size=8),  # 8 batches an epoch
        max_steps=12,
        accumulate_grad_batches=accumulate,
        limit_train_batches=limit,
    )
    first, second = cb.sparsifier.phases
    assert (first.start, first.end) == (0, steps_per_epoch)
    assert (second.start, second.end) == (steps_per_epoch, 12)
    assert epochs.epoch_at[steps_per_epoch - 1] == 0
    assert epochs.epoch_at[steps_per_epoch] == 1
    assert cb.sparsifier.history == [(0, 0), (steps_per_epoch, 1)]


def test_an_epoch_boundary_on_a_loader_without_a_length_says_what_to_set_and_that_runs():
    with pytest.raises(
        ValueError,
        match=r"phases\[0\].until='1 epoch' counts epochs, but the train dataloader has no "
        r"length, so an epoch has no known number of steps: give the boundary in steps "
        r"\('1500 steps'\) or set Trainer\(limit_train_batches=<int>\)",
    ):
        fit(EPOCH_PHASES, stream(), max_steps=6)
    cb, epochs = fit(EPOCH_PHASES, stream(), max_steps=6, limit_train_batches=3)
    assert [(p.start, p.end) for p in cb.sparsifier.phases] == [(0, 3), (3, 6)]
    assert epochs.epoch_at[3] == 1
    cb, _ = fit(
        [{"sparsity": 0.5, "until": "4 steps"}, {"sparsity": 0.0}],
        stream(),
        max_steps=6,
    )
    assert [(p.start, p.end) for p in cb.sparsifier.phases] == [(0, 4), (4, 6)]


def test_a_loader_without_a_length_under_max_epochs_runs_when_nothing_needs_the_length():
    cb, epochs = fit([{"sparsity": 0.5}], stream(), max_epochs=2)
    assert max(epochs.epoch_at) == 7 and epochs.epoch_at[7] == 1  # 2 epochs of 4 steps
    assert cb.sparsifier.phases[0].end is None  # runs to the end, whatever it is
    assert cb.sparsifier.actual_sparsity() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "phases",
    [
        [{"sparsity": 0.5, "until": 0.5}, {"sparsity": 0.0}],
        [{"sparsity": 0.5, "algorithm": "gmp", "update_every": 1}],
        [{"sparsity": 0.5, "algorithm": "set", "update_every": 1}],
    ],
    ids=["fraction", "gmp ramp", "set decay"],
)
def test_a_loader_without_a_length_under_max_epochs_says_to_set_max_steps(phases):
    with pytest.raises(
        ValueError,
        match=r"set Trainer\(max_steps=...\) \(the train dataloader has no length, so "
        r"max_epochs=2 counts no optimizer steps\)",
    ) as err:
        fit(phases, stream(), max_epochs=2)
    assert "-1" not in str(err.value)
    cb, epochs = fit(phases, stream(), max_epochs=2, max_steps=6)  # the suggestion
    assert max(epochs.epoch_at) == 5
    assert cb.sparsifier.phases[-1].end == 6


@pytest.mark.parametrize(
    ("trainer_kwargs", "steps_per_epoch"),
    [
        ({"max_steps": 12}, 8),
        ({"max_steps": 12, "accumulate_grad_batches": 3}, 3),
        ({"max_steps": 12, "limit_train_batches": 5}, 5),
        ({"max_epochs": 2, "limit_train_batches": 0.5}, 4),
    ],
)
def test_plan_places_epoch_boundaries_as_fit_does(trainer_kwargs, steps_per_epoch):
    class Loaders(L.LightningDataModule):
        def train_dataloader(self):
            return random_loader(n=64, batch_size=8)

    def callback():
        return SparsityCallback(phases=EPOCH_PHASES, verbose=False)

    plan = plan_schedule(
        fast_trainer(callbacks=[callback()], **trainer_kwargs), TinyModule(), Loaders()
    )
    planned = [(p.start, p.end) for p in plan.groups[0].sparsifier.phases]
    cb = callback()
    fast_trainer(callbacks=[cb], **trainer_kwargs).fit(TinyModule(), Loaders())
    assert planned == [(p.start, p.end) for p in cb.sparsifier.phases]
    assert planned[0] == (0, steps_per_epoch)


def test_the_command_line_plan_reads_the_data_for_an_epoch_boundary_under_max_steps(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    recipe = tmp_path / "epochs.yaml"
    shutil.copy(VIT_DEMO, recipe)
    text = recipe.read_text().replace("max_epochs: 30", "max_steps: 100")
    recipe.write_text(text.replace("until: 0.7}", "until: '1 epoch'}"))
    SparseCLI(args=["plan", f"--config={recipe}", "--plot=false"])
    out = capsys.readouterr().out
    assert "The data module was built to count the batches of an epoch." in out
    # ceil(1437 / 32) = 45 optimizer steps an epoch
    assert "Run: 100 optimizer steps (max_steps); 45 optimizer steps per epoch" in out
    assert "phase 1: steps 0-44" in out and "phase 2: steps 45-99" in out
