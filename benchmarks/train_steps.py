"""Benchmark: training steps, dense vs 2:4 MLP linears, eager and compiled (bf16, CUDA sm80+).

    PYTHONPATH=. python benchmarks/train_steps.py [--models llm vit-b vit-l]
        [--modes eager compiled] [--repeats 10] [--json out.json]
    PYTHONPATH=. python benchmarks/train_steps.py --cpu-smoke   # checks the script on the CPU

Models (random init, random inputs made on the GPU, fused AdamW):

- ``llm``: an MLP-heavy LLM block stack: 4 pre-norm Llama-7B-sized blocks (d_model 4096, 32
  heads of causal attention, SwiGLU MLP 4096 -> 11008 -> 4096, RMSNorm), bf16 weights, 8
  sequences of 2048 tokens (16384 per step), loss the mean square of the output;
- ``vit-b``: timm ``vit_base_patch16_224``, batch 128, float32 weights, bf16 autocast;
- ``vit-l``: timm ``vit_large_patch14_224``, batch 48, the same.

The 2:4 runs put every MLP linear in a runtime 2:4 phase through the engine, as
``SparsityCallback`` does (``Sparsifier(backend="semi_structured")``; its ``on_step_start``
and ``before_optimizer_step`` at every step): each forward prunes the weight to its greedy
transposable 2:4 pattern and runs cuSPARSELt (searched algorithm, our packer where it matches
``torch._cslt_compress``). Compiled: every block ``torch.compile(mode="reduce-overhead")``
(regional compilation: one compilation serves all blocks; CUDA graphs remove the CPU launch
cost). Reported: median step time (CUDA events, after warm-up), the ratio against dense in the
same mode, and peak ``torch.cuda.max_memory_allocated``.

Each compiled model costs a compilation (tens of seconds); ``--time-limit`` skips what would
start after it and says so. Without a CUDA GPU of capability 8.0+ it says so and exits 0.
``--cpu-smoke`` runs tiny models through the same code on the CPU (``backend="auto"``, which
is masked math there; compiled with ``aot_eager``); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from common import (
    COMPILED_WARMUP,
    TINY_VIT,
    Deadline,
    Records,
    Timer,
    benchmark_device,
    compile_options,
    kernel_check_table,
    markdown_table,
    new_step,
)

from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

MODES = ("eager", "compiled")


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention, then a SwiGLU MLP."""

    def __init__(self, width: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = nn.ModuleDict(
            {
                "gate": nn.Linear(width, hidden, bias=False),
                "up": nn.Linear(width, hidden, bias=False),
                "down": nn.Linear(hidden, width, bias=False),
            }
        )

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, tokens, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, head width)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, tokens, width))
        h = self.mlp_norm(x)
        mlp = self.mlp
        return x + mlp["down"](F.silu(mlp["gate"](h)) * mlp["up"](h))


class BlockStack(nn.Module):
    def __init__(self, depth: int, width: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden, heads) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class Workload:
    """A model to train: how to build it and a batch, its MLP parameters, its loss."""

    label: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[Tensor, ...]]
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor]
    params: list[str]
    dtype: torch.dtype  # of the weights; bf16 matmuls either way (autocast for float32)


