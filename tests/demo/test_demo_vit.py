"""ViTClassifier: trains a few steps on the digits and logs finite metrics."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import demo_trainer

from lightning_sparse.demo import DigitsDataModule, ViTClassifier

TINY = {"img_size": 16, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2}


def test_vit_trains_and_logs():
    model = ViTClassifier(num_classes=10, model_kwargs=TINY, warmup_steps=1)
    trainer = demo_trainer(val_check_interval=3)
    trainer.fit(model, DigitsDataModule(image_size=16, batch_size=16))
    metrics = trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/acc"):
        assert key in metrics and math.isfinite(float(metrics[key])), key
    assert 0.0 <= float(metrics["val/acc"]) <= 1.0
    assert trainer.global_step == 3


def test_vit_parameter_names_and_hparams():
    model = ViTClassifier(model_kwargs=TINY)
    names = dict(model.named_parameters())
    assert (
        "model.blocks.0.mlp.fc1.weight" in names
        and "model.blocks.0.mlp.fc2.weight" in names
    )
    assert (
        model.hparams.model_kwargs == TINY
        and model.hparams.model_name == "vit_tiny_patch16_224"
    )


def test_vit_default_is_the_tiny_cpu_vit():
    model = ViTClassifier()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_vit_optimizer_groups_and_schedule():
    model = ViTClassifier(model_kwargs=TINY, weight_decay=0.1, warmup_steps=2, lr=1e-3)
    trainer = demo_trainer(max_steps=10)
    model.trainer = trainer  # estimated_stepping_batches comes from max_steps
    config = model.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert (
        id(model.model.pos_embed) in no_decay_ids
        and id(model.model.cls_token) in no_decay_ids
    )
    assert id(model.model.blocks[0].mlp.fc1.weight) in {id(p) for p in decay["params"]}
    assert id(model.model.blocks[0].mlp.fc1.bias) in no_decay_ids
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert config["optimizer"].param_groups[0]["lr"] == pytest.approx(
        0.5e-3
    )  # warmup step 1 of 2


def test_vit_other_timm_model():
    model = ViTClassifier("resnet18", num_classes=3, model_kwargs={})
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"model_name": "no_such_model"}, ValueError, "model_name"),
        (
            {"model_name": "resnet18"},
            TypeError,
            "model_kwargs",
        ),  # tiny-ViT kwargs don't fit a ResNet
        ({"num_classes": 0}, ValueError, "num_classes"),
        ({"lr": -1.0}, ValueError, "lr"),
        ({"warmup_steps": 1.5}, ValueError, "warmup_steps"),
        ({"warmup_steps": -3}, ValueError, "warmup_steps"),
        ({"model_kwargs": "img_size=32"}, ValueError, "model_kwargs"),
    ],
)
def test_vit_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        ViTClassifier(**kwargs)


def test_vit_needs_a_run_length():
    model = ViTClassifier(model_kwargs=TINY)
    model.trainer = L.Trainer(max_epochs=-1, accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match="max_steps"):
        model.configure_optimizers()
