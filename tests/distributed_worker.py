"""One rank of a 2-process CPU job (started by ``tests/multiprocess.py``).

For each strategy in ``strategies`` (``"ddp"``, or ``"fsdp2"``: Lightning's
``ModelParallelStrategy`` with ``fully_shard`` on every Linear layer), runs a full ``fit`` with a
checkpoint at ``checkpoint_step``, then a second ``fit`` that resumes from it, and records, per
optimizer step, a hash of every mask as this rank sees it (after the step's mask update), the
logged flip rates and actual sparsities, plus a hash of the final weights. With ``by_name``, it does the same under DDP for a model whose
parameter names sort out of model order, resuming from several checkpoints (:func:`by_name`);
with ``rank_rng``, it resumes a dropout model whose ranks draw differently (:func:`rank_rng`).
One job serves every strategy: starting processes is the slow part.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from helpers import (
    MetricsLog,
    OutOfOrderModule,
    RepeatedBatch,
    StopAfterEpoch,
    TinyModule,
    WithDropout,
    fast_trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sharding import gather_full, is_sharded
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import target_mask
from lightning_sparse.masks.tiles import is_transposable_2to4

STATE_KEY = "SparsityCallback{'name': 'sparsity'}"


class ShardedTinyModule(TinyModule):
    """TinyModule sharded with FSDP2: every Linear layer, then the root."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in self.net.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)


class RankBatches(RepeatedBatch):
    """Every batch of a rank is the same, and each rank has its own: so gradients differ between
    ranks before DDP/FSDP averages them, and a resume mid-epoch sees the batches of the
    uninterrupted run (Lightning restarts the epoch's loader; see DESIGN.md pitfalls)."""

    def __init__(self, rank: int, inputs: int = 8) -> None:
        super().__init__(n=32, batch_size=8, inputs=inputs)
        self.x = self.x + rank


def tensor_hash(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(str((tuple(data.shape), data.dtype)).encode())
    digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class RankRNG(L.Callback):
    """Re-seeds the global RNG per rank and per run once training starts (after Lightning's own
    re-seeding with the global seed, which would otherwise keep the ranks in step)."""

    def on_train_start(self, trainer, pl_module) -> None:
        torch.manual_seed(1000 + 10 * trainer.global_rank + (trainer.global_step > 0))


class MaskHashes(L.Callback):
    """Placed after the SparsityCallback: records the masks after each step's update, and the
    export of the model at that point."""

    def __init__(self, sparsity: SparsityCallback) -> None:
        self.sparsity = sparsity
        self.steps: dict[int, dict[str, Any]] = {}
        self.restored: dict[str, str] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        # the masks the engine holds once activated (restored, on a resume), by name
        sp = self.sparsity.sparsifier
        self.restored = {
            name: tensor_hash(gather_full(mask)) for name, mask in sp.masks.items()
        }

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sp = self.sparsity.sparsifier
        state = sp.state_dict()
        masks = state["masks"]  # whole masks (gathered when sharded)
        logits = state.get("learned", {}).get("logits", {})  # after this step's update
        self.steps[trainer.global_step] = {
            "phase": None if sp.current is None else sp.current.index,
            "masks": {k: tensor_hash(m) for k, m in sorted(masks.items())},
            "logits": {k: tensor_hash(v) for k, v in sorted(logits.items())},
            "kept": {k: int(m.sum()) for k, m in sorted(masks.items())},
            # every mask 2:4 along the rows and the columns of its 4x4 tiles
            "transposable": bool(masks)
            and all(is_transposable_2to4(m) for m in masks.values()),
            "sharded": any(is_sharded(t.param) for t in sp.targets),
            # what a user exporting now would get (gathered and folded on every rank)
            "export": {
                k: tensor_hash(v) for k, v in export_state_dict(trainer).items()
            },
        }


def step_checkpoints(out: Path, every: int) -> ModelCheckpoint:
    """A checkpoint every ``every`` optimizer steps in ``out/ckpt``, named ``step=<n>.ckpt``
    (a directory under FSDP2: a distributed checkpoint), all kept."""
    return ModelCheckpoint(
        dirpath=out / "ckpt",
        every_n_train_steps=every,
        save_top_k=-1,
        filename="{step}",
    )


def job_trainer(
    strategy: Any, max_steps: int, callbacks: list[L.Callback], **kwargs: Any
) -> L.Trainer:
    """A deterministic trainer on this job's 2 processes; each rank feeds its own batches
    (:class:`RankBatches`), so no distributed sampler."""
    return fast_trainer(
        strategy=strategy,
        devices=2,
        max_steps=max_steps,
        callbacks=callbacks,
        deterministic=True,
        use_distributed_sampler=False,
        **kwargs,
    )


def fit(
    cfg: dict[str, Any], strategy_name: str, out: Path, ckpt_path: str | None
) -> dict[str, Any]:
    rank = int(os.environ["LOCAL_RANK"])
    # Every rank builds the same model (FSDP2 does not broadcast: each rank keeps its shards of
    # its own copy) and sees the same data order; RankRNG then makes the global RNG differ per
    # rank, so a mask that depended on it (instead of the weights, gradients and name-derived
    # seeds) would differ between ranks, and between a run and its resume.
    L.seed_everything(cfg["seed"])
    model: L.LightningModule
    strategy: Any
    if cfg.get("model") == "out_of_order":
        assert strategy_name == "ddp"
        model, strategy = OutOfOrderModule(), "ddp"
    elif strategy_name == "ddp":
        model, strategy = TinyModule(lr=0.05), "ddp"
    else:
        model = ShardedTinyModule(lr=0.05)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    # verbose: the summary gathers too; logging every step measures every step's flip rate
    sparsity = SparsityCallback(
        phases=cfg["phases"], params=cfg.get("params"), log_every_n_steps=1
    )
    log = MetricsLog()  # records on every rank
    hashes = MaskHashes(sparsity)
    ckpt = step_checkpoints(out, cfg["checkpoint_step"])
    trainer = job_trainer(
        strategy,
        cfg["max_steps"],
        [RankRNG(), sparsity, hashes, ckpt],
        logger=log,
        enable_checkpointing=True,
    )
    data = DataLoader(RankBatches(rank), batch_size=8)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    full = {name: gather_full(p).detach().cpu() for name, p in model.named_parameters()}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)  # a short resume writes no checkpoint
        torch.save(full, out / "final_weights.pt")
    weights = {name: tensor_hash(value) for name, value in full.items()}
    return {
        "steps": hashes.steps,
        "restored": hashes.restored,
        "weights": weights,
        "history": sparsity.sparsifier.history,
        "flip_rate": log.series("sparsity/sparsity/flip_rate"),
        "actual": [
            [step, m["sparsity/sparsity/actual"]]
            for step, m in log.records
            if "sparsity/sparsity/actual" in m
        ],
    }


