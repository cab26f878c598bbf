"""Memory per rank of a sparsity group, phase by phase: what ``lightning-sparse plan`` prints.

Counted for the group's selected weights (the rest of the model, activations and optimizer
state are not), in each sparse phase, from what the engine keeps (see
:mod:`~lightning_sparse.engine.sparsifier` and :mod:`~lightning_sparse.engine.sharding`):

- **weights**: the stored parameters, in their dtype; under FSDP2 each rank holds ``1/shards``.
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
- **until backward**: a straight-through forward multiplies a new tensor, the weight times its
  mask, which autograd keeps from the forward to the backward: the whole weight in the matmul
  dtype, per layer, on every rank (under FSDP2 too: the gathered weight is freed after the
  forward, this copy is not); on CUTLASS its pruned copy. The cuSPARSELt ops save the weight
  itself (under FSDP2 its gathered parameter, freed after the forward) and make the pruned
  ``W.T`` again in the backward, and a hard mask on masked math multiplies the weight itself:
  they keep none.
- **at a mask choice**: transient, at the phase start and each mask update: under FSDP2 every
  selected weight is gathered whole at once (its stored dtype) with its mask (1 byte), to choose
  masks on whole tensors.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_sparse.backends.cusparselt import packs_stored_masks
from lightning_sparse.engine.report import text_table
from lightning_sparse.engine.sparsifier import Sparsifier

PACKING_BYTES = 3.25
"""Bytes per weight of a stored mask's cuSPARSELt packing (see the module docstring)."""


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes per rank for a group's selected weights in one sparse phase (see the module
    docstring)."""

    phase: int
    weights: int
    masks: int
    whole_masks: int
    packing: int
    until_backward: int
    at_mask_choice: int


def phase_memory(
    sparsifier: Sparsifier,
    shards: int = 1,
    compute_dtype: torch.dtype | None = None,
) -> list[PhaseMemory]:
    """Each sparse phase's :class:`PhaseMemory` for ``sparsifier``'s weights, sharded over
    ``shards`` ranks by FSDP2 (``1``: not sharded), with matmuls in ``compute_dtype``
    (autocast's; ``None``: the weights' own)."""
    sp = sparsifier
    numel = {t.name: t.param.numel() for t in sp.targets}
    total = sum(numel.values())
    weights = sum(t.param.numel() * t.param.element_size() for t in sp.targets)
    found = []
    for phase in sp.phases:
        algo = sp.algorithms.get(phase.index)
        if algo is None:
            continue
        whole = packing = saved = 0
        for t in sp.targets:
            choice = sp.backends[phase.index, t.name]
            kernel = choice.name == "semi_structured"
            stored = not algo.projects and (algo.straight_through or kernel)
            if algo.projects or (algo.straight_through and not kernel):
                dtype = compute_dtype or t.param.dtype
                if not (kernel and choice.kernel == "cusparselt"):  # its ops save W
                    saved += numel[t.name] * dtype.itemsize
            if stored and shards > 1:
                whole += numel[t.name]
            rows = tuple(t.layer.to_rows(t.param).shape)
            if stored and choice.kernel == "cusparselt" and packs_stored_masks(rows):
                packing += round(numel[t.name] * PACKING_BYTES)
        choice_peak = weights + total if shards > 1 else 0
        found.append(
            PhaseMemory(
                phase.index,
                -(-weights // shards),
                -(-total // shards),
                whole,
                packing,
                saved,
                choice_peak,
            )
        )
    return found


def memory_table(
    sparsifier: Sparsifier, shards: int = 1, compute_dtype: torch.dtype | None = None
) -> list[str]:
    """:func:`phase_memory` as table lines, in MiB (none for a group without a sparse phase)."""
    rows = [
        [
            "phase",
            "weights",
            "masks",
            "whole masks",
            "2:4 packing",
            "total",
            "until backward",
            "at a mask choice",
        ]
    ]
    for m in phase_memory(sparsifier, shards, compute_dtype):
        kept = m.weights + m.masks + m.whole_masks + m.packing
        rows.append(
            [f"phase {m.phase + 1}"]
            + [_mib(v) for v in (m.weights, m.masks, m.whole_masks, m.packing, kept)]
            + [f"+{_mib(m.until_backward)}" if m.until_backward else "-"]
            + [f"+{_mib(m.at_mask_choice)} (transient)" if m.at_mask_choice else "-"]
        )
    return text_table(rows) if len(rows) > 1 else []


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f}"


__all__ = ["PACKING_BYTES", "PhaseMemory", "memory_table", "phase_memory"]
