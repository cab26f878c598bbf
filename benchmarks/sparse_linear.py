"""Benchmark: 2:4 sparse tensor cores vs dense matmuls, forward + backward, bfloat16 (CUDA, sm80+).

    python benchmarks/sparse_linear.py [--repeats 20] [--batch 48] [--no-step] [--compile]
    python benchmarks/sparse_linear.py --cpu-smoke   # checks the script on the CPU only

1. ``nn.Linear`` layers (with bias) at ViT-L MLP shapes (13008 tokens, 1024 -> 4096 and
   4096 -> 1024) and GPT-2 MLP shapes (8192 tokens = 8 x 1024; small, medium, large):
   forward + backward (input, weight and bias gradients) of the dense layer, of the 2:4
   ``runtime`` layer on each available kernel (the per-step tile op that prunes and packs the
   weight included), and of the masked 2:4 layer (the same function as dense math).
2. A full ViT-L/14 training step (timm ``vit_large_patch14_224``, random init, bf16 autocast,
   fused AdamW): dense vs the sparse phase (every ``mlp.fc1``/``mlp.fc2`` 2:4 on the kernel).

Speed-ups are against dense measured in the same run. Without a CUDA GPU of compute
capability 8.0+ it prints that it needs one and exits with status 0. ``--cpu-smoke`` runs
tiny shapes through the CPU emulation to check the script; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # this checkout, not an install

from common import markdown_table

from lightning_sparse.backends import capability
from lightning_sparse.backends.masked import install_masked_forward, uninstall_forward
from lightning_sparse.backends.semi_structured import install_semi_structured_forward
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks.tiles import transposable_2to4_mask

# (label, tokens, in_features, out_features)
LINEARS = [
    ("ViT-L MLP fc1", 13008, 1024, 4096),
    ("ViT-L MLP fc2", 13008, 4096, 1024),
    ("GPT-2 small c_fc", 8192, 768, 3072),
    ("GPT-2 small c_proj", 8192, 3072, 768),
    ("GPT-2 medium c_fc", 8192, 1024, 4096),
    ("GPT-2 medium c_proj", 8192, 4096, 1024),
    ("GPT-2 large c_fc", 8192, 1280, 5120),
    ("GPT-2 large c_proj", 8192, 5120, 1280),
]
SMOKE_LINEARS = [("smoke", 64, 128, 256)]
MLP_PARAMS = ["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"]


class Timer:
    """Median milliseconds of a step, after warm-up (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, step: Callable[[], None]) -> float:
        for _ in range(self.warmup):
            step()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize(self.device)
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step()
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)


def available_kernels(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["emulated"]
    major = torch.cuda.get_device_capability(device)[0]
    kernels = ["cusparselt"] if capability.cusparselt_available() else []
    return [*kernels, "cutlass"] if major == 8 else kernels


def linear_rows(args: argparse.Namespace, device: torch.device, timer: Timer) -> list:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants: list[tuple[str, Callable[[nn.Module], None]]] = [
        (f"2:4 {k}", lambda m, k=k: install_semi_structured_forward(m, k))
        for k in available_kernels(device)
    ]
    variants.append(
        (
            "2:4 masked (dense math)",
            lambda m: install_masked_forward(m, project=transposable_2to4_mask),
        )
    )
    rows = []
    for label, tokens, fan_in, fan_out in SMOKE_LINEARS if args.cpu_smoke else LINEARS:
        x = torch.randn(tokens, fan_in, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, fan_out, device=device, dtype=dtype)
        layer = nn.Linear(fan_in, fan_out, device=device, dtype=dtype)
        owners = [("layer", layer, "weight")]
        runs = (
            device.type != "cuda"
            or capability.semi_structured_kernel(layer.weight, owners, dtype)[0]
        )

        def step(layer: nn.Module = layer, x: torch.Tensor = x, grad=grad) -> None:
            layer(x).backward(grad)
            layer.weight.grad = layer.bias.grad = x.grad = None

        dense = timer(step)
        shape = f"{label}: {tokens}x{fan_in} -> {fan_out}"
        rows.append([shape, "dense", f"{dense:.3f}", "1.00x"])
        for name, install in variants:
            if not runs and "masked" not in name:
                rows.append([shape, name, "n/a (no kernel for this shape)", "-"])
                continue
            install(layer)
            ms = timer(step)
            uninstall_forward(layer)
            rows.append([shape, name, f"{ms:.3f}", f"{dense / ms:.2f}x"])
    return rows


def vit_step_rows(args: argparse.Namespace, device: torch.device, timer: Timer) -> list:
    import timm

    size, batch = (28, 2) if args.cpu_smoke else (224, args.batch)
    tokens = batch * (1 + (size // 14) ** 2)
    workload = f"ViT-L/14 step, batch {batch} ({tokens} tokens)"
    variants = [
        ("dense", None),
        ("2:4 semi_structured", "auto" if args.cpu_smoke else "semi_structured"),
        ("2:4 masked (dense math)", "masked"),
    ]
    rows, dense = [], None
    for label, backend in variants:
        torch.manual_seed(0)
        model = timm.create_model("vit_large_patch14_224", img_size=size).to(device)
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-4, fused=device.type == "cuda"
        )
        if backend is not None:
            Sparsifier(
                "bench",
                select_parameters(model, MLP_PARAMS).targets,
                resolve_phases([Phase(sparsity="2:4")]),
                backend=backend,
                compute_dtype=torch.bfloat16 if device.type == "cuda" else None,
            ).on_step_start(0, [opt])
        forward = torch.compile(model) if args.compile else model
        images = torch.randn(batch, 3, size, size, device=device)
        labels = torch.randint(0, 1000, (batch,), device=device)

        def step(forward=forward, opt=opt, images=images, labels=labels) -> None:
            with torch.autocast(device.type, torch.bfloat16, device.type == "cuda"):
                loss = nn.functional.cross_entropy(forward(images), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = timer(step)
        dense = dense or ms
        rows.append([workload, label, f"{ms:.1f}", f"{dense / ms:.2f}x"])
        del model, opt, forward, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def needs_cuda() -> str | None:
    """Why this machine cannot run the benchmark, or ``None``."""
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU found (2:4 sparse tensor cores need compute capability 8.0+)"
        )
    found = torch.cuda.get_device_capability()
    if found < capability.AMPERE:
        return (
            f"{torch.cuda.get_device_name()} has compute capability {found}, not 8.0+"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    parser.add_argument(
        "--batch", type=int, default=48, help="ViT-L/14 images per step"
    )
    parser.add_argument("--no-step", action="store_true", help="skip the ViT-L/14 step")
    parser.add_argument("--compile", action="store_true", help="torch.compile the ViT")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on the CPU"
    )
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        device = torch.device("cpu")
        args.repeats, args.warmup = 1, 0
        where = "CPU smoke run: float32 emulation, timings meaningless"
    else:
        missing = needs_cuda()
        if missing:
            print(
                f"benchmarks/sparse_linear.py needs CUDA: {missing}; nothing measured."
            )
            return
        device = torch.device("cuda")
        where = f"{torch.cuda.get_device_name(device)}, bf16"
    print(
        f"torch {torch.__version__}, {where}; median of {args.repeats} runs after "
        f"{args.warmup} warm-up runs\n"
    )
    timer = Timer(device, args.repeats, args.warmup)
    header = ["workload", "variant", "ms (fwd+bwd)", "vs dense"]
    print(markdown_table(header, linear_rows(args, device, timer)))
    if not args.no_step:
        print()
        header[2] = "ms per step"
        print(markdown_table(header, vit_step_rows(args, device, timer)))


if __name__ == "__main__":
    main()
