"""Benchmark: 2:4 mask functions on the CPU, speed and kept weight energy.

    python benchmarks/tile_masks.py [--threads N] [--repeats R]

Gaussian fp32 weights of a ViT-L MLP shape (4096x1024) and a GPT-2 MLP shape (3072x768).
Masks: row-wise 2:4 (``target_mask``, the baseline), the transposable greedy, the
transposable optimum (exactly 2 per tile row and column, or at most 2; by sum |w|, and by
sum w^2), and torch's pure-Python reference, on |w| (what our greedy reproduces) and on
the signed weights (torch's default). The reference is slow: it runs on a sub-block only,
its throughput is extrapolated, and the table says so. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.sparse._semi_structured_conversions import _sparse_semi_structured_tile

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # this checkout, not an install

from lightning_sparse.masks import NM, target_mask
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
    transposable_2to4_mask,
)

SHAPES = [("ViT-L MLP fc1", 4096, 1024), ("GPT-2 MLP c_fc", 3072, 768)]

METHODS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    (
        "row-wise 2:4, `target_mask(w.abs(), NM(2, 4))`",
        lambda w: target_mask(w.abs(), NM(2, 4)),
    ),
    ("transposable greedy, `transposable_2to4_mask`", transposable_2to4_mask),
    ("transposable optimal, exactly 2 per row/col", optimal_transposable_2to4_mask),
    (
        "transposable optimal, at most 2 (`exactly_two=False`)",
        lambda w: optimal_transposable_2to4_mask(w, exactly_two=False),
    ),
    (
        "transposable optimal for energy, at most 2, on `w.square()`",
        lambda w: optimal_transposable_2to4_mask(w.square(), exactly_two=False),
    ),
]


def median_seconds(
    fn: Callable[[], object], repeats: int, warmup: int
) -> tuple[float, float]:
    """Median wall-clock seconds and median CPU seconds (all threads) of one call."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def energy(weight: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of the L2 energy kept: sum of kept w^2 / sum of w^2."""
    square = weight.double().square()
    return float((square * mask).sum() / square.sum())


def reference(dense: torch.Tensor) -> torch.Tensor:
    """torch's pure-Python greedy (it prunes in place: give it a copy). Returns the kept mask."""
    return _sparse_semi_structured_tile(dense.clone()) != 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--repeats", type=int, default=11, help="timed runs per method (median)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument(
        "--ref-block", type=int, default=256, help="side of the reference's sub-block"
    )
    parser.add_argument(
        "--ref-repeats", type=int, default=3, help="timed runs of the reference"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.ref_block % 4 or args.ref_block <= 0:
        parser.error(f"--ref-block={args.ref_block} must be a positive multiple of 4")

    load = (
        ", ".join(f"{x:.1f}" for x in os.getloadavg())
        if hasattr(os, "getloadavg")
        else "n/a"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()} "
        f"({os.cpu_count()} CPUs), load average {load}; fp32 Gaussian weights; median of "
        f"{args.repeats} runs after {args.warmup} warm-up runs\n"
    )
    print(
        "| shape | mask | transposable | kept | energy kept | M weights/s "
        "| vs row-wise | M weights per CPU-s |"
    )
    print("|---|---|---|---|---|---:|---:|---:|")
    notes = []
    for label, rows, cols in SHAPES:
        gen = torch.Generator().manual_seed(args.seed)
        weight = torch.randn(rows, cols, generator=gen)
        shape = f"{label} {rows}x{cols}"
        baseline = None
        for name, fn in METHODS:
            seconds, cpu = median_seconds(
                functools.partial(fn, weight), args.repeats, args.warmup
            )
            mask = fn(weight)
            rate = weight.numel() / seconds / 1e6
            baseline = baseline or rate
            print(
                f"| {shape} | {name} | {'yes' if is_transposable_2to4(mask) else 'no'} | "
                f"{mask.float().mean():.4f} | {energy(weight, mask):.4f} | {rate:.1f} | "
                f"{rate / baseline:.2f}x | {weight.numel() / cpu / 1e6:.1f} |"
            )

        side_r, side_c = min(args.ref_block, rows), min(args.ref_block, cols)
        block = weight[:side_r, :side_c].contiguous()
        where = f"{side_r}x{side_c} sub-block"
        seconds, cpu = median_seconds(
            functools.partial(reference, block.abs()), args.ref_repeats, warmup=0
        )
        ref_abs = reference(block.abs())
        rate = block.numel() / seconds / 1e6
        ours = transposable_2to4_mask(block)
        print(
            f"| {shape} | torch reference on abs(w) ({where}, throughput extrapolated) | yes | "
            f"{ref_abs.float().mean():.4f} | {energy(block, ref_abs):.4f} | {rate:.2f} | "
            f"{rate / baseline:.4f}x | {block.numel() / cpu / 1e6:.2f} |"
        )
        ref_signed = reference(block)
        print(
            f"| {shape} | torch reference on signed w, torch's default ({where}) | yes | "
            f"{ref_signed.float().mean():.4f} | {energy(block, ref_signed):.4f} | - | - | - |"
        )
        notes.append(
            f"{shape}: on the same {where}, `transposable_2to4_mask` is "
            f"{'identical to' if torch.equal(ours, ref_abs) else 'DIFFERENT FROM'} the reference "
            f"on abs(w) (energy {energy(block, ours):.4f})."
        )
    print()
    for note in notes:
        print(f"- {note}")
    print(
        "- kept: fraction of weights kept (the greedy stops at 7 of 16 in some tiles). "
        "energy kept: sum of kept w^2 / sum of w^2. Reference rows: measured on the "
        "sub-block only.\n"
        "- M weights/s: wall clock. M weights per CPU-s: per second of CPU time of all "
        "threads, which a busy machine (see the load average) skews less; idle OpenMP "
        "threads spinning count in it."
    )


if __name__ == "__main__":
    main()
