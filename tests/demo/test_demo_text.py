"""Text DataModules: shapes, dtypes, deterministic disjoint splits, argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sparse.demo import PydocTextDataModule, TokenFileDataModule
from lightning_sparse.demo.text import RandomWindowSampler, pydoc_bytes


def test_pydoc_shapes_dtypes_and_shift():
    dm = PydocTextDataModule(block_size=32, batch_size=8, max_bytes=20_000)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1]) and 0 <= x.min() and x.max() < 256
    assert dm.vocab_size == 256


def test_pydoc_split_disjoint_contiguous():
    dm = PydocTextDataModule(block_size=16, val_fraction=0.25, max_bytes=10_000)
    dm.setup()
    data = torch.frombuffer(bytearray(pydoc_bytes()[:10_000]), dtype=torch.uint8)
    assert len(dm.train_tokens) == 7500 and len(dm.val_tokens) == 2500
    assert torch.equal(torch.cat([dm.train_tokens, dm.val_tokens]), data)
    # validation windows: fixed, non-overlapping, inside the validation split
    val = dm.val_dataset()
    assert len(val) == (2500 - 1) // 16
    x0, _ = val[0]
    x1, _ = val[1]
    assert torch.equal(x0, dm.val_tokens[:16].long()) and torch.equal(
        x1, dm.val_tokens[16:32].long()
    )


def test_pydoc_full_text_is_large_enough():
    assert len(pydoc_bytes()) > 300_000


def test_pydoc_training_windows_deterministic_per_seed_and_epoch():
    def first_batches(seed, epoch=0):
        dm = PydocTextDataModule(
            block_size=16, batch_size=4, max_bytes=5_000, seed=seed
        )
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))[0]

    assert torch.equal(first_batches(0), first_batches(0))
    assert not torch.equal(first_batches(0), first_batches(1))
    assert not torch.equal(first_batches(0, epoch=0), first_batches(0, epoch=1))


def test_random_window_sampler_range():
    sampler = RandomWindowSampler(num_offsets=10, num_samples=1000, seed=0)
    offsets = list(sampler)
    assert len(offsets) == len(sampler) == 1000 and set(offsets) == set(range(10))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"block_size": 0}, "block_size"),
        ({"batch_size": -2}, "batch_size"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"samples_per_epoch": 0}, "samples_per_epoch"),
    ],
)
def test_pydoc_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PydocTextDataModule(**kwargs)


def test_pydoc_too_little_data_names_block_size():
    dm = PydocTextDataModule(block_size=512, max_bytes=1000)
    with pytest.raises(ValueError, match="block_size"):
        dm.setup()


@pytest.mark.parametrize("dtype", ["uint16", "uint8"])
def test_token_file_with_split(tmp_path, dtype):
    path = tmp_path / "train.bin"
    np.arange(2000, dtype=np.uint16).astype(dtype).tofile(path)
    dm = TokenFileDataModule(
        str(path), block_size=8, batch_size=4, dtype=dtype, val_fraction=0.1
    )
    dm.setup()
    assert len(dm.train_tokens) == 1800 and len(dm.val_tokens) == 200
    x, y = next(iter(dm.train_dataloader()))
    assert (
        x.shape == (4, 8)
        and x.dtype == torch.int64
        and torch.equal(x[:, 1:], y[:, :-1])
    )
    vx, _ = next(iter(dm.val_dataloader()))
    expected = (np.arange(1800, 1808, dtype=np.uint16).astype(dtype)).astype(np.int64)
    assert vx[0].tolist() == expected.tolist()
    # train windows come from the training part only
    assert int(x.max()) < (1800 if dtype == "uint16" else 256)


def test_token_file_separate_val_and_workers(tmp_path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(500, dtype=np.uint16).tofile(train)
    np.arange(1000, 1100, dtype=np.uint16).tofile(val)
    dm = TokenFileDataModule(
        str(train), str(val), block_size=4, batch_size=2, num_workers=1
    )
    dm.setup()
    x, _ = next(iter(dm.val_dataloader()))
    assert x.tolist() == [[1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007]]
    tx, _ = next(
        iter(dm.train_dataloader())
    )  # through a worker process (memmap reopened there)
    assert int(tx.max()) < 500


def test_token_file_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_path"):
        TokenFileDataModule(str(tmp_path / "missing.bin"))
    path = tmp_path / "t.bin"
    np.zeros(100, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="dtype"):
        TokenFileDataModule(str(path), dtype="float32")
    with pytest.raises(ValueError, match="val_fraction"):
        TokenFileDataModule(str(path), val_fraction=1.0)


def test_gpt_demo_trains_with_a_logger(tmp_path):
    """The model's and the data's hyperparameters merge in a logger (both know a block size)."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sparse.demo import GPTLanguageModel

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=1,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PydocTextDataModule(block_size=32, batch_size=2, max_bytes=20_000)
    trainer.fit(GPTLanguageModel(n_layer=1, block_size=64), data)
    assert trainer.global_step == 1
