"""One rank of a 2-process CPU job (``tests/multiprocess.py``) in which choosing the layers'
backends raises on one rank only (a pretend sm90 GPU): the kernel check runs out of memory on
rank 1 (no ``verify_speed``), then ``verify_speed``'s timing raises on rank 0. Each rank
reports, per case, what it raised and how long it took."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparse.algorithms import build_algorithm
from lightning_sparse.backends import capability, kernel_check
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine import forwards


def out_of_memory(x, weight, bias):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def slow_check(*args, **options):
    def measure(weight, kernel, dtype, stored):
        raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED while timing")

    return measure


def choose(verify_speed: bool) -> dict[str, object]:
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    targets = select_parameters(net, params=["0.weight"]).targets
    phases = resolve_phases([Phase(sparsity="2:4")], 10)
    algorithms = {0: build_algorithm(phases[0])}
    start = time.perf_counter()
    try:
        forwards.LayerForwards(
            "group", targets, phases, algorithms, compute_dtype=torch.bfloat16,
            verify_speed=verify_speed,
        )  # fmt: skip
        raised = None
    except Exception as err:  # noqa: BLE001 (reported)
        raised = {"type": type(err).__name__, "message": str(err)}
    return {"raised": raised, "seconds": time.perf_counter() - start}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    capability.device_capability = lambda device: (9, 0)
    capability.cusparselt_available = lambda: True
    report = {}
    checked = kernel_check._KERNELS[
        "cusparselt"
    ]  # the emulation, on the CPU: it passes
    if rank == 1:
        kernel_check.register_kernel("cusparselt", out_of_memory, label="cuSPARSELt")
    report["kernel check"] = choose(verify_speed=False)
    kernel_check._KERNELS["cusparselt"] = checked
    kernel_check.forget_verdicts()
    forwards.SpeedCheck = (
        slow_check
        if rank == 0
        else lambda *args, **options: lambda weight, kernel, dtype, stored: None
    )
    report["verify_speed"] = choose(verify_speed=True)
    (Path(cfg["out"]) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
