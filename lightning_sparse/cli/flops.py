"""Theoretical forward FLOP savings of a sparsity schedule, counted on matmul layers.

What is counted, and what is not:

- Every matmul layer (``nn.Linear``, Hugging Face ``Conv1D``: the layer types with a matrix,
  :mod:`~lightning_sparse.core.layers`) with a trainable weight costs
  ``2 * in_features * out_features`` FLOPs per input row (token) in the forward pass; each module counts once per token. Modules
  that see fewer rows (a classifier head on the CLS token) are over-counted, layers without
  trainable weights (a frozen EMA teacher) are left out, and so are convolutions (a ViT's patch
  embedding), attention's score/value matmuls, norms and activations.
- A sparse weight skips its zeros' share of its layer's FLOPs: 2:4 skips 50%, 70% unstructured
  skips 70%. Per layer and phase the sparsity is the layer's target at the phase end (its share
  of the ``distribution``), scaled by the phase's mean group target over its steps for ramps
  (``gmp``); dense phases skip nothing.
- The saving of the run weights each phase by its number of optimizer steps.

This is what a kernel that skips every zero would save in the forward pass. The ``masked``
backend computes dense math and saves nothing; 2:4 sparse tensor cores run at most 2x the dense
rate (what they reached where measured: ``docs/hopper.md``). In the backward pass, 2:4 kernels with transposable masks
can also run the input-gradient matmul sparse; the weight-gradient matmul stays dense.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> linear_flops_per_token(net)
    {'0.weight': 64, '2.weight': 32}
    >>> savings = run_savings({"0.weight": [0.5, 0.0]}, [0.7, 0.3], linear_flops_per_token(net))
    >>> round(savings.per_phase[0], 4), round(savings.run, 4)
    (0.3333, 0.2333)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_sparse.core.layers import layer_type


def linear_flops_per_token(model: nn.Module) -> dict[str, int]:
    """``{weight name: forward FLOPs per token}`` of every matmul layer (``nn.Linear``, Hugging
    Face ``Conv1D``) whose weight trains.

    A weight shared by several modules (a tied ``lm_head``) is named as
    ``model.named_parameters()`` names it and counts once per module that applies it.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    flops: dict[str, int] = {}
    for module in model.modules():
        if layer_type(module).matrix is not None and module.weight.requires_grad:
            name = names[id(module.weight)]
            flops[name] = flops.get(name, 0) + 2 * module.weight.numel()  # in x out
    return flops


@dataclass(frozen=True)
class FlopSavings:
    """Fractions of all counted forward FLOPs skipped: per phase and over the run."""

    total_per_token: (
        int  #: counted forward FLOPs per token (all trainable matmul layers)
    )
    selected_per_token: int  #: of which in the sparsified layers
    per_phase: list[float]  #: fraction skipped while each phase runs
    run: float  #: fraction skipped over the run, phases weighted by their length


def run_savings(
    layer_sparsity: Mapping[str, Sequence[float]],
    phase_fractions: Sequence[float],
    flops: Mapping[str, int],
) -> FlopSavings:
    """Savings of a schedule.

    Args:
        layer_sparsity: per sparsified weight, its (mean) sparsity in each phase.
        phase_fractions: each phase's share of the run's optimizer steps.
        flops: :func:`linear_flops_per_token` of the model. Sparsified weights that are not
            trainable Linear weights (convolutions) are not counted.
    """
    total = sum(flops.values())
    counted = {name: s for name, s in layer_sparsity.items() if name in flops}
    per_phase = [
        sum(flops[name] * s[index] for name, s in counted.items()) / total
        if total
        else 0.0
        for index in range(len(phase_fractions))
    ]
    return FlopSavings(
        total_per_token=total,
        selected_per_token=sum(flops[name] for name in counted),
        per_phase=per_phase,
        run=sum(f * saved for f, saved in zip(phase_fractions, per_phase)),
    )
