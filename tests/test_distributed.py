"""DDP and FSDP2 on 2 CPU processes (gloo): masks are identical on every rank, without ever being
broadcast, after every kind of mask update (``init: wanda`` included, whose input norms each
rank gathers from its own batches; learned masks, whose logits each rank trains) and after a
resume; FSDP2 masks on sharded parameters equal
the DDP masks at every step; so do the logged flip rates, and masked decay (on the 2:4 phase)
keeps the weights of both strategies equal.

One 2-process job runs, for each strategy, every phase below in sequence (STEPS optimizer steps
each), checkpoints inside the ``magnitude`` phase, and resumes from there.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from distributed_worker import tensor_hash
from helpers import TinyModule, random_loader
from lightning.pytorch.strategies import FSDPStrategy
from multiprocess import run_workers

from lightning_sparse import SparsityCallback
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

STEPS = 3  # optimizer steps per phase
SEED = 0
# (label, phase, whether its masks must change within the phase)
ENTRIES: list[tuple[str, dict[str, Any], bool]] = [
    ("static topk", {"sparsity": 0.5}, False),
    (
        "magnitude",
        {"sparsity": 0.6, "algorithm": "magnitude", "update_every": 1},
        True,
    ),
    ("gmp", {"sparsity": 0.7, "algorithm": "gmp", "update_every": 1}, True),
    (  # 0.6, then 0.3 (regrowth by the dense gradient), then 0.5
        "gmp falling",
        {
            "sparsity": 0.6,
            "algorithm": "gmp",
            "update_every": 1,
            "ramp": [0.6, 0.3, 0.5],
        },
        True,
    ),
    ("static random", {"sparsity": 0.6, "init": "random", "seed": 7}, False),
    ("runtime 2:4", {"sparsity": "2:4", "decay": 0.05}, True),
    (
        "set",
        {"sparsity": 0.5, "algorithm": "set", "update_every": 1, "drop_fraction": 0.3},
        True,
    ),
    (
        "rigl",
        {"sparsity": 0.5, "algorithm": "rigl", "update_every": 1, "drop_fraction": 0.3},
        True,
    ),
    ("global", {"sparsity": 0.6, "distribution": "global"}, False),
    ("erk", {"sparsity": 0.6, "distribution": "erk"}, False),
    # each rank calibrates on its own batches: the norms are summed over the ranks
    ("wanda", {"sparsity": 0.5, "init": "wanda", "calibration_batches": 2}, False),
    ("wanda 2:4", {"sparsity": "2:4", "algorithm": "static", "init": "wanda"}, False),
    # logits from random (no prior), fast enough to change the most likely patterns: their
    # gradients are averaged over the ranks, their Gumbel noise is drawn from the seed
    (
        "learned 2:4",
        {
            "sparsity": "2:4",
            "algorithm": "learned",
            "prior_strength": 0,
            "mask_lr": 0.05,
        },
        True,
    ),
    # the transposable forms: logits per 4x4 tile, and the 6-pattern form projected onto
    # transposable tiles at the handover to the static phase after it
    (
        "learned 2:4 tiles",
        {
            "sparsity": "2:4",
            "algorithm": "learned",
            "prior_strength": 0,
            "mask_lr": 0.05,
            "transposable": "tiles",
        },
        True,
    ),
    (
        "learned 2:4 project",
        {
            "sparsity": "2:4",
            "algorithm": "learned",
            "prior_strength": 0,
            "mask_lr": 0.05,
            "transposable": "project",
        },
        True,
    ),
    ("static after project", {"sparsity": "2:4", "algorithm": "static"}, False),
]


# DDP resumes of a model whose parameter names sort out of model order (see
# helpers.OutOfOrderModule): checkpoints every 3 steps; resumes in a hard-mask phase (rigl, step
# 3), between updates of a straight-through one (magnitude, step 6; update at 8), in a
# runtime phase (step 12), and in a learned one (step 15: logits restored by name, then
# handed to the static phase)
BY_NAME: dict[str, Any] = {
    "phases": [
        {"sparsity": 0.5, "until": 2},
        {"sparsity": 0.5, "algorithm": "rigl", "update_every": 1, "until": 5},
        {"sparsity": 0.6, "algorithm": "magnitude", "update_every": 3, "until": 10},
        {"sparsity": "2:4", "until": 13},
        {"sparsity": "2:4", "algorithm": "learned", "mask_lr": 0.05, "until": 17},
        {"sparsity": "2:4", "algorithm": "static", "until": 19},
        {"sparsity": 0.0},
    ],
    "max_steps": 20,
    "checkpoint_step": 3,
    "resume_steps": [3, 6, 12, 15],
}


def job_config() -> dict[str, Any]:
    phases = [
        {**phase, "until": STEPS * (i + 1)} for i, (_, phase, _) in enumerate(ENTRIES)
    ]
    phases.append({"sparsity": 0.0})
    labels = [label for label, _, _ in ENTRIES]
    magnitude = labels.index("magnitude")
    return {
        "phases": phases,
        "max_steps": STEPS * (len(ENTRIES) + 1),
        # inside the magnitude phase, after an update and just before the next one
        "checkpoint_step": STEPS * magnitude + 2,
        "seed": SEED,
    }


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return job_config()


@pytest.fixture(scope="module")
def job(config, tmp_path_factory) -> list[dict[str, Any]]:
    """Each rank's report of the one 2-process job (DDP runs, then FSDP2 runs)."""
    config = {
        **config,
        "strategies": ["ddp", "fsdp2"],
        "by_name": BY_NAME,
        "rank_rng": True,
    }
    return run_workers(config, tmp_path_factory.mktemp("job"))


