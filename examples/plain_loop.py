"""A plain PyTorch training loop, no Lightning, with 2:4-sparse MLPs for the first 70% of the
optimizer steps and dense after: gradient accumulation, a learning-rate warm-up, dropout, a
checkpoint in the middle of the run and a resume from it. CPU-sized: seconds.

It trains the run twice, once straight through and once stopped at the checkpoint and resumed
in fresh objects, and checks that both end with the same weights, bit for bit.

    python examples/plain_loop.py
"""

from __future__ import annotations

import math
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse import SparseTraining

VOCAB, CONTEXT, WIDTH = 64, 16, 32
PHASES = [{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}]
PARAMS = ["blocks.*.fc.weight", "blocks.*.proj.weight"]


class TinyLM(nn.Module):
    """Byte-level next-token model: embeddings, residual MLP blocks, a head tied to the
    embedding (no attention: small enough for a CPU test)."""

    def __init__(self, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


def batch(step: int, micro: int, size: int = 4) -> tuple[Tensor, Tensor]:
    """Micro-batch ``micro`` of optimizer step ``step``: the same in every run (a real loop
    resumes its data loader from its own state)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def build(
    total_steps: int, phases: list[dict[str, Any]], seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, Any, SparseTraining]:
    """Model, optimizer, warm-up schedule and the sparsity schedule, built in that order."""
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = max(1, total_steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total_steps))
        ),
    )
    sparsity = SparseTraining(
        model,
        optimizer,
        phases=phases,
        params=PARAMS,
        total_steps=total_steps,
        restore_rng=True,  # dropout goes on after a resume as it would have
        verbose=False,
    )
    return model, optimizer, scheduler, sparsity


def train(
    total_steps: int = 20,
    accumulate: int = 2,
    phases: list[dict[str, Any]] = PHASES,
    stop_at: int | None = None,
    checkpoint: Path | None = None,
) -> tuple[nn.Module, SparseTraining]:
    """Train ``total_steps`` optimizer steps; with ``stop_at``, save ``checkpoint`` after that
    many steps and return; with a ``checkpoint`` and no ``stop_at``, resume from it (the
    fresh model starts from other weights, which the checkpoint replaces)."""
    resume = checkpoint is not None and stop_at is None
    model, optimizer, scheduler, sparsity = build(
        total_steps, phases, seed=1 if resume else 0
    )
    start = 0
    if resume:
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sparsity.load_state_dict(state["sparsity"])  # masks, phase, step, generators
        start = state["step"]
    for step in range(start, total_steps):
        for micro in range(accumulate):
            inputs, targets = batch(step, micro)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            (loss / accumulate).backward()
        optimizer.step()  # the sparsity schedule's work runs in here (a step pre-hook)
        sparsity.step()  # once per optimizer step, never per micro-batch
        optimizer.zero_grad()
        scheduler.step()
        if step + 1 == stop_at:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "sparsity": sparsity.state_dict(),
                    "step": step + 1,
                },
                checkpoint,
            )
            return model, sparsity
    sparsity.end()
    return model, sparsity


def main() -> None:
    straight, _ = train()
    with TemporaryDirectory() as tmp:
        path = Path(tmp) / "mid.pt"
        train(stop_at=8, checkpoint=path)
        resumed, _ = train(checkpoint=path)
    same = all(
        torch.equal(a, b)
        for a, b in zip(straight.state_dict().values(), resumed.state_dict().values())
    )
    print(f"resumed run equals the uninterrupted one bit for bit: {same}")


if __name__ == "__main__":
    main()
