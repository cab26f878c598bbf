"""Does sparse-then-dense training keep quality? The sparse fraction of the run vs the task metric.

The CPU-scale version of the table in PyTorch's 2:4 DINOv2 training blog (ImageNet linear probe
of ViT-L: dense 82.8, 2:4 for 40% of the steps 82.9, 70% 82.7, always 2:4 82.3). Two demo
models from ``lightning_sparse.demo``, trained from scratch with the real ``SparsityCallback``:

- ViT: ``ViTClassifier()`` on ``DigitsDataModule()`` (the recipes/vit/cpu_demo.yaml model),
  metric: final val/acc (360 held-out digits; the split is fixed, the seed varies init and order);
- GPT: the ``tiny`` byte-level ``GPTLanguageModel`` on ``PydocTextDataModule``
  (recipes/gpt/cpu_demo.yaml), metric: final val/loss in nats per byte (the seed varies init
  and the training windows);
- HF GPT-2 (``--models hf``, needs ``transformers``): ``HuggingFaceCausalLM`` with the same
  shape as transformers' GPT-2 (``Conv1D`` MLPs), recipes/hf/cpu_demo.yaml, on the same data;

under five schedules of the MLP linears (ViT ``blocks.*.mlp.fc1/fc2``, GPT
``transformer.h.*.mlp.c_fc/c_proj``), each over ``--seeds`` seeds:

- dense;
- 2:4 (``runtime``: re-derived from the dense weights at every forward, straight-through) for
  the first 40% / 70% / 100% of the optimizer steps, then dense;
- 70% unstructured (``static``: the mask chosen by magnitude at the start, i.e. at
  initialization; pruned weights stay zero) for 70% of the steps, then dense.

Every run ends with a validation pass; an always-sparse run is evaluated with its 2:4 weights.
Runs go to ``--workers`` processes of ``--threads`` threads each. Prints one Markdown table
(mean ± sample std over the seeds, and each seed's value) and the setup.

With ``--schedules decay`` the five schedules are 2:4 with and without masked decay
(``decay: 2e-4``, SR-STE) against dense; every run logs the flip rate every 25 steps, printed as
a table (first, peak, last; mean over the seeds) and, with ``--flip-plot``, drawn.

With ``--schedules learned``: 2:4 for 70% of the run, then dense, with masks re-derived at
every forward (``runtime``) or learned (``algorithm: learned``, its defaults: logits from the
magnitude prior, trained with the weights, which learn from the masked product's gradient, or
with ``train_weights: dense`` from the dense one).

    python benchmarks/sparse_fraction.py                      # 30 runs, ~25-35 min on 2 cores
    python benchmarks/sparse_fraction.py --schedules decay --flip-plot docs/flip_rate.png
    python benchmarks/sparse_fraction.py --schedules learned            # 18 runs, ~30 min
    python benchmarks/sparse_fraction.py --models gpt --schedules \
        "learned 2:4 (no prior, mask_lr 5e-3) for 70%, then dense"      # 3 runs, ~9 min
    python benchmarks/sparse_fraction.py --models hf --schedules dense "2:4 for 70%, then dense" \
        "2:4 always (100%)"                                       # the HF GPT-2 demo, 9 runs
    python benchmarks/sparse_fraction.py --seeds 1 --vit-epochs 2 --gpt-steps 40   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import lightning as L
import torch
from common import markdown_table, mean_std_cell, quiet_cpu_trainer
from lightning.pytorch.loggers import Logger

from lightning_sparse import SparsityCallback
from lightning_sparse.demo import (
    DigitsDataModule,
    GPTLanguageModel,
    PydocTextDataModule,
    ViTClassifier,
)

DECAY = 2e-4
"""Masked decay of the ``+ decay`` schedules (SR-STE's lambda_W)."""
SCHEDULES: dict[str, list[dict[str, Any]] | None] = {
    "dense": None,
    "2:4 for 40%, then dense": [{"sparsity": "2:4", "until": 0.4}, {"sparsity": 0.0}],
    "2:4 for 70%, then dense": [{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}],
    "2:4 always (100%)": [{"sparsity": "2:4"}],
    "70% unstructured for 70%, then dense": [
        {"sparsity": 0.7, "until": 0.7},
        {"sparsity": 0.0},
    ],
    "2:4 for 70% + decay, then dense": [
        {"sparsity": "2:4", "until": 0.7, "decay": DECAY},
        {"sparsity": 0.0},
    ],
    "2:4 always + decay": [{"sparsity": "2:4", "decay": DECAY}],
    "learned 2:4 for 70%, then dense": [
        {"sparsity": "2:4", "algorithm": "learned", "until": 0.7},
        {"sparsity": 0.0},
    ],
    "learned 2:4 (dense gradient) for 70%, then dense": [
        {
            "sparsity": "2:4",
            "algorithm": "learned",
            "train_weights": "dense",
            "until": 0.7,
        },
        {"sparsity": 0.0},
    ],
    "learned 2:4 (no prior, mask_lr 5e-3) for 70%, then dense": [
        {
            "sparsity": "2:4",
            "algorithm": "learned",
            "prior_strength": 0.0,
            "mask_lr": 5e-3,
            "until": 0.7,
        },
        {"sparsity": 0.0},
    ],
}
MASKED_DECAY = [
    "dense",
    "2:4 for 70%, then dense",
    "2:4 for 70% + decay, then dense",
    "2:4 always (100%)",
    "2:4 always + decay",
]
"""The schedules of ``--schedules decay``: 2:4 with and without masked decay (SR-STE)."""
LEARNED = [
    "2:4 for 70%, then dense",
    "learned 2:4 for 70%, then dense",
    "learned 2:4 (dense gradient) for 70%, then dense",
]
"""The schedules of ``--schedules learned``: 2:4 by ``runtime`` and by ``learned`` masks, the
weights trained with the masked product's gradient or the dense one."""
PARAMS = {
    "vit": ["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"],
    "gpt": ["transformer.h.*.mlp.c_fc.weight", "transformer.h.*.mlp.c_proj.weight"],
}
PARAMS["hf"] = PARAMS["gpt"]  # the same names in transformers' GPT-2 (Conv1D layers)
METRIC = {"vit": "val/acc", "gpt": "val/loss", "hf": "val/loss"}
LABEL = {"vit": "ViT val/acc", "gpt": "GPT val/loss", "hf": "HF GPT-2 val/loss"}
HF_GPT2 = {
    "n_layer": 4,
    "n_embd": 128,
    "n_head": 4,
    "vocab_size": 256,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": None,
    "eos_token_id": None,
}
"""The config of recipes/hf/cpu_demo.yaml: the tiny GPT's shape as transformers' GPT-2."""
FLIP_RATE = "sparsity/sparsity/flip_rate"  # the callback's default name is "sparsity"
FLIP_EVERY = 25
"""Optimizer steps between logged flip rates."""
GPT_BATCHES_PER_EPOCH = 200


@dataclass(frozen=True)
class Run:
    model: str
    schedule: str
    seed: int
    vit_epochs: int
    gpt_steps: int


def _build(run: Run) -> tuple[L.LightningModule, L.LightningDataModule, dict[str, Any]]:
    """Model, data and run length of one run (the CPU demo recipes' settings)."""
    if run.model == "vit":
        return ViTClassifier(), DigitsDataModule(), {"max_epochs": run.vit_epochs}
    batch_size = 32
    data = PydocTextDataModule(
        batch_size=batch_size,
        seed=run.seed,
        samples_per_epoch=GPT_BATCHES_PER_EPOCH * batch_size,
    )
    if run.model == "hf":
        # transformers is optional (the hf extra): imported only for these runs
        from lightning_sparse.demo.hf import HuggingFaceCausalLM

        model = HuggingFaceCausalLM("gpt2", config=HF_GPT2)
        return model, data, {"max_steps": run.gpt_steps}
    return GPTLanguageModel(preset="tiny"), data, {"max_steps": run.gpt_steps}


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


class FlipRates(Logger):
    """Keeps the logged flip rate of the sparsity callback, ``{step: rate}``."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: dict[int, float] = {}

    @property
    def name(self) -> str:
        return "flip_rates"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if FLIP_RATE in metrics and step is not None:
            self.rates[step] = float(metrics[FLIP_RATE])


def train(run: Run) -> tuple[Run, float, float, dict[int, float]]:
    """One run: ``(run, final task metric, wall seconds, flip rate by step)``."""
    L.seed_everything(run.seed, verbose=False)
    model, data, length = _build(run)
    phases = SCHEDULES[run.schedule]
    callbacks = (
        []
        if phases is None
        else [SparsityCallback(phases=phases, params=PARAMS[run.model], verbose=False)]
    )
    flips = FlipRates()
    trainer = quiet_cpu_trainer(
        callbacks=callbacks, logger=flips, log_every_n_steps=FLIP_EVERY, **length
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    if run.model != "vit" and trainer.global_step % GPT_BATCHES_PER_EPOCH:
        trainer.validate(model, data, verbose=False)  # the run ended mid-epoch
    metric = float(trainer.callback_metrics[METRIC[run.model]])
    return run, metric, time.perf_counter() - start, flips.rates


def _mean_by_step(runs: list[dict[int, float]]) -> dict[int, float]:
    steps = sorted(set.intersection(*(set(r) for r in runs)))
    return {step: statistics.fmean(r[step] for r in runs) for step in steps}


def flip_rate_table(flip_rates: dict[tuple[str, str], list[dict[int, float]]]) -> str:
    """First, peak and last logged flip rate (mean over the seeds) of each sparse run."""
    rows = []
    for (model, schedule), runs in flip_rates.items():
        mean = _mean_by_step(runs)
        if not mean:
            continue
        peak = max(mean, key=mean.__getitem__)
        first, last = min(mean), max(mean)
        rows.append(
            [
                model,
                schedule,
                f"{100 * mean[first]:.2f}% (step {first})",
                f"{100 * mean[peak]:.2f}% (step {peak})",
                f"{100 * mean[last]:.2f}% (step {last})",
            ]
        )
    header = ["model", "schedule", "first flip rate", "peak", "last"]
    return markdown_table(header, rows)


def plot_flip_rates(
    flip_rates: dict[tuple[str, str], list[dict[int, float]]], path: str
) -> None:
    """The mean flip rate over the optimizer steps, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({model for model, _ in flip_rates})
    fig, axes = plt.subplots(
        1, len(models), figsize=(5 * len(models), 3.2), squeeze=False
    )
    for ax, model in zip(axes[0], models):
        for (m, schedule), runs in sorted(flip_rates.items()):
            mean = _mean_by_step(runs)
            if m == model and mean:
                ax.plot(list(mean), [100 * v for v in mean.values()], label=schedule)
        ax.set(title=model, xlabel="optimizer step", ylabel="flip rate (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--vit-epochs", type=int, default=30, help="45 steps per epoch")
    parser.add_argument("--gpt-steps", type=int, default=800)
    parser.add_argument("--workers", type=int, default=2, help="parallel processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["vit", "gpt"],
        choices=["vit", "gpt", "hf"],
        help="hf: recipes/hf/cpu_demo.yaml's transformers GPT-2 (needs the hf extra)",
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["fraction"],
        help="schedule names, or 'fraction' (the sparse fraction study: the first five) "
        "or 'decay' (2:4 with and without masked decay) or 'learned' (2:4 by runtime "
        "and by learned masks)",
    )
    parser.add_argument(
        "--flip-plot", help="write the mean flip rate over training to this PNG file"
    )
    args = parser.parse_args()
    groups = {
        "fraction": list(SCHEDULES)[:5],
        "decay": MASKED_DECAY,
        "learned": LEARNED,
    }
    schedules = [s for name in args.schedules for s in groups.get(name, [name])]
    for name in schedules:
        if name not in SCHEDULES:
            parser.error(
                f"--schedules: {name!r} is unknown; choose from {list(SCHEDULES)}"
            )
    runs = [
        Run(model, schedule, seed, args.vit_epochs, args.gpt_steps)
        for seed in range(args.seeds)
        for model in args.models
        for schedule in schedules
    ]
    flip_rates: dict[tuple[str, str], list[dict[int, float]]] = {}
    results: dict[tuple[str, str], dict[int, float]] = {}
    seconds: dict[str, list[float]] = {model: [] for model in args.models}
    started = time.perf_counter()
    load_before = os.getloadavg()
    with ProcessPoolExecutor(
        args.workers,
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(args.threads,),
    ) as pool:
        futures = [pool.submit(train, run) for run in runs]
        for done, future in enumerate(as_completed(futures), 1):
            run, metric, wall, rates = future.result()
            results.setdefault((run.model, run.schedule), {})[run.seed] = metric
            if rates:
                flip_rates.setdefault((run.model, run.schedule), []).append(rates)
            seconds[run.model].append(wall)
            print(
                f"[{done}/{len(runs)}] {run.model} | {run.schedule} | seed {run.seed}: "
                f"{METRIC[run.model]} {metric:.4f} ({wall:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    total = time.perf_counter() - started

    header = ["schedule (MLP linears)"] + [
        f"{LABEL[m]} (mean ± std, per seed)" for m in args.models
    ]
    rows = []
    for schedule in schedules:
        cells = []
        for model in args.models:
            by_seed = results[model, schedule]
            cells.append(mean_std_cell([by_seed[s] for s in sorted(by_seed)]))
        rows.append([schedule, *cells])
    print(markdown_table(header, rows))
    print()
    print(flip_rate_table(flip_rates))
    if args.flip_plot:
        plot_flip_rates(flip_rates, args.flip_plot)
        print(f"flip rates plotted to {args.flip_plot}")
    print()
    lengths = []
    if "vit" in args.models:
        lengths.append(
            f"ViT {args.vit_epochs} epochs = {args.vit_epochs * 45} optimizer steps "
            f"(batch 32), {statistics.fmean(seconds['vit']):.0f} s per run"
        )
    for model in ("gpt", "hf"):
        if model in args.models:
            lengths.append(
                f"{LABEL[model].split(' val')[0]} {args.gpt_steps} optimizer steps (batch "
                f"32 x 64 bytes), {statistics.fmean(seconds[model]):.0f} s per run"
            )
    load_after = os.getloadavg()
    print(
        f"{args.seeds} seeds per cell; {'; '.join(lengths)}; {len(runs)} runs in "
        f"{total / 60:.1f} min on {args.workers} processes x {args.threads} thread(s); "
        f"{datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} at the start, "
        f"{load_after[0]:.1f} at the end. ViT: higher is better; GPT: nats per byte, lower "
        f"is better."
    )


if __name__ == "__main__":
    main()