@pytest.fixture(scope="module")
def ddp(job) -> list[dict[str, Any]]:
    return [report["ddp"] for report in job]


@pytest.fixture(scope="module")
def fsdp2(job) -> list[dict[str, Any]]:
    return [report["fsdp2"] for report in job]


def single_process_initial_masks(config: dict[str, Any]) -> dict[str, str]:
    """The step-0 masks computed on one process from the same initial model."""
    L.seed_everything(config["seed"], verbose=False)
    model = TinyModule(lr=0.05)
    phases = resolve_phases(
        [Phase.from_any(p) for p in config["phases"]], config["max_steps"]
    )
    sparsifier = Sparsifier("sparsity", select_parameters(model).targets, phases)
    sparsifier.on_step_start(0, [])
    masks = sparsifier.state_dict()["masks"]
    return {k: tensor_hash(m) for k, m in sorted(masks.items())}


def check_job(reports: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """Every rank saw the same masks at every step, in the full run and after the resume."""
    total, resume = config["max_steps"], config["checkpoint_step"]
    rank0, rank1 = reports
    assert sorted(map(int, rank0["full"]["steps"])) == list(range(total))
    assert sorted(map(int, rank0["resumed"]["steps"])) == list(range(resume, total))
    for run in ("full", "resumed"):
        assert rank0[run]["steps"] == rank1[run]["steps"], run
        assert rank0[run]["weights"] == rank1[run]["weights"], run
        assert rank0[run]["flip_rate"] == rank1[run]["flip_rate"], run
        assert rank0[run]["actual"] == rank1[run]["actual"], run
    # the resumed run continues exactly as the uninterrupted one
    full, resumed = rank0["full"]["steps"], rank0["resumed"]["steps"]
    for step in range(resume, total):
        assert resumed[str(step)] == full[str(step)], f"step {step}"
    assert rank0["resumed"]["weights"] == rank0["full"]["weights"]
    flips = rank0["full"]["flip_rate"]
    assert sorted(map(int, flips)) == list(range(total - STEPS))  # not the dense phase
    assert rank0["resumed"]["flip_rate"] == {
        step: rate for step, rate in flips.items() if int(step) >= resume
    }
    assert rank0["full"]["steps"]["0"]["masks"] == single_process_initial_masks(config)
    # the job exercised real updates: dynamic phases changed their masks
    for i, (label, _, dynamic) in enumerate(ENTRIES):
        first, last = full[str(STEPS * i)], full[str(STEPS * i + STEPS - 1)]
        assert first["phase"] == last["phase"] == i, label
        assert first["masks"], label
        if dynamic:
            assert first["masks"] != last["masks"], f"{label}: masks never changed"
        changes = [flips[str(STEPS * i + j)] for j in range(STEPS)]
        assert (max(changes) > 0) == dynamic, (label, changes)
        # the logits (equal on both ranks, as the whole record is) train at every step
        learned = [full[str(STEPS * i + j)]["logits"] for j in range(STEPS)]
        assert all(learned) == label.startswith("learned 2:4"), label
        if all(learned):
            assert len({str(logits) for logits in learned}) == STEPS, label
        # the transposable forms' masks (tiles: while learning; project: once handed over)
        transposable = [full[str(STEPS * i + j)]["transposable"] for j in range(STEPS)]
        if label in ("learned 2:4 tiles", "static after project"):
            assert all(transposable), label
        if label == "learned 2:4 project":
            assert not any(transposable), (
                label
            )  # the most likely groups, not yet projected
    assert full[str(total - 1)]["masks"] == {}  # the last phase is dense


def without_layout(steps: dict[str, Any]) -> dict[str, Any]:
    return {
        step: {k: v for k, v in record.items() if k != "sharded"}
        for step, record in steps.items()
    }


def test_ddp_masks_are_identical_on_every_rank_and_after_resume(ddp, config):
    assert not any(step["sharded"] for step in ddp[0]["full"]["steps"].values())
    check_job(ddp, config)


def test_ddp_resume_restores_each_mask_to_its_own_parameter(job):
    """Masks compared by name, on a model with 36 weights of one shape whose names sort out
    of model order: restored as saved, then identical to the uninterrupted run at every step
    and on every rank, and the final weights too."""
    rank0, rank1 = (report["by_name"] for report in job)
    full = rank0["full"]["steps"]
    names = list(rank0["full"]["restored"])  # the step-0 masks, in model order
    assert len(names) == 36 and names != sorted(names)
    total = BY_NAME["max_steps"]
    for step in BY_NAME["resume_steps"]:
        runs = [rank0[f"resumed{step}"], rank1[f"resumed{step}"]]
        saved = runs[0]["saved"]
        assert len(set(saved.values())) == len(saved) == 36  # every layer its own mask
        for run in runs:
            assert run["restored"] == saved, f"resume at {step}: restored by name"
            assert sorted(map(int, run["steps"])) == list(range(step, total))
            for s in range(step, total):
                assert run["steps"][str(s)] == full[str(s)], (
                    f"resume at {step}: step {s}"
                )
            assert run["weights"] == rank0["full"]["weights"], f"resume at {step}"


def test_fsdp2_masks_on_sharded_parameters_match_ddp_at_every_step(fsdp2, ddp, config):
    steps = fsdp2[0]["full"]["steps"]
    assert all(step["sharded"] for step in steps.values())  # parameters were DTensors
    check_job(fsdp2, config)
    # a mask chosen on local shards alone would differ from the whole-tensor choice of DDP
    for run in ("full", "resumed"):
        assert without_layout(fsdp2[0][run]["steps"]) == without_layout(
            ddp[0][run]["steps"]
        ), run
        assert fsdp2[0][run]["weights"] == ddp[0][run]["weights"], run
        assert fsdp2[0][run]["flip_rate"] == ddp[0][run]["flip_rate"], run
        # counted over whole masks, not this rank's shards
        assert fsdp2[0][run]["actual"] == ddp[0][run]["actual"], run


def test_fsdp2_masks_on_uneven_and_column_shards_equal_whole_tensor_topk(job):
    for rank, report in enumerate(job):
        shards = report["odd_shards"]
        assert all(entry["equal"] for entry in shards.values()), shards
        for algorithm in ("static", "magnitude"):
            columns, rows = (
                shards[f"{algorithm} 0.weight"],
                shards[f"{algorithm} 2.weight"],
            )
            assert columns["local_shape"] == [6, 4]
            assert columns["placements"] == "(Shard(dim=1),)"
            assert rows["local_shape"] == [[3, 6], [2, 6]][rank]
            assert rows["placements"] == "(Shard(dim=0),)"


FSDP1_ERROR = r"FSDPStrategy \(strategy='fsdp', FSDP1\).*Use ModelParallelStrategy"


def test_ranks_agree_on_one_backend_per_layer_under_verify_speed(job):
    """One rank timed 2:4 faster (1.05x), the other slower (0.95x): both keep it dense."""
    faster, slower = (report["agreed_backends"] for report in job)
    assert faster["name"] == slower["name"] == "masked"
    assert faster["reason"].startswith("kept dense: on another rank verify_speed found")
    assert faster["reason"].endswith("1.05x dense (eager, 8192 tokens))")
    assert (
        "sparse 0.95x dense (eager, 8192 tokens), so kept dense (verify_speed)"
        in slower["reason"]
    )


def test_fsdp1_strategy_is_refused_with_the_fix():
    # Lightning runs strategy='fsdp' only on CUDA; the check itself needs no GPU.
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(TypeError, match=FSDP1_ERROR):
        SparsityCallback(sparsity=0.5).setup(trainer, TinyModule(), "fit")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp1_strategy_is_refused_by_a_real_trainer():
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy="fsdp",
        max_steps=1,
        callbacks=[SparsityCallback(sparsity=0.5, verbose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(TypeError, match=FSDP1_ERROR):
        trainer.fit(TinyModule(), random_loader())


def test_restore_rng_resumes_each_rank_s_own_dropout_bitwise(job):
    """Every rank saves and restores its own generators: a DDP run whose ranks draw different
    dropout masks resumes from an epoch boundary bit for bit with ``restore_rng=True``."""
    for report in job:
        runs = report["rank_rng"]
        assert runs["resumed restore_rng=True"] == runs["full restore_rng=True"]
        assert runs["resumed restore_rng=False"] != runs["full restore_rng=False"]


def test_an_error_on_one_rank_while_choosing_backends_stops_every_rank(tmp_path):
    """A rank whose kernel check runs out of memory, or whose verify_speed timing raises,
    reaches the ranks' agreement with its error: every rank raises the same error at once,
    none waits in a collective for ever."""
    worker = Path(__file__).with_name("rank_failure_worker.py")
    ranks = run_workers({}, tmp_path, timeout=120, worker=worker)
    for case, failed, expected in (
        (
            "kernel check",
            1,
            "OutOfMemoryError in the kernel check of cuSPARSELt on sm90",
        ),
        ("verify_speed", 0, "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED while timing"),
    ):
        raised = [report[case]["raised"] for report in ranks]
        assert raised[0] == raised[1], case  # the same error on both ranks
        assert raised[0]["type"] == "RankFailure"
        message = raised[0]["message"]
        assert message.startswith(
            "[group] choosing each layer's backend (the kernel check, verify_speed) "
            f"failed on rank {failed}, {expected}"
        ), message
        assert f"rank {1 - failed}," not in message
        assert all(report[case]["seconds"] < 30 for report in ranks)
    assert "free GPU memory" in ranks[0]["kernel check"]["raised"]["message"]
