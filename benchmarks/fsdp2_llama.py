"""Benchmark: the Llama FSDP2 recipe's blocks, a training step dense vs 2:4 MLPs on the kernels.

    PYTHONPATH=. python benchmarks/fsdp2_llama.py [--layers 4] [--tokens 16384] [--json out.json]
    PYTHONPATH=. torchrun --nproc-per-node 8 benchmarks/fsdp2_llama.py     # 8 GPUs, 8 shards
    PYTHONPATH=. python benchmarks/fsdp2_llama.py --cpu-smoke    # the script, on the CPU

What runs: ``transformers``' Llama decoder blocks at the shapes of
``recipes/hf/llama_1b_fsdp2_24_70pct.yaml`` (read from it: width 2048, SwiGLU MLP 8192, 32
heads / 8 KV heads; ``--layers`` of them), random init, random input embeddings (``--tokens``
per rank, sequences of 2048), loss the mean square of the output. As the recipe runs them:
FSDP2 (``fully_shard`` per block, then the model) with ``MixedPrecisionPolicy(bfloat16,
float32)``, every block compiled (``torch.compile`` default mode, no CUDA graphs), AdamW on
the float32 shards. Started without ``torchrun`` it is one process on NCCL (world size 1).

Three runs from the same initial weights and inputs: dense; 2:4 MLPs on masked math
(``backend="masked"``); 2:4 MLPs on the kernels (``backend="semi_structured"``: every MLP
layer must run cuSPARSELt, or it stops). The 2:4 runs put the MLP weights in a ``runtime`` 2:4
phase through the engine, as ``SparsityCallback`` does. Reported: the kernel run's losses
against the masked run's over the first steps (largest relative difference, PASS within the
kernel check's tolerance), the median step time (CUDA events after warm-up) and its ratio
against dense in the same run, peak memory per rank over the first steps (the phase start
among them; on a GPU ``torch.cuda.max_memory_allocated``, on the CPU what was alive before
them plus the most they held at once, counted by storage:
:mod:`lightning_sparse.engine.memory_census`), the backend table and the kernel checks.

Without a CUDA GPU of capability 8.0+ it says so and exits 0. ``--cpu-smoke`` runs a tiny
block through the same code on the CPU (gloo; ``backend="auto"``, which is masked math there;
``aot_eager``); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from common import (
    Records,
    Timer,
    benchmark_device,
    kernel_check_table,
    live_tensor_bytes,
    markdown_table,
)

from lightning_sparse.backends.kernel_check import TOLERANCE, relative_error
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.demo.fsdp2 import shard_per_block
from lightning_sparse.engine.memory_census import PeakBytes
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks.tiles import greedy_2to4_mask

RECIPE = (
    Path(__file__).resolve().parents[1]
    / "recipes"
    / "hf"
    / "llama_1b_fsdp2_24_70pct.yaml"
)
MLP = ["layers.*.mlp.gate_proj.weight", "layers.*.mlp.up_proj.weight"] + [
    "layers.*.mlp.down_proj.weight"
]
SEQUENCE = 2048
SMOKE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
}
VARIANTS = {"dense": None, "2:4 masked": "masked", "2:4 kernel": "semi_structured"}


def llama(layers: int, smoke: bool):
    """The recipe's Llama config with ``layers`` blocks (tiny shapes for a smoke run)."""
    import transformers  # the benchmark's one optional dependency

    fields = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]["config"]
    fields = {**fields, **(SMOKE if smoke else {}), "num_hidden_layers": layers}
    return transformers.LlamaModel(transformers.LlamaConfig(**fields))


