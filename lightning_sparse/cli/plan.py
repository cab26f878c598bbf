"""A dry run of a sparsity schedule: what the callbacks would do in a run, without training.

:func:`plan_schedule` takes a configured ``Trainer`` (its ``SparsityCallback`` s, run length and
precision), the model and the datamodule, and builds each group exactly as fit start would
(:meth:`SparsityCallback.build`: parameter selection, phases resolved against the run, the
backend each parameter gets on this machine and why), without applying any mask. It adds the
per-layer sparsity in each phase and the theoretical forward FLOP savings
(:mod:`lightning_sparse.cli.flops`). :func:`format_plan` renders it as text, for a GPU to plan
for with the training speed of the layers on 2:4 kernels (from the ratios measured at their
shapes where the project has them, :mod:`lightning_sparse.backends.measured`, from the GPU's
peak rates elsewhere); ``lightning-sparse plan`` prints that and plots the schedule
(:mod:`lightning_sparse.cli.plot`).

The run length is what ``trainer.estimated_stepping_batches`` will be at fit start: ``max_steps``
when the run is bounded by steps only, otherwise ``max_epochs`` times the optimizer steps per
epoch (the train loader's batches divided among the devices (the distributed sampler's rounding
may add a batch), capped by ``limit_train_batches``, divided by ``accumulate_grad_batches``),
capped by ``max_steps``. The datamodule is set up only when the epoch length is needed: under
``max_epochs``, or when a phase boundary counts epochs.

Example:
    >>> import lightning as L
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_sparse import SparsityCallback
    >>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}],
    ...                       params=["layer.weight"])  # BoringModel's only Linear
    >>> trainer = L.Trainer(max_steps=1000, callbacks=[cb], logger=False, accelerator="cpu")
    >>> plan = plan_schedule(trainer, BoringModel())
    >>> [(p.start, p.end) for p in plan.groups[0].sparsifier.phases]
    [(0, 700), (700, 1000)]
    >>> round(plan.groups[0].savings.run, 3)  # of the run's training FLOPs
    0.35
"""

from __future__ import annotations

import contextlib
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_sparse.algorithms import RunLength, SparsityAlgorithm
from lightning_sparse.backends.capability import autocast_dtype
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.backends.measured import (
    H100_FORWARD,
    RATIOS,
    Setup,
    StepEstimate,
    setup_for,
    step_estimates,
    step_speed,
)
from lightning_sparse.calibration import example_forward
from lightning_sparse.callback import SparsityCallback
from lightning_sparse.cli.flops import FlopSavings, linear_flops_per_token, run_savings
from lightning_sparse.cli.memory import memory_table
from lightning_sparse.core.schedule import ResolvedPhase, counts_epochs
from lightning_sparse.core.selection import Selection
from lightning_sparse.engine.report import plan_table, text_table
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import sparsity_fraction

_RAMP_SAMPLES = 256  # steps sampled per phase to average a ramping target


def _span(values: Sequence[float], spec: str) -> str:
    """``"lo-hi"`` of ``values`` formatted with ``spec``, or one value when they are equal."""
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}-{hi}"


MEASURED_2TO4 = (
    f"measured on an {H100_FORWARD.device} with torch {H100_FORWARD.torch} and cuSPARSELt "
    f"{H100_FORWARD.cusparselt}: 0.15-0.24x dense per layer in eager training on an earlier "
    f"kernel path, where verify_speed kept every layer dense; "
    f"{_span([r.ratio for r in RATIOS if r.setup == H100_FORWARD], '.2f')}x for "
    f"{H100_FORWARD.measured}; see {H100_FORWARD.documented}"
)
"""What 2:4 kernels have done, quoted wherever the plan mentions their speed."""


@dataclass
class GroupPlan:
    """One callback's group: its engine (phases, targets, backends), selection and numbers."""

    name: str
    sparsifier: Sparsifier
    selection: Selection
    end_sparsity: dict[str, list[float]]  #: per parameter: target at each phase's end
    mean_sparsity: dict[str, list[float]]  #: per parameter: mean target over each phase
    savings: FlopSavings
    #: phases whose per-layer sparsity shows the group's target: the layers' share depends on
    #: weight values, which a model built on the meta device has not got
    by_values: list[int]


