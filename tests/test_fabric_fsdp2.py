"""``SparseTraining`` under Lightning Fabric's ``ModelParallelStrategy`` (FSDP2) on 2 gloo
processes (``tests/fabric_fsdp2_worker.py``): the weights are sharded DTensors, both ranks hold
the same whole masks at every step (each trains on its own batches), and a resume from a
distributed checkpoint written mid-run (``fabric.save``/``fabric.load``, in the RigL phase)
goes on exactly as the uninterrupted run, through 2:4 to the dense end. ``pytest -m slow``."""

from __future__ import annotations

from pathlib import Path

import pytest
from multiprocess import run_workers

WORKER = Path(__file__).with_name("fabric_fsdp2_worker.py")


@pytest.mark.slow  # two processes importing Fabric: about a minute on 2 cores
def test_fabric_fsdp2_masks_agree_across_ranks_and_resume_exactly(tmp_path):
    rank0, rank1 = run_workers(
        {"total_steps": 10, "checkpoint_step": 3}, tmp_path, timeout=300, worker=WORKER
    )
    for run in ("full", "first", "resumed"):
        assert rank0[run]["sharded"] is True
        assert rank0[run] == rank1[run], run
    full, resumed = rank0["full"]["steps"], rank0["resumed"]["steps"]
    assert sorted(map(int, resumed)) == list(range(3, 10))
    for step in range(3, 10):
        assert resumed[str(step)] == full[str(step)], f"step {step}"
    assert rank0["resumed"]["export"] == rank0["full"]["export"]
    assert (
        len({str(full[str(s)]) for s in range(8)}) > 2
    )  # RigL and 2:4 moved the masks
    assert full["8"] == {} and full["9"] == {}  # dense at the end
