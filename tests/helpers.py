"""Tiny models and a fast Trainer for the tests."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_sparse import SparsityCallback, kernels
from lightning_sparse.algorithms import build_algorithm
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import ParamTarget, select_parameters
from lightning_sparse.engine.forwards import LayerForwards

FEW_UPDATES = pytest.mark.filterwarnings(
    r"ignore:\[\w+\] phase \d+ \(.*\). (its ramp|\w+ has (one|no) mask update)"
)
"""Leaves out the warning of a ``gmp``, ``set`` or ``rigl`` phase with too few mask updates for
its length (``tests/test_few_updates.py`` checks it): a test's few steps give phases few updates
on purpose."""


class TinyNet(nn.Module):
    """Two hidden Linear layers (sparsified by default) and an output head (left dense)."""

    def __init__(self, width: int = 16, inputs: int = 8, outputs: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TinyModule(L.LightningModule):
    """Regression on random data; records hooks that tests inspect."""

    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        width: int = 16,
        inputs: int = 8,
    ) -> None:
        super().__init__()
        self.net = TinyNet(width, inputs)
        self.optimizer, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.val_outputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_outputs.append(self(x).detach())
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(
                self.parameters(),
                lr=self.lr,
                momentum=0.9,
                weight_decay=self.weight_decay,
            )
        return torch.optim.AdamW(
            self.parameters(), lr=self.lr, weight_decay=self.weight_decay
        )


class ReadsItsWeights(TinyModule):
    """A module whose ``__init__`` reads a value of its weights, which a model built on the
    meta device has not got."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = float(self.net.fc1.weight.detach().abs().max())


class WithDropout(TinyModule):
    """:class:`TinyModule` with dropout after both hidden layers."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        hidden = self.drop(torch.relu(net.fc1(x)))
        return net.head(self.drop(torch.relu(net.fc2(hidden))))


class StopAfterEpoch(L.Callback):
    """Ends the run after epoch ``epoch`` (counted from 0), as a job that runs out of time."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


class Classifier(L.LightningModule):
    """Cross-entropy on ``(input, label)`` batches for any network ``net``; ``example`` becomes
    its ``example_input_array``."""

    def __init__(
        self, net: nn.Module, example: torch.Tensor | None = None, lr: float = 1e-2
    ) -> None:
        super().__init__()
        self.model = net
        self.example_input_array = example
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def labelled_loader(
    shape: tuple[int, ...], classes: int, n: int = 8, batch_size: int = 4
) -> DataLoader:
    """``n`` random inputs of ``shape`` with labels below ``classes``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(classes, (n,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Block(nn.Module):
    """Three layers of one shape, defined out of alphabetical order (``up``, ``gate``, ``down``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)) * torch.sigmoid(self.gate(x)))


class OutOfOrderModule(L.LightningModule):
    """Twelve :class:`Block` s in an ``nn.Sequential``: 36 weights of one shape whose names sort
    out of model order (``blocks.10.*`` before ``blocks.2.*``, ``down`` before ``up``), so a
    mask restored to the wrong layer raises no shape error. Sparsify ``blocks.*.weight``."""

    PARAMS = ("blocks.*.weight",)

    def __init__(self, width: int = 8, lr: float = 1e-2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(12)])
        self.head = nn.Linear(width, 4)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class CompiledTiny(TinyModule):
    """TinyModule whose network runs through ``torch.compile`` (parameter names unchanged)."""

    def __init__(self, backend=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        object.__setattr__(self, "compiled", torch.compile(self.net, backend=backend))

    def forward(self, x):
        return self.compiled(x) if self.backend else self.net(x)


class CountingBackend:
    """A ``torch.compile`` backend: ``aot_eager`` (forward and backward traced by
    AOTAutograd), counting the graphs it compiles."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.compiles += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class Recompiles(L.Callback):
    """The graphs a :class:`CountingBackend` has compiled so far, before each optimizer step."""

    def __init__(self, backend: CountingBackend) -> None:
        self.backend = backend
        self.seen: dict[int, int] = {}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self.seen[trainer.global_step] = self.backend.compiles


def random_loader(
    n: int = 64, batch_size: int = 8, inputs: int = 8, seed: int = 0
) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=gen)
    y = torch.randn(n, 4, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class RepeatedBatch(Dataset):
    """Every batch of ``batch_size`` consecutive samples is the same batch, so a resumed run sees
    exactly the batches of the uninterrupted one even when Lightning restarts an epoch's loader."""

    def __init__(self, n: int = 32, batch_size: int = 8, inputs: int = 8) -> None:
        gen = torch.Generator().manual_seed(1)
        self.batch_size = batch_size
        self.x = torch.randn(batch_size, inputs, generator=gen)
        self.y = torch.randn(batch_size, 4, generator=gen)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % self.batch_size], self.y[i % self.batch_size]


