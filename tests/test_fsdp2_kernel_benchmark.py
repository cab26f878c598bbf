"""``benchmarks/fsdp2_llama.py``: the Llama FSDP2 recipe's blocks, dense against 2:4 MLPs.

On a GPU (``-m gpu``): FSDP2 of world size 1 on NCCL runs every MLP layer on the 2:4 kernel,
and its losses equal the masked run's within the kernel check's tolerance. On the CPU, the
script's plumbing (``--cpu-smoke``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sparse.backends.kernel_check import TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fsdp2_llama.py"


def bench(tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    """Run the benchmark in its own process; its output and JSON records."""
    pytest.importorskip("transformers")
    out = tmp_path / "records.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_fsdp2_kernel_benchmark_runs_on_the_cpu(tmp_path):
    out, records = bench(tmp_path, "--cpu-smoke")
    assert [r["variant"] for r in records] == ["dense", "2:4 masked", "2:4 kernel"]
    assert all(r["world_size"] == 1 and len(r["losses"]) == 2 for r in records)
    assert "| 2:4 kernel |" in out and "(PASS:" in out


@pytest.mark.gpu
@pytest.mark.compiles
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_kernel_on_nccl_runs_every_mlp_layer_and_follows_the_masked_run(tmp_path):
    out, records = bench(
        tmp_path, "--layers=2", "--tokens=4096", "--repeats=3", "--warmup=1"
    )
    _, masked, kernel = records  # dense, masked math, kernels
    assert kernel["kernel_layers"] == 2 * 3  # gate, up and down in each block
    assert all("FSDP2 gathers from 1 shard" in r for r in kernel["reasons"])
    for k, m in zip(kernel["losses"], masked["losses"]):
        assert abs(k - m) <= TOLERANCE * abs(m)
    assert "(PASS:" in out
