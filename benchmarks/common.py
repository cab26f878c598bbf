"""Shared helpers for the benchmarks: medians, live-tensor memory, Markdown tables, a quiet
CPU trainer; for the GPU benchmarks: a timer, compile options, CUDA graphs, the kernels and
their checks, JSON records and a time limit."""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_sparse.backends import capability, kernel_check
from lightning_sparse.backends.semi_structured import EMULATED
from lightning_sparse.engine.memory_census import storage_bytes


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def mean_std_cell(values: Sequence[float]) -> str:
    """A table cell for one result over seeds: ``mean ± sample std (each seed's value)``."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    each = ", ".join(f"{v:.3f}" for v in values)
    return f"{statistics.fmean(values):.3f} ± {std:.3f} ({each})"


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python (params, grads, optimizer
    state, masks, buffers, cached tensors; a DTensor's local shard), after a full garbage
    collection. Differences between
    variants measured at the same point of the same loop are the variants' extra memory."""
    gc.collect()
    return storage_bytes(
        obj
        for obj in gc.get_objects()
        if type(obj) in (torch.Tensor, torch.nn.Parameter, DTensor)  # not fake ones
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def quiet_cpu_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU ``Trainer`` without loggers, checkpoints, progress bar, model summary or sanity
    check; ``kwargs`` add to or override these."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})


class Timer:
    """Median milliseconds of a step after warm-up: CUDA events on a GPU (the device
    synchronised after each step), the wall clock on the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, step: Callable[[], object], warmup: int | None = None) -> float:
        for _ in range(self.warmup if warmup is None else warmup):
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


TINY_VIT = {
    "img_size": 32,
    "patch_size": 8,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 2,
}
"""timm ViT settings of the CPU smoke runs."""

COMPILED_WARMUP = 3
"""Calls before timing a ``reduce-overhead`` function: compile and run, record the CUDA graph,
replay."""


def compile_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile`` options of the compiled runs: CUDA graphs on a GPU (``reduce-overhead``:
    no CPU launch cost per kernel); on the CPU (smoke runs) the tracing alone (``aot_eager``)."""
    if device.type == "cuda":
        return {"mode": "reduce-overhead", "dynamic": False}
    return {"backend": "aot_eager", "dynamic": False}


def new_step(device: torch.device) -> None:
    """Tell CUDA graph trees that a new training step begins (its outputs may be overwritten)."""
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


def cuda_problem() -> str | None:
    """Why this machine cannot run the 2:4 kernels, or ``None``."""
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU found (2:4 sparse tensor cores need compute capability 8.0+)"
        )
    found = torch.cuda.get_device_capability()
    if found < capability.AMPERE:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {found[0]}.{found[1]}, not 8.0+"
    return None


def benchmark_device(
    script: str, cpu_smoke: bool, smoke: str
) -> tuple[torch.device, str] | None:
    """The device a benchmark runs on and how its header names it, or ``None`` (after saying
    why) where it cannot run: the CPU for a smoke run (``smoke`` says what it runs), else a
    CUDA GPU of compute capability 8.0+."""
    if cpu_smoke:
        return torch.device("cpu"), f"CPU smoke run: {smoke}, timings meaningless"
    missing = cuda_problem()
    if missing:
        print(f"benchmarks/{script} needs CUDA: {missing}; nothing measured.")
        return None
    device = torch.device("cuda")
    return device, f"{torch.cuda.get_device_name(device)}, bf16"


def available_kernels(device: torch.device) -> list[str]:
    """The 2:4 training kernels of ``device``; on the CPU, their emulation."""
    if device.type != "cuda":
        return [EMULATED]
    major = torch.cuda.get_device_capability(device)[0]
    kernels = ["cusparselt"] if capability.cusparselt_available() else []
    return [*kernels, "cutlass"] if major == 8 else kernels


def kernel_check_table() -> str:
    """The kernel checks this process ran, as a Markdown table: kernel, verdict, relative
    error, how it runs (the packer), and the check's own words (GPU, versions, dtype)."""
    rows = [
        [
            verdict.kernel,
            "passed" if verdict.passed else "FAILED",
            "-" if verdict.error is None else f"{verdict.error:.2g}",
            verdict.note or "-",
            verdict.reason,
        ]
        for verdict in kernel_check.verdicts()
    ]
    header = ["kernel", "check", "rel. error", "runs", "found"]
    return markdown_table(header, rows or [["none run", *["-"] * 4]])


class Records:
    """Measurements as JSON records (``--json PATH``), written out after each one so that a run
    killed at its time limit still leaves what it measured."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.records = path, []

    def add(self, **record: Any) -> None:
        self.records.append(record)
        if self.path is not None:
            self.path.write_text(json.dumps(self.records, indent=1))


class Deadline:
    """``--time-limit`` seconds from now (none: no limit); what ran out of it, for the report."""

    def __init__(self, seconds: float | None) -> None:
        self.at = math.inf if seconds is None else time.time() + seconds
        self.skipped: list[str] = []

    def passed(self, what: str) -> bool:
        """Whether the time is up before ``what`` (then noted as skipped)."""
        if time.time() < self.at:
            return False
        self.skipped.append(what)
        return True

    def note(self) -> str:
        if not self.skipped:
            return ""
        return f"Not run (time limit): {', '.join(self.skipped)}."
