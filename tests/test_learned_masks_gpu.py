"""Learned N:M masks on a CUDA GPU (kept apart from ``test_learned_masks.py`` so that a GPU
machine without hypothesis collects it)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import SameTokens
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.demo import GPTLanguageModel
from lightning_sparse.masks import NM, is_nm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_learned_masks_on_a_gpu_in_bf16_are_reproducible_and_valid():
    """On a CUDA GPU under bf16 autocast the learned phase runs and hands on valid 2:4 masks,
    and two runs agree bit for bit (the Gumbel noise comes from the GPU's seeded generator)."""

    def run() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        L.seed_everything(0, verbose=False)
        cb = SparsityCallback(
            phases=[
                {
                    "sparsity": "2:4",
                    "algorithm": "learned",
                    "until": 3,
                    "mask_lr": 0.05,
                },
                {"sparsity": "2:4", "algorithm": "static"},
            ],
            verbose=False,
        )
        trainer = L.Trainer(
            accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=5,
            callbacks=[cb], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        )  # fmt: skip
        model = GPTLanguageModel(n_layer=1, n_embd=32, block_size=16, warmup_steps=0)
        trainer.fit(model, DataLoader(SameTokens(), batch_size=4))
        masks = {k: v.cpu() for k, v in cb.sparsifier.state_dict()["masks"].items()}
        return masks, {k: v.detach().cpu() for k, v in model.state_dict().items()}

    masks, weights = run()
    again, weights_again = run()
    assert all(torch.equal(masks[k], again[k]) for k in masks)
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)
    for mask in masks.values():
        assert is_nm(mask, NM(2, 4)) and int(mask.sum()) * 2 == mask.numel()
