"""The GPU acceptance, in two parts of one command each (under 4 minutes each on an H200).

    PYTHONPATH=. python benchmarks/gpu_acceptance.py --part correctness --out correctness.md
    PYTHONPATH=. python benchmarks/gpu_acceptance.py --part speed --out speed.md
    PYTHONPATH=. python benchmarks/gpu_acceptance.py --part correctness --cpu-smoke  # the script

``--part correctness`` (is the 2:4 path right on this GPU?):

1. environment: Python, torch (CUDA, cuSPARSELt), Lightning, timm; the GPU; the checkout;
2. kernel check: each 2:4 kernel's check in bf16 and fp16 (verdict, error, versions), and
   which cuSPARSELt packer runs (the Triton kernels, our torch ops or ``torch._cslt_compress``,
   each compared with ``torch._cslt_compress``'s bytes and products) and why;
3. GPU tests: ``pytest -m "gpu and not compiles"`` over the test files that hold GPU-marked
   tests, every test listed with its outcome (passed, failed, skipped, not run);
4. ``verify_speed``: what ``SparsityCallback(backend="auto")`` decides for the ViT-L and ViT-B
   MLP shapes at their recipes' token counts and for a shape no kernel takes, eagerly and as
   CUDA graphs;
5. training: a timm ViT-B (random init, bf16-mixed, synthetic images made on the GPU) trained
   with Lightning three ways: dense, 2:4 MLPs on masked math, 2:4 MLPs on the kernels
   (``backend="auto", verify_speed=False``); the kernel run's loss must follow the masked
   run's (the same function), and the table shows step times and the backend table; then
   what ``verify_speed`` would decide for those MLP weights, and each layer's forward +
   backward timed inside the steps, kernel against dense;
6. GPU compile tests: the GPU tests that compile with inductor (``-m "gpu and compiles"``),
   listed the same way, last, since a cold compile takes tens of seconds.

``--part speed`` (the targets first, then the wider tables as time allows):

1. environment;
2. target layers: ``benchmarks/sparse_linear.py``: the masked runtime mask step, packing ``W``
   and ``W.T`` by each packer, each packing job by each method against its memory bound, and
   the runtime 2:4 linear (searched algorithm, with and without the Triton kernels) against
   dense, eager and compiled, at the two target shapes;
3. target steps: ``benchmarks/train_steps.py``: the LLM block stack's compiled training step,
   dense against 2:4 MLPs;
4. more layers: every ``sparse_linear.py`` shape and variant, eager;
5. more steps: ``train_steps.py`` eagerly, and the other models (``--step-models``).

Each report opens with the GPU targets its part measures (H100/H200, bf16), PASS or FAIL from
this run's numbers, or "not run":

- packing W and W.T (the packer in use, as a CUDA graph): at most 0.1 ms at 4096x1024 and
  0.6 ms at 11008x4096;
- the greedy mask and W and W.T packed by the Triton kernels in one pass (as a CUDA graph) at
  11008x4096: at most 0.1 ms, and at most 2.5x its memory-bound time (the bytes it must move
  at the bandwidth of a copy kernel measured in the same run);
- the runtime 2:4 MLP linear, forward + backward compiled (searched algorithm): at least 1.2x
  dense at 16384x4096->11008 and 1.0x at 32896x1024->4096;
- the LLM block stack's training step, compiled: at least 1.1x dense;
- the masked runtime mask step of a 4096x1024 weight: at most 0.1 ms;
- nothing ``verify_speed`` keeps sparse is slower than dense, each such layer timed again
  inside the training stage's steps against its dense twin (correctness part).

Stages after the environment each run in a subprocess (a CUDA error in one cannot poison the
next; with ``--cpu-smoke`` the in-process stages run here) with a share of ``--time-budget``:
time an earlier stage leaves unused passes to the later ones. A stage about to run out of time
stops cleanly (the benchmarks skip what is left, training stops early, and they say so); one
that overruns its share is killed, and the report says what was cut. ``--stages`` picks stages
of the part (the others are reported as not selected).

It needs only torch, lightning, timm (with its safetensors), torchmetrics, numba and pytest (no
jsonargparse, hypothesis or network): run it from the checkout with ``PYTHONPATH=.``. Without a
CUDA GPU of capability 8.0+ it writes a report saying so and exits 0. ``--cpu-smoke`` runs
each stage's plumbing on the CPU with tiny settings (the test suite runs both parts); its
numbers mean nothing. Exit status: 1 if a stage failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an install

from acceptance_stages import Stage, kernel_checks, training, verify_speed
from common import cuda_problem, markdown_table
from pytest_outcomes import LOG, outcomes
from sparse_linear import COMPILED, STORED, TRITON_MASK_AND_PACK
from train_steps import WORKLOADS

BUDGET = 200.0
"""Seconds per part, by default: with the start-up and the report, under 4 minutes."""
# Each part's stages and their shares of its time budget.
PARTS = {
    "correctness": {
        "kernel check": 0.07,
        "gpu tests": 0.30,
        "verify_speed": 0.10,
        "training": 0.33,
        "gpu compile tests": 0.20,
    },
    "speed": {
        "target layers": 0.35,
        "target steps": 0.35,
        "more layers": 0.15,
        "more steps": 0.15,
    },
}
MORE_STEP_MODELS = ["vit-b"]  # train_steps.py's vit-l: by --step-models
TARGET_VARIANTS = ["dense", "cuSPARSELt, searched"]  # the targets' layer variants
OPTIONAL = ("jsonargparse", "hypothesis")  # never needed here; reported when present


# -- the environment (in this process) ------------------------------------------------------------
def gpu_problem() -> str | None:
    """Why this machine cannot run the GPU stages, or ``None``."""
    if torch.version.hip is not None:
        return "a ROCm build of torch: the 2:4 kernels used here are NVIDIA-only"
    return cuda_problem()


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> Stage:
    rows = [
        ["Python", platform.python_version()],
        ["platform", platform.platform()],
        ["torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"],
    ]
    rows += [[p, version(p)] for p in ("lightning", "timm", "torchmetrics", "numba")]
    rows += [[p, version(p)] for p in ("pytest", "safetensors")]
    rows += [[p, f"{version(p)} (not needed)"] for p in OPTIONAL]
    rows.append(["checkout", git_commit()])
    cusparselt = torch.backends.cusparselt
    found = cusparselt.version() if cusparselt.is_available() else "not in this build"
    rows.append(["cuSPARSELt", str(found)])
    summary = f"torch {torch.__version__}, " + (gpu_problem() or "")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [
            ["GPU", f"{props.name} (of {torch.cuda.device_count()} visible)"],
            ["capability", f"sm{props.major}{props.minor}"],
            ["GPU memory", f"{props.total_memory / 2**30:.1f} GiB"],
            ["driver", nvidia_driver()],
        ]
        summary = summary.rstrip(", ") + f", {props.name} sm{props.major}{props.minor}"
    return Stage("environment", "passed", summary, markdown_table(["", ""], rows))


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown (not a git checkout)"


def nvidia_driver() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            return out.stdout.strip().splitlines()[0]
    return "unknown (nvidia-smi did not answer)"


# -- subprocesses ---------------------------------------------------------------------------------
def run_command(
    cmd: list[str], timeout: float, extra_env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run ``cmd`` from the checkout (``extra_env``: variables to set; a ``PYTHONPATH`` there
    is added to the path); ``(exit status, output)``, status ``None`` if it was killed at
    ``timeout`` seconds (with what it printed until then)."""
    extra = dict(extra_env or {})
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(ROOT),
            *filter(None, [extra.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]),
        ]
    )
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so a timeout kills its children too
        )
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            code = None
        finally:  # on a timeout, and when this script is interrupted
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return code, log.read()


