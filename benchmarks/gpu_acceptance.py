"""One-command GPU acceptance: the GPU tests, the 2:4 benchmarks and a short training comparison.

    PYTHONPATH=. python benchmarks/gpu_acceptance.py --out report.md [--time-budget 540]
    PYTHONPATH=. python benchmarks/gpu_acceptance.py --cpu-smoke --out smoke.md  # checks the script

On a CUDA GPU of compute capability 8.0+ it runs these stages and writes one Markdown report:

1. environment: versions of Python, torch (CUDA, cuSPARSELt), Lightning, timm; the GPU;
2. kernel check: each 2:4 kernel's check on this GPU in bf16 and fp16 (verdict, error,
   versions) and whether our cuSPARSELt packer writes the bytes of ``torch._cslt_compress``;
3. GPU tests: ``pytest -m gpu`` over the test files that hold GPU-marked tests;
4. ``benchmarks/sparse_linear.py``: the masked runtime mask step, packing W and W.T by both
   packers, and 2:4 linear layers vs dense (cuSPARSELt algorithm 0 and searched, masked),
   eager and compiled;
5. ``benchmarks/train_steps.py``: training steps of an LLM block stack and ViT-B/16 (``vit-l``
   by ``--step-models``), dense vs 2:4 MLPs, eager and compiled;
6. ``verify_speed``: what ``backend="auto", verify_speed=True`` decides for a few MLP shapes,
   timed eagerly and as CUDA graphs (a model compiled with ``mode="reduce-overhead"``);
7. training: a timm ViT (``vit_base_patch16_224``, random init, ``bf16-mixed``) trained with
   Lightning on synthetic images made on the GPU, dense vs 2:4 ``runtime`` on the MLP linears
   (``backend="auto"``): median step time, peak memory, loss along the run, the backend table.

The report opens with the GPU targets of issues 28 and 29 (H100, bf16) and, for each, PASS or
FAIL from this run's measurements, or "not run":

- packing W and W.T (the packer in use, as a CUDA graph): at most 0.1 ms at 4096x1024 and
  0.6 ms at 11008x4096;
- the runtime 2:4 MLP linear, forward + backward compiled (searched algorithm): at least 1.2x
  dense at 16384x4096->11008 and 1.0x at 32896x1024->4096;
- the LLM block stack's training step, compiled: at least 1.1x dense;
- the masked runtime mask step of a 4096x1024 weight: at most 0.1 ms;
- nothing ``verify_speed`` keeps sparse is slower than dense.

Stages 2-7 each run in a subprocess (a CUDA error in one cannot poison the next; with
``--cpu-smoke``, stages 2, 6 and 7 run in this process) with a share of ``--time-budget``:
time an earlier stage leaves unused passes to the later ones. A stage about to run out of time
stops cleanly (the benchmarks skip what is left, training stops early, and they say so); one
that overruns its share is killed, and the report says what was cut. ``--stages`` picks stages
(the others are reported as not selected). Defaults fit 9 minutes on one H100.

It needs only torch, lightning, timm, torchmetrics, numba and pytest (no jsonargparse, no
hypothesis, no network): run it from the checkout with ``PYTHONPATH=.``. Without a CUDA GPU of
capability 8.0+ it writes a report saying so and exits 0. ``--cpu-smoke`` runs every stage's
plumbing on the CPU with tiny settings (the test suite calls it); its numbers mean nothing.
Exit status: 1 if a stage failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an install

from common import (
    TINY_VIT,
    available_kernels,
    cuda_problem,
    kernel_check_table,
    markdown_table,
)
from sparse_linear import COMPILED
from train_steps import WORKLOADS

MLP_PARAMS = ["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"]
# (layer, out_features, in_features): ViT-L/14 and ViT-B/16 MLPs, and a shape no kernel takes
SPEED_SHAPES = [
    ("ViT-L MLP fc1", 4096, 1024),
    ("ViT-L MLP fc2", 1024, 4096),
    ("ViT-B MLP fc1", 3072, 768),
    ("ViT-B MLP fc2", 768, 3072),
    ("odd shape", 1000, 1000),
]
SMOKE_SPEED_SHAPES = [("smoke fc1", 256, 128), ("odd shape", 100, 100)]
# Share of the time budget per subprocess stage (the environment stage runs in this process).
SHARES = {
    "kernel check": 0.03,
    "gpu tests": 0.20,
    "sparse_linear": 0.20,
    "train_steps": 0.27,
    "verify_speed": 0.06,
    "training": 0.24,
}
STEP_MODELS = ["llm", "vit-b"]  # train_steps.py's vit-l: by --step-models
BF16 = torch.bfloat16
OPTIONAL = ("jsonargparse", "hypothesis")  # never needed here; reported when present


@dataclass
class Stage:
    """One stage's outcome: ``passed``, ``failed``, ``cut`` (ran out of time) or ``skipped``."""

    name: str
    status: str = "skipped"
    summary: str = ""
    body: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    """Measurements as the benchmarks' JSON records, for the targets."""


