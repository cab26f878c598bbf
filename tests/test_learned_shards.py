"""A learned phase's logits are split over the ranks (DDP and FSDP2 alike): each rank holds
``ceil(units / ranks)`` of every weight's N:M groups, the forwards gather the soft masks and
reduce-scatter their gradient, and training equals the DDP run bit for bit under FSDP2 with a
bf16 ``MixedPrecisionPolicy``; checkpoints hold whole logits and resume exactly.

One 2-process CPU job (gloo; ``tests/learned_shards_worker.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from learned_shards_worker import LEARNED
from multiprocess import run_workers

PHASES = [
    {**LEARNED, "until": 4},
    {"sparsity": "2:4", "algorithm": "static", "until": 5},
    {"sparsity": 0.0},
]
STEPS = 6
CHECKPOINT = 2  # inside the learned phase
RUNS: dict[str, dict[str, Any]] = {
    "ddp autocast": {"strategy": "ddp"},
    "fsdp2 mixed precision policy": {"strategy": "fsdp2", "resume": True},
}
# groups of 4 of blocks.0 (64x32) and blocks.2 (32x64), 6 patterns each
UNITS = {"blocks.0.weight": 512, "blocks.2.weight": 512}
WORKER = Path(__file__).with_name("learned_shards_worker.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[list[dict[str, Any]], Path]:
    """Each rank's report of the one 2-process job, and where it wrote."""
    out = tmp_path_factory.mktemp("learned_shards")
    config = {
        "seed": 0,
        "phases": PHASES,
        "max_steps": STEPS,
        "checkpoint_step": CHECKPOINT,
        "runs": RUNS,
    }
    return run_workers(config, out, timeout=600, worker=WORKER), out


def steps(report: dict[str, Any], run: str) -> dict[int, dict[str, Any]]:
    return {int(step): record for step, record in report[run]["steps"].items()}


def test_the_gathered_units_and_their_gradient_average_over_the_ranks(job):
    reports, _ = job
    for rank, report in enumerate(reports):
        found = report["gathered_units"]
        assert found["5"]["owned"] == [[0, 3], [3, 5]][rank]  # ceil(5 / 2) = 3 each
        assert found["1"]["owned"] == [[0, 1], [1, 1]][rank]  # rank 1 holds none
        for entry in found.values():
            assert entry["dtype"] == "torch.bfloat16"
            assert entry["whole"] and entry["grad"], entry


def test_split_logits_learn_as_whole_logits_with_averaged_gradients(job):
    """Against the same two steps on whole logits in one process, the gradients of both
    ranks' losses summed and halved by hand (only the order of the sums differs)."""
    reports, _ = job
    for rank, report in enumerate(reports):
        found = report["split_step"]
        assert found["owned"] == [[0, 64], [64, 128]][rank]  # 16x32: 128 groups
        assert found["held"] == [64, 6]
        assert found["kept_held"] == [128, 6] and found["kept_equal"]
        assert found["max_difference"] < 1e-6
        assert found["masks_equal"]
        (changed, groups, entropy), (whole_changed, whole_groups, whole_entropy) = (
            found["statistics"]
        )
        assert (changed, groups) == (whole_changed, whole_groups) and groups == 128
        assert entropy == pytest.approx(whole_entropy, rel=1e-5)
        assert found["read_back"] and found["moments_read_back"]


def test_each_rank_holds_its_share_of_the_logits_and_checkpoints_hold_them_whole(job):
    reports, _ = job
    for rank, report in enumerate(reports):
        for run in ("ddp autocast", "fsdp2 mixed precision policy"):
            for step in range(PHASES[0]["until"]):
                record = steps(report, run)[step]
                assert record["whole_logits"] == {n: [u, 6] for n, u in UNITS.items()}
                assert record["held_logits"] == {
                    n: [u // 2, 6] for n, u in UNITS.items()
                }, (run, step)
        assert steps(report, "ddp autocast")[STEPS - 1]["held_logits"] == {}


def test_fsdp2_with_a_bf16_policy_learns_as_ddp_does_bit_for_bit(job):
    """Loss, whole weights, masks, logits and export after every step, on every rank,
    through the learned phase, the handover to the static phase and the dense phase."""
    reports, _ = job
    for report in reports:
        got = steps(report, "fsdp2 mixed precision policy")
        expected = steps(report, "ddp autocast")
        assert sorted(got) == list(range(STEPS))
        for step in range(STEPS):
            for key in ("loss", "weights", "masks", "logits", "export"):
                assert got[step][key] == expected[step][key], (step, key)
        learned = [got[step]["logits"] for step in range(PHASES[0]["until"])]
        assert len({str(logits) for logits in learned}) == len(learned)  # they learn
    for run in RUNS:  # each rank its own loss, the same model
        for step, record in steps(reports[0], run).items():
            other = steps(reports[1], run)[step]
            for key in ("weights", "masks", "logits", "export"):
                assert record[key] == other[key], (run, step, key)


def test_fsdp2_resumes_inside_the_learned_phase_exactly(job):
    reports, _ = job
    for report in reports:
        full = steps(report, "fsdp2 mixed precision policy")
        resumed = steps(report, "fsdp2 mixed precision policy resumed")
        assert sorted(resumed) == list(range(CHECKPOINT, STEPS))
        for step in resumed:
            assert resumed[step] == full[step], step
