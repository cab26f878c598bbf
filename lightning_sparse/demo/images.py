"""Image LightningDataModules: scikit-learn's bundled digits (no download) and ImageFolder trees.

- :class:`DigitsDataModule`: (image, label) batches of the 1797 8x8 handwritten digits, upsampled.
- :class:`DigitsMultiCropDataModule`: the same images as DINO multi-crop views for self-supervised
  training, with labelled validation loaders for k-NN and linear-probe evaluation.
- :class:`ImageFolderDataModule`, :class:`ImageFolderMultiCropDataModule`: the same two roles over
  a ``root/train/<class>/*.png``, ``root/val/<class>/*.png`` tree, for real runs.

Batches are ``(images, labels)`` with ``images`` float32 ``(B, C, H, W)`` and ``labels`` int64
``(B,)``; the multi-crop modules train on ``(crops, labels)`` with ``crops`` a list of such image
batches (two global views first, see :mod:`lightning_sparse.demo.multicrop`), and validate on two
loaders: index 0 is the labelled *train* split without augmentation (the k-NN memory bank and the
probe's training set), index 1 the validation split.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.transforms import v2

from lightning_sparse.demo._checks import (
    check_fraction,
    check_non_negative_int,
    check_positive_int,
    check_range,
)
from lightning_sparse.demo.multicrop import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MultiCropTransform,
    multicrop_collate,
)

# Pixel statistics of the digits scaled to [0, 1] (computed over all 1797 images at 8x8).
DIGITS_MEAN = 0.305
DIGITS_STD = 0.376


class _TensorImageDataset(Dataset):
    """Images kept in memory as a float tensor in [0, 1]; ``transform`` maps one image to the
    model's input (a tensor, or a list of tensors for multi-crop)."""

    def __init__(
        self, images: Tensor, labels: Tensor, transform: Callable[[Tensor], Any]
    ) -> None:
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, Tensor]:
        return self.transform(self.images[index]), self.labels[index]


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 1797 handwritten 8x8 digits (10 classes) as an image-classification task.

    The grey images are scaled to [0, 1], upsampled (bilinear) to ``image_size`` and repeated to
    ``channels`` channels (3 by default, so timm models work unchanged), then normalized. The
    train/val split is stratified and depends only on ``seed`` and ``val_fraction``.

    Args:
        image_size: side of the (square) images fed to the model, >= 8.
        batch_size: images per batch.
        val_fraction: fraction of the 1797 images held out for validation, in (0, 1).
        seed: seed of the train/val split.
        num_workers: DataLoader worker processes (the data is in memory; 0 is fastest here).
        augment: light training augmentation: a random translation of up to ``image_size // 8``
            pixels (pad with background, random crop).
        channels: 1 (grey) or 3 (grey repeated).

    Example:
        >>> dm = DigitsDataModule(image_size=16, batch_size=8)
        >>> dm.setup("fit")
        >>> images, labels = next(iter(dm.train_dataloader()))
        >>> tuple(images.shape), images.dtype, tuple(labels.shape), labels.dtype
        ((8, 3, 16, 16), torch.float32, (8,), torch.int64)
        >>> len(dm.train_indices) + len(dm.val_indices), dm.num_classes
        (1797, 10)
    """

    num_classes = 10

    def __init__(
        self,
        image_size: int = 32,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        augment: bool = False,
        channels: int = 3,
    ) -> None:
        super().__init__()
        check_positive_int("image_size", image_size)
        if image_size < 8:
            raise ValueError(
                f"image_size={image_size!r} is invalid: the digits are 8x8, use image_size >= 8"
            )
        check_positive_int("batch_size", batch_size)
        check_fraction("val_fraction", val_fraction)
        check_non_negative_int("num_workers", num_workers)
        if channels not in (1, 3):
            raise ValueError(
                f"channels={channels!r} is invalid: use channels=3 (grey repeated) or channels=1"
            )
        self.save_hyperparameters()
        self.image_size = image_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.augment = augment
        self.channels = channels
        self.images: Tensor | None = None
        self.labels: Tensor | None = None
        self.train_indices: list[int] = []
        self.val_indices: list[int] = []

    def setup(self, stage: str | None = None) -> None:
        if self.images is not None:
            return
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if self.image_size != 8:
            images = F.interpolate(
                images, size=self.image_size, mode="bilinear", align_corners=False
            )
        self.images = (
            images.clamp_(0.0, 1.0).expand(-1, self.channels, -1, -1).contiguous()
        )
        self.labels = torch.tensor(digits.target, dtype=torch.long)
        indices = list(range(len(self.labels)))
        train_idx, val_idx = train_test_split(
            indices,
            test_size=self.val_fraction,
            random_state=self.seed,
            stratify=digits.target,
        )
        self.train_indices, self.val_indices = sorted(train_idx), sorted(val_idx)

    def _normalize(self) -> v2.Normalize:
        return v2.Normalize(
            mean=[DIGITS_MEAN] * self.channels, std=[DIGITS_STD] * self.channels
        )

    def _subset(
        self, indices: list[int], transform: Callable[[Tensor], Any]
    ) -> _TensorImageDataset:
        assert self.images is not None and self.labels is not None, "call setup() first"
        index = torch.tensor(indices)
        return _TensorImageDataset(self.images[index], self.labels[index], transform)

    def _eval_dataset(self, indices: list[int]) -> _TensorImageDataset:
        return self._subset(indices, self._normalize())

    def _loader(self, dataset: Dataset, shuffle: bool, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        ops: list[Any] = []
        if self.augment:
            ops.append(
                v2.RandomCrop(self.image_size, padding=max(1, self.image_size // 8))
            )
        ops.append(self._normalize())
        return self._loader(
            self._subset(self.train_indices, v2.Compose(ops)), shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._eval_dataset(self.val_indices), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class DigitsMultiCropDataModule(DigitsDataModule):
    """The digits as DINO multi-crop views (self-supervised), with labelled evaluation loaders.

    Training batches are ``(crops, labels)``: ``crops`` holds 2 global views of side
    ``image_size`` and ``local_crops_number`` local views of side ``local_crop_size``; the labels
    are there for convenience and a self-supervised model ignores them. ``val_dataloader`` returns
    two loaders of plain ``(images, labels)``: the train split without augmentation (index 0) and
    the validation split (index 1), for k-NN and linear-probe evaluation.

    Args:
        image_size: side of the global views (and of the evaluation images).
        local_crop_size: side of the local views.
        local_crops_number: local views per image (0 for global views only).
        global_crops_scale, local_crops_scale: ``RandomResizedCrop`` area ranges ``[low, high]``.
        hflip_p: probability of a horizontal flip of each view.
        photometric: add DINO's colour jitter / blur / solarization (off: the digits are grey).
        batch_size, val_fraction, seed, num_workers, channels: as in :class:`DigitsDataModule`.

    Example:
        >>> dm = DigitsMultiCropDataModule(image_size=16, local_crop_size=8, local_crops_number=2, batch_size=4)
        >>> dm.setup("fit")
        >>> crops, labels = next(iter(dm.train_dataloader()))
        >>> [tuple(c.shape) for c in crops]
        [(4, 3, 16, 16), (4, 3, 16, 16), (4, 3, 8, 8), (4, 3, 8, 8)]
        >>> [len(loader.dataset) for loader in dm.val_dataloader()]
        [1437, 360]
    """

    def __init__(
        self,
        image_size: int = 32,
        local_crop_size: int = 16,
        local_crops_number: int = 4,
        global_crops_scale: Sequence[float] = (0.5, 1.0),
        local_crops_scale: Sequence[float] = (0.3, 0.6),
        hflip_p: float = 0.0,
        photometric: bool = False,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        channels: int = 3,
    ) -> None:
        super().__init__(
            image_size=image_size,
            batch_size=batch_size,
            val_fraction=val_fraction,
            seed=seed,
            num_workers=num_workers,
            augment=False,
            channels=channels,
        )
        # validate eagerly, in __init__, with the argument names
        self.multicrop = MultiCropTransform(
            global_crop_size=image_size,
            local_crop_size=local_crop_size,
            local_crops_number=local_crops_number,
            global_crops_scale=global_crops_scale,
            local_crops_scale=local_crops_scale,
            hflip_p=hflip_p,
            photometric=photometric,
            mean=[DIGITS_MEAN] * channels,
            std=[DIGITS_STD] * channels,
        )
        if photometric and channels != 3:
            raise ValueError(
                "photometric=True needs channels=3 (colour jitter works on RGB images)"
            )

    def train_dataloader(self) -> DataLoader:
        dataset = self._subset(self.train_indices, self.multicrop)
        return self._loader(
            dataset, shuffle=True, drop_last=True, collate_fn=multicrop_collate
        )

    def val_dataloader(self) -> list[DataLoader]:  # type: ignore[override]
        return [
            self._loader(self._eval_dataset(self.train_indices), shuffle=False),
            self._loader(self._eval_dataset(self.val_indices), shuffle=False),
        ]

    def test_dataloader(self) -> list[DataLoader]:  # type: ignore[override]
        return self.val_dataloader()


def _image_folder(root: str, split: str, transform: Callable) -> Dataset:
    from torchvision.datasets import ImageFolder

    path = os.path.join(root, split)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"root={root!r} has no {split!r} folder: ImageFolderDataModule expects "
            f"{os.path.join(root, split, '<class>', '*.png')} (one sub-folder per class)"
        )
    return ImageFolder(path, transform=transform)


def _eval_transform(
    image_size: int, resize_ratio: float, mean: Sequence[float], std: Sequence[float]
) -> v2.Compose:
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(round(image_size / resize_ratio), antialias=True),
            v2.CenterCrop(image_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(mean), std=list(std)),
        ]
    )


class ImageFolderDataModule(L.LightningDataModule):
    """Image classification over ``root/train/<class>/*`` and ``root/val/<class>/*`` (torchvision
    ``ImageFolder``; class index = sorted sub-folder names).

    Training: ``RandomResizedCrop(image_size, scale=train_crop_scale)`` and a horizontal flip;
    evaluation: resize to ``image_size / eval_crop_ratio`` and centre crop. Both are normalized
    with ``mean`` / ``std`` (ImageNet statistics by default).

    Example:
        >>> import tempfile, pathlib
        >>> from PIL import Image
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for split in ("train", "val"):
        ...     for cls in ("cat", "dog"):
        ...         (root / split / cls).mkdir(parents=True)
        ...         Image.new("RGB", (40, 30)).save(root / split / cls / "0.png")
        >>> dm = ImageFolderDataModule(str(root), image_size=24, batch_size=2, num_workers=0)
        >>> dm.setup("fit")
        >>> images, labels = next(iter(dm.val_dataloader()))
        >>> tuple(images.shape), labels.tolist(), dm.num_classes
        ((2, 3, 24, 24), [0, 1], 2)
    """

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        batch_size: int = 64,
        num_workers: int = 4,
        train_crop_scale: Sequence[float] = (0.08, 1.0),
        eval_crop_ratio: float = 0.875,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        super().__init__()
        check_positive_int("image_size", image_size)
        check_positive_int("batch_size", batch_size)
        check_non_negative_int("num_workers", num_workers)
        self.train_crop_scale = check_range("train_crop_scale", train_crop_scale)
        if not 0 < eval_crop_ratio <= 1:
            raise ValueError(
                f"eval_crop_ratio={eval_crop_ratio!r} is invalid: it must be in (0, 1], e.g. 0.875"
            )
        self.save_hyperparameters()
        self.root = os.fspath(root)
        self.image_size = image_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.eval_crop_ratio = eval_crop_ratio
        self.mean, self.std = list(mean), list(std)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    @property
    def num_classes(self) -> int:
        """Number of class sub-folders in ``root/train`` (after :meth:`setup`)."""
        if self.train_dataset is None:
            raise RuntimeError(
                "num_classes is known after setup(): call dm.setup('fit') first"
            )
        return len(self.train_dataset.classes)  # type: ignore[attr-defined]

    def _train_transform(self) -> Callable:
        return v2.Compose(
            [
                v2.ToImage(),
                v2.RandomResizedCrop(
                    self.image_size, scale=self.train_crop_scale, antialias=True
                ),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=self.mean, std=self.std),
            ]
        )

    def _eval_transform(self) -> Callable:
        return _eval_transform(
            self.image_size, self.eval_crop_ratio, self.mean, self.std
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = _image_folder(
                self.root, "train", self._train_transform()
            )
            self.val_dataset = _image_folder(self.root, "val", self._eval_transform())

    def _loader(self, dataset: Dataset, shuffle: bool, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "call setup() first"
        return self._loader(self.train_dataset, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_dataset is not None, "call setup() first"
        return self._loader(self.val_dataset, shuffle=False)


class ImageFolderMultiCropDataModule(ImageFolderDataModule):
    """DINO multi-crop views of an ImageFolder tree, with labelled evaluation loaders.

    Training batches are ``(crops, labels)`` (2 global views of ``image_size``, then
    ``local_crops_number`` local views of ``local_crop_size``, DINO colour augmentation on by
    default). ``val_dataloader`` returns ``[train split, val split]`` of centre-cropped labelled
    images for k-NN / linear-probe evaluation; ``eval_train_subset`` caps the train split used
    there (a seeded random subset) to keep evaluation short on large datasets.

    Example:
        >>> import tempfile, pathlib
        >>> from PIL import Image
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for split in ("train", "val"):
        ...     for cls in ("cat", "dog"):
        ...         (root / split / cls).mkdir(parents=True)
        ...         Image.new("RGB", (40, 30)).save(root / split / cls / "0.png")
        >>> dm = ImageFolderMultiCropDataModule(str(root), image_size=24, local_crop_size=12,
        ...     local_crops_number=2, batch_size=2, num_workers=0)
        >>> dm.setup("fit")
        >>> crops, labels = next(iter(dm.train_dataloader()))
        >>> [tuple(c.shape) for c in crops]
        [(2, 3, 24, 24), (2, 3, 24, 24), (2, 3, 12, 12), (2, 3, 12, 12)]
    """

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        local_crop_size: int = 96,
        local_crops_number: int = 8,
        global_crops_scale: Sequence[float] = (0.32, 1.0),
        local_crops_scale: Sequence[float] = (0.05, 0.32),
        photometric: bool = True,
        batch_size: int = 64,
        num_workers: int = 4,
        eval_train_subset: int | None = None,
        eval_crop_ratio: float = 0.875,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        seed: int = 0,
    ) -> None:
        super().__init__(
            root,
            image_size=image_size,
            batch_size=batch_size,
            num_workers=num_workers,
            eval_crop_ratio=eval_crop_ratio,
            mean=mean,
            std=std,
        )
        if eval_train_subset is not None:
            check_positive_int("eval_train_subset", eval_train_subset)
        self.multicrop = MultiCropTransform(
            global_crop_size=image_size,
            local_crop_size=local_crop_size,
            local_crops_number=local_crops_number,
            global_crops_scale=global_crops_scale,
            local_crops_scale=local_crops_scale,
            photometric=photometric,
            mean=mean,
            std=std,
        )
        self.eval_train_subset = eval_train_subset
        self.seed = seed
        self.eval_train_dataset: Dataset | None = None

    def _train_transform(self) -> Callable:
        return self.multicrop

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.eval_train_dataset is None:
            dataset = _image_folder(self.root, "train", self._eval_transform())
            if self.eval_train_subset is not None and self.eval_train_subset < len(
                dataset
            ):
                generator = torch.Generator().manual_seed(self.seed)
                keep = torch.randperm(len(dataset), generator=generator)[
                    : self.eval_train_subset
                ]
                dataset = Subset(dataset, sorted(keep.tolist()))
            self.eval_train_dataset = dataset

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "call setup() first"
        return self._loader(
            self.train_dataset,
            shuffle=True,
            drop_last=True,
            collate_fn=multicrop_collate,
        )

    def val_dataloader(self) -> list[DataLoader]:  # type: ignore[override]
        assert self.eval_train_dataset is not None and self.val_dataset is not None, (
            "call setup() first"
        )
        return [
            self._loader(self.eval_train_dataset, shuffle=False),
            self._loader(self.val_dataset, shuffle=False),
        ]


__all__ = [
    "DigitsDataModule",
    "DigitsMultiCropDataModule",
    "ImageFolderDataModule",
    "ImageFolderMultiCropDataModule",
]