class MetricsLog(Logger):
    """A logger that keeps every ``log_metrics`` call as ``(step, metrics)``, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def series(self, key: str) -> dict[int, float]:
        """``{step: value}`` of one metric (every step logged it at most once)."""
        steps = [step for step, metrics in self.records if key in metrics]
        assert len(steps) == len(set(steps)), f"{key} logged twice at one step: {steps}"
        return {step: m[key] for step, m in self.records if key in m}


def fast_trainer(**kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(**defaults)


class StopAt(L.Callback):
    """Ends the run after optimizer step ``step``, as an interruption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def resumable_fit(
    tmp_path: Any,
    callbacks: list[L.Callback],
    max_steps: int,
    stop_at: int | None = None,
    ckpt_path: Any = None,
    seed: int = 0,
    model: Callable[[], L.LightningModule] | None = None,
    loader: DataLoader | None = None,
) -> L.LightningModule:
    """Fit a :class:`TinyModule` (or ``model()``, built after seeding) on identical batches
    (see :class:`RepeatedBatch`; or ``loader``, which should repeat one batch too) for
    ``max_steps``; with ``stop_at``, stop after that step, writing ``step=<stop_at>.ckpt`` in
    ``tmp_path``; with ``ckpt_path``, resume from it. Returns the model (its ``trainer``
    attribute is the trainer that fit it)."""
    L.seed_everything(seed, verbose=False)
    module = TinyModule(lr=0.05, weight_decay=0.1) if model is None else model()
    callbacks = list(callbacks)
    if stop_at:
        checkpoint = ModelCheckpoint(
            dirpath=tmp_path,
            every_n_train_steps=stop_at,
            save_top_k=-1,
            filename="{step}",
        )
        callbacks += [StopAt(stop_at), checkpoint]
    trainer = fast_trainer(
        max_steps=max_steps,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(stop_at),
    )
    if loader is None:
        loader = DataLoader(RepeatedBatch(n=24, batch_size=6), batch_size=6)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module


class WeightsAtTrainStart(L.Callback):
    """A copy of the model's weights when training starts (after the callbacks before it, such
    as a SparsityCallback that prunes at step 0)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = {
            k: v.detach().clone() for k, v in pl_module.state_dict().items()
        }


class StepProbe(L.Callback):
    """Records, at every optimizer step, what the forward saw and what is stored."""

    def __init__(self, param: str = "net.fc1.weight") -> None:
        self.param = param
        self.stored_zero_fraction: dict[int, float] = {}
        self.grad_zero_where_pruned: dict[int, bool] = {}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        weight = pl_module.get_parameter(self.param)
        self.stored_zero_fraction[trainer.global_step] = float(
            (weight == 0).float().mean()
        )


def pretend_gpu(
    monkeypatch: Any, capability: tuple[int, int] = (8, 0), cusparselt: bool = True
) -> None:
    """Make the 2:4 capability rules see every parameter on a GPU of ``capability``; the
    sparse layers then run their emulation (the parameters are still on the CPU)."""
    from lightning_sparse.backends import capability as cap

    monkeypatch.setattr(cap, "device_capability", lambda device: capability)
    monkeypatch.setattr(cap, "cusparselt_available", lambda: cusparselt)


def slow_kernels(monkeypatch: Any, ratio: float = 0.12) -> None:
    """Make ``verify_speed`` time every weight, as on a GPU (its default times CUDA weights
    only), and find each 2:4 kernel ``ratio`` times dense speed: eager 2:4 at small shapes
    measured 0.10-0.13x on an H100, so ``verify_speed`` keeps such layers dense."""
    from lightning_sparse.backends import speed
    from lightning_sparse.engine import forwards

    class EverywhereCheck(speed.SpeedCheck):
        def __init__(self, tokens=None, timing=speed.EAGER, gpu_only=False) -> None:
            super().__init__(tokens, timing, gpu_only=False)

    def measured(shape, dtype, kernel, device, tokens, timing, stored):
        return speed.SpeedMeasurement(ratio, 0.0, timing=timing, tokens=tokens)

    monkeypatch.setattr(forwards, "SpeedCheck", EverywhereCheck)
    monkeypatch.setattr(speed, "measure_speedup", measured)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw 16-bit words of a float16/bfloat16 tensor, flat (to compare packed bytes)."""
    return t.contiguous().view(-1).view(torch.int16)


