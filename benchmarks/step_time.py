"""Step time and memory of masked sparse training vs dense and Lightning's ModelPruning (CPU).

One process; the variants run interleaved, ``--repeats`` times each, on the same timm ViT
(img 32, patch 4, dim 192, depth 6, 3 heads) with AdamW through a real ``lightning.Trainer``.
Reported: the median step time over all timed steps of all repeats, its ratio to the first
dense run (a second dense run shows the noise floor), the time spent inside this project's
callback hooks per step (the callback's own work, timed on the real hooks), and extra
live-tensor memory vs dense.

Where a static-70% step's extra time over dense goes, measured per phase (forward, backward,
hooks, ``optimizer.step``) by ``python benchmarks/step_phases.py`` (the variants step
round-robin in one process, 1 thread, per-thread CPU time so that other processes' load barely
counts; 30 paired steps at batch 64):

- Forward and backward: the same as dense (within 1%, the noise of the medians). A static hard
  mask installs no forward: pruned weights are stored as zeros and the unmodified
  ``nn.Linear`` runs (``ModelPruning`` recomputes ``weight_orig * weight_mask`` at every forward
  and backpropagates through it, about 1-2 ms).
- The callback's hooks: about 2 ms at 1 thread (1 ms at 2), nearly all masking 2.65 M
  gradients (one ``torch._foreach_mul_`` by the masks' ``uint8`` bytes).
- The ``AdamW`` step: +11-17 ms at 1 thread (a 2.65 M-weight step: 8 -> 20 ms alone; 14 -> 28
  ms in the model, where ``ModelPruning``'s is 31). Masked gradients leave ``exp_avg_sq``
  exactly zero on pruned weights, and torch's CPU ``sqrt`` (which the default single-tensor
  and ``foreach`` AdamW take of ``exp_avg_sq``) is 6-10x slower on zeros than on other
  values (13 against 2 ms over 2.65 M values with 70% zeros; NumPy's is not); ``-0.0`` and
  denormals are slower still, but ``exp_avg_sq`` holds only ``+0.0``. Whoever masks the
  gradients pays it: ``ModelPruning`` does too. ``torch.set_flush_denormal(True)`` does not
  change it; ``AdamW(fused=True)`` does (3.4 ms dense or masked; the default's results differ
  from the fused ones in the last bits, so the callback cannot switch for the user).

So the step pays about 1.3% at batch 64 (static 1.011x, ``ModelPruning`` 1.019x, a second dense
run 0.989x in that paired run), and more at batch 4, where the optimizer step is a larger part.
Differences beyond that between whole-step medians here are noise: on this shared 2-core
machine a step's time varies by 20-40% from one step to the next whenever other jobs run, and
two threads (the default) suffer most, since each parallel op waits for its slower thread; read
the load average printed above the table. The lines printed under the table measure the
optimizer's part directly (``AdamW`` alone, dense against masked gradients, alternating).

    python benchmarks/step_time.py                 # batch 64 and 4, about 4.5 minutes on 2 cores
    python benchmarks/step_time.py --fused         # the same with AdamW(fused=True)
    python benchmarks/step_time.py --batch-sizes 4 --repeats 2 --steps 20
    python benchmarks/step_time.py --batch-sizes 64 --repeats 2 --steps 6 --warmup 2  # ~3 min idle
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import timm
import torch
from common import live_tensor_bytes, markdown_table, median
from lightning.pytorch.callbacks import ModelPruning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback


class ViTModule(L.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.model = timm.models.vision_transformer.VisionTransformer(
            img_size=32,
            patch_size=4,
            embed_dim=192,
            depth=6,
            num_heads=3,
            num_classes=10,
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=1e-4, weight_decay=0.05, fused=self.fused
        )


class PruningFromFirstStep(ModelPruning):
    """ModelPruning l1_unstructured 70%, applied before the first step (it normally waits for an
    epoch end) and never again."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.apply_pruning(0.7)


class StepTimer(L.Callback):
    """Times every step after ``warmup``; at the last step, measures live tensor bytes."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.live_bytes = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)
        if trainer.global_step == trainer.max_steps:
            self.live_bytes = live_tensor_bytes()


class HookTimer:
    """Wraps the per-step hooks of a callback instance (Lightning looks hooks up on the
    instance) and sums the time spent in them per batch."""

    HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")

    def __init__(self, callback: L.Callback) -> None:
        self.per_batch: list[float] = []
        for hook in self.HOOKS:
            setattr(callback, hook, self._timed(getattr(callback, hook), hook))

    def _timed(self, hook: Callable[..., None], name: str) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            hook(*args, **kwargs)
            if name == "on_train_batch_start":
                self.per_batch.append(0.0)
            self.per_batch[-1] += time.perf_counter() - start

        return timed


def adam_sqrt_on_zeros(numel: int, sparsity: float = 0.7) -> tuple[float, float]:
    """Median ms of ``torch.sqrt`` over ``numel`` float32 values, random vs ``sparsity`` zeros
    (what AdamW's default step computes over ``exp_avg_sq``)."""
    values = torch.rand(numel)
    zeros = values.masked_fill(torch.rand(numel) < sparsity, 0.0)
    result = []
    for x in (values, zeros):
        times = []
        for _ in range(15):
            start = time.perf_counter()
            x.sqrt()
            times.append(time.perf_counter() - start)
        result.append(median(times[3:]) * 1e3)
    return result[0], result[1]


def adamw_step_on_zeros(
    shapes: list[torch.Size], fused: bool, sparsity: float = 0.7
) -> tuple[float, float]:
    """Median ms of one ``AdamW`` step over weights of ``shapes``, with random gradients vs the
    same gradients masked at ``sparsity`` (so ``exp_avg``/``exp_avg_sq`` hold exact zeros, as
    under any hard mask); the two optimizers step alternately, on the benchmark's threads."""
    torch.manual_seed(0)
    keep = [torch.rand(s) >= sparsity for s in shapes]
    runs = []
    for _ in range(2):
        params = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        runs.append(
            (params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, fused=fused))
        )
    times: list[list[float]] = [[], []]
    for _ in range(20):
        grads = [torch.randn(s) * 1e-3 for s in shapes]
        for masked, (params, optimizer) in enumerate(runs):
            for p, g, k in zip(params, grads, keep):
                p.grad = g * k if masked else g.clone()
            start = time.perf_counter()
            optimizer.step()
            times[masked].append(time.perf_counter() - start)
    return median(times[0][3:]) * 1e3, median(times[1][3:]) * 1e3