@dataclass
class SchedulePlan:
    """What :func:`plan_schedule` found: the run length, each group, the Linear FLOPs."""

    run: RunLength
    run_description: str
    groups: list[GroupPlan]
    flops: dict[str, int]  #: forward FLOPs per token of each trainable Linear weight
    gpu: GpuTarget | None = None  #: the GPU the backends were predicted for
    precision: str | None = None  #: the precision the backends were chosen for
    world_size: int = 1  #: the run's processes
    sharded: bool = (
        False  #: FSDP2 (``ModelParallelStrategy``) shards the weights over them
    )
    model: nn.Module | None = (
        None  #: the model planned (on the meta device from the CLI)
    )

    @property
    def run_savings(self) -> float:
        """Fraction of the counted forward FLOPs skipped over the run, all groups together."""
        return sum(group.savings.run for group in self.groups)


def run_length(
    trainer: pl.Trainer,
    datamodule: pl.LightningDataModule | None = None,
    world_size: int | None = None,
    epochs: bool = False,
) -> tuple[RunLength, str]:
    """The run's optimizer steps and steps per epoch as fit start will see them, and how they
    were worked out (see the module docstring); ``world_size``: the run's processes, when
    ``trainer`` was built with another number; ``epochs``: a boundary counts epochs, so an
    epoch's steps are needed even when ``max_steps`` alone bounds the run."""
    world_size = world_size or trainer.world_size
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    by_steps = max_epochs == -1 or max_epochs is None
    if by_steps and max_steps == -1:
        raise ValueError(
            "the run has no length (max_epochs=-1 and max_steps=-1): set trainer.max_steps "
            "or trainer.max_epochs (with a sized train dataloader) so that the schedule's "
            "fractions can be resolved"
        )
    steps = f"{max_steps} optimizer steps (max_steps)"
    if by_steps and not epochs:
        return RunLength(float(max_steps)), steps
    if datamodule is None:
        raise ValueError(
            "a phase boundary counts epochs, whose length comes from the train dataloader, so "
            "give a datamodule, or give the boundaries in steps ('1500 steps')"
            if by_steps
            else f"max_epochs={max_epochs}: an epoch's length comes from the train dataloader, "
            f"so give a datamodule, or bound the run with trainer.max_steps"
        )
    datamodule.setup("fit")
    batches = _epoch_batches(
        datamodule.train_dataloader(), trainer.limit_train_batches, world_size
    )
    per_device = f" per device on {world_size}" if world_size > 1 else ""
    if not math.isfinite(batches):
        if max_steps == -1:
            raise ValueError(
                "the train dataloader has no length, so max_epochs gives no number of steps: "
                "set trainer.max_steps"
            )
        return RunLength(float(max_steps)), steps
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    epoch = (
        f"{per_epoch} optimizer steps per epoch ({batches} batches{per_device}, "
        f"accumulate_grad_batches={trainer.accumulate_grad_batches})"
    )
    if by_steps:
        return RunLength(float(max_steps), float(per_epoch)), f"{steps}; {epoch}"
    total = per_epoch * max(max_epochs, 1)
    how = f"max_epochs={max_epochs} x {epoch}"
    if max_steps != -1 and max_steps < total:
        total, how = max_steps, f"max_steps, reached before {how}"
    return RunLength(float(total), float(per_epoch)), f"{total} optimizer steps: {how}"


def _epoch_batches(loader: object, limit: float, world_size: int) -> float:
    """The train batches of an epoch on one device, as Lightning counts them: a sized loader's
    batches split among the devices (by the distributed sampler), then capped by
    ``limit_train_batches``; ``inf`` for a loader without a length unless the cap is a count."""
    try:
        length: float = math.ceil(len(loader) / max(1, world_size))  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset without a length
        length = math.inf
    if isinstance(limit, int):
        return min(length, limit)
    return int(length * limit) if math.isfinite(length) else length


