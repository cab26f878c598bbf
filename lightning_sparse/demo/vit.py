"""Image classification with any timm model (a small ViT by default), trained from scratch."""

from __future__ import annotations

from typing import Any

import lightning as L
import timm
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from lightning_sparse.demo._checks import (
    check_positive_int,
)
from lightning_sparse.demo.optim import (
    adamw_warmup_cosine,
    check_adamw_warmup_cosine,
    param_groups_weight_decay,
    total_training_steps,
)

#: The CPU demo ViT used when ``model_kwargs`` is left out: 32-pixel images, 8-pixel patches
#: (16 tokens + CLS; on the 8x8 digits upsampled to 32 pixels a patch covers 2x2 original
#: pixels), width 96, 4 blocks of 3 heads, MLP 96 -> 384 -> 96; about 0.47 M parameters.
TINY_VIT_KWARGS: dict[str, Any] = {
    "img_size": 32,
    "patch_size": 8,
    "embed_dim": 96,
    "depth": 4,
    "num_heads": 3,
}


def create_timm_model(
    model_name: str, model_kwargs: dict[str, Any] | None, **kwargs: Any
) -> torch.nn.Module:
    """``timm.create_model(model_name, pretrained=False, **kwargs, **model_kwargs)`` where
    ``model_kwargs=None`` means :data:`TINY_VIT_KWARGS`, with errors that say what to change."""
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise ValueError(
            f"model_kwargs={model_kwargs!r} is invalid: pass a dict of timm.create_model arguments"
        )
    extra = dict(TINY_VIT_KWARGS if model_kwargs is None else model_kwargs)
    try:
        return timm.create_model(model_name, pretrained=False, **kwargs, **extra)
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise ValueError(
                f"model_name={model_name!r} is not a timm model; list them with timm.list_models('vit*')"
            ) from err
        raise
    except TypeError as err:
        hint = (
            f" (model_kwargs=None means the tiny ViT preset {TINY_VIT_KWARGS}; pass model_kwargs={{}} for "
            f"the defaults of {model_name!r})"
            if model_kwargs is None
            else ""
        )
        raise TypeError(
            f"timm.create_model({model_name!r}, **{extra}) failed: {err}{hint}"
        ) from err


class ViTClassifier(L.LightningModule):
    """A timm image classifier trained with cross-entropy, AdamW and warmup + cosine LR.

    The timm model is ``self.model``, so parameter names are timm's under ``model.``, e.g.
    ``model.blocks.0.mlp.fc1.weight`` (what a sparsity callback's ``params`` patterns match).
    Logs ``train/loss``, ``val/loss`` and ``val/acc`` (top-1 accuracy).

    Args:
        model_name: any timm model name, built with ``pretrained=False``.
        num_classes: number of classes (the classifier head's size).
        model_kwargs: extra ``timm.create_model`` arguments. ``None`` (the default) gives the
            CPU demo ViT for 32-pixel images (:data:`TINY_VIT_KWARGS`); ``{}`` gives the timm
            model's own configuration (e.g. 224-pixel images for ``vit_tiny_patch16_224``).
        lr: peak learning rate.
        weight_decay: AdamW weight decay; not applied to biases, norms, ``pos_embed`` and
            ``cls_token`` (timm's ``no_weight_decay()``).
        warmup_steps: linear warmup length: a fraction of the run in [0, 1) (of
            ``trainer.estimated_stepping_batches``), or a whole number >= 1 of optimizer steps.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        label_smoothing: cross-entropy label smoothing.
        betas: AdamW betas.

    Example:
        >>> import torch
        >>> model = ViTClassifier(num_classes=10)
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
        >>> "model.blocks.0.mlp.fc1.weight" in dict(model.named_parameters())
        True
        >>> ViTClassifier("resnet18", num_classes=5, model_kwargs={}).model.fc.out_features
        5
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        num_classes: int = 10,
        model_kwargs: dict[str, Any] | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_steps: float = 0.1,
        min_lr_ratio: float = 0.01,
        label_smoothing: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_adamw_warmup_cosine(lr, weight_decay, warmup_steps, min_lr_ratio)
        if not 0 <= label_smoothing < 1:
            raise ValueError(
                f"label_smoothing={label_smoothing!r} is invalid: it must be in [0, 1)"
            )
        self.save_hyperparameters()
        self.model = create_timm_model(
            model_name, model_kwargs, num_classes=num_classes
        )
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        images, labels = batch
        logits = self(images)
        return (
            F.cross_entropy(
                logits, labels, label_smoothing=self.hparams.label_smoothing
            ),
            logits,
            labels,
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, labels = self._loss(batch)
        self.train_acc(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_acc(logits, labels)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_acc(logits, labels)
        self.log("test/loss", loss)
        self.log("test/acc", self.val_acc)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        no_decay = {
            f"model.{name}" for name in getattr(self.model, "no_weight_decay", set)()
        }
        groups = param_groups_weight_decay(
            self, hp.weight_decay, no_decay_names=tuple(no_decay)
        )
        return adamw_warmup_cosine(groups, hp, total_training_steps(self.trainer))
