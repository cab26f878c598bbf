"""Any Hugging Face causal LM as a LightningModule: built from a config, or loaded pretrained;
sharded with FSDP2 per block under Lightning's ``ModelParallelStrategy``.

Needs ``transformers`` (``pip install "lightning-sparse[hf]"``). The model is the ``model``
attribute, so its parameters are named as in ``transformers`` with a ``model.`` prefix (GPT-2:
``model.transformer.h.0.mlp.c_fc.weight``, a ``Conv1D``; Llama:
``model.model.layers.0.mlp.up_proj.weight``). Batches are ``(x, y)`` int64 ``(B, T)`` with ``y``
the next tokens, as from :class:`~lightning_sparse.demo.PydocTextDataModule` (byte-level: give a
``vocab_size`` of 256 or more).

Example:
    >>> import math, torch
    >>> lm = HuggingFaceCausalLM("gpt2", config={"n_layer": 1, "n_embd": 32, "n_head": 2,
    ...                                          "vocab_size": 256, "n_positions": 32})
    >>> x, y = torch.randint(0, 256, (2, 2, 16))
    >>> abs(lm.loss(x, y).item() - math.log(256)) < 0.3  # untrained: about uniform
    True
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from lightning_sparse.demo._checks import check_choice
from lightning_sparse.demo.compiling import compile_in_place, compile_mode
from lightning_sparse.demo.fsdp2 import DTYPES, shard_per_block
from lightning_sparse.demo.optim import (
    adamw_warmup_cosine,
    check_adamw_warmup_cosine,
    param_groups_weight_decay,
    total_training_steps,
)


class HuggingFaceCausalLM(L.LightningModule):
    """Next-token language modelling with a ``transformers`` causal LM, AdamW, warmup + cosine.

    Args:
        model: a model type (``"gpt2"``, ``"llama"``: a fresh config of that type, no download),
            a local directory with a ``config.json`` (and weights, for ``pretrained``), or a Hub
            name (needs the network or a filled Hugging Face cache).
        config: fields that override the config (e.g. ``{"n_layer": 4}``).
        pretrained: load the weights (``from_pretrained``) instead of initializing at random.
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the 2-D weights (not of embeddings, norms, biases).
        betas: AdamW betas.
        warmup_steps: linear warmup: a fraction of the run in [0, 1), or optimizer steps >= 1.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        compile: ``torch.compile`` the ``transformers`` model in place in ``configure_model``
            (names unchanged): ``False`` (eager), ``True`` (the default mode) or a mode such as
            ``"reduce-overhead"`` (see :data:`~lightning_sparse.demo.compiling.COMPILE_MODES`);
            under FSDP2, each block on its own.
        param_dtype: under Lightning's ``ModelParallelStrategy`` (FSDP2), the dtype of the
            weights each block's forward gets (``MixedPrecisionPolicy``; the parameters stay
            float32 shards), see :func:`~lightning_sparse.demo.fsdp2.shard_per_block`.
        reduce_dtype: under FSDP2, the dtype gradients are reduce-scattered in.
    """

    def __init__(
        self,
        model: str = "gpt2",
        config: dict[str, Any] | None = None,
        pretrained: bool = False,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: float = 0.05,
        min_lr_ratio: float = 0.1,
        compile: bool | str = False,
        param_dtype: str = "float32",
        reduce_dtype: str = "float32",
    ) -> None:
        super().__init__()
        check_adamw_warmup_cosine(lr, weight_decay, warmup_steps, min_lr_ratio)
        compile_mode(compile)
        check_choice("param_dtype", param_dtype, DTYPES)
        check_choice("reduce_dtype", reduce_dtype, DTYPES)
        self.save_hyperparameters()
        overrides = dict(config or {})
        if pretrained:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model, **overrides
            )
        else:
            self.model = transformers.AutoModelForCausalLM.from_config(
                _config(model, overrides)
            )

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: FSDP2 per block, then each block compiled;
        otherwise the whole model compiled (with ``compile``)."""
        hp = self.hparams
        mode = compile_mode(hp.compile)
        if self.device_mesh is None:
            compile_in_place(mode, self.model)
            return
        mesh = self.device_mesh["data_parallel"]
        blocks = shard_per_block(self.model, mesh, hp.param_dtype, hp.reduce_dtype)
        compile_in_place(mode, *blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x).logits  # (B, T, vocab)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean next-token cross-entropy (nats) of targets ``y`` given inputs ``x``."""
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(*batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(*batch), prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups_weight_decay(
            self, hp.weight_decay, no_decay_modules=(nn.Embedding,)
        )
        return adamw_warmup_cosine(groups, hp, total_training_steps(self.trainer))


def _config(model: str, overrides: dict[str, Any]) -> transformers.PretrainedConfig:
    """A model type's fresh config, or the config of a local directory or Hub name."""
    if model in transformers.CONFIG_MAPPING and not os.path.isdir(model):
        return transformers.AutoConfig.for_model(model, **overrides)
    return transformers.AutoConfig.from_pretrained(model, **overrides)


__all__ = ["HuggingFaceCausalLM"]