# -- stage 1: environment (in this process) ------------------------------------------------------
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
def run_command(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` from the checkout; ``(exit status, output)``, status ``None`` if it was
    killed at ``timeout`` seconds (with what it printed until then)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
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


# -- stage 2: the GPU tests -----------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """The test files holding GPU-marked tests (the others need not import on a bare machine)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def gpu_tests(args: argparse.Namespace, timeout: float) -> Stage:
    files = gpu_test_files()
    # -m gpu overrides the 'not slow' of pyproject's addopts; its doctests need not run here
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-v", "-rfE"]
    cmd += [
        "-p",
        "no:cacheprovider",
        *(["--collect-only", "-q"] if args.cpu_smoke else []),
        *files,
    ]
    code, out = run_command(cmd, timeout)
    counts = {
        word.rstrip("s") if word == "errors" else word: int(n)
        for n, word in re.findall(
            r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
            last_summary(out),
        )
    }
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    failures = [
        line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    stage = Stage("gpu tests")
    shown = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no summary"
    if collected and "passed" not in counts:
        shown = f"{collected.group(1)} collected, {shown}"
    stage.summary = f"{len(files)} files: {shown}"
    if code is None:
        stage.status = "cut"
        stage.summary += f"; killed after {timeout:.0f} s"
    elif code != 0:
        stage.status = "failed"
        stage.summary += f"; pytest exit status {code}"
    elif not args.cpu_smoke and counts.get("passed", 0) == 0:
        stage.status = "failed"
        stage.summary += "; no GPU test passed (all skipped?)"
    else:
        stage.status = "passed"
    body = [f"`{' '.join(['pytest', *cmd[3:]])}`", ""]
    if failures:
        body += ["Failed:", "", *(f"- `{line}`" for line in failures), ""]
    stage.body = "\n".join([*body, tail(out, 60)])
    return stage


def last_summary(out: str) -> str:
    lines = [line for line in out.splitlines() if re.search(r" in [\d.]+s", line)]
    return lines[-1] if lines else ""


# -- stages 4 and 5: benchmarks/sparse_linear.py and benchmarks/train_steps.py ------------------
def benchmark(
    script: str, extra: list[str], args: argparse.Namespace, timeout: float
) -> Stage:
    """Run ``benchmarks/<script>.py`` with a time limit a margin before ``timeout``; its tables
    and its JSON records (what it measured before a kill, too)."""
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
    stage = Stage(script, summary=f"{len(records)} measurements", records=records)
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


def sparse_linear(args: argparse.Namespace, timeout: float) -> Stage:
    return benchmark(
        "sparse_linear", ["--compiled", *args.compiled_shapes], args, timeout
    )


def train_steps(args: argparse.Namespace, timeout: float) -> Stage:
    models = ["llm"] if args.cpu_smoke else args.step_models  # the target's model
    return benchmark("train_steps", ["--models", *models], args, timeout)


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


# -- stage 2: the kernel check (in a child process) -----------------------------------------------
def kernel_checks(args: argparse.Namespace, deadline: float) -> Stage:
    from lightning_sparse.backends.cusparselt import packer_matches
    from lightning_sparse.backends.kernel_check import check_kernel
    from lightning_sparse.backends.semi_structured import INFERENCE

    if args.cpu_smoke:  # the emulation: the check's plumbing only
        device, dtypes, kernels = torch.device("cpu"), [torch.float32], ["cusparselt"]
    else:
        device, dtypes = torch.device("cuda"), [BF16, torch.float16]
        kernels = [*available_kernels(device), INFERENCE]
    verdicts = [check_kernel(k, d, device) for k in kernels for d in dtypes]
    lines = [kernel_check_table()]
    if device.type == "cuda" and "cusparselt" in kernels:
        packers = [
            [
                str(d).removeprefix("torch."),
                "yes" if packer_matches(d, device) else "no",
            ]
            for d in dtypes
        ]
        header = ["dtype", "lightning_sparse packer = torch._cslt_compress bytes"]
        lines += ["", markdown_table(header, packers)]
    failed = [v.reason for v in verdicts if not v.passed]
    stage = Stage(
        "kernel check", "failed" if failed else "passed", body="\n".join(lines)
    )
    stage.summary = f"{len(verdicts) - len(failed)}/{len(verdicts)} checks passed"
    stage.notes += failed
    return stage


# -- stage 6: verify_speed (in a child process) ---------------------------------------------------
def verify_speed(args: argparse.Namespace, deadline: float) -> Stage:
    from torch import nn

    from lightning_sparse.backends import choose_backend
    from lightning_sparse.backends.speed import TIMINGS, VERIFY_TOKENS, SpeedCheck
    from lightning_sparse.masks import NM

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    tokens = 32 if args.cpu_smoke else VERIFY_TOKENS
    rows, stage = [], Stage("verify_speed", "passed")
    shapes = SMOKE_SPEED_SHAPES if args.cpu_smoke else SPEED_SHAPES
    for timing in TIMINGS:  # as an eager model runs, and one compiled with CUDA graphs
        check = SpeedCheck(tokens=tokens, timing=timing)
        for label, out_features, in_features in shapes:
            if time.time() > deadline:
                stage.status = "cut"
                stage.notes.append(f"out of time before {label} ({timing})")
                break
            # float32 weights and bfloat16 matmuls, as under precision="bf16-mixed"
            layer = nn.Linear(in_features, out_features, device=device)
            owners = [(label, layer, "weight")]
            choice = choose_backend("auto", NM(2, 4), layer.weight, owners, BF16, check)
            if (
                args.cpu_smoke
            ):  # no kernel on the CPU: time the emulation, to check the rest
                check(layer.weight, "emulated", torch.float32)
            shape = tuple(layer.weight.shape)
            measured = [
                (key[2], m) for key, m in check.results.items() if key[0] == shape
            ]
            stage.records += [
                {"table": "verify_speed", "layer": label, "kernel": kernel,
                 "timing": timing, "ratio": m.ratio,
                 "kept_sparse": choice.name == "semi_structured" and kernel == choice.kernel}
                for kernel, m in measured
            ]  # fmt: skip
            rows.append(
                [
                    label,
                    f"{out_features}x{in_features}",
                    timing,
                    ", ".join(f"{m.ratio:.2f}x" for _, m in measured) or "-",
                    choice.name,
                    choice.reason,
                ]
            )
            no_kernel = choice.kernel is None and "kept dense" not in choice.reason
            if (
                label.startswith("ViT-L") and no_kernel
            ):  # the shapes the kernels are for
                stage.status = "failed"
                stage.notes.append(f"{label}: no 2:4 kernel ({choice.reason})")
    header = [
        "layer",
        "weight",
        "timing",
        "sparse speed (dense time / sparse)",
        "backend",
    ]
    header.append("why")
    stage.body = (
        f"`choose_backend('auto', 2:4, ..., bf16, SpeedCheck(tokens={tokens}, timing=...))` "
        f"per layer: what `SparsityCallback(backend='auto', verify_speed=True)` decides at fit "
        f"start for a model run eagerly, and for one compiled with CUDA graphs.\n\n"
        + markdown_table(header, rows)
    )
    kept = sum(row[4] == "semi_structured" for row in rows)
    stage.summary = f"{kept}/{len(rows)} (shape, timing) pairs on the 2:4 kernel"
    return stage


# -- stage 7: training comparison (in a child process) --------------------------------------------
def training(args: argparse.Namespace, deadline: float) -> Stage:
    import lightning as L
    import timm
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_sparse import SparsityCallback

    cuda = not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    model_kwargs = TINY_VIT if args.cpu_smoke else {}
    size = model_kwargs.get("img_size", 224)
    classes = 10

    class SyntheticImages(L.LightningModule):
        """Noisy copies of one fixed low-frequency image per class, made on the device; batch
        ``i`` is the same in every run."""

        def __init__(self) -> None:
            super().__init__()
            self.model = timm.create_model(
                args.model, pretrained=False, num_classes=classes, **model_kwargs
            )
            gen = torch.Generator().manual_seed(0)
            coarse = torch.randn(
                classes, 3, max(size // 16, 2), max(size // 16, 2), generator=gen
            )
            self.register_buffer("templates", F.interpolate(coarse, size=(size, size)))

        def training_step(self, index: int, _: int) -> torch.Tensor:
            gen = torch.Generator(self.device).manual_seed(int(index))
            labels = torch.randint(
                classes, (args.batch,), generator=gen, device=self.device
            )
            noise = torch.randn(
                args.batch, 3, size, size, generator=gen, device=self.device
            )
            return F.cross_entropy(
                self.model(self.templates[labels] + 2 * noise), labels
            )

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                self.parameters(), lr=args.lr, weight_decay=0.05, fused=cuda
            )

    class StepClock(Callback):
        """Time from one step's start to the next's (synchronised, so every hook of the step
        counts) and each step's loss; stops the run at ``stop_at``."""

        def __init__(self, stop_at: float) -> None:
            self.stop_at, self.cut, self.last = stop_at, False, None
            self.times: list[float] = []
            self.losses: list[float] = []

        def tick(self, *_) -> None:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

        on_train_batch_start = on_train_end = tick

        def on_train_batch_end(self, trainer, pl_module, outputs, *_) -> None:
            self.losses.append(float(outputs["loss"]))
            if time.time() > self.stop_at:
                trainer.should_stop, self.cut = True, True

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)

    def run(label: str, steps: int, stop_at: float) -> dict:
        torch.manual_seed(0)
        model = SyntheticImages()
        clock = StepClock(stop_at)
        callbacks: list[Callback] = [clock]
        sparsity = None
        if label != "dense":
            sparsity = SparsityCallback(
                phases=[{"sparsity": "2:4", "algorithm": "runtime"}],
                params=MLP_PARAMS,
                backend="masked" if args.cpu_smoke else "auto",
            )
            callbacks.append(sparsity)
        trainer = L.Trainer(
            accelerator=device.type, devices=1, precision=args.precision, max_steps=steps,
            max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        del lines[:]
        trainer.fit(model, DataLoader(range(steps), batch_size=None))
        result = {
            "label": label,
            "times": clock.times,
            "losses": clock.losses,
            "cut": clock.cut,
            "peak": torch.cuda.max_memory_allocated() if cuda else None,
            "table": "\n".join(
                line for line in lines if line.startswith("SparsityCallback '")
            ),
            "backends": (
                [c.name for c in sparsity.sparsifier.backends.values()]
                if sparsity
                else []
            ),
        }
        del trainer, model, callbacks, sparsity
        gc.collect()
        return result

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    start = time.time()
    try:
        dense = run("dense", args.steps, start + (deadline - start) / 2)
        steps = len(dense["times"])  # the sparse run takes as many steps as dense got
        if not steps:
            return Stage("training", "cut", "no dense step finished in its time")
        sparse = run("2:4 runtime (MLPs)", steps, deadline)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    return training_report(args, dense, sparse)


def training_report(args: argparse.Namespace, dense: dict, sparse: dict) -> Stage:
    warm = min(20, len(dense["times"]) // 5)
    rows, medians = [], {}
    for run in (dense, sparse):
        timed = run["times"][warm:] or run["times"]
        medians[run["label"]] = ms = (
            statistics.median(timed) * 1e3 if timed else math.nan
        )
        peak = f"{run['peak'] / 2**30:.2f}" if run["peak"] is not None else "-"
        rows.append(
            [
                run["label"],
                str(len(run["times"])) + (" (cut)" if run["cut"] else ""),
                f"{ms:.1f}",
                f"{medians['dense'] / ms:.2f}x",
                f"{args.batch / ms * 1e3:.0f}",
                peak,
            ]
        )
    header = [
        "run",
        "steps",
        "median ms/step",
        "speed vs dense",
        "images/s",
        "peak GiB",
    ]
    steps = min(len(dense["losses"]), len(sparse["losses"]))
    points = (
        sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1}) if steps else []
    )
    loss_rows = [
        [str(i + 1), f"{dense['losses'][i]:.4f}", f"{sparse['losses'][i]:.4f}"]
        for i in points
    ]
    window = max(1, min(10, steps))
    last = [
        statistics.mean(run["losses"][steps - window : steps])
        for run in (dense, sparse)
    ]
    loss_rows.append([f"mean of last {window}", f"{last[0]:.4f}", f"{last[1]:.4f}"])
    model = f"`{args.model}`" + (f" {TINY_VIT}" if args.cpu_smoke else "")
    body = [
        (
            f"{model}, random init, {args.precision}, batch {args.batch}, AdamW lr {args.lr}, "
            f"{args.steps} steps requested; synthetic 10-class images made on the device. "
            f"Median step time after {warm} warm-up steps (synchronised), peak "
            f"`torch.cuda.max_memory_allocated`."
        ),
        "",
        markdown_table(header, rows),
        "",
        "Loss (step: dense, 2:4):",
        "",
        markdown_table(["step", "dense", "2:4 runtime"], loss_rows),
        "",
        "Backend table printed by the callback at fit start:",
        "",
        "```",
        sparse["table"] or "(none printed)",
        "```",
    ]
    stage = Stage("training", "passed", body="\n".join(body))
    ratio = medians["dense"] / medians[sparse["label"]]
    kernel = sum(name == "semi_structured" for name in sparse["backends"])
    stage.summary = (
        f"2:4 step {ratio:.2f}x dense speed, {kernel}/{len(sparse['backends'])} MLP weights "
        f"on 2:4 kernels, loss {last[0]:.3f} dense / {last[1]:.3f} 2:4"
    )
    if not all(math.isfinite(x) for x in dense["losses"] + sparse["losses"]):
        stage.status = "failed"
        stage.notes.append("a loss was not finite")
    if not args.cpu_smoke and kernel == 0:
        stage.status = "failed"
        stage.notes.append("no MLP weight ran on a 2:4 kernel (see the backend table)")
    if dense["cut"] or sparse["cut"]:
        stage.status = "cut" if stage.status == "passed" else stage.status
        stage.notes.append(
            f"stopped at the time limit after {steps} steps of {args.steps}"
        )
    return stage


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
    "sparse_linear": sparse_linear,
    "train_steps": train_steps,
    "verify_speed": lambda args, timeout: child(args, timeout, "verify_speed"),
    "training": lambda args, timeout: child(args, timeout, "training"),
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
    def find(records: list[dict]) -> float | None:
        match = {
            "table": "packing",
            "weight": weight,
            "in_use": True,
            "what": "W and W.T",
        }
        return first(records, "graphed_ms", **match) or first(
            records, "eager_ms", **match
        )

    return find