def assert_packs_as(w24: torch.Tensor, expected: torch.Tensor) -> None:
    """Our packer writes ``expected`` (cuSPARSELt's bytes) for ``w24``, stored zeros compared
    by value (``canonical_words``: a compressor may write ``-0.0`` into padding), and those
    bytes unpack to ``w24``."""
    from lightning_sparse.backends.cusparselt_packer import (
        canonical_words,
        compress,
        unpack,
    )

    got = compress(w24)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(canonical_words(got), canonical_words(expected))
    assert torch.equal(unpack(expected, w24.shape), w24)


def dense_cusparselt(monkeypatch: Any, packer_matches: bool = True) -> list[tuple]:
    """Run the cuSPARSELt custom ops on the CPU: their matmul is dense math on the weight that
    the packed bytes hold (unpacked by our packer), ``torch._cslt_compress`` returns the dense
    2:4 weight as it is, and our packer counts as matching it (or not). Returns the calls'
    ``(packed shape, tokens)``."""
    import torch.nn.functional as F

    from lightning_sparse.backends import cusparselt
    from lightning_sparse.backends.cusparselt_packer import unpack

    calls: list[tuple] = []

    def sparse_mm(packed, out_features, dense, bias):
        calls.append((tuple(packed.shape), dense.shape[0]))
        shape = (out_features, dense.shape[1])
        w24 = packed if tuple(packed.shape) == shape else unpack(packed, shape)
        return F.linear(dense, w24, bias)

    monkeypatch.setattr(cusparselt, "_sparse_mm", sparse_mm)
    monkeypatch.setattr(torch, "_cslt_compress", lambda w24: w24.clone())
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    monkeypatch.setattr(
        cusparselt, "_compare_packers", lambda dtype, device: packer_matches
    )
    return calls


def emulated_cusparselt(monkeypatch: Any, raw_padding: bool = False) -> None:
    """``torch._cslt_compress`` and ``torch._cslt_sparse_mm`` on the CPU, in the layout our
    packer writes (cuSPARSELt's, as captured on an H100): the compressor counts ``-0.0`` as
    zero and, with ``raw_padding``, copies the bits at padded positions as they are (as
    CUTLASS's sm90 compressor did, so a ``-0.0`` lands in the packed values); the matmul
    multiplies densely by the weight the bytes hold."""
    import torch.nn.functional as F

    from lightning_sparse.backends import cusparselt_packer as packer

    def cslt_compress(w24: torch.Tensor) -> torch.Tensor:
        out = packer.compress(w24)
        if raw_padding:
            keys = packer._keys(w24 != 0)
            positions = packer._tables(keys)[0].index_select(0, keys.view(-1))
            groups = w24.contiguous().view(torch.int16).view(-1, 4)
            torch.gather(groups, 1, positions, out=packer._regions(out)[0])
        return out

    def cslt_sparse_mm(packed, dense, bias=None, transpose_result=False, **options):
        w24 = packer.unpack(packed, (packed.shape[0], dense.shape[0]))
        out = F.linear(dense.t(), w24, bias)
        return out if transpose_result else out.t()

    monkeypatch.setattr(torch, "_cslt_compress", cslt_compress)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", cslt_sparse_mm)


def speed_rows(plan_text: str) -> dict[str, list[str]]:
    """The rows of a plan's 2:4 training speed table, by matmul shape (``"1024->4096"``):
    layers, tokens, forward, input gradient, training step."""
    rows = (re.split(r"\s{2,}", line.strip()) for line in plan_text.splitlines())
    return {
        cells[0]: cells[1:] for cells in rows if re.fullmatch(r"\d+->\d+", cells[0])
    }


class ClassProbe(L.Callback):
    """The class of ``net.fc1`` at every optimizer step (which forward it runs)."""

    def __init__(self) -> None:
        self.classes: dict[int, str] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.classes[trainer.global_step] = type(pl_module.net.fc1).__name__


KERNEL_PHASES = [
    {"sparsity": "2:4", "until": 3},
    {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2, "until": 6},
    {"sparsity": 0.0},
]
"""runtime 2:4, then magnitude 2:4 with an update, then dense: the GPU fits' schedule."""


