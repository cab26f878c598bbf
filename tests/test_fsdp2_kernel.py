"""FSDP2 runs the 2:4 kernel path on the weights it gathers, exactly as DDP runs it.

One 2-process CPU job (gloo; ``tests/fsdp2_kernel_worker.py``) trains a 2-block model through a
``runtime`` 2:4 phase (the mask chosen in the forward, on the gathered weight), a ``magnitude``
and a ``rigl`` 2:4 phase (stored masks updated at every step, their cuSPARSELt packing made on
the whole mask) and a dense phase, on the cuSPARSELt custom ops with a dense stand-in for
cuSPARSELt's matmul that multiplies by the bytes it is given (a pretend sm90 GPU). Each FSDP2
run is compared with the DDP run of the same settings after every optimizer step: loss, whole
weights, masks and exported state dict, bit for bit (same bf16 matmuls on the same values; the
gradient averages of 2 ranks are exact either way), and the 2:4 matmuls by layer.

Select these tests with ``pytest -k "fsdp2 and kernel"``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from multiprocess import run_workers

PHASES = [
    {"sparsity": "2:4", "until": 2},  # runtime: projected in the forward
    {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 1, "until": 5},
    {
        "sparsity": "2:4",
        "algorithm": "rigl",
        "update_every": 1,
        "drop_fraction": 0.3,
        "until": 8,
    },
    {"sparsity": 0.0},
]
STEPS = 9
SPARSE = PHASES[-2]["until"]  # steps before the dense phase
CHECKPOINT = 3  # inside the magnitude phase, after an update
# each FSDP2 run, the DDP run it must equal, and how it runs
RUNS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "fsdp2 autocast": {"strategy": "fsdp2", "reference": "ddp"},
    "fsdp2 mixed precision policy": {
        "strategy": "fsdp2",
        "mixed_precision_policy": True,
        "resume": True,
        "reference": "ddp",
    },
    "ddp compiled": {"strategy": "ddp", "compile": True},
    "fsdp2 compiled": {
        "strategy": "fsdp2",
        "mixed_precision_policy": True,
        "compile": True,
        "reference": "ddp compiled",
    },
}
FSDP2 = [name for name, run in RUNS.items() if "reference" in run]
# the 2:4 matmuls of a sparse step on each rank, by the whole shape they multiply by: the
# forwards of blocks.0 (128->384) and blocks.1 (384->256), and the input gradient of blocks.1
# (its W.T); the first layer's input needs no gradient
SPARSE_STEP = {"384x128": 1, "256x384": 1, "384x256": 1}
WORKER = Path(__file__).with_name("fsdp2_kernel_worker.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict[str, Any]]:
    """Each rank's report of the one 2-process job."""
    config = {
        "seed": 0,
        "phases": PHASES,
        "max_steps": STEPS,
        "checkpoint_step": CHECKPOINT,
        "runs": RUNS,
    }
    return run_workers(
        config, tmp_path_factory.mktemp("fsdp2_kernel"), timeout=600, worker=WORKER
    )


def steps(report: dict[str, Any], run: str) -> dict[int, dict[str, Any]]:
    return {int(step): record for step, record in report[run]["steps"].items()}


@pytest.mark.parametrize("run", FSDP2)
def test_fsdp2_kernel_runs_on_the_gathered_weights_as_ddp_does(job, run):
    """Every sparse step runs each layer's 2:4 matmuls once (forward; input gradient where
    the input needs one) on the whole weight, on every rank, as DDP does; the dense phase
    runs none."""
    reference = RUNS[run]["reference"]
    for report in job:
        got, expected = steps(report, run), steps(report, reference)
        assert sorted(got) == list(range(STEPS))
        for step, record in got.items():
            assert record["calls"] == (SPARSE_STEP if step < SPARSE else {}), step
            assert record["calls"] == expected[step]["calls"], step
        assert report[run]["kernel_dtypes"] == ["torch.bfloat16"]


@pytest.mark.parametrize("run", FSDP2)
def test_fsdp2_kernel_training_equals_ddp_bit_for_bit(job, run):
    """Loss, whole weights, masks and exported state dict after every step, on every rank;
    the stored masks change within their phases (so a stale packing would show)."""
    reference = RUNS[run]["reference"]
    for report in job:
        got, expected = steps(report, run), steps(report, reference)
        for step in range(STEPS):
            for key in ("loss", "weights", "masks", "export"):
                assert got[step][key] == expected[step][key], (run, step, key)
        for start, end in ((2, 5), (5, 8)):  # magnitude, rigl
            assert got[start]["masks"] != got[end - 1]["masks"], (run, start)
    assert (
        steps(job[0], run)[STEPS - 1]["weights"]
        == steps(job[1], run)[STEPS - 1]["weights"]
    )