def llm(depth: int, width: int, hidden: int, heads: int, shape: tuple[int, int]):
    def batch(device: torch.device) -> tuple[Tensor, ...]:
        return (torch.randn(*shape, width, device=device, dtype=dtype(device)),)

    def dtype(device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    return Workload(
        f"LLM block stack: {depth} x (d {width}, SwiGLU {hidden}), "
        f"{shape[0]} x {shape[1]} tokens",
        lambda: BlockStack(depth, width, hidden, heads),
        batch,
        lambda model, batch: model(*batch).float().square().mean(),
        ["blocks.*.mlp.*.weight"],
        torch.bfloat16,
    )


def vit(name: str, batch_size: int, label: str, **kwargs: int):
    size = kwargs.get("img_size", 224)

    def build() -> nn.Module:
        import timm  # only the ViT workloads need it

        return timm.create_model(name, **kwargs)

    def batch(device: torch.device) -> tuple[Tensor, ...]:
        images = torch.randn(batch_size, 3, size, size, device=device)
        return images, torch.randint(0, 1000, (batch_size,), device=device)

    return Workload(
        f"{label}, batch {batch_size}",
        build,
        batch,
        lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        ["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"],
        torch.float32,
    )


WORKLOADS = {
    "llm": lambda: llm(4, 4096, 11008, 32, (8, 2048)),
    "vit-b": lambda: vit("vit_base_patch16_224", 128, "ViT-B/16 (timm)"),
    "vit-l": lambda: vit("vit_large_patch14_224", 48, "ViT-L/14 (timm)"),
}
SMOKE_WORKLOADS = {
    "llm": lambda: llm(2, 64, 128, 2, (2, 16)),
    "vit-b": lambda: vit("vit_base_patch16_224", 2, "tiny ViT-B", **TINY_VIT),
    "vit-l": lambda: vit("vit_large_patch14_224", 2, "tiny ViT-L", **TINY_VIT),
}


def time_step(
    workload: Workload, sparse: bool, compiled: bool, device: torch.device, timer: Timer
) -> tuple[float, float | None]:
    """Median ms of one training step, and peak GiB allocated (``None`` off a GPU)."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = workload.build().to(device, workload.dtype if cuda else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    sparsifier = None
    if sparse:
        sparsifier = Sparsifier(
            "bench",
            select_parameters(model, workload.params).targets,
            resolve_phases([Phase(sparsity="2:4")]),  # runtime 2:4 for the whole run
            backend="semi_structured" if cuda else "auto",
            compute_dtype=torch.bfloat16 if cuda else None,
        )
    if compiled:
        for block in model.blocks:
            block.compile(**compile_options(device))
    batch = workload.batch(device)
    autocast = cuda and workload.dtype == torch.float32
    steps = itertools.count()

    def step() -> None:
        index = next(steps)
        if sparsifier is not None:
            sparsifier.on_step_start(index, [optimizer])
        if compiled:
            new_step(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = workload.loss(model, batch)
        loss.backward()
        if sparsifier is not None:
            sparsifier.before_optimizer_step(index, optimizer, [optimizer])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        ms = timer(step, max(timer.warmup, COMPILED_WARMUP) if compiled else None)
    finally:
        if sparsifier is not None:
            sparsifier.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return ms, peak


def release(device: torch.device) -> None:
    """Free what the last run left: compiled code, CUDA graphs, cached GPU memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_rows(
    args: argparse.Namespace, device: torch.device, timer: Timer, records: Records
) -> list[list[str]]:
    workloads = SMOKE_WORKLOADS if args.cpu_smoke else WORKLOADS
    rows = []
    for name in args.models:
        workload = workloads[name]()
        for mode in args.modes:
            dense = None
            for variant in ("dense", "2:4 MLPs"):
                what = f"{name} {mode} {variant}"
                if args.deadline.passed(what) or (variant != "dense" and dense is None):
                    rows.append([workload.label, mode, variant, "not run", "-", "-"])
                    continue
                ms, peak = time_step(
                    workload, variant != "dense", mode == "compiled", device, timer
                )
                release(device)
                dense = dense or ms
                shown = "-" if peak is None else f"{peak:.2f}"
                rows.append(
                    [
                        workload.label,
                        mode,
                        variant,
                        f"{ms:.1f}",
                        f"{dense / ms:.2f}x",
                        shown,
                    ]
                )
                records.add(
                    table="steps", model=name, label=workload.label, mode=mode,
                    variant=variant, ms=ms, ratio=dense / ms, peak_gib=peak,
                )  # fmt: skip
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="what to train",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--time-limit", type=float, help="seconds; skip what is left")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on the CPU"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.repeats, args.warmup = 1, 0
    args.deadline = Deadline(args.time_limit)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    found = benchmark_device("train_steps.py", args.cpu_smoke, "tiny models, float32")
    if found is None:
        return
    device, where = found
    print(
        f"torch {torch.__version__}, {where}; median of {args.repeats} steps after "
        f"{args.warmup} warm-up steps (at least {COMPILED_WARMUP} compiled)\n",
        flush=True,
    )
    timer, records = Timer(device, args.repeats, args.warmup), Records(args.json)
    header = ["model", "mode", "variant", "ms per step", "vs dense", "peak GiB"]
    print(markdown_table(header, step_rows(args, device, timer, records)) + "\n")
    print("Kernel checks in this process:\n")
    print(kernel_check_table())
    if args.deadline.skipped:
        print(f"\n{args.deadline.note()}")


if __name__ == "__main__":
    main()
