"""Language-modelling LightningDataModules over a flat token sequence.

- :class:`PydocTextDataModule`: byte-level text that ships with CPython (the pydoc topic help,
  ``pydoc_data.topics.topics``, about 460 kB); vocabulary = the 256 byte values; no download.
- :class:`TokenFileDataModule`: a flat token file (nanoGPT's ``train.bin`` / ``val.bin`` of
  uint16 tokens, or raw uint8 bytes), memory-mapped, for real runs.

A sample is ``(x, y)``: ``x`` = ``block_size`` consecutive tokens, ``y`` = the same window
shifted by one; both int64. Training windows start at random offsets, drawn afresh each epoch
from a generator seeded with ``seed + epoch`` (so a run is reproducible and a resumed epoch sees
the same windows); validation windows are fixed, contiguous and non-overlapping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_sparse.demo._checks import (
    check_choice,
    check_fraction,
    check_non_negative_int,
    check_positive_int,
)


class _TokenWindows(Dataset):
    """``dataset[offset]`` is the window starting at ``offset`` of a 1-D token array."""

    def __init__(
        self,
        tokens: np.ndarray | Tensor,
        block_size: int,
        offsets: Tensor | None = None,
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.offsets = offsets  # None: every offset is a valid index

    def __len__(self) -> int:
        if self.offsets is not None:
            return len(self.offsets)
        return len(self.tokens) - self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index]) if self.offsets is not None else int(index)
        chunk = self.tokens[start : start + self.block_size + 1]
        chunk = (
            torch.from_numpy(np.asarray(chunk).astype(np.int64))
            if not isinstance(chunk, Tensor)
            else chunk.long()
        )
        return chunk[:-1], chunk[1:]


class _LazyMemmap:
    """A numpy memmap opened on first use (so DataLoader workers open their own)."""

    def __init__(
        self, path: str, dtype: str, start: int = 0, stop: int | None = None
    ) -> None:
        self.path, self.dtype = path, dtype
        length = os.path.getsize(path) // np.dtype(dtype).itemsize
        self.start, self.stop = start, length if stop is None else stop
        self._array: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, item: slice) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._array[self.start + item.start : self.start + item.stop]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None}


class RandomWindowSampler(Sampler[int]):
    """Yields ``num_samples`` random window offsets in ``[0, num_offsets)`` per epoch.

    The offsets depend only on ``seed`` and the epoch (Lightning calls :meth:`set_epoch`).

    Example:
        >>> s = RandomWindowSampler(num_offsets=100, num_samples=4, seed=0)
        >>> a = list(s); s.set_epoch(1); b = list(s); s.set_epoch(0)
        >>> len(a), a == list(s), a != b, all(0 <= o < 100 for o in a + b)
        (4, True, True, True)
    """

    def __init__(self, num_offsets: int, num_samples: int, seed: int = 0) -> None:
        self.num_offsets = num_offsets
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randint(
            self.num_offsets, (self.num_samples,), generator=generator
        ).tolist()


class _WindowDataModule(L.LightningDataModule):
    """Shared loaders: random training windows, fixed non-overlapping validation windows.

    Subclasses leave ``block_size`` out of their hyperparameters: the GPT model has one of the
    same name (its longest context, which may exceed the windows), and a logger that records
    both would refuse the two values."""

    vocab_size: int = 256

    def __init__(
        self,
        block_size: int,
        batch_size: int,
        seed: int,
        num_workers: int,
        samples_per_epoch: int | None,
    ) -> None:
        super().__init__()
        check_positive_int("block_size", block_size)
        check_positive_int("batch_size", batch_size)
        check_non_negative_int("num_workers", num_workers)
        if samples_per_epoch is not None:
            check_positive_int("samples_per_epoch", samples_per_epoch)
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.samples_per_epoch = samples_per_epoch
        self.train_tokens: Any = None
        self.val_tokens: Any = None

    def _check_length(self, name: str, tokens: Any) -> None:
        if len(tokens) < self.block_size + 1:
            raise ValueError(
                f"the {name} split has {len(tokens)} tokens, fewer than block_size + 1 = "
                f"{self.block_size + 1}: lower block_size or give it more data"
            )

    def _loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )

    def train_dataset(self) -> Dataset:
        """All training windows, indexed by start offset."""
        assert self.train_tokens is not None, "call setup() first"
        return _TokenWindows(self.train_tokens, self.block_size)

    def val_dataset(self) -> Dataset:
        """The validation windows at offsets ``0, block_size, 2 * block_size, ...``."""
        assert self.val_tokens is not None, "call setup() first"
        count = (len(self.val_tokens) - 1) // self.block_size
        return _TokenWindows(
            self.val_tokens, self.block_size, torch.arange(count) * self.block_size
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        # default: one epoch sees about as many tokens as the training split holds
        num_samples = self.samples_per_epoch or max(
            1, len(self.train_tokens) // self.block_size
        )
        sampler = RandomWindowSampler(len(dataset), num_samples, seed=self.seed)
        return self._loader(dataset, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset(), shuffle=False)


def pydoc_bytes() -> bytes:
    """The pydoc topic help texts that ship with CPython, joined in sorted key order, as UTF-8."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