def block_linears(module: ViTModule) -> list[tuple[nn.Module, str]]:
    return [
        (m, "weight")
        for n, m in module.named_modules()
        if isinstance(m, nn.Linear) and ".blocks." in f".{n}"
    ]


VARIANTS: dict[str, Callable[[ViTModule], list[L.Callback]]] = {
    "dense": lambda m: [],
    "dense (again)": lambda m: [],
    "ModelPruning l1 70%": lambda m: [
        PruningFromFirstStep(
            "l1_unstructured",
            parameters_to_prune=block_linears(m),
            amount=0.7,
            apply_pruning=False,
            verbose=0,
        )
    ],
    "lightning_sparse static 70%": lambda m: [
        SparsityCallback(sparsity=0.7, verbose=False)
    ],
    "lightning_sparse magnitude 70% /100": lambda m: [
        SparsityCallback(
            phases=[{"sparsity": 0.7, "algorithm": "magnitude", "update_every": 100}],
            verbose=False,
        )
    ],
}


def run_variant(
    name: str, batch_size: int, steps: int, warmup: int, fused: bool
) -> tuple[list[float], float, int]:
    """Step times, the time per timed step inside SparsityCallback hooks, and the tensor bytes
    the run added (model, optimizer, data, masks...)."""
    before = live_tensor_bytes()
    torch.manual_seed(0)
    module = ViTModule(fused)
    timer = StepTimer(warmup)
    callbacks = VARIANTS[name](module)
    hooks = [HookTimer(c) for c in callbacks if isinstance(c, SparsityCallback)]
    data = TensorDataset(
        torch.randn(batch_size * 4, 3, 32, 32), torch.randint(0, 10, (batch_size * 4,))
    )
    trainer = L.Trainer(
        max_steps=steps + warmup,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
    )
    trainer.fit(module, DataLoader(data, batch_size=batch_size))
    # the batches StepTimer timed: all but the first `warmup`
    hook_time = sum(sum(h.per_batch[warmup:]) for h in hooks) / max(len(timer.times), 1)
    return timer.times, hook_time, timer.live_bytes - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 4])
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved runs of each variant"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="timed steps per run (default: 10 at batch>=32, 30 below)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--fused", action="store_true", help="AdamW(fused=True) instead of the default"
    )
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    sparse_weights = sum(
        p.numel() for m, _ in block_linears(ViTModule()) for p in [m.weight]
    )
    optimizer = "AdamW(fused=True)" if args.fused else "AdamW (torch's default)"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {optimizer}, "
        f"{sparse_weights / 1e6:.2f} M sparse weights, load average "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    rows = []
    for batch_size in args.batch_sizes:
        steps = args.steps or (10 if batch_size >= 32 else 30)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        hook_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        memory: dict[str, int] = {}
        for repeat in range(args.repeats):
            for name in VARIANTS:
                t, hook_time, mem = run_variant(
                    name, batch_size, steps, args.warmup, args.fused
                )
                times[name] += t
                hook_times[name].append(hook_time)
                memory[name] = mem
                print(
                    f"  batch {batch_size} repeat {repeat + 1}: {name:<38} {median(t) * 1e3:8.2f} ms",
                    flush=True,
                )
        base = median(times["dense"])
        for name in VARIANTS:
            extra = memory[name] - memory["dense"]
            hooks = median(hook_times[name]) * 1e3
            rows.append(
                [
                    str(batch_size),
                    name,
                    f"{median(times[name]) * 1e3:.2f}",
                    f"{median(times[name]) / base:.3f}x",
                    f"{hooks:.2f} ({hooks / (base * 1e3):.1%})"
                    if name.startswith("lightning_sparse")
                    else "-",
                    f"{extra / 2**20:+.2f}",
                    f"{extra / sparse_weights:+.2f}",
                ]
            )
    print()
    print(
        markdown_table(
            [
                "batch",
                "variant",
                "step ms (median)",
                "vs dense",
                "callback hooks ms/step (of dense step)",
                "extra MiB",
                "extra bytes / sparse weight",
            ],
            rows,
        )
    )
    shapes = [m.weight.shape for m, _ in block_linears(ViTModule())]
    dense_ms, masked_ms = adamw_step_on_zeros(shapes, args.fused)
    print(
        f"\n{optimizer} step over the {sparse_weights / 1e6:.2f} M sparse weights alone: "
        f"{dense_ms:.2f} ms with dense gradients, {masked_ms:.2f} ms with 70% masked "
        f"({masked_ms - dense_ms:+.2f} ms, paid by any hard mask: ModelPruning too)"
    )
    dense_ms, zeros_ms = adam_sqrt_on_zeros(sparse_weights)
    print(
        f"torch.sqrt over {sparse_weights / 1e6:.2f} M float32 values (AdamW's exp_avg_sq): "
        f"{dense_ms:.2f} ms random, {zeros_ms:.2f} ms with 70% zeros ({zeros_ms / dense_ms:.1f}x)"
    )


if __name__ == "__main__":
    main()
