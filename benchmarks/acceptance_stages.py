"""The GPU acceptance's in-process stages: the kernel check, what ``verify_speed`` decides, and
a short training comparison (dense, 2:4 masked math, 2:4 kernels) that also times each MLP
layer inside the steps, to check verify_speed's choices independently. ``gpu_acceptance.py``
runs each in a child process of its own on a GPU, so a CUDA error in one cannot poison the
next."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
from common import TINY_VIT, available_kernels, kernel_check_table, markdown_table
from lightning.pytorch.callbacks import Callback

MLP_PARAMS = ["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"]
BF16 = torch.bfloat16


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


# -- the kernel check -----------------------------------------------------------------------------
def kernel_checks(args: argparse.Namespace, deadline: float) -> Stage:
    from lightning_sparse.backends.cusparselt import packer
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
            [str(d).removeprefix("torch."), packer(d, device).note()] for d in dtypes
        ]
        header = ["dtype", "cuSPARSELt packer (compared with torch._cslt_compress)"]
        lines += ["", markdown_table(header, packers)]
    failed = [v.reason for v in verdicts if not v.passed]
    stage = Stage(
        "kernel check", "failed" if failed else "passed", body="\n".join(lines)
    )
    stage.summary = f"{len(verdicts) - len(failed)}/{len(verdicts)} checks passed"
    stage.notes += failed
    return stage


# -- verify_speed ---------------------------------------------------------------------------------
# (layer, out_features, in_features, tokens): ViT-L/14 MLPs at the DINOv2 recipe's student
# matmul (64 images x 2 global crops x 257 tokens), ViT-B/16 MLPs at batch 128 x 197, a shape
# no kernel takes
SPEED_SHAPES = [
    ("ViT-L MLP fc1", 4096, 1024, 32896),
    ("ViT-L MLP fc2", 1024, 4096, 32896),
    ("ViT-B MLP fc1", 3072, 768, 25216),
    ("ViT-B MLP fc2", 768, 3072, 25216),
    ("odd shape", 1000, 1000, 8192),
]
SMOKE_SPEED_SHAPES = [("smoke fc1", 256, 128, 32), ("odd shape", 100, 100, 32)]


def verify_speed(args: argparse.Namespace, deadline: float) -> Stage:
    from torch import nn

    from lightning_sparse.backends import choose_backend
    from lightning_sparse.backends.speed import TIMINGS, SpeedCheck
    from lightning_sparse.masks import NM

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    rows, stage = [], Stage("verify_speed", "passed")
    shapes = SMOKE_SPEED_SHAPES if args.cpu_smoke else SPEED_SHAPES
    for timing in TIMINGS:  # as an eager model runs, and one compiled with CUDA graphs
        for label, out_features, in_features, tokens in shapes:
            if time.time() > deadline:
                stage.status = "cut"
                stage.notes.append(f"out of time before {label} ({timing})")
                break
            check = SpeedCheck(tokens=tokens, timing=timing)
            # float32 weights and bfloat16 matmuls, as under precision="bf16-mixed"
            layer = nn.Linear(in_features, out_features, device=device)
            owners = [(label, layer, "weight")]
            choice = choose_backend("auto", NM(2, 4), layer.weight, owners, BF16, check)
            if (
                args.cpu_smoke
            ):  # no kernel on the CPU: time the emulation, to check the rest
                check(layer.weight, "emulated", torch.float32)
            measured = [(key[2], m) for key, m in check.results.items()]
            stage.records += [
                {"table": "verify_speed", "layer": label, "kernel": kernel,
                 "timing": timing, "tokens": tokens, "ratio": m.ratio,
                 "kept_sparse": choice.name == "semi_structured" and kernel == choice.kernel}
                for kernel, m in measured
            ]  # fmt: skip
            rows.append(
                [
                    label,
                    f"{out_features}x{in_features}",
                    str(tokens),
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
    header = ["layer", "weight", "tokens", "timing", "sparse speed (dense / sparse)"]
    header += ["backend", "why"]
    stage.body = (
        "`choose_backend('auto', 2:4, ..., bf16, SpeedCheck(tokens, timing))` per layer: what "
        "`SparsityCallback(backend='auto')` (verify_speed on, `verify_speed_tokens` as shown) "
        "decides at fit start for a model run eagerly, and for one compiled with CUDA graphs.\n\n"
        + markdown_table(header, rows)
    )
    kept = sum(row[5] == "semi_structured" for row in rows)
    stage.summary = f"{kept}/{len(rows)} (shape, timing) pairs on the 2:4 kernel"
    return stage


# -- training: dense, 2:4 masked math, 2:4 kernels -------------------------------------------------
RUNS = [
    ("dense", None),
    ("2:4 masked (MLPs)", "masked"),
    ("2:4 kernels (MLPs)", "auto"),
]
"""The three runs: label and backend (``None``: no SparsityCallback)."""
FIRST_LOSS_TOLERANCE, LAST_LOSS_TOLERANCE = 0.01, 0.05
"""How far the 2:4 kernel run's loss may stray from the masked run's (the same function):
relative difference of the first step's loss, and of the mean of the last steps'."""


def training(args: argparse.Namespace, deadline: float) -> Stage:
    import lightning as L
    import timm
    import torch.nn.functional as F
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

    def run(label: str, backend: str | None, steps: int, stop_at: float) -> dict:
        torch.manual_seed(0)
        model = SyntheticImages()
        clock = StepClock(stop_at)
        callbacks: list[Callback] = [clock]
        sparsity = None
        clock_layers = LayerClock(cuda)
        callbacks.append(clock_layers)
        if (
            backend is not None
        ):  # the kernels whatever verify_speed would decide: see below
            sparsity = SparsityCallback(
                phases=[{"sparsity": "2:4", "algorithm": "runtime"}],
                params=MLP_PARAMS,
                backend=backend,
                verify_speed=False,
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
                {name: c.name for (_, name), c in sparsity.sparsifier.backends.items()}
                if sparsity
                else {}
            ),
            "layers": clock_layers.result(warm=min(20, len(clock.times) // 5)),
        }
        del trainer, model, callbacks, sparsity
        gc.collect()
        return result

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    start = time.time()
    runs: list[dict] = []
    steps = args.steps
    try:
        for i, (label, backend) in enumerate(RUNS, 1):
            stop_at = start + (deadline - start) * i / len(RUNS)
            runs.append(run(label, backend, steps, stop_at))
            steps = len(runs[0]["times"])  # the later runs take as many as dense got
            if not steps:
                return Stage("training", "cut", "no dense step finished in its time")
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    stage = training_report(args, runs)
    kept_layers(stage, args, runs, device)
    return stage


class LayerClock(Callback):
    """Each MLP linear's forward + backward time in every training step, as the step runs it:
    CUDA events recorded by the layer's hooks on a GPU, the wall clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stamps: dict[str, list[list]] = {}
        self.shapes: dict[str, tuple[int, int, int]] = {}  # out, in, rows of one matmul

    def stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            if name.endswith(("mlp.fc1", "mlp.fc2")):
                self._watch(name + ".weight", module)

    def _watch(self, name: str, module: torch.nn.Module) -> None:
        steps = self.stamps[name] = []

        def before(mod, inputs):
            rows = inputs[0].numel() // inputs[0].shape[-1]
            self.shapes[name] = (*mod.weight.shape, rows)
            steps.append([self.stamp()])

        def after(*_):
            steps[-1].append(self.stamp())

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        module.register_full_backward_pre_hook(after)
        module.register_full_backward_hook(after)

    def result(self, warm: int) -> dict[str, dict]:
        """Per layer: its weight's shape, the rows of its matmul and the median ms of its
        forward + backward per step after ``warm`` steps."""
        if self.cuda:
            torch.cuda.synchronize()
        found = {}
        for name, steps in self.stamps.items():
            times = [
                (self._ms(s[0], s[1]) + self._ms(s[2], s[3]))
                for s in steps[warm:] or steps
                if len(s) == 4
            ]
            out_features, in_features, rows = self.shapes[name]
            found[name] = {
                "weight": f"{out_features}x{in_features}",
                "rows": rows,
                "ms": statistics.median(times) if times else math.nan,
            }
        return found

    def _ms(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]


