"""Fits for the learned-mask tests, kept apart from the test modules so that a module
without hypothesis (``test_learned_transposable.py``) can use them on a machine that lacks it:
the demo GPT and a tiny Hugging Face GPT-2 fitted on identical batches, resumable, and a
callback that records the masks at a learned phase's end."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from helpers import SameTokens, resumable_fit
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import Sparsifier, SparsityCallback
from lightning_sparse.algorithms import Learned
from lightning_sparse.demo import GPTLanguageModel

LEARN = {"sparsity": "2:4", "algorithm": "learned"}


class HFGPT2(L.LightningModule):
    """A tiny Hugging Face GPT-2 (``Conv1D`` layers, 2 blocks of width 64) on token batches,
    without dropout (a resume must not depend on the global random stream)."""

    def __init__(self) -> None:
        super().__init__()
        from hf_models import tiny_gpt2  # skips the HF cases without transformers

        self.model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


MODELS = ["gpt", "hf"]


def build(model: str) -> L.LightningModule:
    if model == "gpt":
        return GPTLanguageModel(n_layer=1, n_embd=32, block_size=16, warmup_steps=0)
    return HFGPT2()


def fit(
    model_name: str,
    phases: list[dict[str, Any]],
    max_steps: int,
    before: tuple[L.Callback, ...] = (),
    after: tuple[L.Callback, ...] = (),
    tmp_path: Any = None,
    stop_at: int | None = None,
    ckpt_path: Any = None,
    seed: int = 0,
) -> tuple[L.LightningModule, SparsityCallback, L.Trainer]:
    """Fit ``model_name`` (``"gpt"`` or ``"hf"``) under ``phases`` on identical batches by
    :func:`~helpers.resumable_fit`; ``before``/``after``: callbacks around the
    SparsityCallback (hooks run in list order)."""
    sparsity = SparsityCallback(phases=phases, verbose=False)
    model = resumable_fit(
        tmp_path,
        [*before, sparsity, *after],
        max_steps,
        stop_at,
        ckpt_path,
        seed,
        model=lambda: build(model_name),
        loader=DataLoader(SameTokens(), batch_size=4),
    )
    return model, sparsity, model.trainer


def learner(trainer: L.Trainer) -> Learned:
    """The learned algorithm of the trainer's SparsityCallback (in a learned phase)."""
    (sparsity,) = [cb for cb in trainer.callbacks if isinstance(cb, SparsityCallback)]
    algo = sparsity.sparsifier.algorithm
    assert isinstance(algo, Learned)
    return algo


def sparsifier_of(trainer: L.Trainer) -> Sparsifier:
    (sparsity,) = [cb for cb in trainer.callbacks if isinstance(cb, SparsityCallback)]
    return sparsity.sparsifier


class MostLikelyAt(L.Callback):
    """After the SparsityCallback: the masks the forwards use at the end of step ``last`` (the
    last of the learned phase) and at the start of the next."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.learned: dict[str, torch.Tensor] = {}
        self.next: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        sp = sparsifier_of(trainer)
        if trainer.global_step - 1 == self.last:  # the step just finished
            self.learned = {t.name: sp.current_mask(t).clone() for t in sp.targets}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sp = sparsifier_of(trainer)
        if trainer.global_step == self.last + 1:
            masks = {t.name: sp.current_mask(t) for t in sp.targets}
            self.next = {k: m.clone() for k, m in masks.items() if m is not None}
            self.weights = {t.name: t.param.detach().clone() for t in sp.targets}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