def _for_this_machine(trainer: pl.Trainer, model: nn.Module) -> nn.Module:
    """The model in the dtype and on the device the run will use, so that backend choices
    are those of fit start (``bf16-true`` weights, a CUDA device)."""
    model = trainer.precision_plugin.convert_module(model)
    device = trainer.strategy.root_device
    on_meta = any(p.is_meta for p in model.parameters())
    if device.type == "cuda" and not on_meta:
        model.to(device)
    return model


def _configure(model: nn.Module) -> None:
    """Run the model's ``configure_model`` hook, as fit does before its callbacks start
    (Lightning asks the hook to be idempotent): a model it compiles with CUDA graphs is timed
    by ``verify_speed`` as CUDA graphs, and layers it creates are planned too (on the meta
    device, for a model built there)."""
    configure = getattr(model, "configure_model", None)
    if not callable(configure):
        return
    on_meta = any(p.is_meta for p in model.parameters())
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        configure()


def _eagerly(forward: Callable[[], object]) -> Callable[[], object]:
    """``forward`` with ``torch.compile`` set aside: a plan records which layers a forward calls,
    and a model that ``configure_model`` compiled would compile now (on meta tensors)."""

    def run() -> object:
        with torch.compiler.set_stance("force_eager"):
            return forward()

    return run


