"""Every demo class can be built from a LightningCLI YAML config (plain-typed arguments)."""

from __future__ import annotations

import sys

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_sparse.demo import (
    DigitsDataModule,
    DigitsMultiCropDataModule,
    DINOSelfDistillation,
    GPTLanguageModel,
    PydocTextDataModule,
    ViTClassifier,
)

CONFIGS = {
    "vit": (
        """
model:
  class_path: lightning_sparse.demo.ViTClassifier
  init_args:
    model_name: vit_tiny_patch16_224
    num_classes: 10
    model_kwargs: {img_size: 16, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}
    warmup_steps: 100
    betas: [0.9, 0.95]
data:
  class_path: lightning_sparse.demo.DigitsDataModule
  init_args: {image_size: 16, batch_size: 32, augment: true}
""",
        ViTClassifier,
        DigitsDataModule,
    ),
    "dino": (
        """
model:
  class_path: lightning_sparse.demo.DINOSelfDistillation
  init_args:
    model_kwargs: {img_size: 16, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2, dynamic_img_size: true}
    out_dim: 64
    warmup_teacher_temp_steps: 0.2
data:
  class_path: lightning_sparse.demo.DigitsMultiCropDataModule
  init_args: {image_size: 16, local_crop_size: 8, local_crops_scale: [0.1, 0.4]}
""",
        DINOSelfDistillation,
        DigitsMultiCropDataModule,
    ),
    "gpt": (
        """
model:
  class_path: lightning_sparse.demo.GPTLanguageModel
  init_args: {preset: tiny, n_layer: 1, block_size: 32, warmup_steps: 0.05}
data:
  class_path: lightning_sparse.demo.PydocTextDataModule
  init_args: {block_size: 32, max_bytes: 50000}
""",
        GPTLanguageModel,
        PydocTextDataModule,
    ),
}


# Lightning 2.6 calls jsonargparse APIs that jsonargparse 4.49 deprecates: not ours to fix
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_lightning_cli_instantiates_from_yaml(name, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse-demo"])
    text, model_class, data_class = CONFIGS[name]
    config = tmp_path / "config.yaml"
    config.write_text(
        text
        + "seed_everything: 0\ntrainer: {accelerator: cpu, logger: false, max_steps: 1}\n"
    )
    cli = LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config)],
        save_config_callback=None,
    )
    assert type(cli.model) is model_class and type(cli.datamodule) is data_class
    if name == "vit":
        assert (
            cli.model.hparams.warmup_steps == 100
            and cli.model.hparams.model_kwargs["img_size"] == 16
        )
    if name == "gpt":
        assert cli.model.config.n_layer == 1 and cli.model.config.n_embd == 128
