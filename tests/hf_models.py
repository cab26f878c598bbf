"""Hugging Face models from tiny configs (random weights, no downloads) and a LightningModule that
trains them on random tokens. Importing this module skips the importing tests where
``transformers`` is not installed."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")


def tiny_gpt2(**config: Any) -> nn.Module:
    """GPT-2 (``Conv1D`` layers, ``lm_head`` tied to ``wte``): 2 layers of width 64."""
    fields = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**fields, "n_positions": 64, **config})
    )


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


class LMModule(L.LightningModule):
    """A causal LM (its ``labels`` loss) with AdamW."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def token_loader(steps: int = 4) -> DataLoader:
    ids = torch.randint(
        0, 256, (steps * 2, 16), generator=torch.Generator().manual_seed(0)
    )
    return DataLoader(TensorDataset(ids), batch_size=2)