def kept_layers(
    stage: Stage, args: argparse.Namespace, runs: list[dict], device: torch.device
) -> None:
    """What ``verify_speed`` would decide for the kernel run's MLP weights (timed at fit start
    as it times them, at the run's rows per matmul), and, for the layers it would keep on a
    2:4 kernel, an independent check of that choice: the layer timed again inside the
    training steps (forward + backward, by its hooks), on the kernel against its dense twin
    in the dense run. Adds a table and ``kept layers`` records to ``stage``."""
    from torch import nn

    from lightning_sparse.backends import choose_backend
    from lightning_sparse.backends.speed import EAGER, SpeedCheck
    from lightning_sparse.masks import NM

    dense, _, kernels = runs
    dtype = BF16 if "bf16" in args.precision else None
    checks: dict[int, SpeedCheck] = {}
    rows = []
    for name, timed in kernels["layers"].items():
        out_features, in_features = map(int, timed["weight"].split("x"))
        check = checks.setdefault(timed["rows"], SpeedCheck(timed["rows"], EAGER))
        layer = nn.Linear(in_features, out_features, device=device)
        choice = choose_backend(
            "auto", NM(2, 4), layer.weight, [(name, layer, "weight")], dtype, check
        )
        if (
            args.cpu_smoke
        ):  # no kernel on the CPU: time the emulation, to check the rest
            check(layer.weight, "emulated", dtype or torch.float32)
        measured = [m.ratio for m in check.results.values()]
        in_steps = dense["layers"][name]["ms"] / timed["ms"]
        kept = choice.name == "semi_structured"
        on_kernel = kernels["backends"].get(name) == "semi_structured"
        stage.records.append(
            {"table": "kept layers", "layer": name, "kept_sparse": kept,
             "on_kernel": on_kernel, "ratio": in_steps}
        )  # fmt: skip
        rows.append(
            [
                name,
                timed["weight"],
                str(timed["rows"]),
                f"{measured[-1]:.2f}x" if measured else "-",
                "2:4 kernel" if kept else f"masked ({choice.reason})",
                f"{dense['layers'][name]['ms']:.3f}",
                f"{timed['ms']:.3f}" + ("" if on_kernel else " (masked)"),
                f"{in_steps:.2f}x",
            ]
        )
    header = ["layer", "weight", "rows", "verify_speed ratio", "verify_speed keeps"]
    header += [
        "dense ms in the steps",
        "2:4 ms in the steps",
        "dense / 2:4 in the steps",
    ]
    kept = [
        r for r in stage.records if r["table"] == "kept layers" and r["kept_sparse"]
    ]
    stage.body += (
        "\n\nWhat `verify_speed` (on by default with `backend='auto'`) would decide for each "
        "MLP weight, timed eagerly at fit start at the run's rows per matmul, and every "
        "layer timed again inside the training steps (median forward + backward per step "
        "after the warm-up, by the layer's own hooks): on the 2:4 kernel in the kernel run "
        "against its dense twin in the dense run. A layer verify_speed keeps must not be "
        "slower there.\n\n" + markdown_table(header, rows)
    )
    slowest = min((r["ratio"] for r in kept), default=None)
    stage.summary += (
        f"; verify_speed would keep {len(kept)}/{len(rows)} MLP weights"
        + (
            f" (slowest in the steps {slowest:.2f}x dense)"
            if slowest is not None
            else ""
        )
    )