def _phase_sparsity(
    algo: SparsityAlgorithm | None,
    phase: ResolvedPhase,
    weights: dict[str, torch.Tensor],
    total: float,
) -> tuple[dict[str, float], dict[str, float], bool]:
    """Per parameter: the target at the phase's last step, and the mean over the phase; and
    whether those are the group's target because the layers' share depends on weight values
    that a model built on the meta device has not got (the ``global`` distribution)."""
    if algo is None:
        zeros = dict.fromkeys(weights, 0.0)
        return zeros, dict(zeros), False
    end = phase.end if phase.end is not None else int(total)
    last = max(phase.start, end - 1)
    group_final = sparsity_fraction(algo.target_at(last))
    try:
        final = {
            name: sparsity_fraction(target)
            for name, target in algo.layer_targets(last, weights, None).items()
        }
        by_values = False
    except (NotImplementedError, RuntimeError):
        if not any(w.is_meta for w in weights.values()):
            raise
        final, by_values = dict.fromkeys(weights, group_final), True
    count = min(_RAMP_SAMPLES, end - phase.start)
    samples = [phase.start + (end - phase.start) * i // count for i in range(count)]
    group_mean = sum(sparsity_fraction(algo.target_at(s)) for s in samples) / count
    scale = group_mean / group_final if group_final else 0.0
    return final, {name: value * scale for name, value in final.items()}, by_values


def _plan_group(
    callback: SparsityCallback,
    model: nn.Module,
    run: RunLength,
    compute_dtype: torch.dtype | None,
    others: list[tuple[str, Selection]],
    flops: dict[str, int],
    gpu: GpuTarget | None,
) -> GroupPlan:
    forward = example_forward(model)
    sparsifier, selection = callback.build(
        model,
        run,
        compute_dtype,
        others,
        gpu,
        example_forward=forward and _eagerly(forward),
    )
    weights = {t.name: t.param.detach() for t in sparsifier.targets}
    end: dict[str, list[float]] = {name: [] for name in weights}
    mean: dict[str, list[float]] = {name: [] for name in weights}
    fractions, by_values = [], []
    for phase in sparsifier.phases:
        phase_end = phase.end if phase.end is not None else run.total_steps
        fractions.append((phase_end - phase.start) / run.total_steps)
        algo = sparsifier.algorithms.get(phase.index)
        final, average, unknown = _phase_sparsity(algo, phase, weights, run.total_steps)
        if unknown:
            by_values.append(phase.index)
        for name in weights:
            end[name].append(final[name])
            mean[name].append(average[name])
    savings = run_savings(mean, fractions, flops)
    return GroupPlan(
        callback.name, sparsifier, selection, end, mean, savings, by_values
    )


def plan_schedule(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    gpu: GpuTarget | None = None,
    precision: str | None = None,
    world_size: int | None = None,
    sharded: bool | None = None,
) -> SchedulePlan:
    """Build every ``SparsityCallback`` of ``trainer`` for ``model`` as fit start would, without
    training or applying masks (see the module docstring): after the model's
    ``configure_model``, as in fit, so that a model it compiles with CUDA graphs is planned to
    be timed as CUDA graphs by ``verify_speed``.

    With ``gpu``, each layer's backend is the one ``fit`` would choose on that GPU (same rules,
    :func:`~lightning_sparse.backends.capability.semi_structured_kernel`): a prediction of
    eligibility, not a measured speed. ``precision`` is the run's precision when the trainer
    given was built with another one (the command line plans on the CPU), ``world_size``
    its number of processes, and ``sharded`` whether FSDP2 shards its weights over them
    (``None``: whether ``trainer`` runs ``ModelParallelStrategy``), for the memory per rank
    (:mod:`lightning_sparse.cli.memory`).

    Raises:
        ValueError: the trainer has no ``SparsityCallback``, the run has no length, or a
            callback's configuration fails at fit start (the same errors as ``fit``).
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, SparsityCallback)]
    if not callbacks:
        raise ValueError(
            "the trainer has no SparsityCallback, so there is no schedule to plan: add one to "
            "trainer.callbacks (e.g. --config recipes/overlays/sparsity_24_70pct.yaml)"
        )
    epochs = any(counts_epochs(cb.phases) for cb in callbacks)
    run, how = run_length(trainer, datamodule, world_size, epochs)
    _configure(model)
    model = _for_this_machine(trainer, model)
    flops = linear_flops_per_token(model)
    precision = precision or str(trainer.precision)
    compute_dtype = autocast_dtype(precision)
    groups: list[GroupPlan] = []
    for callback in callbacks:
        others = [(g.name, g.selection) for g in groups]
        groups.append(
            _plan_group(callback, model, run, compute_dtype, others, flops, gpu)
        )
    if sharded is None:
        sharded = isinstance(trainer.strategy, ModelParallelStrategy)
    processes = world_size or trainer.world_size
    return SchedulePlan(
        run, how, groups, flops, gpu, precision, processes, sharded, model
    )


def kernel_share(plan: SchedulePlan, group: GroupPlan) -> list[float]:
    """Per phase of ``group``: the fraction of the model's counted forward Linear FLOPs whose
    layers run on a 2:4 kernel (``semi_structured``) in that phase."""
    total = sum(plan.flops.values())
    shares = []
    for phase in group.sparsifier.phases:
        on_kernel = sum(
            plan.flops.get(name, 0)
            for (index, name), choice in group.sparsifier.backends.items()
            if index == phase.index and choice.name == "semi_structured"
        )
        shares.append(on_kernel / total if total else 0.0)
    return shares


def format_plan(plan: SchedulePlan) -> str:
    """The plan as text: run length, each group's table (parameters, phases, backends and
    why), per-layer sparsity and FLOPs, with a GPU to plan for the training speed of the
    layers on 2:4 kernels by matmul shape, and the theoretical FLOP savings."""
    lines = [f"Run: {plan.run_description}", backends_line(plan), ""]
    total = plan.flops and sum(plan.flops.values())
    for group in plan.groups:
        sp = group.sparsifier
        lines.append(plan_table(sp, group.selection))
        lines += _wrap(verify_speed_line(sp), 2)
        for warning in sp.schedule_warnings():
            lines += _wrap(f"Warning: {warning}", 2)
        lines.append("")
        lines.append(
            "  per-layer sparsity at the end of each phase, and forward MFLOP per token:"
        )
        header = ["parameter", "MFLOP/token"] + [
            f"phase {p.index + 1}" for p in sp.phases
        ]
        rows = [header]
        for name, values in group.end_sparsity.items():
            mflop = (
                f"{plan.flops[name] / 1e6:.3g}" if name in plan.flops else "not counted"
            )
            rows.append([name, mflop] + [f"{v:.1%}" for v in values])
        lines += ["    " + line for line in text_table(rows)]
        for index in group.by_values:
            lines += _wrap(
                f"phase {index + 1}: the group's target on every layer; fit start spreads it "
                f"by the weights' values ('global'), which a model planned on the meta device "
                f"has not got",
                4,
            )
        saved = group.savings
        share = saved.selected_per_token / total if total else 0.0
        lines.append(
            f"  sparsified Linear layers: {saved.selected_per_token / 1e6:.3g} of "
            f"{saved.total_per_token / 1e6:.3g} MFLOP/token ({share:.1%} of the model's "
            f"trainable Linear FLOPs)"
        )
        shares = kernel_share(plan, group)
        for phase, fraction, share in zip(sp.phases, saved.per_phase, shares):
            end = phase.end if phase.end is not None else plan.run.total_steps
            length = (end - phase.start) / plan.run.total_steps
            lines.append(
                f"  phase {phase.index + 1} ({phase.span()}, {length:.0%} of the run, "
                f"{phase.spec.describe()}): skips {fraction:.1%} of the forward Linear FLOPs"
            )
            if plan.gpu is not None and share:
                lines.append(f"    {_peak_bound(plan.gpu, share)}")
        lines += _speed_lines(plan, group)
        lines += _memory_lines(plan, group)
        lines.append("")
    lines.append(
        f"Theoretical forward FLOP savings over the run: {plan.run_savings:.1%} of the "
        f"trainable nn.Linear matmul FLOPs (phases weighted by length). Only a kernel that "
        f"skips the zeros saves them: the masked backend runs dense math, 2:4 sparse tensor "
        f"cores at most 2x the dense rate ({MEASURED_2TO4}). Counting rules: "
        f"lightning_sparse/cli/flops.py."
    )
    return "\n".join(lines)


def _memory_lines(plan: SchedulePlan, group: GroupPlan) -> list[str]:
    """The group's memory per rank by sparse phase (:mod:`lightning_sparse.cli.memory`),
    sharded over the run's ranks under FSDP2."""
    shards = plan.world_size if plan.sharded else 1
    parameters = None if plan.model is None else plan.model.parameters()
    dtype = autocast_dtype(plan.precision)
    table = memory_table(
        group.sparsifier, shards, dtype, parameters, plan.gpu, plan.world_size
    )
    if not table:
        return []
    if plan.sharded:
        how = (
            f"FSDP2 over {shards} rank(s): each keeps 1/{shards} of every weight, its "
            f"mask and its learned-mask logits, and each forward multiplies the weight "
            f"gathered whole"
        )
    else:
        ranks = (
            f"each of {plan.world_size} ranks" if plan.world_size > 1 else "one device"
        )
        how = f"not sharded: whole weights and masks on {ranks}"
        if plan.world_size > 1:
            how += ", learned-mask logits split over them"
    title = (
        f"memory per rank, MiB ({how}; the model's parameters, their gradients and 2 tensors "
        f"of optimizer state each (Adam's moments); until backward: what the sparsity path "
        f"adds to the activations kept for the backward; at a mask choice: the largest "
        f"layer gathered with its mask; other activations and the mask algorithm's own work "
        f"not counted: a phase that fits leaves the rest to them; "
        f"lightning_sparse/cli/memory.py):"
    )
    return _wrap(title, 2) + ["    " + line for line in table]