@pytest.mark.parametrize("run", FSDP2)
def test_fsdp2_kernel_keeps_sharded_fp32_parameters_and_masks(job, run):
    """The parameters stay float32 shards (the optimizer state with them) and the stored
    masks are shards too, under a bf16 MixedPrecisionPolicy as under autocast; each rank
    packs the whole current mask for its forward after every update."""
    for report in job:
        for step, record in steps(report, run).items():
            assert record["param_dtypes"] == ["torch.float32"]
            if step < SPARSE:
                assert record["sharded"] == [True, True], step
            if PHASES[0]["until"] <= step < SPARSE:
                assert record["packing"] == {
                    "blocks.0.fc.weight": True,
                    "blocks.1.fc.weight": True,
                }, step


@pytest.mark.parametrize("run", FSDP2)
def test_fsdp2_kernel_table_says_why_each_sharded_layer_runs_it(job, run):
    dtype = "bfloat16" if RUNS[run].get("mixed_precision_policy") else "float32"
    for report in job:
        choices = report[run]["choices"]
        assert len(choices) == 6  # 3 sparse phases x 2 layers
        for name, reason in choices.values():
            assert name == "semi_structured"
            assert reason == (
                f"cuSPARSELt, sm90, bfloat16, on the {dtype} weight FSDP2 gathers from 2 "
                f"shards"
            )
        # the kernel check ran in the dtype of the gathered weight's matmuls
        assert report[run]["checked"] == [["cusparselt", "torch.bfloat16"]]
        assert report["ddp"]["choices"]["0 blocks.0.fc.weight"] == [
            "semi_structured",
            "cuSPARSELt, sm90, bfloat16",
        ]


def test_fsdp2_kernel_compiled_per_block_trains_as_eager(job):
    """The compiled runs follow every mask update within a phase: compiled DDP equals eager
    DDP after every step (so compiled FSDP2, equal to compiled DDP, does too)."""
    for report in job:
        compiled, eager = steps(report, "ddp compiled"), steps(report, "ddp")
        for step in range(STEPS):
            for key in ("loss", "weights", "masks"):
                assert compiled[step][key] == eager[step][key], (step, key)


def test_fsdp2_kernel_graphs_compile_only_at_phase_starts(job):
    """Per-block ``aot_eager``: one graph per block at the start, a new one at the start of
    the stored-mask phases and of the dense phase, none at the mask updates in between nor at
    the ``rigl`` phase (stored masks too: its packing is refreshed in the same tensors)."""
    for report in job:
        compiles = {
            s: r["compiles"] for s, r in steps(report, "fsdp2 compiled").items()
        }
        runtime, dense = PHASES[0]["until"], SPARSE
        assert compiles == {
            s: 2 if s < runtime else 4 if s < dense else 6 for s in range(STEPS)
        }
        ddp = {s: r["compiles"] for s, r in steps(report, "ddp compiled").items()}
        assert compiles == ddp


def test_fsdp2_kernel_resumes_from_a_distributed_checkpoint_exactly(job):
    for report in job:
        full = steps(report, "fsdp2 mixed precision policy")
        resumed = steps(report, "fsdp2 mixed precision policy resumed")
        assert sorted(resumed) == list(range(CHECKPOINT, STEPS))
        for step, record in resumed.items():
            assert record == {**full[step], "compiles": record["compiles"]}, step
        assert report["fsdp2 mixed precision policy"]["checkpoint_is_a_directory"]


def test_fsdp2_kernel_verify_speed_times_the_whole_shape(job):
    for report in job:
        shapes = report["speed_shapes"]
        assert shapes["timed"] == [[384, 128, "torch.bfloat16"]]
        assert shapes["local"] == [192, 128]
        name, reason = shapes["choice"]
        assert name == "semi_structured"
        assert reason.endswith(
            "on the bfloat16 weight FSDP2 gathers from 2 shards, 1.20x dense (eager, "
            "8192 tokens)"
        )


def test_fsdp2_kernel_runs_only_where_every_rank_passed_the_kernel_check(job):
    passed, failed = (report["agreed_kernel_checks"] for report in job)
    assert passed["name"] == failed["name"] == "masked"
    assert passed["reason"].startswith(
        "kept dense: on another rank verify_speed found 2:4 slower or the kernel check "
        "failed"
    )
    assert "gave wrong results in the kernel check" in failed["reason"]


def test_fsdp2_kernel_runs_on_every_mlp_of_the_llama_cpu_demo_recipe(job):
    """``recipes/hf/llama_1b_fsdp2_cpu_demo.yaml`` through ``lightning-sparse fit`` (3 steps,
    the first 2 sparse): FSDP2 per decoder block, bf16 MixedPrecisionPolicy and autocast;
    each of the 6 MLP layers runs its forward and input gradient on the kernel at each sparse
    step (gate_proj and up_proj 128->384, down_proj 384->128; ``W.T`` of one is the shape
    of ``W`` of the other)."""
    for report in job:
        demo = report["llama_demo"]
        assert len(demo["choices"]) == 6
        for name, reason in demo["choices"].values():
            assert name == "semi_structured"
            assert reason.endswith("on the bfloat16 weight FSDP2 gathers from 2 shards")
        sparse = {"384x128": 6, "128x384": 6}
        assert demo["calls"] == {"0": sparse, "1": sparse, "2": {}}
        assert demo["kernel_dtypes"] == ["torch.bfloat16"]
        assert 4.0 < demo["loss"] < 6.0  # log(256) = 5.5: untrained