def run(variant: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One run: losses of the first steps, median ms per step, peak GiB, backends."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = llama(args.layers, args.cpu_smoke).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = shard_per_block(model, mesh, "bfloat16", "float32")
    backend = VARIANTS[variant]
    sparsifier = None
    if backend is not None:
        sparsifier = Sparsifier(
            "bench",
            select_parameters(model, MLP).targets,
            resolve_phases([Phase(sparsity="2:4")]),  # runtime 2:4 for the whole run
            backend=backend if cuda else "auto",
        )
    for block in blocks:
        block.compile(**({} if cuda else {"backend": "aot_eager"}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device).manual_seed(1 + dist.get_rank())
    width = model.config.hidden_size
    sequences = max(1, args.tokens // SEQUENCE)
    length = min(args.tokens, SEQUENCE)
    x = torch.randn(sequences, length, width, generator=gen, device=device)
    steps = itertools.count()
    losses: list[float] = []

    def step() -> None:
        index = next(steps)
        if sparsifier is not None:
            sparsifier.on_step_start(index, [optimizer])
        loss = model(inputs_embeds=x).last_hidden_state.float().square().mean()
        loss.backward()
        if sparsifier is not None:
            sparsifier.before_optimizer_step(index, optimizer, [optimizer])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if len(losses) < args.compare:
            losses.append(loss.item())

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = 0 if cuda else live_tensor_bytes()  # the model, its shards, the inputs
    try:
        # the CPU's accounting: what was alive before, and the most the steps (the phase start
        # and the optimizer's state among them) held at once on top of it
        with contextlib.nullcontext() if cuda else PeakBytes() as counted:
            for _ in range(args.compare):
                step()
        ms = Timer(device, args.repeats, args.warmup)(step)
        reasons = (
            {c.reason for c in sparsifier.backends.values()} if sparsifier else set()
        )
        kernels = (
            sum(c.name == "semi_structured" for c in sparsifier.backends.values())
            if sparsifier
            else 0
        )
    finally:
        if sparsifier is not None:
            sparsifier.close()
    peak = (
        torch.cuda.max_memory_allocated() if cuda else before + counted.peak
    ) / 2**30
    return {
        "variant": variant,
        "losses": losses,
        "ms": ms,
        "peak_gib": peak,
        "kernel_layers": kernels,
        "reasons": sorted(reasons),
    }


def release(device: torch.device) -> None:
    """Free what the last run left: compiled code, cached GPU memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument(
        "--tokens", type=int, default=16384, help="tokens per rank and step"
    )
    parser.add_argument("--compare", type=int, default=4, help="steps whose losses")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on the CPU"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.layers, args.tokens, args.compare = 1, 64, 2
        args.repeats, args.warmup = 1, 0
    return args


def init_process_group(device: torch.device) -> None:
    """torchrun's process group, or one process of world size 1 (NCCL on a GPU)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    found = benchmark_device("fsdp2_llama.py", args.cpu_smoke, "a tiny Llama block")
    if found is None:
        return []
    device, where = found
    init_process_group(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank0, world = dist.get_rank() == 0, dist.get_world_size()
    if (
        device.type == "cpu"
    ):  # the mask code's tables, built once a process: before any run
        greedy_2to4_mask(torch.ones(128, 128))
    results = []
    for variant in VARIANTS:
        results.append(run(variant, args, device))
        release(device)
    records = Records(args.json if rank0 else None)
    for result in results:
        records.add(**result, world_size=world, tokens=args.tokens)
    dist.destroy_process_group()
    if not rank0:
        return results
    dense, masked, kernel = results
    difference = max(
        relative_error(torch.tensor([k]), torch.tensor([m]))
        for k, m in zip(kernel["losses"], masked["losses"])
    )
    verdict = "PASS" if difference <= TOLERANCE else "FAIL"
    print(
        f"torch {torch.__version__}, {where}; FSDP2 over {world} rank(s), "
        f"{args.layers} Llama blocks of {RECIPE.name}, {args.tokens} tokens per rank; "
        f"median of {args.repeats} steps after {args.warmup} warm-up steps\n"
    )
    rows = [
        [
            r["variant"],
            f"{r['ms']:.1f}",
            f"{dense['ms'] / r['ms']:.2f}x",
            f"{r['peak_gib'] * 2**10:.1f}",
            str(r["kernel_layers"]),
        ]
        for r in results
    ]
    memory = "max_memory_allocated" if device.type == "cuda" else "CPU accounting"
    header = [
        "run",
        "ms per step",
        "vs dense",
        f"peak MiB per rank ({memory})",
        "MLP layers on 2:4 kernels",
    ]
    print(markdown_table(header, rows) + "\n")
    print(
        f"kernel run against masked run, losses of the first {args.compare} steps: largest "
        f"relative difference {difference:.2g} ({verdict}: the kernel check's tolerance is "
        f"{TOLERANCE})\n"
    )
    print(
        "Backends of the 2:4 runs: " + "; ".join(kernel["reasons"] + masked["reasons"])
    )
    print("\nKernel checks in this process:\n")
    print(kernel_check_table())
    return results


if __name__ == "__main__":
    main()
