"""Pruning a trained model: magnitude (``init: topk``) against Wanda (``init: wanda``).

The "prune, then fine-tune sparse" workflow of recipes/gpt/prune_finetune_cpu.yaml, measured:

1. train the tiny byte-level GPT dense with the settings of recipes/gpt/cpu_demo.yaml (800
   optimizer steps) and save it (or load ``--dense-ckpt``);
2. for each target (``2:4``, ``50%`` unstructured) and each ``init``: load the dense weights
   (no trainer state), choose a fixed (``static``) mask at step 0 with ``SparsityCallback``
   (Wanda: 8 calibration batches of the training data), and measure the validation loss
   (nats per byte, over the whole validation split) right after pruning and, with
   ``--finetune-steps N``, after N steps of fine-tuning with the mask fixed.

Which weights: every Linear weight of the transformer blocks (``--params all``, the default
selection, as Wanda prunes LLMs) or only the MLPs (``--params mlp``). Prints one Markdown
table per seed, the dense model's loss first.

    python benchmarks/prune_pretrained.py                         # one seed, one-shot, ~5 min
    python benchmarks/prune_pretrained.py --finetune-steps 100 --seeds 0 1 2   # + mean ± std
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from common import markdown_table, mean_std_cell, quiet_cpu_trainer

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.demo import GPTLanguageModel, PydocTextDataModule

PARAMS = {
    "all": None,  # the default selection: every Linear weight of the blocks
    "mlp": ["transformer.h.*.mlp.c_fc.weight", "transformer.h.*.mlp.c_proj.weight"],
}
BATCH_SIZE = 32
BATCHES_PER_EPOCH = 200


class ValLoss(L.Callback):
    """The validation loss over the whole validation split at the start and end of training
    (placed after the SparsityCallback, so the start sees the pruned model)."""

    def __init__(self, data: PydocTextDataModule) -> None:
        self.data = data
        self.start = self.end = float("nan")

    @torch.no_grad()
    def measure(self, module: GPTLanguageModel) -> float:
        training = module.training
        module.eval()
        total = count = 0.0
        for x, y in self.data.val_dataloader():
            total += float(module.loss(x, y)) * len(x)
            count += len(x)
        module.train(training)
        return total / count

    def on_train_start(self, trainer: L.Trainer, pl_module: GPTLanguageModel) -> None:
        self.start = self.measure(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: GPTLanguageModel) -> None:
        self.end = self.measure(pl_module)


def data(seed: int) -> PydocTextDataModule:
    data = PydocTextDataModule(
        batch_size=BATCH_SIZE,
        seed=seed,
        samples_per_epoch=BATCHES_PER_EPOCH * BATCH_SIZE,
    )
    data.setup("fit")
    return data


def trainer(max_steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return quiet_cpu_trainer(
        max_steps=max_steps, callbacks=callbacks, limit_val_batches=0
    )


def train_dense(seed: int, steps: int, path: Path) -> None:
    L.seed_everything(seed, verbose=False)
    dense = trainer(steps, [])
    dense.fit(GPTLanguageModel(preset="tiny"), data(seed))
    dense.save_checkpoint(path)


def prune(
    seed: int,
    ckpt: Path,
    sparsity: str | float | None,
    init: str,
    params: list[str] | None,
    finetune_steps: int,
    lr: float,
) -> tuple[float, float]:
    """Validation loss right after pruning and after ``finetune_steps`` steps."""
    L.seed_everything(seed, verbose=False)
    model = GPTLanguageModel(preset="tiny", lr=lr)
    model.load_state_dict(export_state_dict(ckpt))  # weights only: no trainer state
    text = data(seed)
    loss = ValLoss(text)
    callbacks: list[L.Callback] = [loss]
    if sparsity is not None:
        phase = {"sparsity": sparsity, "algorithm": "static", "init": init}
        callbacks.insert(
            0, SparsityCallback(phases=[phase], params=params, verbose=False)
        )
    trainer(max(finetune_steps, 1), callbacks).fit(model, text)
    return loss.start, loss.end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dense-steps", type=int, default=4 * BATCHES_PER_EPOCH)
    parser.add_argument("--dense-ckpt", type=Path, help="skip training: prune this one")
    parser.add_argument("--finetune-steps", type=int, default=0)
    parser.add_argument("--lr", type=float, default=5e-4, help="fine-tuning peak lr")
    parser.add_argument("--params", choices=sorted(PARAMS), default="all")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    tmp = Path(tempfile.mkdtemp())
    # (target, init) -> per seed (right after pruning, after fine-tuning)
    by_row: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for seed in args.seeds:
        started = time.perf_counter()
        ckpt = args.dense_ckpt or tmp / f"dense_seed{seed}.ckpt"
        if args.dense_ckpt is None:
            train_dense(seed, args.dense_steps, ckpt)
        trained = time.perf_counter() - started
        rows = []
        dense, _ = prune(seed, ckpt, None, "topk", None, 0, args.lr)
        rows.append(["dense", "-", f"{dense:.4f}", "-"])
        by_row.setdefault(("dense", "-"), []).append((dense, float("nan")))
        for sparsity in ("2:4", 0.5):
            for init in ("topk", "wanda"):
                start, end = prune(
                    seed,
                    ckpt,
                    sparsity,
                    init,
                    PARAMS[args.params],
                    args.finetune_steps,
                    args.lr,
                )
                after = f"{end:.4f}" if args.finetune_steps else "-"
                label = "2:4" if sparsity == "2:4" else "50% unstructured"
                rows.append([label, init, f"{start:.4f}", after])
                by_row.setdefault((label, init), []).append((start, end))
        header = [
            f"target ({args.params} block linears)",
            "init",
            "val/loss right after pruning",
            f"after {args.finetune_steps} fine-tuning steps",
        ]
        print(
            f"seed {seed}: dense model {ckpt} ({args.dense_steps} steps, {trained:.0f} s)"
        )
        print(markdown_table(header, rows))
        print()
    if len(args.seeds) > 1:
        print(f"seeds {args.seeds}: mean ± sample std (per seed)")
        print(markdown_table(header, summary_rows(by_row, args.finetune_steps > 0)))


def summary_rows(
    by_row: dict[tuple[str, str], list[tuple[float, float]]], finetuned: bool
) -> list[list[str]]:
    """One row per (target, init): each loss as mean ± std over the seeds, then each seed's."""
    rows = []
    for (label, init), losses in by_row.items():
        after = [end for _, end in losses]
        tuned = finetuned and label != "dense"
        rows.append(
            [
                label,
                init,
                mean_std_cell([start for start, _ in losses]),
                mean_std_cell(after) if tuned else "-",
            ]
        )
    return rows


if __name__ == "__main__":
    main()
