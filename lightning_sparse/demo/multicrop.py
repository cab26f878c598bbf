"""DINO multi-crop augmentation: two global views and N local views of each image.

Works on PIL images and on float image tensors in [0, 1] (``(C, H, W)``), via torchvision's
``transforms.v2``. A batch collated with :func:`multicrop_collate` is ``(crops, labels)`` where
``crops`` is a list of ``2 + local_crops_number`` tensors of shape ``(B, C, size, size)``: the two
global crops first, then the local crops.

Example:
    >>> import torch
    >>> t = MultiCropTransform(global_crop_size=32, local_crop_size=16, local_crops_number=3)
    >>> crops = t(torch.rand(3, 32, 32))
    >>> [tuple(c.shape) for c in crops]
    [(3, 32, 32), (3, 32, 32), (3, 16, 16), (3, 16, 16), (3, 16, 16)]
    >>> views, labels = multicrop_collate([(t(torch.rand(3, 32, 32)), 7) for _ in range(4)])
    >>> len(views), tuple(views[0].shape), tuple(views[-1].shape), labels.tolist()
    (5, (4, 3, 32, 32), (4, 3, 16, 16), [7, 7, 7, 7])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchvision.transforms import v2

from lightning_sparse.demo._checks import (
    check_non_negative_int,
    check_positive_int,
    check_range,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class MultiCropTransform:
    """Turn one image into ``[global_1, global_2, local_1, ..., local_N]`` normalized tensors.

    Each view is a ``RandomResizedCrop`` (global views with ``global_crops_scale``, local views
    with the smaller ``local_crops_scale``) and a random horizontal flip. With
    ``photometric=True`` the DINO colour recipe is added (colour jitter and random greyscale on
    every view; Gaussian blur always on the first global view, 10% on the second and 50% on local
    views; solarization 20% on the second global view); it needs 3-channel images.

    Example:
        >>> import torch
        >>> t = MultiCropTransform(32, 16, local_crops_number=2, mean=(0.5,), std=(0.5,))
        >>> [tuple(c.shape) for c in t(torch.rand(1, 8, 8))]
        [(1, 32, 32), (1, 32, 32), (1, 16, 16), (1, 16, 16)]
    """

    def __init__(
        self,
        global_crop_size: int = 224,
        local_crop_size: int = 96,
        local_crops_number: int = 8,
        global_crops_scale: Sequence[float] = (0.32, 1.0),
        local_crops_scale: Sequence[float] = (0.05, 0.32),
        hflip_p: float = 0.5,
        photometric: bool = False,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        check_positive_int("global_crop_size", global_crop_size)
        check_positive_int("local_crop_size", local_crop_size)
        check_non_negative_int("local_crops_number", local_crops_number)
        global_scale = check_range("global_crops_scale", global_crops_scale)
        local_scale = check_range("local_crops_scale", local_crops_scale)
        if not 0 <= hflip_p <= 1:
            raise ValueError(
                f"hflip_p={hflip_p!r} is invalid: it is a probability in [0, 1]"
            )
        self.local_crops_number = local_crops_number

        def view(
            size: int, scale: tuple[float, float], blur_p: float, solarize_p: float
        ) -> v2.Compose:
            ops: list[Any] = [
                v2.ToImage(),
                v2.RandomResizedCrop(size, scale=scale, antialias=True),
                v2.RandomHorizontalFlip(hflip_p),
                v2.ToDtype(torch.float32, scale=True),
            ]
            if photometric:
                ops += [
                    v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                    v2.RandomGrayscale(p=0.2),
                    v2.RandomApply(
                        [
                            v2.GaussianBlur(
                                kernel_size=_odd(size // 10), sigma=(0.1, 2.0)
                            )
                        ],
                        p=blur_p,
                    ),
                    v2.RandomSolarize(threshold=0.5, p=solarize_p),
                ]
            ops.append(v2.Normalize(mean=list(mean), std=list(std)))
            return v2.Compose(ops)

        self.global_1 = view(global_crop_size, global_scale, blur_p=1.0, solarize_p=0.0)
        self.global_2 = view(global_crop_size, global_scale, blur_p=0.1, solarize_p=0.2)
        self.local = view(local_crop_size, local_scale, blur_p=0.5, solarize_p=0.0)

    def __call__(self, image: Any) -> list[Tensor]:
        crops = [self.global_1(image), self.global_2(image)]
        crops += [self.local(image) for _ in range(self.local_crops_number)]
        return [c.as_subclass(Tensor) for c in crops]


def _odd(n: int) -> int:
    n = max(3, n)
    return n if n % 2 else n + 1


def multicrop_collate(
    samples: Sequence[tuple[Sequence[Tensor], Any]],
) -> tuple[list[Tensor], Tensor]:
    """Collate ``(crops, label)`` samples into ``(list of stacked crops, labels)``."""
    n_views = len(samples[0][0])
    views = [torch.stack([crops[i] for crops, _ in samples]) for i in range(n_views)]
    labels = torch.as_tensor([int(label) for _, label in samples], dtype=torch.long)
    return views, labels
