"""Pretraining with Lightning Fabric, in the shape of litgpt's pretraining loop, with 2:4-sparse
MLPs for the first 70% of the optimizer steps and dense after: gradient accumulation under
``fabric.no_backward_sync``, a learning-rate warm-up set per iteration, gradient clipping, and
the sparsity state saved and loaded with ``fabric.save`` / ``fabric.load`` beside the model and
optimizer. CPU-sized: the project's tiny demo GPT, seconds.

It trains the run twice, once straight through and once stopped at a checkpoint and resumed
in fresh objects, and checks that both end with the same weights, bit for bit.

    python examples/fabric_pretrain.py
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse import SparseTraining
from lightning_sparse.demo import GPT, GPTConfig

PHASES = [{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}]
VOCAB, CONTEXT = 64, 16


def demo_gpt() -> tuple[nn.Module, list[str]]:
    """The demo GPT at a CPU size, and its MLP weights' names."""
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=CONTEXT,
        n_layer=2,
        n_head=2,
        n_embd=32,
        dropout=0.1,
    )
    params = ["transformer.h.*.mlp.c_fc.weight", "transformer.h.*.mlp.c_proj.weight"]
    return GPT(config), params


def batch(iteration: int, size: int = 4) -> tuple[Tensor, Tensor]:
    """The micro-batch of ``iteration``, the same in every run (litgpt resumes its streaming
    loader from the checkpoint's state; a fixed stream keeps this example short)."""
    g = torch.Generator().manual_seed(iteration)
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def learning_rate(step: int, warmup: int, total: int, peak: float = 3e-3) -> float:
    """Linear warm-up, then cosine decay (litgpt's default schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def pretrain(
    fabric: L.Fabric,
    model_factory: Callable[[], tuple[nn.Module, list[str]]] = demo_gpt,
    total_steps: int = 12,
    accumulate: int = 2,
    stop_at: int | None = None,
    checkpoint: Path | None = None,
    resume: bool = False,
) -> tuple[nn.Module, SparseTraining, dict[str, Any]]:
    """Train ``total_steps`` optimizer steps of ``accumulate`` micro-batches each; with
    ``stop_at``, save ``checkpoint`` after that many steps and return; with ``resume``, load it
    first. Returns the model, the sparsity schedule and the loop's state."""
    fabric.seed_everything(1 if resume else 0)  # a resume starts from other weights
    model, params = model_factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    sparsity = SparseTraining(
        model,
        optimizer,
        phases=PHASES,
        params=params,
        total_steps=total_steps,
        restore_rng=True,  # dropout goes on after a resume as it would have
        verbose=False,
    )
    state = {
        "model": model,
        "optimizer": optimizer,
        "sparsity": sparsity,  # a stateful object: fabric.save/load call its state_dict
        "iter_num": 0,
        "step_count": 0,
    }
    if resume:
        fabric.load(checkpoint, state)
    warmup = max(1, total_steps // 4)
    while state["step_count"] < total_steps:
        iteration = state["iter_num"]
        state["iter_num"] += 1
        lr = learning_rate(state["step_count"], warmup, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        is_accumulating = state["iter_num"] % accumulate != 0
        inputs, targets = batch(iteration)
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            fabric.backward(loss / accumulate)
        if is_accumulating:
            continue
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()  # the sparsity schedule's work runs in here (a step pre-hook)
        sparsity.step()  # once per optimizer step, never per micro-batch
        optimizer.zero_grad()
        state["step_count"] += 1
        if state["step_count"] == stop_at:
            fabric.save(checkpoint, state)
            return model, sparsity, state
    sparsity.end()
    return model, sparsity, state


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="ddp")
    fabric.launch()
    straight, _, _ = pretrain(fabric)
    with TemporaryDirectory() as tmp:
        path = Path(tmp) / "mid.ckpt"
        pretrain(fabric, stop_at=6, checkpoint=path)
        resumed, _, _ = pretrain(fabric, checkpoint=path, resume=True)
    same = all(
        torch.equal(a, b)
        for a, b in zip(straight.state_dict().values(), resumed.state_dict().values())
    )
    fabric.print(f"resumed run equals the uninterrupted one bit for bit: {same}")


if __name__ == "__main__":
    main()
