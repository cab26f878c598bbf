"""One rank of the split learned-logits job (started by ``tests/multiprocess.py``).

First, without Lightning: the gather of the ranks' units and its gradient on uneven splits
(:func:`gathered_units`), and one learned step on split logits against the same step on whole
logits whose gradients are averaged by hand (:func:`split_step`). Then each run of ``RUNS``
trains a 2-block model through a learned 2:4 phase (its masks projected onto transposable tiles
at the handover), a static 2:4 phase and a dense one, under DDP (bf16 autocast) or FSDP2 (a
bf16 ``MixedPrecisionPolicy``), and records per optimizer step the loss and hashes of the whole
weights, masks, learned logits (whole, as checkpoints hold them) and export, with the logits
this rank holds. The FSDP2 run also resumes from a distributed checkpoint inside the learned
phase.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from distributed_worker import RankBatches, job_trainer, step_checkpoints, tensor_hash
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.algorithms import Learned, MaskContext, build_algorithm
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.engine.gradients import average_over_ranks
from lightning_sparse.engine.logit_shards import RankShards
from lightning_sparse.engine.sharding import gather_full

INPUTS, HIDDEN, OUTPUTS = 32, 64, 32
LEARNED = {
    "sparsity": "2:4",
    "algorithm": "learned",
    "prior_strength": 0,
    "mask_lr": 0.05,
    "weight_reg": 1e-3,
    "transposable": "project",
}


class BlocksModule(L.LightningModule):
    """Two Linear blocks and a dense head; under FSDP2 each block and the root are sharded,
    with a bf16 ``MixedPrecisionPolicy`` (float32 gradient reduction)."""

    def __init__(self, strategy: str) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUTPUTS), nn.ReLU()
        )
        self.head = nn.Linear(OUTPUTS, 4)
        self.strategy_name = strategy

    def configure_model(self) -> None:
        if self.strategy_name == "fsdp2":
            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
            for index in (0, 2):
                fully_shard(self.blocks[index], mesh=mesh, mp_policy=policy)
            fully_shard(self, mesh=mesh, mp_policy=policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class StepRecord(L.Callback):
    """Placed after the SparsityCallback: what each optimizer step left, on this rank."""

    def __init__(self, sparsity: SparsityCallback) -> None:
        self.sparsity = sparsity
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sp = self.sparsity.sparsifier
        state = sp.state_dict()  # whole masks and logits (gathered)
        logits = state.get("learned", {}).get("logits", {})
        algo = sp.algorithm
        held = algo.logits if isinstance(algo, Learned) else {}
        weights = {n: gather_full(p.detach()) for n, p in pl_module.named_parameters()}
        self.steps[trainer.global_step - 1] = {
            "loss": float(outputs["loss"]).hex(),
            "weights": {n: tensor_hash(w) for n, w in sorted(weights.items())},
            "masks": {k: tensor_hash(m) for k, m in sorted(state["masks"].items())},
            "logits": {k: tensor_hash(v) for k, v in sorted(logits.items())},
            "whole_logits": {k: list(v.shape) for k, v in sorted(logits.items())},
            "held_logits": {k: list(v.shape) for k, v in sorted(held.items())},
            "export": {
                k: tensor_hash(v) for k, v in export_state_dict(trainer).items()
            },
        }


def fit(
    cfg: dict[str, Any], run: dict[str, Any], out: Path, ckpt_path: str | None = None
) -> dict[str, Any]:
    rank = int(os.environ["LOCAL_RANK"])
    L.seed_everything(cfg["seed"])
    model = BlocksModule(run["strategy"])
    strategy: Any = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if run["strategy"] == "fsdp2"
        else "ddp"
    )
    sparsity = SparsityCallback(
        phases=cfg["phases"],
        params=["blocks.0.weight", "blocks.2.weight"],
        verbose=False,
    )
    record = StepRecord(sparsity)
    callbacks: list[L.Callback] = [sparsity, record]
    if run.get("resume"):
        callbacks.append(step_checkpoints(out, cfg["checkpoint_step"]))
    trainer = job_trainer(
        strategy,
        cfg["max_steps"],
        callbacks,
        # FSDP2's policy casts the gathered weights; its DDP counterpart autocasts
        precision="32-true" if run["strategy"] == "fsdp2" else "bf16-mixed",
        enable_checkpointing=bool(run.get("resume")),
    )
    data = DataLoader(RankBatches(rank, inputs=INPUTS), batch_size=8)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {"steps": record.steps}


def gathered_units() -> dict[str, Any]:
    """For a weight of 5 units and one of 1 (this rank may hold none): the units each rank
    holds, the gathered whole (in bf16 from float32), and the gradient each rank's part gets
    when rank ``r``'s whole gradient is ``(r + 1) * g``: the mean over the ranks, ``1.5 g``."""
    rank = int(os.environ["LOCAL_RANK"])
    shards = RankShards()
    found: dict[str, Any] = {}
    for units in (5, 1):
        owned = shards.owned(units)
        whole = torch.arange(units * 3, dtype=torch.float32).reshape(units, 3)
        local = whole[owned].clone().requires_grad_(True)
        gathered = shards.gather(local, units, torch.bfloat16)
        g = (torch.arange(units * 3.0) - 7).reshape(units, 3) / 4  # exact in bf16
        (gathered.float() * (rank + 1) * g).sum().backward()
        found[str(units)] = {
            "owned": [owned.start, owned.stop],
            "dtype": str(gathered.dtype),
            "whole": bool(torch.equal(gathered.float(), whole)),
            "grad": bool(torch.equal(local.grad, 1.5 * g[owned])),
        }
    return found


