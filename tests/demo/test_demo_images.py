"""Image DataModules: shapes, dtypes, deterministic disjoint splits, argument errors."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lightning_sparse.demo import (
    DigitsDataModule,
    DigitsMultiCropDataModule,
    ImageFolderDataModule,
    ImageFolderMultiCropDataModule,
    MultiCropTransform,
)


def test_digits_shapes_and_dtypes():
    dm = DigitsDataModule(image_size=24, batch_size=16, augment=True)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        images, labels = next(iter(loader))
        assert images.shape == (16, 3, 24, 24) and images.dtype == torch.float32
        assert labels.shape == (16,) and labels.dtype == torch.int64
        assert torch.isfinite(images).all() and 0 <= labels.min() <= labels.max() <= 9


def test_digits_single_channel_native_size():
    dm = DigitsDataModule(image_size=8, channels=1, batch_size=4, augment=False)
    dm.setup()
    images, _ = next(iter(dm.val_dataloader()))
    assert images.shape == (4, 1, 8, 8)


def test_digits_split_deterministic_disjoint_stratified():
    a, b = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    a.setup(), b.setup()
    assert a.train_indices == b.train_indices and a.val_indices == b.val_indices
    assert not set(a.train_indices) & set(a.val_indices)
    assert len(a.train_indices) + len(a.val_indices) == 1797
    assert len(a.val_indices) == 360  # 20% of 1797, rounded up by scikit-learn
    counts = torch.bincount(a.labels[a.val_indices], minlength=10)
    assert counts.min() >= 35  # stratified: every class is in the validation split
    c = DigitsDataModule(seed=4)
    c.setup()
    assert c.val_indices != a.val_indices


def test_digits_val_loader_is_deterministic():
    dm = DigitsDataModule(batch_size=32)
    dm.setup()
    first = next(iter(dm.val_dataloader()))[0]
    assert torch.equal(first, next(iter(dm.val_dataloader()))[0])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"image_size": 4}, "image_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"channels": 2}, "channels"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_digits_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DigitsDataModule(**kwargs)


def test_multicrop_digits_batches_and_eval_loaders():
    dm = DigitsMultiCropDataModule(
        image_size=32, local_crop_size=16, local_crops_number=3, batch_size=8
    )
    dm.setup("fit")
    crops, labels = next(iter(dm.train_dataloader()))
    assert [tuple(c.shape) for c in crops] == [(8, 3, 32, 32)] * 2 + [
        (8, 3, 16, 16)
    ] * 3
    assert all(c.dtype == torch.float32 for c in crops) and labels.shape == (8,)
    assert not torch.equal(crops[0], crops[1])  # two different random views
    train_eval, val = dm.val_dataloader()
    assert len(train_eval.dataset) == len(dm.train_indices) and len(val.dataset) == len(
        dm.val_indices
    )
    images, labels = next(iter(val))
    assert images.shape == (8, 3, 32, 32) and labels.dtype == torch.int64


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"local_crops_scale": (0.5, 0.2)}, "local_crops_scale"),
        ({"global_crops_scale": (0.0, 1.0)}, "global_crops_scale"),
        ({"local_crops_number": -1}, "local_crops_number"),
        ({"local_crop_size": 0}, "local_crop_size"),
        ({"hflip_p": 2.0}, "hflip_p"),
    ],
)
def test_multicrop_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DigitsMultiCropDataModule(**kwargs)


def test_multicrop_transform_photometric_on_rgb():
    t = MultiCropTransform(
        global_crop_size=16, local_crop_size=8, local_crops_number=2, photometric=True
    )
    crops = t(Image.new("RGB", (20, 20), color=(120, 30, 200)))
    assert [tuple(c.shape) for c in crops] == [(3, 16, 16)] * 2 + [(3, 8, 8)] * 2
    assert all(type(c) is torch.Tensor for c in crops)


@pytest.fixture
def image_tree(tmp_path):
    for split, per_class in (("train", 3), ("val", 2)):
        for cls, colour in (("ants", (255, 0, 0)), ("bees", (0, 0, 255))):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (30 + i, 20), color=colour).save(folder / f"{i}.png")
    return tmp_path


def test_image_folder_datamodule(image_tree):
    dm = ImageFolderDataModule(
        str(image_tree), image_size=16, batch_size=2, num_workers=0
    )
    dm.setup("fit")
    assert dm.num_classes == 2
    images, labels = next(iter(dm.train_dataloader()))
    assert (
        images.shape == (2, 3, 16, 16)
        and images.dtype == torch.float32
        and labels.dtype == torch.int64
    )
    val_images, val_labels = next(iter(dm.val_dataloader()))
    assert val_images.shape == (2, 3, 16, 16) and val_labels.tolist() == [0, 0]


def test_image_folder_multicrop(image_tree):
    dm = ImageFolderMultiCropDataModule(
        str(image_tree),
        image_size=16,
        local_crop_size=8,
        local_crops_number=2,
        batch_size=2,
        num_workers=0,
        eval_train_subset=4,
    )
    dm.setup("fit")
    crops, _ = next(iter(dm.train_dataloader()))
    assert [tuple(c.shape) for c in crops] == [(2, 3, 16, 16)] * 2 + [(2, 3, 8, 8)] * 2
    train_eval, val = dm.val_dataloader()
    assert len(train_eval.dataset) == 4 and len(val.dataset) == 4


def test_image_folder_missing_split(tmp_path):
    dm = ImageFolderDataModule(str(tmp_path), num_workers=0)
    with pytest.raises(FileNotFoundError, match="root="):
        dm.setup("fit")


def test_image_folder_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="train_crop_scale"):
        ImageFolderDataModule(str(tmp_path), train_crop_scale=(0.5, 2.0))
    with pytest.raises(ValueError, match="eval_crop_ratio"):
        ImageFolderDataModule(str(tmp_path), eval_crop_ratio=1.2)
