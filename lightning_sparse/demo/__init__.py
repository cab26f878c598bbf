"""Demo models and offline datasets for trying sparse training on a laptop CPU or a real GPU.

Everything trains from scratch on data that needs no download (scikit-learn's digits, CPython's
pydoc text) or on local files (an ImageFolder tree, a token ``.bin`` file). All constructor
arguments are plain types, so every class can be named in a LightningCLI YAML recipe, e.g.
``model: {class_path: lightning_sparse.demo.ViTClassifier, init_args: {num_classes: 10}}``.

Models and where their sparsifiable weights live:

- :class:`ViTClassifier`: ``model.blocks.*.mlp.fc1.weight``, ``model.blocks.*.mlp.fc2.weight``
- :class:`DINOSelfDistillation`: ``student.backbone.blocks.*.mlp.fc1.weight`` (student only;
  the EMA teacher under ``teacher.`` is frozen and follows the student)
- :class:`GPTLanguageModel`: ``model.transformer.h.*.mlp.c_fc.weight``,
  ``model.transformer.h.*.mlp.c_proj.weight``, ``model.transformer.h.*.attn.c_attn.weight``
- ``lightning_sparse.demo.hf.HuggingFaceCausalLM`` (needs ``transformers``; not imported here):
  any Hugging Face causal LM, its parameters named as in ``transformers`` under ``model.``
"""

from lightning_sparse.demo.dino import DINOHead, DINOSelfDistillation
from lightning_sparse.demo.gpt import GPT, GPT_PRESETS, GPTConfig, GPTLanguageModel
from lightning_sparse.demo.images import (
    DigitsDataModule,
    DigitsMultiCropDataModule,
    ImageFolderDataModule,
    ImageFolderMultiCropDataModule,
)
from lightning_sparse.demo.multicrop import MultiCropTransform, multicrop_collate
from lightning_sparse.demo.probes import knn_predict, linear_probe_predict
from lightning_sparse.demo.text import PydocTextDataModule, TokenFileDataModule
from lightning_sparse.demo.vit import ViTClassifier

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "DINOHead",
    "DINOSelfDistillation",
    "DigitsDataModule",
    "DigitsMultiCropDataModule",
    "GPTConfig",
    "GPTLanguageModel",
    "ImageFolderDataModule",
    "ImageFolderMultiCropDataModule",
    "MultiCropTransform",
    "PydocTextDataModule",
    "TokenFileDataModule",
    "ViTClassifier",
    "knn_predict",
    "linear_probe_predict",
    "multicrop_collate",
]