def kernel_fit(
    tmp_path: Any,
    backend: str = "auto",
    stop: int | None = None,
    ckpt_path: Any = None,
    compile: bool = False,
    accelerator: str = "gpu",
) -> tuple[L.LightningModule, SparsityCallback, ClassProbe]:
    """8 bf16 steps of a 256-wide TinyModule through :data:`KERNEL_PHASES` (``stop``: a
    checkpoint there and the end), for the tests of the 2:4 kernel path: ``verify_speed`` is
    off, since these tests are about the kernels (at this size eager 2:4 is slower than
    dense, so it would keep every layer on masked math)."""
    L.seed_everything(0, verbose=False)
    model = CompiledTiny(
        "inductor" if compile else None, width=256, inputs=256, lr=1e-3
    )
    cb = SparsityCallback(
        phases=KERNEL_PHASES, backend=backend, verbose=False, verify_speed=False
    )
    probe = ClassProbe()
    callbacks: list[L.Callback] = [cb, probe]
    if stop:
        callbacks += [
            StopAt(stop),
            ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=stop),
        ]
    trainer = fast_trainer(
        accelerator=accelerator,
        max_steps=8,
        precision="bf16-mixed",
        callbacks=callbacks,
        enable_checkpointing=bool(stop),
    )
    data = DataLoader(RepeatedBatch(n=48, batch_size=12, inputs=256), batch_size=12)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, cb, probe


def demo_trainer(**kwargs: Any) -> L.Trainer:
    """A fast trainer that also validates (2 batches, with the sanity check): for demo models."""
    return fast_trainer(
        **{"max_steps": 3, "limit_val_batches": 2, "num_sanity_val_steps": 2, **kwargs}
    )


def on_both_paths(run):
    """``run()`` on the torch operations and on the compiled CPU loops: ``(torch, compiled)``
    (the test is skipped where the ``[cpu]`` extra is not installed)."""
    if not kernels.installed():
        pytest.skip("the compiled loops need the [cpu] extra (numba)")
    with kernels.compiled(False):
        reference = run()
    with kernels.compiled(True):
        compiled = run()
    return reference, compiled


def dst_updates(
    algorithm: str, sparsity: float | str, steps: int = 3
) -> list[torch.Tensor]:
    """The masks of ``steps`` drop-and-grow updates of a 256x512 Linear (``update_every=1``,
    fixed seeds), plus its final weight: a fingerprint of the whole mask-update path."""
    from lightning_sparse.core.schedule import Phase, resolve_phases
    from lightning_sparse.core.selection import select_parameters
    from lightning_sparse.engine.sparsifier import Sparsifier

    torch.manual_seed(0)
    net = nn.Linear(512, 256, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    phase = Phase(sparsity=sparsity, algorithm=algorithm, update_every=1, seed=3)
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["weight"]).targets,
        resolve_phases([phase], 100),
    )
    sp.on_step_start(0, [opt])
    results = []
    for step in range(1, steps + 1):
        net.weight.grad = torch.randn(256, 512)
        sp.before_optimizer_step(step, opt, [opt])
        opt.step()
        results.append(sp.masks["weight"].clone())
    sp.close()
    return [*results, net.weight.detach().clone()]


def resume_run(
    tmp_path: Any,
    phases: list[dict[str, Any]],
    stop_at: int | None = None,
    ckpt_path: Any = None,
    seed: int = 0,
) -> tuple[L.LightningModule, Any]:
    """12 steps of ``phases`` by :func:`resumable_fit` (so a resume sees the batches of the
    uninterrupted run). Returns the model and the SparsityCallback."""
    callback = SparsityCallback(phases=phases, verbose=False)
    return resumable_fit(tmp_path, [callback], 12, stop_at, ckpt_path, seed), callback


def install_runtime(
    net: nn.Module, params: list[str], sparsity: str = "2:4"
) -> list[ParamTarget]:
    """Give ``params`` of ``net`` the masked backend's ``runtime`` forward (the weight projected
    at every forward), installed by the engine as a fit installs it."""
    targets = select_parameters(net, params=params).targets
    phases = resolve_phases(
        [Phase(sparsity=sparsity, algorithm="runtime")], total_steps=1
    )
    algo = build_algorithm(phases[0])
    forwards = LayerForwards("runtime", targets, phases, {0: algo}, backend="masked")
    for target in targets:
        forwards.install(0, target, algo, None)
    return targets


class SameTokens(Dataset):
    """Copies of one batch of token sequences: every batch of every epoch is the same, so a
    resumed run sees the batches of the uninterrupted one (see DESIGN.md, exact resume)."""

    def __init__(self, n: int = 16, batch_size: int = 4, length: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 256, (batch_size, length + 1), generator=gen)
        self.n, self.batch_size = n, batch_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        row = self.tokens[i % self.batch_size]
        return row[:-1], row[1:]
