"""Memory per rank, phase by phase: what ``lightning-sparse plan`` prints, and what the tests
measure on a run (:mod:`~lightning_sparse.engine.memory_census`).

Counted per rank in each sparse phase, from what the engine keeps (see
:mod:`~lightning_sparse.engine.sparsifier` and :mod:`~lightning_sparse.engine.sharding`); under
FSDP2 a sharded tensor is split by rows over the ranks (``ceil(rows / ranks)`` rows each, as
FSDP2 pads them):

- **parameters**: the model's parameters in their stored dtype, **gradients** the same for the
  trainable ones, and **optimizer state** two of each trainable parameter (the moments of
  Adam and AdamW, the optimizers of the recipes; other optimizers keep other state).
- **masks**: the engine's bool masks (1 byte per weight), laid out like the parameters (shards
  under FSDP2). Every sparse phase keeps them, ``runtime`` too (its mask at the phase start).
- **whole masks**: under FSDP2, a layer whose forward multiplies by a stored mask (a
  straight-through phase such as ``magnitude``, or any stored mask on a 2:4 kernel) keeps that
  layer's whole mask on every rank, since the forward runs on the gathered weight (1 byte per
  weight); without sharding the forward reads the engine's own mask.
- **2:4 packing**: a stored mask on cuSPARSELt keeps its packing for ``W`` and ``W.T``
  (:class:`~lightning_sparse.backends.cusparselt.MaskPacking`: a copy of the mask, 1 byte per
  weight, 2 x 1 byte of group keys and 2 x 1/8 byte of metadata: 3.25 bytes per weight), whole,
  on every rank. A mask projected in the forward (``runtime``) keeps none.
- **logits**: a learned phase's logits over each N:M group's patterns (float32), with their
  gradient and the two moments of their Adam: ``16 * C(M, N) / M`` bytes per weight (24 for
  2:4), or over each 4x4 tile's 90 transposable tiles (``transposable: tiles``: 90 bytes per
  weight), split over the run's ranks (``ceil(units / ranks)`` groups or tiles each, under
  DDP as under FSDP2: :mod:`~lightning_sparse.engine.logit_shards`), whole on every rank
  with ``allow_skipped_layers``.
- **until backward**: the share of the saved activations that the sparsity path adds (eager;
  a compiled graph is the compiler's to plan). A straight-through forward on masked math
  multiplies the weight by its mask: a Linear keeps the weight and the mask, not their product
  (:mod:`~lightning_sparse.backends.masked_linear`), so a stored mask adds nothing and a
  projected one (``runtime``) its bool mask, 1 byte a weight; other layers (convolutions,
  ``Conv1D``) keep the product, the whole weight in the matmul dtype, per layer, on every rank
  (under FSDP2 too: the gathered weight is freed after the forward, this copy is not); on
  CUTLASS its pruned copy. The cuSPARSELt ops save the weight itself (under FSDP2 its gathered
  parameter, freed after the forward) and make the pruned ``W.T`` again in the backward, and a
  hard mask on masked math multiplies the weight itself: they keep none. A learned phase keeps
  the whole sampled mask it multiplies by (in the matmul dtype, for the weight's gradient) and
  its rank's share of the softmax over the candidates (float32, ``ceil(units / ranks)`` rows
  of ``C(M, N)`` or 90).
- **at a mask choice**: transient, at the phase start and each mask update: under FSDP2 the
  engine gathers one selected weight whole at a time (its stored dtype) and chooses its whole
  mask (1 byte a weight) before the next: the largest layer's. Not counted: at an update, that
  layer's gradient, gathered too; and the algorithm's own work on the layer (scores, sorting
  indices), which depends on the device's mask kernel and comes with or without sharding.

The rest of the activations, the CUDA context and the allocator's slack are not counted: a
phase that "fits" a GPU leaves what is left to them.

Example:
    >>> from torch import nn
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.core.selection import select_parameters
    >>> from lightning_sparse.engine.sparsifier import Sparsifier
    >>> net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    >>> phases = resolve_phases([Phase(sparsity="2:4", algorithm="magnitude")], 100)
    >>> sp = Sparsifier("g", select_parameters(net, params=["*.weight"]).targets, phases)
    >>> [m.masks for m in phase_memory(sp, shards=8)]  # bytes per rank
    [1048576]
    >>> phases = resolve_phases([Phase(sparsity="2:4", until=50), Phase(sparsity=0.0)], 100)
    >>> sp = Sparsifier("g", select_parameters(net, params=["*.weight"]).targets, phases)
    >>> [(m.masks, m.optimizer_state) for m in phase_memory(sp, shards=8)]  # the dense phase: none
    [(1048576, 8388608), (0, 8388608)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.algorithms.learned import Learned
from lightning_sparse.backends.cusparselt import packs_stored_masks
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.core.layers import LINEAR
from lightning_sparse.engine.report import text_table
from lightning_sparse.engine.sparsifier import Sparsifier

PACKING_BYTES = 3.25
"""Bytes per weight of a stored mask's cuSPARSELt packing (see the module docstring)."""
OPTIMIZER_STATES = 2
"""Tensors of optimizer state per trainable parameter (Adam's and AdamW's two moments)."""
LOGIT_TENSORS = 4
"""A learned phase's logits, their gradient and their Adam's two moments."""


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes per rank in one sparse phase (see the module docstring); ``weights``: the
    group's selected weights, a part of ``parameters``."""

    phase: int
    parameters: int
    gradients: int
    optimizer_state: int
    weights: int
    masks: int
    whole_masks: int
    packing: int
    logits: int
    until_backward: int
    at_mask_choice: int

    @property
    def kept(self) -> int:
        """What the phase holds between steps."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.masks
            + self.whole_masks
            + self.packing
            + self.logits
        )

    @property
    def peak(self) -> int:
        """What it holds at most: the activations it keeps until the backward, or a mask
        choice's transient, on top of :attr:`kept`."""
        return self.kept + max(self.until_backward, self.at_mask_choice)