def tail(text: str, lines: int = 40) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    if not kept:
        return ""
    return "<details><summary>output (last {} lines)</summary>\n\n```\n{}\n```\n</details>".format(
        len(kept), "\n".join(kept)
    )


# -- correctness: the GPU tests ------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """The test files holding GPU-marked tests (the others need not import on a bare machine)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


GPU_TEST_STAGES = {
    "gpu tests": "gpu and not compiles",
    "gpu compile tests": "gpu and compiles",
}
"""The stages running GPU tests and the markers each selects: those that compile with inductor
(tens of seconds each, cold) in a stage of their own, last, so that the others finish."""


def gpu_tests(
    args: argparse.Namespace, timeout: float, name: str = "gpu tests"
) -> Stage:
    files = gpu_test_files()
    marker = GPU_TEST_STAGES[name]
    # -m overrides the 'not slow' of pyproject's addopts; its doctests need not run here
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-o", "addopts=", "-v", "-rfE"]
    cmd += [
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_outcomes",
        *(["--collect-only", "-q"] if args.cpu_smoke else []),
        *files,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "outcomes.jsonl"
        log.touch()
        code, out = run_command(
            cmd, timeout, {LOG: str(log), "PYTHONPATH": str(Path(__file__).parent)}
        )
        found = outcomes(str(log))
    counts = {
        word.rstrip("s") if word == "errors" else word: int(n)
        for n, word in re.findall(
            r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
            last_summary(out),
        )
    }
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    stage = Stage(name)
    shown = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no summary"
    if collected and "passed" not in counts:
        shown = f"{collected.group(1)} collected, {shown}"
    not_run = sum(outcome == "not run" for outcome in found.values())
    stage.summary = f"{len(files)} files: {shown}"
    if code is None:
        stage.status = "cut"
        stage.summary += f"; killed after {timeout:.0f} s, {not_run} not run"
    elif code != 0:
        stage.status = "failed"
        stage.summary += f"; pytest exit status {code}"
    elif not args.cpu_smoke and counts.get("passed", 0) == 0:
        stage.status = "failed"
        stage.summary += "; no GPU test passed (all skipped?)"
    else:
        stage.status = "passed"
    listed = markdown_table(
        ["test", "outcome"], [[f"`{test}`", outcome] for test, outcome in found.items()]
    )
    body = [f"`{' '.join(['pytest', *cmd[3:]])}`", "", listed, ""]
    stage.body = "\n".join([*body, tail(out, 60)])
    return stage


def last_summary(out: str) -> str:
    lines = [line for line in out.splitlines() if re.search(r" in [\d.]+s", line)]
    return lines[-1] if lines else ""


# -- the benchmarks in a subprocess ---------------------------------------------------------------
def benchmark(
    script: str, extra: list[str], args: argparse.Namespace, timeout: float, name: str
) -> Stage:
    """Run ``benchmarks/<script>.py`` with a time limit a margin before ``timeout``, as stage
    ``name``; its tables and its JSON records (what it measured before a kill, too)."""
    if args.cpu_smoke:
        extra = ["--cpu-smoke", *extra]
    else:
        extra = ["--repeats", "10", "--warmup", "3", *extra]
        extra += ["--time-limit", f"{timeout - min(30.0, 0.15 * timeout):.0f}"]
    with tempfile.TemporaryDirectory() as tmp:
        found = Path(tmp) / "records.json"
        path = str(Path(__file__).with_name(f"{script}.py"))
        code, out = run_command(
            [sys.executable, path, *extra, "--json", str(found)], timeout
        )
        records = json.loads(found.read_text()) if found.exists() else []
    kept = [
        line
        for line in out.splitlines()
        if line.startswith(("|", "torch ", "Kernel checks", "Not run"))
        or not line.strip()
    ]
    tables = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    stage = Stage(name, summary=f"{len(records)} measurements", records=records)
    if code is None:
        stage.status = "cut"
        stage.summary += f"; killed after {timeout:.0f} s"
    elif code != 0 or "needs CUDA" in out or not records:
        stage.status, stage.summary = "failed", f"exit status {code}; no measurement"
    else:
        stage.status = "passed"
        stage.summary += "".join(f"; {best}" for best in best_speedups(records))
        if "Not run (time limit)" in out:
            stage.status = "cut"
            stage.notes.append(
                "the time limit skipped some measurements (listed below)"
            )
    command = f"`python benchmarks/{script}.py {shlex.join(extra)}`"
    output = tail(out, 30) if stage.status in ("failed", "cut") else ""
    stage.body = "\n\n".join(filter(None, [command, tables, output]))
    return stage


def best_speedups(records: list[dict]) -> list[str]:
    """The best 2:4 kernel speed-up over dense of a linear layer and of a training step."""
    best = {}
    for r in records:
        kernel = r["kernel"] not in ("", "masked") if r["table"] == "layers" else True
        if r["table"] in ("layers", "steps") and r["variant"] != "dense" and kernel:
            what = r.get("label", "") + (
                f" {r['tokens']}x{r['in_features']} -> {r['out_features']}"
                if r["table"] == "layers"
                else ""
            )
            found = (r["ratio"], f"{what.strip()}, {r['variant']}, {r['mode']}")
            best[r["table"]] = max(best.get(r["table"], found), found)
    return [
        f"best {table} {r:.2f}x dense ({what})" for table, (r, what) in best.items()
    ]


# -- speed: benchmarks/sparse_linear.py and benchmarks/train_steps.py ---------------------------
def target_layers(args: argparse.Namespace, timeout: float) -> Stage:
    if args.cpu_smoke:  # the emulation stands in for cuSPARSELt
        extra = ["--variants", "emulated, searched", "--compiled", "all"]
    else:
        extra = [
            "--variants",
            *TARGET_VARIANTS,
            "--shapes",
            *COMPILED,
            "--compiled",
            "all",
        ]
    return benchmark("sparse_linear", extra, args, timeout, "target layers")


def target_steps(args: argparse.Namespace, timeout: float) -> Stage:
    extra = ["--models", "llm", "--modes", "compiled"]
    return benchmark("train_steps", extra, args, timeout, "target steps")


def more_layers(args: argparse.Namespace, timeout: float) -> Stage:
    extra = ["--stages", "layers", "--compiled", "none"]
    return benchmark("sparse_linear", extra, args, timeout, "more layers")


def more_steps(args: argparse.Namespace, timeout: float) -> Stage:
    modes = ["eager"] if args.cpu_smoke else ["eager", "compiled"]
    extra = ["--models", *args.step_models, "--modes", *modes]
    return benchmark("train_steps", extra, args, timeout, "more steps")


# -- correctness: the in-process stages, each in a child process ----------------------------------
CHILD_STAGES = {
    "kernel check": kernel_checks,
    "verify_speed": verify_speed,
    "training": training,
}


def child(
    args: argparse.Namespace, timeout: float, name: str, isolate: bool | None = None
) -> Stage:
    """Run a stage of this script in a subprocess that stops itself a margin before ``timeout``
    (by default in this process on the CPU, where there is no CUDA context to poison)."""
    isolate = not args.cpu_smoke if isolate is None else isolate
    deadline = time.time() + timeout - min(30.0, 0.15 * timeout)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "stage.json"
        flags = ["--stage", name, "--result", str(result), "--deadline", str(deadline)]
        if not isolate:
            code, out = main([*args.argv, *flags]), ""
        else:
            code, out = run_command(
                [sys.executable, __file__, *args.argv, *flags], timeout
            )
        if result.exists():
            stage = Stage(**json.loads(result.read_text()))
        elif code is None:
            stage = Stage(name, "cut", f"killed after {timeout:.0f} s")
        else:
            stage = Stage(name, "failed", f"exit status {code}, no result")
    if stage.status != "passed" and out:
        stage.body += "\n\n" + tail(out, 40)
    return stage


STAGES = {
    "kernel check": lambda args, timeout: child(args, timeout, "kernel check"),
    "gpu tests": gpu_tests,
    "gpu compile tests": lambda args, timeout: gpu_tests(
        args, timeout, "gpu compile tests"
    ),
    "verify_speed": lambda args, timeout: child(args, timeout, "verify_speed"),
    "training": lambda args, timeout: child(args, timeout, "training"),
    "target layers": target_layers,
    "target steps": target_steps,
    "more layers": more_layers,
    "more steps": more_steps,
}


# -- the targets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A GPU target: ``find`` picks its number from the records (``None``: not measured);
    it holds when the number is at most ``limit`` (``at_most``) or at least ``limit``."""

    what: str
    limit: float
    at_most: bool
    unit: str
    find: Callable[[list[dict]], float | None]
    part: str = "speed"

    def row(self, records: list[dict]) -> list[str]:
        must = f"{'at most' if self.at_most else 'at least'} {self.limit:g} {self.unit}"
        value = self.find(records)
        if value is None:
            return [self.what, must, "-", "not run"]
        holds = value <= self.limit if self.at_most else value >= self.limit
        shown = "none kept sparse" if value == math.inf else f"{value:.3g} {self.unit}"
        return [self.what, must, shown, "PASS" if holds else "FAIL"]


def first(records: list[dict], key: str, **match: object) -> float | None:
    """``key`` of the first record matching every ``match``."""
    for r in records:
        if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None:
            return r[key]
    return None


def packing(weight: str) -> Callable[[list[dict]], float | None]:
    """Packing ``W`` and ``W.T`` of ``weight`` by the packer in use (the Triton kernels: at a
    stored mask, their packing alone), as a CUDA graph where it was captured."""

    def find(records: list[dict]) -> float | None:
        for match in (
            {"table": "packing", "what": "W and W.T"},
            {"table": "fused", "job": STORED.name},
        ):
            match.update(weight=weight, in_use=True)
            found = first(records, "graphed_ms", **match) or first(
                records, "eager_ms", **match
            )
            if found is not None:
                return found
        return None

    return find


def triton_mask_and_pack(key: str) -> Callable[[list[dict]], float | None]:
    """``key`` of the Triton kernels' mask + ``W`` and ``W.T`` packing at 11008x4096."""
    return lambda records: first(
        records, key, table="fused", weight="11008x4096", method=TRITON_MASK_AND_PACK
    )


def compiled_linear(tokens: int, fan_in: int, fan_out: int) -> Callable:
    return lambda records: first(
        records, "ratio", table="layers", tokens=tokens, in_features=fan_in,
        out_features=fan_out, kernel="cusparselt", algorithm="searched", mode="compiled",
        stored=False, fused=True,
    )  # fmt: skip


def slowest_kept_sparse(records: list[dict]) -> float | None:
    """Of the MLP layers ``verify_speed`` would keep on a 2:4 kernel in the training stage,
    the lowest dense / 2:4 time of the layer timed again inside the training steps (``inf``:
    none kept): a measurement independent of the one that made the choice."""
    timed = [r for r in records if r["table"] == "kept layers"]
    kept = [r["ratio"] for r in timed if r["kept_sparse"] and r["on_kernel"]]
    return min(kept, default=math.inf) if timed else None


LLM = WORKLOADS["llm"]()  # the block stack of the target (not the smoke run's)
TARGETS = [
    Target("packing W and W.T, 4096x1024 (packer in use, CUDA graph)", 0.1, True, "ms",
           packing("4096x1024")),
    Target("packing W and W.T, 11008x4096 (packer in use, CUDA graph)", 0.6, True, "ms",
           packing("11008x4096")),
    Target("mask + packing W and W.T, 11008x4096 (Triton kernels, one pass, CUDA graph)",
           0.1, True, "ms", triton_mask_and_pack("graphed_ms")),
    Target("the same, as a multiple of its memory-bound time (copy bandwidth, this run)",
           2.5, True, "x", triton_mask_and_pack("times_limit")),
    Target("runtime 2:4 linear fwd+bwd compiled, 16384x4096 -> 11008", 1.2, False, "x",
           compiled_linear(16384, 4096, 11008)),
    Target("runtime 2:4 linear fwd+bwd compiled, 32896x1024 -> 4096", 1.0, False, "x",
           compiled_linear(32896, 1024, 4096)),
    Target("LLM block stack training step, compiled", 1.1, False, "x",
           lambda records: first(records, "ratio", table="steps", label=LLM.label,
                                 mode="compiled", variant="2:4 MLPs")),
    Target("masked runtime mask step, 4096x1024 (greedy_2to4_mask, eager)", 0.1, True, "ms",
           lambda records: first(records, "eager_ms", table="mask", weight="4096x1024",
                                 function="greedy_2to4_mask")),
    Target("slowest layer verify_speed keeps on a 2:4 kernel, timed again in the training steps",
           1.0, False, "x", slowest_kept_sparse, "correctness"),
]  # fmt: skip


def target_rows(stages: list[Stage], part: str) -> list[list[str]]:
    """The rows of the targets ``part`` measures, from its stages' records."""
    records = [r for stage in stages for r in stage.records]
    return [target.row(records) for target in TARGETS if target.part == part]


# -- the report -----------------------------------------------------------------------------------
def report(
    stages: list[Stage], args: argparse.Namespace, seconds: float, verdict: str
) -> str:
    title = f"GPU acceptance, {args.part} part" + (
        ": a CPU smoke run (timings mean nothing)" if args.cpu_smoke else ""
    )
    command = shlex.join(["python", "benchmarks/gpu_acceptance.py", *args.argv])
    lines = [
        f"# {title}",
        "",
        (
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; `{command}`; "
            f"{seconds:.0f} s of a {args.time_budget:.0f} s budget. **{verdict}**"
        ),
        "",
        markdown_table(
            ["stage", "status", "seconds", "summary"],
            [
                [s.name, s.status, f"{s.seconds:.0f}", s.summary.replace("|", "/")]
                for s in stages
            ],
        ),
        "",
        f"The GPU targets the {args.part} part measures (bf16), from this run's numbers"
        + (" (a CPU smoke run: meaningless)" if args.cpu_smoke else "")
        + ":",
        "",
        markdown_table(
            ["target", "must", "measured", "verdict"], target_rows(stages, args.part)
        ),
    ]
    for i, stage in enumerate(stages, 1):
        lines += ["", f"## {i}. {stage.name}: {stage.status}", ""]
        lines += [f"- **{note}**" for note in stage.notes]
        lines += [""] if stage.notes else []
        lines.append(stage.body or stage.summary)
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=PARTS, required=True, help="correctness or speed"
    )
    parser.add_argument(
        "--out", type=Path, help="the report (default: acceptance-PART.md)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=BUDGET,
        help="seconds, all the part's stages",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument(
        "--batch", type=int, default=128, help="training images per step"
    )
    parser.add_argument(
        "--model", default="vit_base_patch16_224", help="timm model (training)"
    )
    parser.add_argument("--precision", default="bf16-mixed", help="Lightning precision")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument(
        "--stages", nargs="+", help="the part's stages to run (default: all)"
    )
    parser.add_argument(
        "--step-models",
        nargs="+",
        default=MORE_STEP_MODELS,
        choices=WORKLOADS,
        help="train_steps.py --models of the 'more steps' stage",
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on the CPU"
    )
    parser.add_argument("--stage", choices=CHILD_STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    unknown = set(args.stages or ()) - set(PARTS[args.part])
    if unknown:
        parser.error(
            f"--stages {sorted(unknown)} are not stages of --part {args.part}; "
            f"its stages: {list(PARTS[args.part])}"
        )
    args.stages = args.stages or list(PARTS[args.part])
    args.out = args.out or Path(f"acceptance-{args.part}.md")
    if args.cpu_smoke:
        args.steps, args.batch = min(args.steps, 4), min(args.batch, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.stage:  # a child: run one stage, write its result
        try:
            stage = CHILD_STAGES[args.stage](args, args.deadline)
        except Exception:  # noqa: BLE001 (reported as the stage's failure)
            stage = Stage(
                args.stage,
                "failed",
                "raised an exception",
                f"```\n{traceback.format_exc()}```",
            )
        args.result.write_text(json.dumps(asdict(stage)))
        return 0

    start = time.time()
    shares = PARTS[args.part]
    stages = [environment()]
    stages[0].seconds = time.time() - start
    problem = None if args.cpu_smoke else gpu_problem()
    if problem:
        verdict = f"Nothing measured: {problem}."
        stages += [
            Stage(name, "skipped", "needs a CUDA GPU of capability 8.0+")
            for name in shares
        ]
    else:
        spent = 0.0
        for name, share in shares.items():
            spent += share
            timeout = start + spent * args.time_budget - time.time()
            if name not in args.stages:
                stage = Stage(name, "skipped", "not selected (--stages)")
            elif timeout < 10:
                stage = Stage(
                    name, "cut", f"skipped: {timeout:.0f} s left of its share"
                )
            else:
                print(f"[gpu_acceptance] {name} (up to {timeout:.0f} s)", flush=True)
                began = time.time()
                stage = STAGES[name](args, timeout)
                stage.seconds = time.time() - began
            stages.append(stage)
        failed = [s.name for s in stages if s.status == "failed"]
        cut = [s.name for s in stages if s.status == "cut"]
        verdict = (
            f"FAILED: {', '.join(failed)}." if failed else "All stages passed."
        ) + (f" Cut short by the time budget: {', '.join(cut)}." if cut else "")
    args.out.write_text(report(stages, args, time.time() - start, verdict))
    print(f"[gpu_acceptance] {verdict} Report: {args.out}", flush=True)
    return 1 if any(s.status == "failed" for s in stages) else 0


if __name__ == "__main__":
    sys.exit(main())
