"""``SparseTraining`` in a plain PyTorch DDP loop on 2 gloo processes, no Lightning imported
(``tests/plain_ddp_worker.py``): both ranks hold the same masks at every step, though each
trains on its own batches; a resume from a checkpoint written mid-run (in the RigL phase)
goes on exactly as the uninterrupted run, through the 2:4 magnitude phase to the dense end."""

from __future__ import annotations

from pathlib import Path

from multiprocess import run_workers

WORKER = Path(__file__).with_name("plain_ddp_worker.py")


def test_plain_ddp_masks_agree_across_ranks_and_resume_exactly(tmp_path):
    rank0, rank1 = run_workers(
        {"total_steps": 10, "checkpoint_step": 3}, tmp_path, timeout=240, worker=WORKER
    )
    for run in ("full", "first", "resumed"):
        assert rank0[run] == rank1[run], run
    full, resumed = rank0["full"]["steps"], rank0["resumed"]["steps"]
    assert sorted(map(int, full)) == list(range(10))
    assert sorted(map(int, resumed)) == list(range(3, 10))
    for step in range(3, 10):
        assert resumed[str(step)] == full[str(step)], f"step {step}"
    assert rank0["resumed"]["weights"] == rank0["full"]["weights"]
    # the masks moved: RigL's updates and the switch to 2:4 changed them
    assert len({str(full[str(s)]) for s in range(8)}) > 2
    assert full["8"] == {} and full["9"] == {}  # dense at the end
    assert rank0["lightning"] == rank1["lightning"] == []