class PydocTextDataModule(_WindowDataModule):
    """Byte-level language modelling on CPython's bundled pydoc help text (vocabulary 256).

    The text (first ``max_bytes`` bytes if set) is split into a leading training part and a
    trailing validation part of ``val_fraction`` of the bytes: disjoint and contiguous.

    Args:
        block_size: tokens (bytes) per sample.
        batch_size: samples per batch.
        val_fraction: trailing fraction of the bytes held out, in (0, 1).
        max_bytes: use only the first ``max_bytes`` bytes (None: all, about 466 kB).
        seed: seed of the random training windows.
        num_workers: DataLoader worker processes (0 is fastest for in-memory bytes).
        samples_per_epoch: training windows per epoch (None: ``train bytes // block_size``).

    Example:
        >>> dm = PydocTextDataModule(block_size=16, batch_size=4, max_bytes=10_000)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), x.dtype, bool((x[:, 1:] == y[:, :-1]).all()), len(dm.train_tokens)
        ((4, 16), torch.int64, True, 9000)
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_bytes: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        super().__init__(block_size, batch_size, seed, num_workers, samples_per_epoch)
        check_fraction("val_fraction", val_fraction)
        if max_bytes is not None:
            check_positive_int("max_bytes", max_bytes)
        self.save_hyperparameters(ignore=["block_size"])  # see _WindowDataModule
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
            return
        data = pydoc_bytes()
        if self.max_bytes is not None:
            data = data[: self.max_bytes]
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = round(len(tokens) * self.val_fraction)
        self.train_tokens, self.val_tokens = (
            tokens[: len(tokens) - n_val],
            tokens[len(tokens) - n_val :],
        )
        self._check_length("training", self.train_tokens)
        self._check_length("validation", self.val_tokens)


_DTYPES = ("uint8", "uint16", "int32", "uint32")


class TokenFileDataModule(_WindowDataModule):
    """Language modelling on flat binary token files (memory-mapped; nanoGPT's format).

    ``train_path`` holds the training tokens; ``val_path`` the validation tokens, or, if left
    out, the last ``val_fraction`` of ``train_path`` is held out instead.

    Args:
        train_path: file of tokens, e.g. nanoGPT's ``train.bin``.
        val_path: file of validation tokens, e.g. ``val.bin`` (optional).
        block_size, batch_size, seed, num_workers, samples_per_epoch: as in
            :class:`PydocTextDataModule`.
        dtype: element type of the files: ``"uint16"`` (GPT-2 BPE ids, nanoGPT), ``"uint8"``
            (raw bytes), ``"int32"`` or ``"uint32"``.
        val_fraction: the held-out trailing fraction when there is no ``val_path``.

    Example:
        >>> import tempfile, os, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "train.bin")
        >>> np.arange(1000, dtype=np.uint16).tofile(path)
        >>> dm = TokenFileDataModule(path, block_size=8, batch_size=2, dtype="uint16")
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.val_dataloader()))
        >>> x.tolist(), y[0].tolist()
        ([[990, 991, 992, 993, 994, 995, 996, 997]], [991, 992, 993, 994, 995, 996, 997, 998])
    """

    def __init__(
        self,
        train_path: str,
        val_path: str | None = None,
        block_size: int = 1024,
        batch_size: int = 12,
        dtype: str = "uint16",
        val_fraction: float = 0.01,
        seed: int = 0,
        num_workers: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        super().__init__(block_size, batch_size, seed, num_workers, samples_per_epoch)
        check_choice("dtype", dtype, _DTYPES)
        check_fraction("val_fraction", val_fraction)
        for name, path in (("train_path", train_path), ("val_path", val_path)):
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{name}={path!r} does not exist or is not a file"
                )
        self.save_hyperparameters(ignore=["block_size"])  # see _WindowDataModule
        self.train_path = os.fspath(train_path)
        self.val_path = None if val_path is None else os.fspath(val_path)
        self.dtype = dtype
        self.val_fraction = val_fraction

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
            return
        if self.val_path is not None:
            self.train_tokens = _LazyMemmap(self.train_path, self.dtype)
            self.val_tokens = _LazyMemmap(self.val_path, self.dtype)
        else:
            total = len(_LazyMemmap(self.train_path, self.dtype))
            n_val = round(total * self.val_fraction)
            self.train_tokens = _LazyMemmap(
                self.train_path, self.dtype, 0, total - n_val
            )
            self.val_tokens = _LazyMemmap(
                self.train_path, self.dtype, total - n_val, total
            )
        self._check_length("training", self.train_tokens)
        self._check_length("validation", self.val_tokens)