def sharded_bytes(tensor: Tensor, shards: int, itemsize: int | None = None) -> int:
    """The bytes of one rank's shard of ``tensor`` when FSDP2 splits its rows over ``shards``
    ranks (``ceil(rows / shards)`` rows, padded as FSDP2 pads them), in ``itemsize`` bytes an
    element (``None``: its own).

    Example:
        >>> sharded_bytes(torch.empty(5, 8), 2), sharded_bytes(torch.empty(5, 8), 1, itemsize=1)
        (96, 40)
    """
    size = tensor.element_size() if itemsize is None else itemsize
    if shards <= 1 or tensor.dim() == 0:
        return tensor.numel() * size
    return math.ceil(tensor.shape[0] / shards) * math.prod(tensor.shape[1:]) * size


def phase_memory(
    sparsifier: Sparsifier,
    shards: int = 1,
    compute_dtype: torch.dtype | None = None,
    parameters: Iterable[Tensor] | None = None,
    ranks: int | None = None,
) -> list[PhaseMemory]:
    """Each phase's :class:`PhaseMemory` (a dense one keeps no masks), sharded over ``shards`` ranks by FSDP2
    (``1``: not sharded), with matmuls in ``compute_dtype`` (autocast's; ``None``: the weights'
    own), for the model's ``parameters`` (``None``: the selected weights only), in a run of
    ``ranks`` processes (``None``: ``shards``), over which learned-mask logits are split."""
    sp = sparsifier
    learners = 1 if sp.allow_skipped_layers else (ranks or shards)
    params = list(parameters) if parameters is not None else []
    params = params or [t.param for t in sp.targets]
    trainable = [p for p in params if p.requires_grad]
    stored = sum(sharded_bytes(p, shards) for p in params)
    grads = sum(sharded_bytes(p, shards) for p in trainable)
    weights = sum(sharded_bytes(t.param, shards) for t in sp.targets)
    masks = sum(sharded_bytes(t.param, shards, itemsize=1) for t in sp.targets)
    # the largest layer, gathered whole, and its new mask (1 byte a weight)
    largest = max(t.param.numel() * (t.param.element_size() + 1) for t in sp.targets)
    choosing = largest if shards > 1 else 0
    found = []
    for phase in sp.phases:
        algo = sp.algorithms.get(phase.index)
        whole = packing = saved = logits = 0
        for t in sp.targets if algo is not None else ():
            numel = t.param.numel()
            choice = sp.backends[phase.index, t.name]
            kernel = choice.name == "semi_structured"
            kept = not algo.projects and (algo.straight_through or kernel)
            dtype = compute_dtype or t.param.dtype
            if algo.projects or (algo.straight_through and not kernel):
                if kernel:  # cuSPARSELt's ops save W; CUTLASS keeps its pruned copy
                    if choice.kernel != "cusparselt":
                        saved += numel * dtype.itemsize
                elif t.layer is not LINEAR:  # the product, for the input's gradient
                    saved += numel * dtype.itemsize
                elif algo.projects:  # a Linear keeps the projected bool mask instead
                    saved += numel
            if kept and shards > 1:
                whole += numel
            rows = tuple(t.layer.to_rows(t.param).shape)
            if kept and choice.kernel == "cusparselt" and packs_stored_masks(rows):
                packing += round(numel * PACKING_BYTES)
            if isinstance(algo, Learned):
                units, candidates = algo.logit_count(torch.Size(rows))
                units = math.ceil(units / learners)  # this rank's share
                logits += units * candidates * 4 * LOGIT_TENSORS
                # the sampled mask, whole, and this rank's softmax over the candidates
                saved += numel * dtype.itemsize + units * candidates * 4
        found.append(
            PhaseMemory(
                phase=phase.index,
                parameters=stored,
                gradients=grads,
                optimizer_state=OPTIMIZER_STATES * grads,
                weights=weights,
                masks=masks if algo is not None else 0,
                whole_masks=whole,
                packing=packing,
                logits=logits,
                until_backward=saved,
                at_mask_choice=choosing if algo is not None else 0,
            )
        )
    return found


