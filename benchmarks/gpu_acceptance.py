"""One-command GPU acceptance: the GPU tests, the 2:4 benchmarks and a short training comparison.

    PYTHONPATH=. python benchmarks/gpu_acceptance.py --out report.md [--time-budget 540]
    PYTHONPATH=. python benchmarks/gpu_acceptance.py --cpu-smoke --out smoke.md  # checks the script

On a CUDA GPU of compute capability 8.0+ it runs five stages and writes one Markdown report:

1. environment: versions of Python, torch (CUDA, cuSPARSELt), Lightning, timm; the GPU;
2. GPU tests: ``pytest -m gpu`` over the test files that hold GPU-marked tests;
3. ``benchmarks/sparse_linear.py``: 2:4 linear layers and a ViT-L/14 step vs dense;
4. ``verify_speed``: what ``backend="auto", verify_speed=True`` decides for a few MLP shapes;
5. training: a timm ViT (``vit_base_patch16_224``, random init, ``bf16-mixed``) trained with
   Lightning on synthetic images made on the GPU, dense vs 2:4 ``runtime`` on the MLP linears
   (``backend="auto"``): median step time, peak memory, loss along the run, the backend table.

Stages 2-5 each run in a subprocess (a CUDA error in one cannot poison the next; with
``--cpu-smoke``, stages 4-5 run in this process) with a share of ``--time-budget``: time an
earlier stage leaves unused passes to the later ones. A stage about
to run out of time stops cleanly (training stops early, and says so); one that overruns its
share is killed, and the report says what was cut. Defaults fit 9 minutes on one H100.

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an install

from common import markdown_table

from lightning_sparse.backends import capability

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
TINY_VIT = {
    "img_size": 32,
    "patch_size": 8,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 2,
}
# Share of the time budget per subprocess stage (the environment stage runs in this process).
SHARES = {
    "gpu tests": 0.30,
    "sparse_linear": 0.22,
    "verify_speed": 0.08,
    "training": 0.40,
}
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


# -- stage 1: environment (in this process) ------------------------------------------------------
def gpu_problem() -> str | None:
    """Why this machine cannot run the GPU stages, or ``None``."""
    if torch.version.hip is not None:
        return "a ROCm build of torch: the 2:4 kernels used here are NVIDIA-only"
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU found (2:4 sparse tensor cores need compute capability 8.0+)"
        )
    found = torch.cuda.get_device_capability()
    if found < capability.AMPERE:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {found[0]}.{found[1]}, not 8.0+"
    return None


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


# -- stage 3: benchmarks/sparse_linear.py ---------------------------------------------------------
def sparse_linear(args: argparse.Namespace, timeout: float) -> Stage:
    script = str(Path(__file__).with_name("sparse_linear.py"))
    smoke = ["--cpu-smoke", "--no-step"]
    extra = smoke if args.cpu_smoke else ["--repeats", "10", "--warmup", "3"]
    code, out = run_command([sys.executable, script, *extra], timeout)
    kept = [
        line
        for line in out.splitlines()
        if line.startswith(("|", "torch ")) or not line.strip()
    ]
    tables = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    rows = [cells(line) for line in kept if line.startswith("| ") and "---" not in line]
    rows = [row for row in rows if row[0] != "workload"]  # not the headers
    stage = Stage("sparse_linear", summary=f"{len(rows)} table rows")
    if code is None:
        stage.status = "cut"
        stage.summary += f"; killed after {timeout:.0f} s"
    elif code != 0 or "needs CUDA" in out or not rows:
        stage.status, stage.summary = "failed", f"exit status {code}; no table"
    else:
        stage.status = "passed"
        stage.summary += "".join(f"; {best}" for best in best_speedups(rows))
    command = f"`python benchmarks/sparse_linear.py {' '.join(extra)}`"
    output = tail(out, 30) if stage.status != "passed" else ""
    stage.body = "\n\n".join(filter(None, [command, tables, output]))
    return stage


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def best_speedups(rows: list[list[str]]) -> list[str]:
    """The best 2:4 kernel speed-up over dense of a linear layer, and of the ViT-L step."""
    best = {}
    for workload, variant, _, ratio in (row for row in rows if len(row) == 4):
        if "2:4" in variant and "masked" not in variant and ratio.endswith("x"):
            kind = "step" if "step" in workload else "linear"
            found = (float(ratio[:-1]), workload, variant)
            best[kind] = max(best.get(kind, found), found)
    return [
        f"best {kind} {r:.2f}x dense ({w}, {v})" for kind, (r, w, v) in best.items()
    ]


# -- stage 4: verify_speed (in a child process) ---------------------------------------------------
def verify_speed(args: argparse.Namespace, deadline: float) -> Stage:
    from torch import nn

    from lightning_sparse.backends import choose_backend
    from lightning_sparse.backends.speed import VERIFY_TOKENS, SpeedCheck
    from lightning_sparse.masks import NM

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    tokens = 32 if args.cpu_smoke else VERIFY_TOKENS
    check = SpeedCheck(tokens=tokens)
    rows, stage = [], Stage("verify_speed", "passed")
    for label, out_features, in_features in (
        SMOKE_SPEED_SHAPES if args.cpu_smoke else SPEED_SHAPES
    ):
        if time.time() > deadline:
            stage.status = "cut"
            stage.notes.append(f"out of time before {label}")
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
        ratios = [
            f"{m.ratio:.2f}x" for key, m in check.results.items() if key[0] == shape
        ]
        rows.append(
            [
                label,
                f"{out_features}x{in_features}",
                ", ".join(ratios) or "-",
                choice.name,
                choice.reason,
            ]
        )
        no_kernel = choice.kernel is None and "kept dense" not in choice.reason
        if label.startswith("ViT-L") and no_kernel:  # the shapes the kernels are for
            stage.status = "failed"
            stage.notes.append(f"{label}: no 2:4 kernel ({choice.reason})")
    header = ["layer", "weight", "sparse speed (dense time / sparse)", "backend", "why"]
    stage.body = (
        f"`choose_backend('auto', 2:4, ..., bf16, SpeedCheck(tokens={tokens}))` per layer: what "
        f"`SparsityCallback(backend='auto', verify_speed=True)` decides at fit start.\n\n"
        + markdown_table(header, rows)
    )
    kept = sum(row[3] == "semi_structured" for row in rows)
    stage.summary = f"{kept}/{len(rows)} shapes on the 2:4 kernel"
    return stage


# -- stage 5: training comparison (in a child process) --------------------------------------------
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


CHILD_STAGES = {"verify_speed": verify_speed, "training": training}


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
    "gpu tests": gpu_tests,
    "sparse_linear": sparse_linear,
    "verify_speed": lambda args, timeout: child(args, timeout, "verify_speed"),
    "training": lambda args, timeout: child(args, timeout, "training"),
}


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
            if timeout < 10:
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