@pytest.mark.parametrize("precision", ["mixed precision policy", "autocast"])
@pytest.mark.parametrize("mode", ["runtime", "stored", "stored unpacked"])
def test_fsdp2_kernel_saves_no_weight_sized_tensor_of_its_own(job, mode, precision):
    """Between a layer's forward and its backward, of the tensors its 2:4 ops saved, those of
    at least a quarter of its weight's elements are FSDP2's own gathered parameter (its
    storage freed after the forward: 0 bytes; gathered again for the backward) and, with a
    stored mask, that mask and its packing (kept by the layer anyway); no pruned, packed or
    cast copy of the weight."""
    weights = {"0": [384, 128], "1": [256, 384]}  # the worker's two layers
    for report in job:
        saved = report["saved_for_backward"][f"{mode}, {precision}"]
        assert sorted(saved) == ["0", "1"]
        for layer, tensors in saved.items():
            own = [t for t in tensors if t[2] != "stored mask"]
            assert own == [[weights[layer], 0, ""]], (layer, tensors)
            kept = [t for t in tensors if t[2] == "stored mask"]
            # the whole mask; with a packing, also its keys for W and W.T
            assert len(kept) == {"runtime": 0, "stored": 3, "stored unpacked": 1}[mode]


def test_fsdp2_mask_choice_gathers_one_layer_at_a_time(job):
    """Choosing masks for weights sharded by FSDP2 holds, beyond what the same choice holds
    unsharded (the algorithm's own work on a layer, the masks), at most one layer's whole
    weight and mask at once (and its gradient, at an update): not every layer's at once. The
    masks are those chosen unsharded."""
    for report in job:
        peak = report["mask_choice_peak"]
        sharded, plain = peak["sharded"], peak["plain"]
        largest = max(peak["weights"])  # float32: 4 bytes a weight, its mask 1
        one_layer = largest + largest // 4
        assert sharded["start"][0] <= plain["start"][0] + one_layer
        assert sharded["update"][0] <= plain["update"][0] + one_layer + largest
        # every layer's whole weight at once would not fit under these bounds
        assert sum(peak["weights"]) > one_layer + largest
        assert sharded["updated"] and plain["updated"]
        assert sharded["masks"] == plain["masks"]


MEMORY_ITEMS = [
    "parameters",
    "gradients",
    "optimizer_state",
    "masks",
    "whole_masks",
    "packing",
    "until_backward",
    "at_mask_choice",
]


@pytest.mark.parametrize("run", ["llama_demo", "llama_demo_masked"])
def test_fsdp2_memory_per_rank_measured_matches_the_plan(job, run, capsys):
    """The Llama CPU demo recipe on 2 ranks (on the kernel path, and as it runs on the CPU:
    masked math): each rank's bytes of parameters, gradients, AdamW state, mask shards, whole
    masks and packing, what the sparsity path adds to the saved activations, and the mask
    choice's transient, counted by storage, are what the plan predicts, within 10%; the
    plan's table for the recipe on 2 devices prints the same."""
    for report in job:
        memory = report[run]["memory"] if run == "llama_demo" else report[run]
        measured, predicted = memory["measured"], memory["predicted"]
        assert sorted(measured) == sorted(MEMORY_ITEMS)
        for item in MEMORY_ITEMS:
            assert abs(measured[item] - predicted[item]) <= 0.1 * predicted[item], item
        # masked math keeps the bool mask it projected for each of the 6 MLP layers
        # (128x384) until the backward, not the weight times it; the kernel path saves
        # FSDP2's own weight
        saved = 6 * 128 * 384 if run == "llama_demo_masked" else 0
        assert measured["until_backward"] == saved
        assert (
            measured["at_mask_choice"] == 128 * 384 * 5
        )  # one float32 layer, its mask
    out = plan_demo(capsys)
    row = re.split(r"\s{2,}", out.split("memory per rank", 1)[1].split("phase 1", 1)[1])
    measured = job[0]["llama_demo_masked"]["measured"]
    assert row[1:5] == [
        f"{measured[k] / 2**20:.1f}"
        for k in ("parameters", "gradients", "optimizer_state", "masks")
    ]


def plan_demo(capsys) -> str:
    """``lightning-sparse plan`` of the CPU demo recipe."""
    from lightning_sparse.cli.main import SparseCLI

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "hf"
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(sys, "argv", ["lightning-sparse"])
        SparseCLI(
            args=[
                "plan",
                f"--config={recipe / 'llama_1b_fsdp2_cpu_demo.yaml'}",
                "--plot=false",
            ]
        )
    return capsys.readouterr().out


def test_fsdp2_kernel_is_refused_for_a_dtensor_the_forward_sees(job):
    """A weight sharded without FSDP2 (tensor parallelism) reaches the forward as a
    DTensor: masked math, and the table says why."""
    for report in job:
        assert report["tensor_parallel"].startswith(
            "a S(0) DTensor not sharded by FSDP2 (fully_shard), e.g. by tensor parallelism"
        )