def memory_table(
    sparsifier: Sparsifier,
    shards: int = 1,
    compute_dtype: torch.dtype | None = None,
    parameters: Iterable[Tensor] | None = None,
    gpu: GpuTarget | None = None,
    ranks: int | None = None,
) -> list[str]:
    """:func:`phase_memory` as table lines, in MiB (none for a group without a sparse phase);
    dense phases too, since the question whether a run fits is asked of every phase;
    with a ``gpu`` whose memory is known, whether each phase's peak fits it."""
    header = [
        "phase",
        "parameters",
        "gradients",
        "optimizer",
        "masks",
        "whole masks",
        "2:4 packing",
        "logits",
        "total",
        "until backward",
        "at a mask choice",
    ]
    fits = gpu is not None and gpu.memory_gib is not None
    rows = [header + ([f"fits {gpu.name} ({gpu.memory_gib:g} GiB)"] if fits else [])]  # type: ignore[union-attr]
    found = phase_memory(sparsifier, shards, compute_dtype, parameters, ranks)
    if not sparsifier.algorithms:
        found = []
    for m in found:
        values = (
            m.parameters,
            m.gradients,
            m.optimizer_state,
            m.masks,
            m.whole_masks,
            m.packing,
            m.logits,
            m.kept,
        )
        row = [f"phase {m.phase + 1}"] + [_mib(v) for v in values]
        row += [f"+{_mib(m.until_backward)}" if m.until_backward else "-"]
        row += [f"+{_mib(m.at_mask_choice)} (transient)" if m.at_mask_choice else "-"]
        if fits:
            row.append(fit_verdict(m.peak, gpu.memory_gib))  # type: ignore[union-attr,arg-type]
        rows.append(row)
    return text_table(rows) if len(rows) > 1 else []


def fit_verdict(peak: int, memory_gib: float) -> str:
    """Whether ``peak`` bytes fit a GPU of ``memory_gib`` GiB, and by how much.

    Example:
        >>> fit_verdict(60 * 2**30, 80), fit_verdict(90 * 2**30, 80)
        ('yes: 60.0 GiB, 20.0 left', 'no: 90.0 GiB, 10.0 over')
    """
    need, have = peak / 2**30, memory_gib
    if need <= have:
        return f"yes: {need:.1f} GiB, {have - need:.1f} left"
    return f"no: {need:.1f} GiB, {need - have:.1f} over"


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f}"


__all__ = [
    "OPTIMIZER_STATES",
    "PACKING_BYTES",
    "PhaseMemory",
    "fit_verdict",
    "memory_table",
    "phase_memory",
    "sharded_bytes",
]
