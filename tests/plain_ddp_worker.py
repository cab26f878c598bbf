"""One rank of a 2-process plain PyTorch DDP job (gloo, started by ``tests/multiprocess.py``),
without Lightning: the plain-loop example's model under ``DistributedDataParallel`` with
``SparseTraining``, each rank on its own batches. Runs the whole schedule, then again stopped at
``checkpoint_step`` (``torch.save`` on rank 0) and resumed in fresh objects; records per
optimizer step a hash of every mask this rank holds, the final weights' hashes, and which
Lightning modules were loaded.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_sparse import SparseTraining

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = runpy.run_path(
    str(ROOT / "examples" / "plain_loop.py"), run_name="plain_loop"
)
PHASES = [
    {"sparsity": 0.5, "algorithm": "rigl", "update_every": 2, "until": 0.4},
    {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2, "until": 0.8},
    {"sparsity": 0.0},
]


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run(total: int, stop_at: int | None, path: Path, resume: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(1 if resume else 0)  # the same initial weights on every rank
    model = DistributedDataParallel(EXAMPLE["TinyLM"](dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sparsity = SparseTraining(
        model,
        optimizer,
        phases=PHASES,
        params=EXAMPLE["PARAMS"],
        total_steps=total,
        verbose=False,
    )
    start = 0
    if resume:
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sparsity.load_state_dict(state["sparsity"])
        start = sparsity.current_step
    steps: dict[str, dict[str, str]] = {}
    for step in range(start, total):
        inputs, targets = EXAMPLE["batch"](step, rank)  # each rank its own batch
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        sp = sparsity.sparsifier
        steps[str(step)] = {
            t.name: digest(mask)
            for t in sp.targets
            if (mask := sp.current_mask(t)) is not None
        }
        sparsity.step()
        optimizer.zero_grad()
        if step + 1 == stop_at:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sparsity": sparsity.state_dict(),  # a collective: on every rank
            }
            if rank == 0:
                torch.save(state, path)
            dist.barrier()
            return {"steps": steps}
    sparsity.end()
    weights = {k: digest(v) for k, v in model.module.state_dict().items()}
    return {"steps": steps, "weights": weights}


def main() -> None:
    config = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    out = Path(config["out"])
    path = out / "mid.pt"
    total, stop = config["total_steps"], config["checkpoint_step"]
    report = {
        "full": run(total, None, path, resume=False),
        "first": run(total, stop, path, resume=False),
        "resumed": run(total, None, path, resume=True),
        "lightning": sorted(
            m
            for m in sys.modules
            if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
        ),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
