"""Synthetic token sequences for language-model recipes that measure speed and plumbing.

:class:`SyntheticTokensDataModule` needs no data: sample ``i`` is an arithmetic progression
modulo the vocabulary, ``start + stride * t``, its start and stride drawn from a generator
seeded by ``(seed, i)``. A model learns to continue it in a few hundred steps (the loss falls
well below ``log(vocab_size)``), so a run shows that training works, at any model size, on any
number of ranks (Lightning's distributed sampler splits the indices), without a download.

A sample is ``(x, y)``: ``block_size`` tokens and the same window shifted by one, both int64,
as :mod:`lightning_sparse.demo.text` gives them.

Example:
    >>> dm = SyntheticTokensDataModule(vocab_size=100, block_size=6, batch_size=2)
    >>> dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([2, 6]), True)
    >>> steps = (x[:, 1:] - x[:, :-1]) % 100  # each sequence keeps its stride
    >>> bool((steps == steps[:, :1]).all())
    True
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_sparse.demo._checks import check_non_negative_int, check_positive_int

MAX_STRIDE = 8
"""Strides are drawn from 1 to this."""


class _Progressions(Dataset):
    """``dataset[i]``: the progression of sample ``first + i`` (see the module docstring)."""

    def __init__(
        self, length: int, first: int, vocab_size: int, block_size: int, seed: int
    ) -> None:
        self.length, self.first = length, first
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + index)
        start = torch.randint(self.vocab_size, (), generator=gen)
        stride = torch.randint(1, MAX_STRIDE + 1, (), generator=gen)
        tokens = (start + stride * torch.arange(self.block_size + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


class SyntheticTokensDataModule(L.LightningDataModule):
    """Arithmetic progressions of tokens (see the module docstring).

    Args:
        vocab_size: tokens are below this (the model's vocabulary).
        block_size: tokens per sample.
        batch_size: samples per batch (per device).
        samples_per_epoch: training samples in an epoch (over all devices).
        val_samples: validation samples (others than the training ones).
        seed: the samples' seed.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        block_size: int = 2048,
        batch_size: int = 8,
        samples_per_epoch: int = 100_000,
        val_samples: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("samples_per_epoch", samples_per_epoch),
        ):
            check_positive_int(name, value)
        check_non_negative_int("val_samples", val_samples)
        check_non_negative_int("seed", seed)
        check_non_negative_int("num_workers", num_workers)
        self.save_hyperparameters()

    def _loader(self, length: int, first: int) -> DataLoader:
        hp = self.hparams
        data = _Progressions(length, first, hp.vocab_size, hp.block_size, hp.seed)
        return DataLoader(
            data, batch_size=hp.batch_size, num_workers=hp.num_workers, drop_last=True
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.samples_per_epoch, 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.val_samples, self.hparams.samples_per_epoch)


__all__ = ["SyntheticTokensDataModule"]
