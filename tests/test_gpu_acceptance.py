"""``benchmarks/gpu_acceptance.py --cpu-smoke``: every stage's plumbing runs on the CPU, as on a
bare GPU machine (its subprocesses cannot import jsonargparse or hypothesis), into one report."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# Imported first in every subprocess (via PYTHONPATH): the wheels a bare GPU machine lacks are
# found (so torch's find_spec probes see a spec without a file) but fail to import.
BLOCKER = """
import sys
from importlib.machinery import ModuleSpec

class Bare:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("jsonargparse", "hypothesis"):
            return ModuleSpec(name, self)

    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} is blocked: a bare GPU machine lacks it")

sys.meta_path.insert(0, Bare())
"""
STAGES = [
    "environment",
    "kernel check",
    "gpu tests",
    "sparse_linear",
    "train_steps",
    "verify_speed",
    "training",
]


@pytest.fixture
def acceptance(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(BLOCKER)
    monkeypatch.setenv("PYTHONPATH", str(blocked))
    monkeypatch.setenv(
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"
    )  # no hypothesis plugin there
    return importlib.import_module("gpu_acceptance")


def test_cpu_smoke_writes_a_report_of_every_stage(acceptance, tmp_path):
    out = tmp_path / "report.md"
    assert acceptance.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = out.read_text()
    assert "**All stages passed.**" in report
    for i, stage in enumerate(STAGES, 1):
        assert f"\n## {i}. {stage}: passed\n" in report, stage
        assert f"| {stage} | passed |" in report, stage
    # the GPU tests were collected (not run) without hypothesis, and each stage's table came back
    assert "test_semi_structured_gpu.py" in report
    assert "| 256x128 | greedy_2to4_mask (the masked runtime step) |" in report
    assert "| 256x128 | lightning_sparse compress | - |" in report
    for variant in ("dense", "2:4 emulated, alg 0", "2:4 emulated, searched"):
        assert f"| smoke: 64x128 -> 256 | {variant} |" in report  # eager and compiled
    assert "| 2:4 masked runtime |" in report
    assert "| compiled | 2:4 MLPs |" in report  # the LLM block stack
    assert "| cusparselt | passed |" in report  # the kernel check (emulated)
    assert (
        "| LLM block stack training step, compiled | at least 1.1 x | - | not run |"
        in report
    )
    assert "| odd shape | 100x100 |" in report
    assert "| 2:4 runtime (MLPs) | 4 |" in report
    assert "model.blocks.1.mlp.fc2.weight" in report


def test_without_a_gpu_it_says_so_and_exits_0(acceptance, tmp_path, monkeypatch):
    monkeypatch.setattr(acceptance.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    assert acceptance.main(["--out", str(out)]) == 0
    report = out.read_text()
    assert "**Nothing measured: no CUDA GPU found" in report
    for stage in STAGES[1:]:
        assert f"| {stage} | skipped |" in report, stage


def test_a_stage_runs_in_a_subprocess_of_the_script(acceptance):
    args = acceptance.parse(["--cpu-smoke"])
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
         "stored": True, "ratio": 1.5},  # a stored mask: not the runtime target's layer
        {"table": "layers", "tokens": 16384, "in_features": 4096, "out_features": 11008,
         "kernel": "cusparselt", "algorithm": "searched", "mode": "compiled",
         "stored": False, "ratio": 1.1},
        {"table": "verify_speed", "kept_sparse": False, "ratio": 0.5},
    ]  # fmt: skip
    stages = [acceptance.Stage("s", records=records)]
    verdicts = {row[0]: row[2:] for row in acceptance.target_rows(stages)}
    assert verdicts["packing W and W.T, 4096x1024 (packer in use, CUDA graph)"] == [
        "0.05 ms",
        "PASS",
    ]
    assert verdicts["runtime 2:4 linear fwd+bwd compiled, 16384x4096 -> 11008"] == [
        "1.1 x",
        "FAIL",
    ]
    assert verdicts["LLM block stack training step, compiled"] == ["-", "not run"]
    assert verdicts["slowest layer verify_speed keeps on a 2:4 kernel"] == [
        "none kept sparse",
        "PASS",
    ]


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