def verify_speed_line(sparsifier: Sparsifier) -> str:
    """What ``verify_speed`` will do at fit start for a group with layers on 2:4 kernels
    (nothing for a group without)."""
    if not any(c.name == "semi_structured" for c in sparsifier.backends.values()):
        return ""
    speed = sparsifier.forwards.speed_check
    if speed is None:
        return (
            "verify_speed: off: every layer above on a 2:4 kernel runs it, even where it is "
            "slower than dense (leave verify_speed unset or true to time them at fit start)"
        )
    return f"verify_speed: on: {speed.describe()}; slower ones keep dense math"


def backends_line(plan: SchedulePlan) -> str:
    """Where the plan's backends come from: this machine, or a prediction for a GPU."""
    if plan.gpu is None:
        return (
            f"Backends: as fit would choose them on this machine (precision "
            f"{plan.precision}); plan --gpu NAME predicts them for a GPU"
        )
    gpu = plan.gpu
    rates = (
        f", peak tensor cores {gpu.dense_tflops:g} TFLOP/s dense, {gpu.sparse_tflops:g} "
        f"with 2:4"
        if gpu.dense_tflops and gpu.sparse_tflops
        else ""
    )
    return (
        f"Backends: predicted for {gpu.name} ({gpu.arch}{rates}), precision "
        f"{plan.precision}, from the rules fit applies (capability, dtype, shape; a CUDA "
        f"build of torch with cuSPARSELt assumed): which layers can run 2:4 kernels, not a "
        f"measured speed. Fit start decides on the GPU itself: a kernel check runs a small "
        f"2:4 matmul through the training code and compares it with dense math (a kernel "
        f"that fails runs masked math), and where verify_speed is on (the default with "
        f"backend auto; each group's verify_speed line says) each layer shape is timed as "
        f"the model runs (as CUDA graphs if it is compiled with them) and keeps dense math "
        f"where 2:4 is slower ({MEASURED_2TO4})"
    )


