"""One rank of a 2-process Lightning Fabric job with ``ModelParallelStrategy`` (FSDP2,
``fully_shard`` on every Linear, gloo on the CPU; started by ``tests/multiprocess.py``), with
``SparseTraining`` after ``fabric.setup_module``/``setup_optimizers``: each rank on its own
batches, accumulation under ``fabric.no_backward_sync``. Runs the whole schedule, then again
stopped at ``checkpoint_step`` (``fabric.save``: a distributed checkpoint, the sparsity state in
its metadata) and resumed with ``fabric.load`` in fresh objects; records per optimizer step a
hash of every whole mask, whether the weights were sharded, and the final export's hashes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_sparse import SparseTraining

PHASES = [
    {"sparsity": 0.5, "algorithm": "rigl", "update_every": 2, "until": 0.4},
    {"sparsity": "2:4", "until": 0.8},
    {"sparsity": 0.0},
]


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def shard_linears(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def run(
    fabric: L.Fabric, total: int, stop_at: int | None, path: Path, resume: bool
) -> dict:
    fabric.seed_everything(1 if resume else 0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sparsity = SparseTraining(
        model,
        optimizer,
        phases=PHASES,
        params=["0.weight", "2.weight"],
        total_steps=total,
        verbose=False,
    )
    state = {"model": model, "optimizer": optimizer, "sparsity": sparsity, "step": 0}
    if resume:
        fabric.load(path, state)
        # Fabric hands back a distributed checkpoint's other entries as saved (dicts), without
        # calling their load_state_dict
        sparsity.load_state_dict(state["sparsity"])
        state["sparsity"] = sparsity
    steps: dict[str, dict[str, str]] = {}
    sharded = isinstance(model.module[0].weight, DTensor)
    while state["step"] < total:
        step = state["step"]
        for micro in range(2):
            g = torch.Generator().manual_seed(
                100 * step + 10 * micro + fabric.global_rank
            )
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(F.mse_loss(model(x), y) / 2)
        optimizer.step()
        masks = sparsity.sparsifier.state_dict()["masks"]  # whole masks: a collective
        steps[str(step)] = {name: digest(mask) for name, mask in masks.items()}
        sparsity.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] == stop_at:
            fabric.save(path, state)
            return {"steps": steps, "sharded": sharded}
    sparsity.end()
    export = {k: digest(v) for k, v in sparsity.export_state_dict().items()}
    return {"steps": steps, "sharded": sharded, "export": export}


def main() -> None:
    config = json.loads(sys.argv[1])
    out = Path(config["out"])
    strategy = ModelParallelStrategy(
        shard_linears, data_parallel_size=2, tensor_parallel_size=1
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    path = out / "mid"
    total, stop = config["total_steps"], config["checkpoint_step"]
    report = {
        "full": run(fabric, total, None, path, resume=False),
        "first": run(fabric, total, stop, path, resume=False),
        "resumed": run(fabric, total, None, path, resume=True),
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
