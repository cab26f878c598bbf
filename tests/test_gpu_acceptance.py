"""``benchmarks/gpu_acceptance.py --part correctness|speed --cpu-smoke``: every stage's plumbing
runs on the CPU, as on a bare GPU machine (its subprocesses cannot import jsonargparse or
hypothesis), into one report per part."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# First on every subprocess's path: the packages a bare GPU machine lacks are missing there
BARE = Path(__file__).resolve().parent / "bare_gpu_machine"
STAGES = {
    "correctness": [
        "environment",
        "kernel check",
        "gpu tests",
        "verify_speed",
        "training",
        "gpu compile tests",
    ],
    "speed": [
        "environment",
        "target layers",
        "target steps",
        "more layers",
        "more steps",
    ],
}


@pytest.fixture
def acceptance(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("PYTHONPATH", str(BARE))
    monkeypatch.setenv(
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"
    )  # no hypothesis plugin there
    return importlib.import_module("gpu_acceptance")


def smoke_report(acceptance, tmp_path, part: str) -> str:
    out = tmp_path / f"{part}.md"
    assert acceptance.main(["--part", part, "--cpu-smoke", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.startswith(f"# GPU acceptance, {part} part: a CPU smoke run")
    assert "**All stages passed.**" in report
    for i, stage in enumerate(STAGES[part], 1):
        assert f"\n## {i}. {stage}: passed\n" in report, stage
        assert f"| {stage} | passed |" in report, stage
    return report


def test_the_correctness_part_checks_kernels_runs_gpu_tests_and_trains(
    acceptance, tmp_path
):
    report = smoke_report(acceptance, tmp_path, "correctness")
    # the GPU tests were collected (not run) without hypothesis
    assert "test_semi_structured_gpu.py" in report and "test_export.py" in report
    assert "| cusparselt | passed |" in report  # the kernel check (emulated)
    assert "| odd shape | 100x100 | 32 | eager |" in report  # verify_speed, with tokens
    for run in ("dense", "2:4 masked (MLPs)", "2:4 kernels (MLPs)"):
        assert f"| {run} | 4 |" in report
    assert "the kernel run against the masked run: first step 0.00% apart" in report
    assert "model.blocks.1.mlp.fc2.weight" in report
    assert (
        "| slowest layer verify_speed keeps on a 2:4 kernel, timed again in the training "
        "steps | at least 1 x | none kept sparse | PASS |" in report
    )
    # every GPU test by name, in the stage that runs it (collected only, here)
    gpu_tests, compile_tests = report.split("## 3. gpu tests")[1].split("## 6.")
    row = "| `tests/test_semi_structured_gpu.py::test_compiled_training_on_the_gpu` |"
    assert f"{row} not run |" in compile_tests and row not in gpu_tests
    row = "| `tests/test_semi_structured_gpu.py::test_resume_on_the_gpu` | not run |"
    assert row in gpu_tests
    # what verify_speed would decide in the training run, and the layers timed in its steps
    assert "| model.blocks.0.mlp.fc1.weight | 256x64 | 34 |" in report
    assert "LLM block stack" not in report.split("## 1.")[0]  # the speed part's targets


def test_the_speed_part_measures_the_targets_first_then_the_rest(acceptance, tmp_path):
    report = smoke_report(acceptance, tmp_path, "speed")
    targets, rest = report.split("## 3. target steps")[0], report.split("## 4.")[1]
    assert "--variants 'emulated, searched' --compiled all" in targets
    for variant in ("dense", "2:4 emulated, searched"):
        assert f"| smoke: 64x128 -> 256 | {variant} |" in targets  # eager and compiled
    assert "2:4 masked runtime" not in targets and "2:4 masked runtime" in rest
    assert "| 256x128 | greedy_2to4_mask (the masked runtime step) |" in targets
    assert "| 256x128 | lightning_sparse compress | - |" in targets
    assert "| compiled | 2:4 MLPs |" in report  # the LLM block stack
    assert "| tiny ViT-B, batch 2 | eager | 2:4 MLPs |" in rest
    assert (
        "| LLM block stack training step, compiled | at least 1.1 x | - | not run |"
        in report
    )
    assert "slowest layer verify_speed" not in report


def test_without_a_gpu_it_says_so_and_exits_0(acceptance, tmp_path, monkeypatch):
    monkeypatch.setattr(acceptance.torch.cuda, "is_available", lambda: False)
    for part, stages in STAGES.items():
        out = tmp_path / f"{part}.md"
        assert acceptance.main(["--part", part, "--out", str(out)]) == 0
        report = out.read_text()
        assert "**Nothing measured: no CUDA GPU found" in report
        for stage in stages[1:]:
            assert f"| {stage} | skipped |" in report, stage


def test_a_part_refuses_the_other_parts_stages(acceptance):
    with pytest.raises(SystemExit):
        acceptance.parse(["--part", "speed", "--stages", "training"])


def test_a_stage_runs_in_a_subprocess_of_the_script(acceptance):
    args = acceptance.parse(["--part", "correctness", "--cpu-smoke"])
    stage = acceptance.child(args, 300, "verify_speed", isolate=True)
    assert stage.status == "passed", stage.body
    assert "| odd shape | 100x100 |" in stage.body


def test_a_stage_that_overruns_its_share_is_cut(acceptance):
    code, out = acceptance.run_command(
        [
            sys.executable,
            "-c",
            "import time; print('started', flush=True); time.sleep(60)",
        ],
        timeout=3,
    )
    assert code is None
    assert out.strip() == "started"


def test_targets_pass_fail_or_not_run_from_the_records(acceptance):
    records = [
        {"table": "packing", "weight": "4096x1024", "in_use": True, "what": "W and W.T",
         "eager_ms": 0.3, "graphed_ms": 0.05},
        {"table": "packing", "weight": "4096x1024", "in_use": False, "what": "W and W.T",
         "eager_ms": 0.01, "graphed_ms": 0.01},  # the packer not in use does not count
        {"table": "layers", "tokens": 16384, "in_features": 4096, "out_features": 11008,
         "kernel": "cusparselt", "algorithm": "searched", "mode": "compiled",
         "stored": True, "fused": True, "ratio": 1.5},  # a stored mask: not the target's
        {"table": "layers", "tokens": 16384, "in_features": 4096, "out_features": 11008,
         "kernel": "cusparselt", "algorithm": "searched", "mode": "compiled",
         "stored": False, "fused": False, "ratio": 1.4},  # without the Triton kernels
        {"table": "layers", "tokens": 16384, "in_features": 4096, "out_features": 11008,
         "kernel": "cusparselt", "algorithm": "searched", "mode": "compiled",
         "stored": False, "fused": True, "ratio": 1.1},
        {"table": "fused", "weight": "11008x4096", "job": "mask + W, W.T", "in_use": False,
         "method": "torch ops: tile-op mask, our packer", "graphed_ms": 0.05,
         "times_limit": 1.0},  # not the Triton kernels
        {"table": "fused", "weight": "11008x4096", "job": "mask + W, W.T", "in_use": True,
         "method": "Triton: mask + W, W.T, one pass", "graphed_ms": 0.09, "eager_ms": 0.2,
         "times_limit": 2.6},
        {"table": "fused", "weight": "11008x4096", "job": "W, W.T at a stored mask",
         "in_use": True, "method": "Triton: W, W.T, one pass", "graphed_ms": 0.07,
         "eager_ms": 0.1},  # the packer in use: Triton, no packing row in use
        {"table": "verify_speed", "kept_sparse": True, "ratio": 1.5},  # the decision's own
        {"table": "kept layers", "kept_sparse": False, "on_kernel": True, "ratio": 0.5},
    ]  # fmt: skip
    stages = [acceptance.Stage("s", records=records)]
    verdicts = {
        row[0]: row[2:]
        for part in ("speed", "correctness")
        for row in acceptance.target_rows(stages, part)
    }
    assert verdicts["packing W and W.T, 4096x1024 (packer in use, CUDA graph)"] == [
        "0.05 ms",
        "PASS",
    ]
    assert verdicts["packing W and W.T, 11008x4096 (packer in use, CUDA graph)"] == [
        "0.07 ms",
        "PASS",
    ]
    triton = (
        "mask + packing W and W.T, 11008x4096 (Triton kernels, one pass, CUDA graph)"
    )
    assert verdicts[triton] == ["0.09 ms", "PASS"]
    bound = (
        "the same, as a multiple of its memory-bound time (copy bandwidth, this run)"
    )
    assert verdicts[bound] == ["2.6 x", "FAIL"]
    assert verdicts["runtime 2:4 linear fwd+bwd compiled, 16384x4096 -> 11008"] == [
        "1.1 x",
        "FAIL",
    ]
    assert verdicts["LLM block stack training step, compiled"] == ["-", "not run"]
    slowest = "slowest layer verify_speed keeps on a 2:4 kernel, timed again in the training steps"
    assert verdicts[slowest] == ["none kept sparse", "PASS"]
    records.append(
        {"table": "kept layers", "kept_sparse": True, "on_kernel": True, "ratio": 0.9}
    )
    (row,) = [
        r for r in acceptance.target_rows(stages, "correctness") if r[0] == slowest
    ]
    assert row[2:] == ["0.9 x", "FAIL"]


def test_benchmark_stages_are_picked_by_flag(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sparse_linear = importlib.import_module("sparse_linear")
    train_steps = importlib.import_module("train_steps")
    out = tmp_path / "records.json"
    sparse_linear.main(["--cpu-smoke", "--stages", "packing", "--json", str(out)])
    tables = {r["table"] for r in json.loads(out.read_text())}
    assert tables == {"packing", "packing_stored"}
    train_steps.main(["--cpu-smoke", "--models", "vit-b", "--modes", "eager"])
    printed = capsys.readouterr().out
    assert "| tiny ViT-B, batch 2 | eager | 2:4 MLPs |" in printed
    assert "compiled" not in printed.split("| model |")[1]


def test_the_training_stage_runs_its_kernel_leg_on_the_kernels_and_reports_the_decision(
    acceptance, monkeypatch
):
    """On a GPU where eager 2:4 is 0.12x dense at these shapes (a pretend one, the emulation
    standing in for the kernels) verify_speed would keep every layer on masked math: the
    kernel leg runs the kernels all the same, and the report says what verify_speed would
    decide, and how each layer timed inside the steps."""
    from helpers import pretend_gpu, slow_kernels

    stages = importlib.import_module("acceptance_stages")
    # MLP weights of 512x128 and 128x512, which the kernel rules take
    monkeypatch.setattr(stages, "TINY_VIT", {**stages.TINY_VIT, "embed_dim": 128})
    pretend_gpu(monkeypatch, (9, 0))
    slow_kernels(monkeypatch)
    args = acceptance.parse(["--part", "correctness", "--cpu-smoke"])
    stage = stages.training(args, deadline=float("inf"))
    assert "4/4 MLP weights on 2:4 kernels" in stage.summary
    assert "verify_speed would keep 0/4 MLP weights" in stage.summary
    assert (
        "| model.blocks.1.mlp.fc2.weight | 128x512 | 34 | 0.12x | masked ("
        in stage.body
    )
    assert (
        "sparse 0.12x dense (eager, 34 tokens), so kept dense (verify_speed)"
        in stage.body
    )
    timed = [r for r in stage.records if r["table"] == "kept layers"]
    assert len(timed) == 4 and all(
        r["on_kernel"] and not r["kept_sparse"] for r in timed
    )
    assert all(r["ratio"] > 0 for r in timed)


def test_the_test_log_says_which_tests_passed_failed_or_never_ran(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    plugin = importlib.import_module("pytest_outcomes")
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(plugin.LOG, str(log))
    session = type("Session", (), {"items": []})()
    session.items = [type("Item", (), {"nodeid": f"t.py::{n}"})() for n in "abcd"]
    plugin.pytest_collection_finish(session)

    def report(name, when, outcome):
        fields = {"nodeid": f"t.py::{name}", "when": when, "outcome": outcome}
        fields.update(passed=outcome == "passed", skipped=outcome == "skipped")
        plugin.pytest_runtest_logreport(type("Report", (), fields)())

    report("a", "setup", "passed")
    report("a", "call", "passed")
    report("b", "setup", "skipped")  # skipped before its call
    report("c", "call", "passed")
    report("c", "teardown", "failed")  # an error after a passed call: an error
    # d: the run was killed before it
    assert plugin.outcomes(str(log)) == {
        "t.py::a": "passed",
        "t.py::b": "skipped",
        "t.py::c": "error",
        "t.py::d": "not run",
    }