def _peak_bound(gpu: GpuTarget, share: float) -> str:
    """What the layers on 2:4 kernels could save at the GPU's peak rates (an upper bound)."""
    if not (gpu.dense_tflops and gpu.sparse_tflops):
        return f"{share:.1%} of the forward Linear FLOPs on 2:4 kernels"
    speedup = gpu.sparse_tflops / gpu.dense_tflops
    time = 1.0 - share + share / speedup
    return (
        f"{share:.1%} of the forward Linear FLOPs on 2:4 kernels: at peak rates "
        f"({speedup:.1f}x for them) the counted Linear forward takes at least {time:.1%} of "
        f"its dense time, a bound, not a prediction (see the Backends line for what ran)"
    )


_WIDTH = 100  # the speed block wraps its sentences for a 100-column terminal


def _speed_lines(plan: SchedulePlan, group: GroupPlan) -> list[str]:
    """With a GPU to plan for: per matmul shape of ``group``'s layers on 2:4 kernels, a
    training step's speed estimated from the ratios measured at that shape
    (:mod:`lightning_sparse.backends.measured`) where the project has them for the GPU, else
    the bound from its peak rates, each labelled; empty without such layers."""
    sp = group.sparsifier
    on_kernel = {n for (_, n), c in sp.backends.items() if c.name == "semi_structured"}
    gpu = plan.gpu
    if gpu is None or not on_kernel:
        return []
    compute_dtype = autocast_dtype(plan.precision)
    shapes: dict[tuple[int, int, torch.dtype], int] = {}  # (in, out, dtype) -> layers
    for t in sp.targets:
        if t.name in on_kernel:
            out_features, in_features = t.layer.to_rows(t.param).shape
            key = (in_features, out_features, compute_dtype or t.param.dtype)
            shapes[key] = shapes.get(key, 0) + 1
    rows = [
        ["matmul", "layers", "tokens", "forward", "input gradient", "training step"]
    ]
    bounds: list[list[str]] = []
    setups: dict[Setup, None] = {}  # those quoted, in order
    measured = 0  # layers at a measured shape
    for (in_features, out_features, dtype), count in shapes.items():
        setup = setup_for(gpu, dtype)
        steps = step_estimates(in_features, out_features, setup) if setup else []
        cells = [f"{in_features}->{out_features}", str(count)]
        if setup and steps:
            setups[setup] = None
            measured += count
            rows.append(
                cells
                + [
                    _span([s.tokens for s in steps], "d"),
                    _ratio_cell(steps, "forward"),
                    _ratio_cell(steps, "input gradient"),
                    f"{_span([s.training for s in steps], '.2f')}x",
                ]
            )
        else:
            bounds.append(cells + ["-"] + _peak_cells(gpu))
    where = "; ".join(_measured_on(setup, gpu) for setup in setups)
    title = (
        f"2:4 training speed by matmul shape: {measured} of the {sum(shapes.values())} "
        f"layers on 2:4 kernels have a measured shape" + (f", {where}" if where else "")
    )
    lines = _wrap(title, 2)
    lines += ["    " + line for line in text_table(rows + bounds)]
    notes = [
        f"measured: {setup.measured} ({setup.documented}); a layer's input gradient is the "
        f"out->in matmul at the same tokens, and where one of its two sparse matmuls was not "
        f"measured it is taken equal to the other; training step: 3 / (1/forward + 1/input "
        f"gradient + 1), the weight gradient dense, packing W and W.T not counted, so an "
        f"upper estimate"
        for setup in setups
    ]
    if bounds:
        notes.append(_unmeasured_note(gpu))
    notes.append(
        "fit start decides on the GPU itself (kernel check, verify_speed), see the Backends line"
    )
    for note in notes:
        lines += _wrap(note, 4)
    return lines