def split_step() -> dict[str, Any]:
    """Two learned steps (with the sparse-weight regulariser) of a 16x32 weight's logits, split
    over the ranks, each rank's loss from its own inputs; and the same steps on whole logits
    in this one process, each step's gradients summed over both ranks' losses and halved;
    and on whole logits on each rank (``allow_skipped_layers``), their gradients averaged by
    the engine: the logits, the most likely masks, and the split state read back by each
    rank."""
    rank = int(os.environ["LOCAL_RANK"])
    phase = resolve_phases([Phase(**{**LEARNED, "until": 10})], 10)[0]
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 32, generator=gen)
    inputs = [torch.randn(8, 32, generator=gen) for _ in range(2)]
    split, whole, kept = (build_algorithm(phase) for _ in range(3))
    split.shards, kept.shards = RankShards(), RankShards(split=False)
    for algo in (split, whole, kept):
        prior = algo.initial_mask(weight, phase.target, MaskContext("w", 0, 0))
        algo.begin(0, {"w": prior})

    def loss(algo: Learned, x: torch.Tensor) -> torch.Tensor:
        return (x @ (weight * algo.sample("w", True)).T).square().mean()

    for step in range(2):
        split.step = whole.step = kept.step = step
        loss(split, inputs[rank]).backward()
        loss(kept, inputs[rank]).backward()
        average_over_ranks(list(kept.parameters()))  # as the engine does for them
        for x in inputs:
            loss(whole, x).backward()
        whole.logits["w"].grad /= 2
        for algo in (split, whole, kept):
            algo.learn(step, {"w": weight})
    state = split.state_dict()  # whole, gathered
    checked = split.check_state(state, {"w": weight.shape}, {"w": weight.device})
    owned = split.owned["w"]
    return {
        "held": list(split.logits["w"].shape),
        "kept_held": list(kept.logits["w"].shape),
        # two ranks' gradients summed in either order: the same bits
        "kept_equal": bool(torch.equal(kept.logits["w"], whole.logits["w"])),
        "max_difference": float((state["logits"]["w"] - whole.logits["w"]).abs().max()),
        "masks_equal": bool(
            torch.equal(split.most_likely("w"), whole.most_likely("w"))
        ),
        "statistics": [list(split.statistics("w")), list(whole.statistics("w"))],
        "read_back": bool(torch.equal(checked["logits"]["w"], split.logits["w"])),
        "moments_read_back": bool(
            torch.equal(
                checked["optimizer"].state_dict()["state"][0]["exp_avg"],
                split.optimizer.state_dict()["state"][0]["exp_avg"],
            )
        ),
        "owned": [owned.start, owned.stop],
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    torch.distributed.init_process_group("gloo")
    report: dict[str, Any] = {
        "gathered_units": gathered_units(),
        "split_step": split_step(),
    }
    torch.distributed.destroy_process_group()
    for name, run in cfg["runs"].items():
        where = out / name.replace(" ", "_")
        report[name] = fit(cfg, run, where)
        if run.get("resume"):
            ckpt = where / "ckpt" / f"step={cfg['checkpoint_step']}.ckpt"
            report[f"{name} resumed"] = fit(cfg, run, where / "resumed", str(ckpt))
    rank = int(os.environ["LOCAL_RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    # end without the interpreter's shutdown, as tests/distributed_worker.py explains
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
