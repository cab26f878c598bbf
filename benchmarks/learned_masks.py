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
   ``mask_lr`` and ``train_weights``, ``--learned``), then fix the most likely patterns
   (``static``) and fine-tune for the rest: the same total number of steps;
3. the validation loss (nats per byte, the whole validation split) is measured right after
   the mask is fixed (step 0 for the one-shot masks, step ``--learn-steps`` for the learned
   ones), at step ``--learn-steps`` for every variant (the same point of the run), and at the
   end.

Prints one Markdown table per seed, and with several seeds one of mean ± sample std.

Step cost (``--step-time``): median wall time of a training step of the demo GPT (the
recipe's shape and batch) dense, with ``runtime`` 2:4 and with ``learned`` 2:4 on every block
Linear, interleaved in one process (same-run ratios).

    python benchmarks/learned_masks.py --seeds 0 --steps 20 --learn-steps 6    # smoke test
    python benchmarks/learned_masks.py --seeds 0 1 2                           # ~1-2 h
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
from lightning_sparse.demo import GPTLanguageModel

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
"""The default learned variants, ``mask_lr:frozen|train``: mask_lr 0 (no mask learning: the
same schedule, freezing and soft samples, the argmax left where the prior's initial noise put
it) as the control; MaskLLM's 5e-4 and 4x more with the weights frozen; 5e-4 with them
training."""


def variants(learn_steps: int, learned: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Label -> phases of every variant (``learned``: ``mask_lr:frozen|train`` entries)."""
    found = {
        "magnitude (one-shot)": [{**TWO_FOUR, "algorithm": "static", "init": "topk"}],
        "wanda (one-shot)": [{**TWO_FOUR, "algorithm": "static", "init": "wanda"}],
    }
    for entry in learned:
        lr, weights = entry.split(":")
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
        found[label] = [phase, {**TWO_FOUR, "algorithm": "static"}]
    return found


def prune(
    seed: int,
    ckpt: Path,
    phases: list[dict[str, Any]],
    steps: int,
    learn_steps: int,
    lr: float,
) -> tuple[float, float, float, float]:
    """Validation loss right after the mask is fixed (at step 0, or where the learned phase
    ends), at step ``learn_steps``, after ``steps`` steps; and the seconds it took."""
    L.seed_everything(seed, verbose=False)
    model = GPTLanguageModel(preset="tiny", lr=lr)
    model.load_state_dict(export_state_dict(ckpt))  # weights only: no trainer state
    text = data(seed)
    loss = FixedAt(text, learn_steps)
    sparsity = SparsityCallback(phases=phases, verbose=False)
    started = time.perf_counter()
    trainer(steps, [sparsity, loss]).fit(model, text)
    fixed = loss.at_step if phases[0]["algorithm"] == "learned" else loss.start
    return fixed, loss.at_step, loss.end, time.perf_counter() - started


def pruning(args: argparse.Namespace) -> None:
    runs = variants(args.learn_steps, args.learned)
    header = [
        "masks (2:4, all block linears)",
        "val/loss right after the mask is fixed",
        f"at step {args.learn_steps}",
        f"after {args.steps} steps in all",
    ]
    by_label: dict[str, list[tuple[float, ...]]] = {}
    args.dense_dir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        ckpt = args.dense_dir / f"dense_seed{seed}.ckpt"
        if not ckpt.exists():
            train_dense(seed, args.dense_steps, ckpt)
        rows = []
        for label, phases in runs.items():
            *losses, seconds = prune(
                seed, ckpt, phases, args.steps, args.learn_steps, args.lr
            )
            by_label.setdefault(label, []).append(tuple(losses))
            rows.append([label, *(f"{v:.4f}" for v in losses)])
            print(
                f"seed {seed} | {label}: {rows[-1][1:]} ({seconds:.0f} s)", flush=True
            )
        print(f"\nseed {seed}: dense model {ckpt}")
        print(markdown_table(header, rows), flush=True)
    if len(args.seeds) > 1:
        print(f"\nseeds {args.seeds}: mean ± sample std (per seed)")
        rows = [
            [label, *(mean_std_cell([v[i] for v in losses]) for i in range(3))]
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
    }
    times: dict[str, list[float]] = {name: [] for name in setups}
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
    dense = median(times["dense"])
    rows = [
        [name, f"{1000 * median(t):.1f}", f"{median(t) / dense:.2f}x"]
        for name, t in times.items()
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} "
        f"fits of {args.timed_steps} steps per setup (the first step of each untimed)"
    )
    print(
        markdown_table(
            ["setup (all block linears)", "ms per step (median)", "vs dense"], rows
        )
    )


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