def compiled_linear(tokens: int, fan_in: int, fan_out: int) -> Callable:
    return lambda records: first(
        records, "ratio", table="layers", tokens=tokens, in_features=fan_in,
        out_features=fan_out, kernel="cusparselt", algorithm="searched", mode="compiled",
        stored=False,
    )  # fmt: skip


def slowest_kept_sparse(records: list[dict]) -> float | None:
    """The lowest speed-up of a shape ``verify_speed`` kept on a 2:4 kernel (``inf``: none)."""
    checked = [r for r in records if r["table"] == "verify_speed"]
    kept = [r["ratio"] for r in checked if r["kept_sparse"]]
    return min(kept, default=math.inf) if checked else None


LLM = WORKLOADS["llm"]()  # the block stack of the target (not the smoke run's)
TARGETS = [
    Target("packing W and W.T, 4096x1024 (packer in use, CUDA graph)", 0.1, True, "ms",
           packing("4096x1024")),
    Target("packing W and W.T, 11008x4096 (packer in use, CUDA graph)", 0.6, True, "ms",
           packing("11008x4096")),
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
    Target("slowest layer verify_speed keeps on a 2:4 kernel", 1.0, False, "x",
           slowest_kept_sparse),
]  # fmt: skip


def target_rows(stages: list[Stage]) -> list[list[str]]:
    records = [r for stage in stages for r in stage.records]
    return [target.row(records) for target in TARGETS]