def by_name(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """DDP runs of :class:`OutOfOrderModule` (names that sort out of model order): a full run
    with a checkpoint every ``checkpoint_step`` steps, and one resume from each of the
    ``resume_steps``, with the masks each checkpoint saved (by name)."""
    cfg = {**cfg, "model": "out_of_order", "params": OutOfOrderModule.PARAMS}
    report = {"full": fit(cfg, "ddp", out, None)}
    for step in cfg["resume_steps"]:
        ckpt = out / "ckpt" / f"step={step}.ckpt"
        run = fit(cfg, "ddp", out / f"resumed{step}", str(ckpt))
        state = torch.load(ckpt, weights_only=False)["callbacks"][STATE_KEY]
        run["saved"] = {
            key.removesuffix("_mask"): tensor_hash(mask)
            for key, mask in state["masks"].items()
        }
        report[f"resumed{step}"] = run
    return report


def odd_shards() -> dict[str, Any]:
    """Masks on shards split along dim 1, or unevenly (5 rows over 2 ranks), equal the
    whole-tensor top-k, for a hard mask and a straight-through one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5), nn.Linear(5, 2))
    fully_shard(net[0], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(net[2])  # Shard(0): 3 rows on rank 0, 2 on rank 1
    fully_shard(net)
    report = {}
    for phase in (Phase(sparsity=0.55), Phase(sparsity=0.45, algorithm="magnitude")):
        targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
        sparsifier = Sparsifier("odd", targets, resolve_phases([phase], 10))
        sparsifier.on_step_start(0, [])
        saved = sparsifier.state_dict()["masks"]
        for t in targets:
            expected = target_mask(gather_full(t.param.detach()).abs(), phase.target)
            report[f"{phase.algorithm} {t.name}"] = {
                "equal": bool(torch.equal(saved[f"{t.name}_mask"], expected.cpu())),
                "local_shape": list(sparsifier.masks[t.name].to_local().shape),
                "placements": str(t.param.placements),
            }
        sparsifier.close()
    return report


def agreed_backends() -> dict[str, Any]:
    """``verify_speed`` timed 1.05x on rank 0 and 0.95x on rank 1 (a pretend sm90 GPU, the
    kernel check passed): both ranks keep the layers dense, and say why."""
    from lightning_sparse.algorithms import build_algorithm
    from lightning_sparse.backends import capability
    from lightning_sparse.backends.speed import SpeedMeasurement
    from lightning_sparse.engine import forwards

    rank = int(os.environ["LOCAL_RANK"])
    capability.device_capability = lambda device: (9, 0)
    capability.cusparselt_available = lambda: True
    ratio = (1.05, 0.95)[rank]
    forwards.SpeedCheck = lambda *args, **options: (
        lambda weight, kernel, dtype, stored: SpeedMeasurement(ratio, 0.0)
    )
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    targets = select_parameters(net, params=["0.weight"]).targets
    phases = resolve_phases([Phase(sparsity="2:4")], 10)
    chosen = forwards.LayerForwards(
        "agree", targets, phases, {0: build_algorithm(phases[0])},
        compute_dtype=torch.bfloat16, verify_speed=True,
    ).choices[0, "0.weight"]  # fmt: skip
    return {"name": chosen.name, "reason": chosen.reason}


class RankSeeded(L.Callback):
    """Seeds the global generators differently on each rank at setup (before a resume restores
    them), so each rank draws its own dropout masks."""

    def setup(self, trainer, pl_module, stage) -> None:
        torch.manual_seed(2000 + trainer.global_rank)


def rank_rng(out: Path) -> dict[str, Any]:
    """DDP with dropout drawn differently on each rank: 3 epochs in one run, and in a run that
    stops after the first epoch (a checkpoint) and its resume, with and without
    ``restore_rng``: a hash of the final weights of each run."""
    rank = int(os.environ["LOCAL_RANK"])
    report: dict[str, Any] = {}
    for restore in (True, False):
        folder = out / f"restore_rng={restore}"
        checkpoint = folder / "epoch=0.ckpt"
        for run, stop, ckpt_path in (
            ("full", None, None),
            ("stopped", 0, None),
            ("resumed", None, str(checkpoint)),
        ):
            L.seed_everything(0)
            model = WithDropout()
            callbacks = [
                RankSeeded(),
                SparsityCallback(sparsity=0.5, verbose=False, restore_rng=restore),
            ]
            if stop is not None:
                callbacks += [
                    StopAfterEpoch(stop),
                    ModelCheckpoint(folder, "{epoch}", save_top_k=-1),
                ]
            trainer = fast_trainer(
                strategy="ddp",
                devices=2,
                max_epochs=3,
                callbacks=callbacks,
                enable_checkpointing=stop is not None,
                deterministic=True,
                use_distributed_sampler=False,  # RankBatches splits the data
            )
            loader = DataLoader(RankBatches(rank), batch_size=8, shuffle=True)
            trainer.fit(model, loader, ckpt_path=ckpt_path)
            weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
            report[f"{run} restore_rng={restore}"] = hashlib.sha256(weights).hexdigest()
    return report


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report: dict[str, Any] = {}
    for strategy in cfg["strategies"]:
        out = Path(cfg["out"]) / strategy
        ckpt = out / "ckpt" / f"step={cfg['checkpoint_step']}.ckpt"
        report[strategy] = {
            "full": fit(cfg, strategy, out, None),
            "resumed": fit(cfg, strategy, out / "resumed", str(ckpt)),
        }
    if "by_name" in cfg:
        report["by_name"] = by_name(
            {**cfg["by_name"], "seed": cfg["seed"]}, Path(cfg["out"]) / "by_name"
        )
    if "fsdp2" in cfg["strategies"]:
        report["odd_shards"] = odd_shards()
    if cfg.get("rank_rng"):
        report["rank_rng"] = rank_rng(Path(cfg["out"]) / "rank_rng")
    report["agreed_backends"] = (
        agreed_backends()
    )  # last: it patches the capability rules
    rank = int(os.environ["LOCAL_RANK"])
    (Path(cfg["out"]) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    # The report is written: end here, without the interpreter's shutdown. The gloo process
    # groups are still alive (Lightning destroys only NCCL ones at exit, and torch's DTensor
    # caches keep the device meshes' groups alive even after destroy_process_group), and a gloo
    # worker thread that releases a finished collective once finalization has begun must take
    # the GIL, which ends the thread inside a C++ destructor: "terminate called without an
    # active exception", exit code 134 (issue 23: one job in ten failed so).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
