"""Learned 2:4 masks (``algorithm: learned``) against one-shot magnitude and Wanda masks, when
pruning a trained model; and what a learned phase costs per training step.

Pruning (the workflow of recipes/gpt/learn_masks_cpu.yaml, beside prune_pretrained.py's):

1. train the tiny byte-level GPT dense with the settings of recipes/gpt/cpu_demo.yaml (800
   optimizer steps), or load ``--dense-dir/dense_seed<N>.ckpt`` if it is there (it is
   written there otherwise);
2. every variant loads those weights (no trainer state) and runs ``--steps`` optimizer steps
   at peak lr ``--lr`` on every Linear of the blocks: ``magnitude`` and ``wanda`` choose a
   fixed (``static``) 2:4 mask at step 0 and fine-tune it; ``learned`` variants learn the 2:4
   masks for the first ``--learn-steps`` steps (prior ``init: wanda``, with their
   ``mask_lr``, ``train_weights`` and ``transposable``, ``--learned``), then fix the most
   likely patterns (``static``) and fine-tune for the rest: the same total number of steps;
   ``dense`` fine-tunes the dense model for as many steps;
3. the validation loss (nats per byte, the whole validation split) is measured right after
   the mask is fixed (step 0 for the one-shot masks, step ``--learn-steps`` for the learned
   ones), at step ``--learn-steps`` for every variant (the same point of the run), and at the
   end.

Prints one Markdown table per seed, and with several seeds one of mean ± sample std; each
row says whether the mask the fine-tuning ran with is transposable 2:4 (the ``static`` one-shot
masks are: ``static`` chooses transposable tiles for 2:4).

Step cost (``--step-time``): median wall time of a training step of the demo GPT (the
recipe's shape and batch) dense, with ``runtime`` 2:4 and with ``learned`` 2:4 on every block
Linear (each form), interleaved in one process (same-run ratios), and the bytes per weight a
learned form holds (fp32 logits, their gradient and Adam's two moments).

    python benchmarks/learned_masks.py --seeds 0 --steps 20 --learn-steps 6    # smoke test
    python benchmarks/learned_masks.py --seeds 0 1 2                           # ~1-2 h
    python benchmarks/learned_masks.py --seeds 0 1 2 --learned 5e-4:frozen \
        5e-4:frozen:tiles 5e-4:frozen:project                 # transposable forms, ~1 h
    python benchmarks/learned_masks.py --step-time                             # ~2 min
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import markdown_table, mean_std_cell, median
from prune_pretrained import ValLoss, data, train_dense, trainer

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.algorithms import Learned
from lightning_sparse.demo import GPTLanguageModel
from lightning_sparse.engine.learning import logit_bytes
from lightning_sparse.masks.tiles import is_transposable_2to4

TWO_FOUR = {"sparsity": "2:4"}


class FixedAt(ValLoss):
    """:class:`ValLoss`, plus the validation loss at the start of optimizer step ``step``
    (placed after the SparsityCallback: a phase that begins there has begun)."""

    def __init__(self, data: Any, step: int) -> None:
        super().__init__(data)
        self.step = step
        self.at_step = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.at_step = self.measure(pl_module)


LEARNED = ["0:frozen", "5e-4:frozen", "2e-3:frozen", "5e-4:train"]
"""The default learned variants, ``mask_lr:frozen|train[:tiles|project]``: mask_lr 0 (no mask
learning: the same schedule, freezing and soft samples, the argmax left where the prior's
initial noise put it) as the control; MaskLLM's 5e-4 and 4x more with the weights frozen; 5e-4
with them training. A third field sets ``transposable``."""


def variants(
    learn_steps: int, learned: list[str]
) -> dict[str, list[dict[str, Any]] | None]:
    """Label -> phases of every variant (``None``: dense; ``learned``:
    ``mask_lr:frozen|train[:tiles|project]`` entries)."""
    found: dict[str, list[dict[str, Any]] | None] = {
        "dense (not pruned)": None,
        "magnitude (one-shot)": [{**TWO_FOUR, "algorithm": "static", "init": "topk"}],
        "wanda (one-shot)": [{**TWO_FOUR, "algorithm": "static", "init": "wanda"}],
    }
    for entry in learned:
        lr, weights, *form = entry.split(":")
        label = f"learned {learn_steps} steps, mask_lr {lr}, weights {weights}"
        phase = {
            **TWO_FOUR,
            "algorithm": "learned",
            "init": "wanda",
            "until": learn_steps,
            # mask_lr must be positive: 1e-30 moves no logit
            "mask_lr": max(float(lr), 1e-30),
            "train_weights": weights == "train",
        }
        if form:
            label += f", transposable: {form[0]}"
            phase["transposable"] = form[0]
        found[label] = [phase, {**TWO_FOUR, "algorithm": "static"}]
    return found


def prune(
    seed: int,
    ckpt: Path,
    phases: list[dict[str, Any]] | None,
    steps: int,
    learn_steps: int,
    lr: float,
) -> tuple[tuple[float, float, float], str, float]:
    """Validation loss right after the mask is fixed (at step 0, or where the learned phase
    ends), at step ``learn_steps``, after ``steps`` steps; what the fine-tuning's masks are
    (transposable or not, and how many groups a projection changed); the seconds it took."""
    L.seed_everything(seed, verbose=False)
    model = GPTLanguageModel(preset="tiny", lr=lr)
    model.load_state_dict(export_state_dict(ckpt))  # weights only: no trainer state
    text = data(seed)
    loss = FixedAt(text, learn_steps)
    callbacks: list[L.Callback] = [loss]
    if phases is not None:
        sparsity = SparsityCallback(phases=phases, verbose=False)
        callbacks.insert(0, sparsity)
    started = time.perf_counter()
    trainer(steps, callbacks).fit(model, text)
    seconds = time.perf_counter() - started
    learned = phases is not None and phases[0]["algorithm"] == "learned"
    fixed = loss.at_step if learned else loss.start
    return (fixed, loss.at_step, loss.end), masks_kind(phases, callbacks[0]), seconds


def masks_kind(phases: list[dict[str, Any]] | None, callback: L.Callback) -> str:
    """Whether the masks the run ended with are transposable 2:4, and how many groups a
    learned phase's projection changed."""
    if phases is None:
        return "-"
    sp = callback.sparsifier
    kind = "yes" if all(map(is_transposable_2to4, sp.masks.values())) else "no"
    learned = sp.algorithms.get(0)
    if isinstance(learned, Learned) and learned.projected:
        groups = sum(t.param.numel() // 4 for t in sp.targets)
        changed = sum(learned.projected.values())
        kind += f" (projection changed {changed / groups:.1%} of the groups)"
    return kind


def pruning(args: argparse.Namespace) -> None:
    runs = variants(args.learn_steps, args.learned)
    header = [
        "masks (2:4, all block linears)",
        "val/loss right after the mask is fixed",
        f"at step {args.learn_steps}",
        f"after {args.steps} steps in all",
        "transposable",
    ]
    by_label: dict[str, list[tuple[float, ...]]] = {}
    kinds: dict[str, list[str]] = {}
    args.dense_dir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        ckpt = args.dense_dir / f"dense_seed{seed}.ckpt"
        if not ckpt.exists():
            train_dense(seed, args.dense_steps, ckpt)
        rows = []
        for label, phases in runs.items():
            losses, kind, seconds = prune(
                seed, ckpt, phases, args.steps, args.learn_steps, args.lr
            )
            by_label.setdefault(label, []).append(losses)
            kinds.setdefault(label, []).append(kind)
            rows.append([label, *(f"{v:.4f}" for v in losses), kind])
            print(
                f"seed {seed} | {label}: {rows[-1][1:]} ({seconds:.0f} s)", flush=True
            )
        print(f"\nseed {seed}: dense model {ckpt}")
        print(markdown_table(header, rows), flush=True)
    if len(args.seeds) > 1:
        print(f"\nseeds {args.seeds}: mean ± sample std (per seed)")
        rows = [
            [
                label,
                *(mean_std_cell([v[i] for v in losses]) for i in range(3)),
                "; ".join(kinds[label]),
            ]
            for label, losses in by_label.items()
        ]
        print(markdown_table(header, rows))


class StepTimer(L.Callback):
    """Wall seconds of each training step after the first (batch start to batch end: the
    forward, backward, the callbacks' hooks and the optimizer step)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step > 1:
            self.seconds.append(time.perf_counter() - self._started)


def step_time(args: argparse.Namespace) -> None:
    """Median seconds per training step, dense / runtime / learned: ``--repeats`` fits of
    ``--timed-steps`` steps each, the setups interleaved."""
    text = data(0)
    setups: dict[str, list[dict[str, Any]] | None] = {
        "dense": None,
        "runtime 2:4": [{**TWO_FOUR, "algorithm": "runtime"}],
        "learned 2:4": [{**TWO_FOUR, "algorithm": "learned"}],
        "learned 2:4, weights frozen": [
            {**TWO_FOUR, "algorithm": "learned", "train_weights": False}
        ],
        "learned 2:4, dense weight gradient": [
            {**TWO_FOUR, "algorithm": "learned", "train_weights": "dense"}
        ],
        "learned 2:4, transposable: tiles": [
            {**TWO_FOUR, "algorithm": "learned", "transposable": "tiles"}
        ],
        "learned 2:4, transposable: project": [
            {**TWO_FOUR, "algorithm": "learned", "transposable": "project"}
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in setups}
    per_weight: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, phases in setups.items():
            L.seed_everything(0, verbose=False)
            timer = StepTimer()
            callbacks: list[L.Callback] = [timer]
            if phases is not None:
                callbacks.insert(0, SparsityCallback(phases=phases, verbose=False))
            trainer(args.timed_steps, callbacks).fit(
                GPTLanguageModel(preset="tiny"), text
            )
            times[name] += timer.seconds
            per_weight[name] = state_per_weight(callbacks[0])
    dense = median(times["dense"])
    rows = [
        [name, f"{1000 * median(t):.1f}", f"{median(t) / dense:.2f}x", per_weight[name]]
        for name, t in times.items()
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} "
        f"fits of {args.timed_steps} steps per setup (the first step of each untimed)"
    )
    print(
        markdown_table(
            [
                "setup (all block linears)",
                "ms per step (median)",
                "vs dense",
                "learned state, bytes per weight",
            ],
            rows,
        )
    )


def state_per_weight(callback: L.Callback) -> str:
    """Bytes of fp32 state (logits, gradient, Adam's moments) per selected weight that the
    learned phase of ``callback`` holds (``-`` for other setups)."""
    sp = getattr(callback, "sparsifier", None)
    algo = None if sp is None else sp.algorithms.get(0)
    if not isinstance(algo, Learned):
        return "-"
    held = sum(logit_bytes(*algo.logit_count(t.rows_shape)) for t in sp.targets)
    return f"{held / sum(t.param.numel() for t in sp.targets):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dense-steps", type=int, default=800)
    parser.add_argument(
        "--dense-dir", type=Path, default=Path("runs/learned_masks_dense")
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="total steps per variant"
    )
    parser.add_argument("--learn-steps", type=int, default=30)
    parser.add_argument(
        "--learned",
        nargs="+",
        default=LEARNED,
        help="learned variants as mask_lr:frozen or mask_lr:train",
    )
    parser.add_argument("--lr", type=float, default=5e-4, help="fine-tuning peak lr")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--step-time", action="store_true", help="time steps instead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timed-steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.step_time:
        step_time(args)
    else:
        pruning(args)


if __name__ == "__main__":
    main()