# -- the report -----------------------------------------------------------------------------------
def report(
    stages: list[Stage], args: argparse.Namespace, seconds: float, verdict: str
) -> str:
    title = (
        "CPU smoke run (timings mean nothing)" if args.cpu_smoke else "GPU acceptance"
    )
    lines = [
        f"# {title}",
        "",
        (
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; `{' '.join(['python', 'benchmarks/gpu_acceptance.py', *args.argv])}`; "
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
        "GPU targets (issues 28 and 29; H100, bf16), from this run's measurements"
        + (" (a CPU smoke run: meaningless)" if args.cpu_smoke else "")
        + ":",
        "",
        markdown_table(["target", "must", "measured", "verdict"], target_rows(stages)),
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
        "--out", type=Path, default=Path("gpu_acceptance.md"), help="the report"
    )
    parser.add_argument(
        "--time-budget", type=float, default=540.0, help="seconds, all stages"
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument(
        "--batch", type=int, default=128, help="training images per step"
    )
    parser.add_argument(
        "--model", default="vit_base_patch16_224", help="timm model (training)"
    )
    parser.add_argument("--precision", default="bf16-mixed", help="Lightning precision")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument(
        "--stages", nargs="+", choices=SHARES, default=list(SHARES), help="what to run"
    )
    parser.add_argument(
        "--step-models", nargs="+", default=STEP_MODELS, help="train_steps.py --models"
    )
    parser.add_argument(
        "--compiled-shapes",
        nargs="+",
        default=COMPILED,
        help="sparse_linear.py --compiled (layer label substrings, 'all' or 'none')",
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
    stages = [environment()]
    stages[0].seconds = time.time() - start
    problem = None if args.cpu_smoke else gpu_problem()
    if problem:
        verdict = f"Nothing measured: {problem}."
        stages += [
            Stage(name, "skipped", "needs a CUDA GPU of capability 8.0+")
            for name in SHARES
        ]
    else:
        spent = 0.0
        for name, share in SHARES.items():
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
