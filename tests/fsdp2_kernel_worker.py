"""One rank of the FSDP2 2:4 kernel job (started by ``tests/multiprocess.py``).

The cuSPARSELt path runs on the CPU: a pretend sm90 GPU for the capability rules, the custom
ops of :mod:`lightning_sparse.backends.cusparselt` as they are, and for cuSPARSELt's matmul a
dense stand-in that unpacks the bytes it is given (``helpers.dense_cusparselt``), so what was
packed is what is multiplied. Each run of ``runs`` trains the same 2-block model under DDP or
FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard`` on each block, then the root;
with a bf16 ``MixedPrecisionPolicy`` or under autocast), eagerly or compiled per block, and
records per optimizer step: the loss, a hash of the whole weights, of the masks and of the
exported state dict, the 2:4 matmuls by layer (forward and input gradient) and how their
weights were packed, the graphs compiled so far, and whether each layer's stored-mask
packing holds its current whole mask. A run with ``resume`` writes a checkpoint (a
distributed one under FSDP2) and resumes from it. Three
small checks without Lightning follow (:func:`speed_shapes`, :func:`agreed_kernel_checks`,
:func:`tensor_parallel`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distributed_worker import (
    RankBatches,
    RankRNG,
    job_trainer,
    step_checkpoints,
    tensor_hash,
)
from helpers import dense_cusparselt, pretend_gpu
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.algorithms import build_algorithm
from lightning_sparse.backends import cusparselt, kernel_check, speed
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.forwards import LayerForwards
from lightning_sparse.engine.sharding import gather_full, is_sharded

INPUTS, HIDDEN, OUTPUTS = 128, 384, 256
LLAMA_DEMO = "llama_1b_fsdp2_cpu_demo.yaml"


class Block(nn.Module):
    """One Linear and its activation: the unit FSDP2 shards and ``torch.compile`` compiles."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class BlockModule(L.LightningModule):
    """Two blocks and a dense head, sharded (``fsdp2``) and compiled per block (by
    ``compiler``) as ``run`` says, in ``configure_model`` as LLM training scripts do."""

    def __init__(self, run: dict[str, Any], compiler: Any = "aot_eager") -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(INPUTS, HIDDEN), Block(HIDDEN, OUTPUTS))
        self.head = nn.Linear(OUTPUTS, 4)
        self.run, self.compiler = run, compiler

    def configure_model(self) -> None:
        if self.run["strategy"] == "fsdp2":
            mesh = self.device_mesh["data_parallel"]
            policy = (
                MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
                if self.run.get("mixed_precision_policy")
                else MixedPrecisionPolicy()
            )
            for block in self.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self, mesh=mesh, mp_policy=policy)
        if self.run.get("compile"):
            for block in self.blocks:
                block.compile(backend=self.compiler)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # float32 loss whichever dtype the forward ran in
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class KernelCalls:
    """The 2:4 matmuls (cuSPARSELt's, on the stand-in) of each optimizer step, by the shape
    ``"<out>x<in>"`` of the weight they multiply by (``W`` in a forward, ``W.T`` in an input
    gradient: the whole weight's, not a shard's), the dtypes they ran in, and the graphs
    compiled by then; the kernel check's own matmuls at fit start are not counted."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.step: int | None = None
        self.calls: dict[int, Counter] = {}
        self.dtypes: set[str] = set()
        self.compiles = 0
        matmul = cusparselt._sparse_mm

        def recorded(packed, out_features, dense, bias):
            if self.step is not None:
                shape = f"{out_features}x{dense.shape[1]}"
                self.calls.setdefault(self.step, Counter())[shape] += 1
                self.dtypes.add(str(dense.dtype))
            return matmul(packed, out_features, dense, bias)

        patch.setattr(cusparselt, "_sparse_mm", recorded)

    def backend(self, gm: Any, example_inputs: Any) -> Any:
        """``aot_eager``, counting the graphs it compiles."""
        self.compiles += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class StepRecord(L.Callback):
    """Placed after the SparsityCallback: what each optimizer step left (see the module
    docstring), on this rank."""

    def __init__(self, kernel: KernelCalls) -> None:
        self.kernel = kernel
        self.sparsity: SparsityCallback | None = None
        self.steps: dict[int, dict[str, Any]] = {}
        self.choices: dict[str, list[str]] = {}
        self.checked: list[list[str]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        (self.sparsity,) = [
            cb for cb in trainer.callbacks if isinstance(cb, SparsityCallback)
        ]

    def on_train_start(self, trainer, pl_module) -> None:
        self.choices = {
            f"{index} {name}": [choice.name, choice.reason]
            for (index, name), choice in self.sparsity.sparsifier.backends.items()
        }
        # the (kernel, dtype) pairs the kernel check ran for at fit start
        self.checked = sorted(
            [kernel, str(dtype)] for kernel, dtype, _ in kernel_check._VERDICTS
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.kernel.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the step just taken
        self.kernel.step = None
        sp = self.sparsity.sparsifier
        weights = {n: gather_full(p.detach()) for n, p in pl_module.named_parameters()}
        masks = sp.state_dict()["masks"]  # whole masks (gathered when sharded)
        self.steps[step] = {
            "loss": float(outputs["loss"]).hex(),
            "weights": {n: tensor_hash(w) for n, w in sorted(weights.items())},
            "masks": {k: tensor_hash(m) for k, m in sorted(masks.items())},
            "export": {
                k: tensor_hash(v) for k, v in export_state_dict(trainer).items()
            },
            "calls": dict(self.kernel.calls.get(step, {})),
            "compiles": self.kernel.compiles,
            "packing": packings(sp),
            "sharded": [
                is_sharded(t.param) and is_sharded(sp.masks.get(t.name))
                for t in sp.targets
            ],
            "param_dtypes": sorted({str(t.param.dtype) for t in sp.targets}),
        }


def packings(sp) -> dict[str, bool]:
    """For each layer with a stored mask on cuSPARSELt: whether the packing its forward
    reads holds the current whole mask (refreshed on this rank after each update)."""
    found = {}
    for t in sp.targets:
        packing = t.module.__dict__.get("_ls_packing")
        if packing is not None:
            whole = gather_full(sp.masks[t.name])
            found[t.name] = bool(torch.equal(packing.mask, whole))
    return found


def fit(
    cfg: dict[str, Any],
    run: dict[str, Any],
    out: Path,
    kernel: KernelCalls,
    ckpt_path: str | None = None,
) -> dict[str, Any]:
    rank = int(os.environ["LOCAL_RANK"])
    strategy_name = run["strategy"]
    kernel.calls, kernel.dtypes, kernel.compiles = {}, set(), 0
    kernel_check.forget_verdicts()  # as a new process: each fit checks again
    torch._dynamo.reset()
    L.seed_everything(cfg["seed"])
    model = BlockModule(run, kernel.backend)
    strategy: Any = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if strategy_name == "fsdp2"
        else "ddp"
    )
    # FSDP2's MixedPrecisionPolicy casts the gathered weights; its DDP counterpart autocasts
    mixed = run.get("mixed_precision_policy") and strategy_name == "fsdp2"
    precision = "32-true" if mixed else "bf16-mixed"
    sparsity = SparsityCallback(
        phases=cfg["phases"], params=["blocks.*.fc.weight"], verbose=False
    )
    record = StepRecord(kernel)
    callbacks: list[L.Callback] = [RankRNG(), sparsity, record]
    if run.get("resume"):
        callbacks.append(step_checkpoints(out, cfg["checkpoint_step"]))
    trainer = job_trainer(
        strategy,
        cfg["max_steps"],
        callbacks,
        precision=precision,
        enable_checkpointing=bool(run.get("resume")),
    )
    data = DataLoader(RankBatches(rank, inputs=INPUTS), batch_size=8)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {
        "steps": record.steps,
        "choices": record.choices,
        "checked": record.checked,
        "kernel_dtypes": sorted(kernel.dtypes),
    }


def sharded_layer(**options: Any) -> tuple[list[Any], LayerForwards]:
    """A Linear sharded by FSDP2 (bf16 ``MixedPrecisionPolicy``) and the backends the engine
    chooses for it in a runtime 2:4 phase, with ``options`` (e.g. ``verify_speed``)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(INPUTS, HIDDEN))
    fully_shard(net[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    targets = select_parameters(net, params=["0.weight"]).targets
    phases = resolve_phases([Phase(sparsity="2:4")], 10)
    algorithms = {0: build_algorithm(phases[0])}
    return targets, LayerForwards("layer", targets, phases, algorithms, **options)


def speed_shapes() -> dict[str, Any]:
    """``verify_speed`` on a layer sharded by FSDP2 times the whole shape, not the shard."""
    timed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            speed,
            "measure_speedup",
            lambda shape, dtype, *args, **kw: (
                timed.append([*shape, str(dtype)]) or speed.SpeedMeasurement(1.2, 0.0)
            ),
        )
        targets, forwards = sharded_layer(verify_speed=True)
    choice = forwards.choices[0, "0.weight"]
    local = list(targets[0].param.to_local().shape)
    return {"timed": timed, "local": local, "choice": [choice.name, choice.reason]}


def agreed_kernel_checks() -> dict[str, Any]:
    """The kernel check passes on rank 0 and fails on rank 1 (a scrambled kernel there): both
    ranks run the FSDP2-sharded layer with masked math, and say why."""
    rank = int(os.environ["LOCAL_RANK"])
    kernel_check.forget_verdicts()
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            right = ss.KERNELS["cusparselt"]
            patch.setitem(
                ss.KERNELS,
                "cusparselt",
                lambda x, w, b, mask, packing: right(x, w.flip(1), b, mask, packing),
            )
        with pytest.warns(RuntimeWarning) if rank == 1 else contextlib.nullcontext():
            _, forwards = sharded_layer()
    kernel_check.forget_verdicts()
    choice = forwards.choices[0, "0.weight"]
    return {"name": choice.name, "reason": choice.reason}


class MemoryCensus(L.Callback):
    """Placed after the SparsityCallback: this rank's bytes (by storage,
    :mod:`~lightning_sparse.engine.memory_census`) of what plan counts, measured at optimizer
    step ``step`` of a sparse phase (the items of :class:`~lightning_sparse.cli.memory.PhaseMemory`),
    and the plan's prediction for the same sparsifier (``phase_memory``, 2 shards, bf16
    matmuls). The mask choice at the phase start is measured by :class:`HeldBytes` over the
    weights the engine gathers and the masks the algorithm returns."""

    def __init__(self, patch: pytest.MonkeyPatch, step: int) -> None:
        from lightning_sparse.engine import sparsifier as engine
        from lightning_sparse.engine.memory_census import HeldBytes

        self.step, self.found, self.choice = step, {}, HeldBytes()
        self.saved: list[torch.Tensor] = []
        self.inputs: set[int] = set()
        self.inside = 0
        gather = engine.gather_full
        patch.setattr(engine, "gather_full", lambda t: self.choice.add(gather(t)))
        self.patch = patch

    def on_fit_start(self, trainer, pl_module) -> None:
        (cb,) = [c for c in trainer.callbacks if isinstance(c, SparsityCallback)]
        self.sparsity = cb
        for algo in cb.sparsifier.algorithms.values():
            choose = algo.initial_mask
            self.patch.setattr(
                algo, "initial_mask", lambda *a, c=choose: self.choice.add(c(*a))
            )
        for t in cb.sparsifier.targets:
            t.module.register_forward_pre_hook(self._enter)
            t.module.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        self.inside += 1
        self.inputs.add(args[0].untyped_storage().data_ptr())

    def _leave(self, module, args, output) -> None:
        self.inside -= 1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.inside:
            self.saved.append(t)
        return t

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(
                self._pack, lambda t: t
            )
            self.hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        from lightning_sparse.engine.memory_census import storage_bytes

        if trainer.global_step == self.step:
            self.hooks.__exit__(None, None, None)
            own = [
                t
                for t in self.saved
                if t.untyped_storage().data_ptr() not in self.inputs
            ]
            self.found["until_backward"] = storage_bytes(own)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning_sparse.engine.memory_census import storage_bytes

        if trainer.global_step == self.step:
            grads = [p.grad for p in pl_module.parameters()]
            self.found["gradients"] = storage_bytes(grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_sparse.cli.memory import phase_memory
        from lightning_sparse.engine.memory_census import storage_bytes

        if trainer.global_step - 1 != self.step:
            return
        sp = self.sparsity.sparsifier
        (optimizer,) = trainer.optimizers
        state = [v for s in optimizer.state.values() for v in s.values()]
        modules = [t.module.__dict__ for t in sp.targets]
        packings = [m.get("_ls_packing") for m in modules]
        self.found |= {
            "parameters": storage_bytes(pl_module.parameters()),
            "optimizer_state": storage_bytes(v for v in state if v.dim() > 0),
            "masks": storage_bytes(sp.masks.values()),
            "whole_masks": storage_bytes(m.get("_ls_mask") for m in modules),
            "packing": storage_bytes(
                t for p in packings if p is not None for t in p.op_arguments()
            ),
            "at_mask_choice": self.choice.peak,
        }
        (predicted, _) = phase_memory(sp, 2, torch.bfloat16, pl_module.parameters())
        self.predicted = {k: getattr(predicted, k) for k in self.found}


def llama_demo(out: Path, kernel: KernelCalls) -> dict[str, Any]:
    """The Llama FSDP2 CPU demo recipe through the command line for 3 steps (2 on 2:4): its
    MLPs choose the kernel and run it, per step, on the weights FSDP2 gathers."""
    from lightning_sparse.cli.main import SparseCLI

    kernel.calls, kernel.dtypes = {}, set()
    record = StepRecord(kernel)
    patch = pytest.MonkeyPatch()
    census = MemoryCensus(patch, step=1)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "hf" / LLAMA_DEMO
    cli = SparseCLI(
        args=[
            "fit",
            f"--config={recipe}",
            "--trainer.max_steps=3",
            "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={out}",
        ],
        trainer_defaults={"callbacks": [record, census]},
    )
    patch.undo()
    return {
        "memory": {"measured": census.found, "predicted": census.predicted},
        "choices": record.choices,
        "calls": {step: record.steps[step]["calls"] for step in record.steps},
        "kernel_dtypes": sorted(kernel.dtypes),
        "loss": float(cli.trainer.callback_metrics["train/loss"]),
    }


SAVED_MODES = ("runtime", "stored", "stored unpacked")


def saved_for_backward() -> dict[str, Any]:
    """What each 2:4 layer's cuSPARSELt ops save for the backward under FSDP2 (a 2-layer
    model, ``fully_shard`` per layer, resharded after the forward), seen by
    ``saved_tensors_hooks`` and read between the forward and the backward: per layer, each
    saved tensor of at least a quarter of the weight's elements as ``[shape, bytes its storage
    holds then, what it is]``. Modes: ``runtime`` (projected in the forward), ``stored`` (a
    stored mask, packed at its positions) and ``stored unpacked`` (a stored mask at a shape
    treated as one our packer does not know); each with a bf16 ``MixedPrecisionPolicy`` and
    under autocast (float32 gathered weights)."""
    from lightning_sparse.masks.tiles import transposable_2to4_mask

    found: dict[str, Any] = {}
    for precision in ("mixed precision policy", "autocast"):
        for mode in SAVED_MODES:
            with pytest.MonkeyPatch.context() as patch:
                if mode == "stored unpacked":
                    patch.setattr(ss, "packs_stored_masks", lambda shape: False)
                found[f"{mode}, {precision}"] = _saved(
                    precision == "autocast", mode != "runtime", transposable_2to4_mask
                )
    return found


def _saved(autocast: bool, stored: bool, choose: Any) -> dict[str, list]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(INPUTS, HIDDEN), nn.Linear(HIDDEN, OUTPUTS))
    dtype = None if autocast else torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for layer in net:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=True)
    fully_shard(net, mp_policy=policy)
    held: dict[
        int, str
    ] = {}  # storages kept anyway: the stored masks and their packings
    current: list[str] = []
    for name, layer in net.named_children():
        mask = choose(gather_full(layer.weight.detach())) if stored else None
        ss.install_semi_structured_forward(layer, "cusparselt", mask)
        packing = layer._ls_packing
        for t in [mask, *(packing.op_arguments() if packing else ())]:
            if t is not None:
                held[t.untyped_storage().data_ptr()] = "stored mask"
        layer.register_forward_pre_hook(lambda m, args, name=name: current.append(name))
    saved: dict[str, list[torch.Tensor]] = {
        name: [] for name, _ in net.named_children()
    }

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[current[-1]].append(t)
        return t

    x = torch.randn(8, INPUTS, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        net(x).float().sum().backward()  # a first step: the kernel check runs before it
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(x)
    found = {}
    for name, layer in net.named_children():
        numel = layer.weight.numel()
        found[name] = [
            [list(t.shape), t.untyped_storage().nbytes(), held.get(storage, "")]
            for t in saved[name]
            if t.numel() >= numel // 4
            for storage in [t.untyped_storage().data_ptr()]
        ]
    out.float().sum().backward()
    return found


MASK_CHOICE_WIDTHS = (128, 384, 256, 384, 128)  # 4 Linears, the largest 256x384


def mask_choice_peak() -> dict[str, Any]:
    """The bytes a mask choice holds at once (:class:`PeakBytes`) for 4 Linear weights in a
    ``gmp`` phase (hard masks), sharded by FSDP2 and, as the reference, the same model
    unsharded: at the phase start (step 0) and at the update of step 1 (after a backward: the
    weights have gradients); each with what is still held when it ends, and the whole bytes of
    each layer's weight."""
    torch.manual_seed(0)
    widths = MASK_CHOICE_WIDTHS
    net = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    plain = copy.deepcopy(net)
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    x = torch.randn(4, widths[0])
    found: dict[str, Any] = {"weights": [layer.weight.nbytes for layer in plain]}
    for name, model in (("sharded", net), ("plain", plain)):
        found[name] = _mask_choice_peaks(model, x)
    return found


def _mask_choice_peaks(net: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    from lightning_sparse.engine.memory_census import PeakBytes
    from lightning_sparse.engine.sparsifier import Sparsifier

    targets = select_parameters(net, params=["*.weight"]).targets
    phase = Phase(sparsity=0.5, algorithm="gmp", initial_sparsity=0.25, update_every=1)
    sp = Sparsifier("peak", targets, resolve_phases([phase], 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with PeakBytes() as start:
        sp.on_step_start(0, [optimizer])
    net(x).sum().backward()
    sp.on_step_start(1, [optimizer])
    with PeakBytes() as update:
        updated = sp.before_optimizer_step(1, optimizer, [optimizer])
    masks = {n: tensor_hash(m) for n, m in sorted(sp.state_dict()["masks"].items())}
    sp.close()
    return {
        "start": [start.peak, start.held],
        "update": [update.peak, update.held],
        "updated": updated,
        "masks": masks,
    }


def llama_demo_memory(out: Path) -> dict[str, Any]:
    """The Llama FSDP2 CPU demo recipe as it runs on the CPU (masked math), 2 steps: this
    rank's memory measured at step 0 (:class:`MemoryCensus`) and as plan predicts it."""
    from lightning_sparse.cli.main import SparseCLI

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "hf" / LLAMA_DEMO
    with pytest.MonkeyPatch.context() as patch:
        census = MemoryCensus(patch, step=0)
        SparseCLI(
            args=[
                "fit",
                f"--config={recipe}",
                "--trainer.max_steps=2",
                "--trainer.limit_val_batches=0",
                f"--trainer.default_root_dir={out}",
            ],
            trainer_defaults={"callbacks": [census]},
        )
    return {"measured": census.found, "predicted": census.predicted}


def tensor_parallel() -> str:
    """A weight sharded as a DTensor without FSDP2 (as tensor parallelism does): its
    forward would multiply a DTensor, which the 2:4 kernels do not take."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_sparse.backends.capability import semi_structured_kernel

    mesh = init_device_mesh("cpu", (2,))
    layer = nn.Linear(INPUTS, HIDDEN)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight, mesh, [Shard(0)]))
    kernel, why = semi_structured_kernel(
        layer.weight, [("fc", layer, "weight")], torch.bfloat16
    )
    assert kernel is None
    return why


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = Path(cfg["out"])
    report: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        pretend_gpu(patch, (9, 0))
        dense_cusparselt(patch)
        patch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
        kernel = KernelCalls(patch)
        for name, run in cfg["runs"].items():
            where = out / name.replace(" ", "_")
            report[name] = fit(cfg, run, where, kernel)
            if run.get("resume"):
                ckpt = where / "ckpt" / f"step={cfg['checkpoint_step']}.ckpt"
                report[name]["checkpoint_is_a_directory"] = ckpt.is_dir()
                report[f"{name} resumed"] = fit(
                    cfg, run, where / "resumed", kernel, str(ckpt)
                )
        report["llama_demo"] = llama_demo(out / "llama_demo", kernel)
        report["saved_for_backward"] = saved_for_backward()
        report["mask_choice_peak"] = mask_choice_peak()
        report["speed_shapes"] = speed_shapes()
        report["agreed_kernel_checks"] = agreed_kernel_checks()
        report["tensor_parallel"] = tensor_parallel()
    report["llama_demo_masked"] = llama_demo_memory(out / "llama_demo_masked")
    rank = int(os.environ["LOCAL_RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    # end without the interpreter's shutdown, as tests/distributed_worker.py explains
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