def _ratio_cell(steps: list[StepEstimate], part: str) -> str:
    """The measured ratios of one of a layer's two sparse matmuls (``"forward"`` or ``"input
    gradient"``), or that it was taken equal to the other."""
    values = [
        s.forward if part == "forward" else s.input_grad
        for s in steps
        if s.assumed != part
    ]
    if not values:
        return "taken equal"
    text = f"{_span(values, '.2f')}x"
    return text if len(values) == len(steps) else f"{text}, else equal"


def _peak_cells(gpu: GpuTarget) -> list[str]:
    """Forward, input gradient and training step of an unmeasured shape: the bounds the GPU's
    peak rates put on them."""
    if not (gpu.dense_tflops and gpu.sparse_tflops):
        return ["not measured"] * 3
    speedup = gpu.sparse_tflops / gpu.dense_tflops
    bound = f"<= {speedup:.1f}x (peak)"
    return [bound, bound, f"<= {step_speed(speedup, speedup):.2f}x (peak)"]


def _measured_on(setup: Setup, gpu: GpuTarget) -> str:
    """Where ``setup``'s ratios come from, said from the point of view of ``gpu``."""
    if setup.gpu == gpu:
        return f"measured on this GPU ({setup.device}; {setup.versions})"
    # a named GPU is another GPU of the capability; a bare capability is not a GPU
    other = "another" if gpu.name != gpu.arch else "an"
    return f"measured on an {setup.device}, {other} {setup.gpu.arch} GPU ({setup.versions})"


def _unmeasured_note(gpu: GpuTarget) -> str:
    """What the rows without a measurement show, and where the project has measured."""
    measured = "; ".join(
        f"an {s.device} ({s.gpu.arch}, {s.versions})"
        for s in dict.fromkeys(r.setup for r in RATIOS)
    )
    bound = (
        f"so they show bounds from its peak rates ({gpu.dense_tflops:g} TFLOP/s dense, "
        f"{gpu.sparse_tflops:g} with 2:4), not predictions"
        if gpu.dense_tflops and gpu.sparse_tflops
        else "and a bare compute capability has no peak rates to bound them"
    )
    return (
        f"rows without tokens have no measurement for {gpu.name} at their shape, {bound}; "
        f"the project has measured 2:4 matmuls on {measured} only"
    )


def _wrap(text: str, indent: int) -> list[str]:
    """``text`` wrapped to the block's width, indented by ``indent``, continued 2 further in."""
    return textwrap.wrap(
        text,
        _WIDTH,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent + 2),
        break_on_hyphens=False,
    )