def training_report(args: argparse.Namespace, runs: list[dict]) -> Stage:
    dense, masked, kernels = runs
    warm = min(20, len(dense["times"]) // 5)
    rows, medians = [], {}
    for run in runs:
        timed = run["times"][warm:] or run["times"]
        medians[run["label"]] = ms = (
            statistics.median(timed) * 1e3 if timed else math.nan
        )
        peak = f"{run['peak'] / 2**30:.2f}" if run["peak"] is not None else "-"
        steps = str(len(run["times"])) + (" (cut)" if run["cut"] else "")
        speed = f"{medians['dense'] / ms:.2f}x"
        rows.append(
            [
                run["label"],
                steps,
                f"{ms:.1f}",
                speed,
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
    steps = min(len(run["losses"]) for run in runs)
    points = (
        sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1}) if steps else []
    )
    loss_rows = [
        [str(i + 1), *(f"{run['losses'][i]:.4f}" for run in runs)] for i in points
    ]
    window = max(1, min(10, steps))
    last = [statistics.mean(run["losses"][steps - window : steps]) for run in runs]
    loss_rows.append([f"mean of last {window}", *(f"{x:.4f}" for x in last)])
    first_gap = abs(kernels["losses"][0] - masked["losses"][0]) / abs(
        masked["losses"][0]
    )
    last_gap = abs(last[2] - last[1]) / abs(last[1])
    model = f"`{args.model}`" + (f" {TINY_VIT}" if args.cpu_smoke else "")
    body = [
        (
            f"{model}, random init, {args.precision}, batch {args.batch}, AdamW lr {args.lr}, "
            f"{args.steps} steps requested; synthetic 10-class images made on the device. "
            f"The MLP linears in a runtime 2:4 phase with `backend='masked'` (dense math on "
            f"the 2:4 weight) and with `backend='auto', verify_speed=False` (2:4 kernels where "
            f"they pass the kernel check, whatever their speed; what verify_speed would decide "
            f"is below), the same function: their losses must agree (first step within "
            f"{FIRST_LOSS_TOLERANCE:.0%}, mean of the last within {LAST_LOSS_TOLERANCE:.0%}). "
            f"Median step time after {warm} warm-up steps (synchronised), peak "
            f"`torch.cuda.max_memory_allocated`."
        ),
        "",
        markdown_table(header, rows),
        "",
        (
            f"Loss; the kernel run against the masked run: first step {first_gap:.2%} "
            f"apart, mean of the last {window} {last_gap:.2%} apart:"
        ),
        "",
        markdown_table(["step", *(run["label"] for run in runs)], loss_rows),
        "",
        "Backend table printed by the callback of the kernel run at fit start:",
        "",
        "```",
        kernels["table"] or "(none printed)",
        "```",
    ]  # fmt: skip
    stage = Stage("training", "passed", body="\n".join(body))
    ratio = medians["dense"] / medians[kernels["label"]]
    on_kernel = sum(name == "semi_structured" for name in kernels["backends"].values())
    stage.summary = (
        f"2:4 kernel step {ratio:.2f}x dense speed, {on_kernel}/{len(kernels['backends'])} "
        f"MLP weights on 2:4 kernels, loss {last[0]:.3f} dense / {last[1]:.3f} masked / "
        f"{last[2]:.3f} kernels"
    )
    if not all(math.isfinite(x) for run in runs for x in run["losses"]):
        stage.status = "failed"
        stage.notes.append("a loss was not finite")
    if first_gap > FIRST_LOSS_TOLERANCE or last_gap > LAST_LOSS_TOLERANCE:
        stage.status = "failed"
        stage.notes.append(
            f"the 2:4 kernel run's loss strays from the masked run's (first step "
            f"{first_gap:.2%}, last steps {last_gap:.2%} apart)"
        )
    if not args.cpu_smoke and on_kernel == 0:
        stage.status = "failed"
        stage.notes.append("no MLP weight ran on a 2:4 kernel (see the backend table)")
    if any(run["cut"] for run in runs):
        stage.status = "cut" if stage.status == "passed" else stage.status
        stage.notes.append(
            f"stopped at the time limit after {steps} steps of {args.steps}"
        )
    return stage
