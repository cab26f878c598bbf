"""What a layer computes, measured from outside: the weight it multiplies by, found by feeding it
an identity (never read from the stored tensor), and a callback that records it during ``fit``."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_sparse.core.layers import layer_type
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier


@torch.no_grad()
def effective_rows(module: nn.Module) -> torch.Tensor:
    """The weight ``module`` computes with, as rows with the computation's inputs last:
    ``(out, in)`` for a matmul layer (``nn.Linear``, Hugging Face ``Conv1D``),
    ``(out, kh, kw, in_channels / groups)`` for an ``nn.Conv2d`` (any stride, padding, groups)."""
    if isinstance(module, nn.Conv2d):
        return _conv2d_rows(module)
    n_in = module.weight.shape[layer_type(module).input_dim]
    out = module(torch.eye(n_in))  # (in, out)
    bias = 0 if module.bias is None else module.bias
    return (out - bias).T


def _conv2d_rows(conv: nn.Conv2d) -> torch.Tensor:
    assert conv.dilation == (1, 1) and conv.padding_mode == "zeros"
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    per_group = conv.in_channels // conv.groups  # the inputs each output reads
    # every group's channels get the same identity: an output sums its own group's only
    eye = torch.eye(per_group * kh * kw).view(-1, per_group, kh, kw)
    # the output at (i, j) reads input rows from i * sh - ph: place the identity there
    i, j = -(-ph // sh), -(-pw // sw)
    qh, qw = i * sh - ph, j * sw - pw
    probe = torch.zeros(len(eye), conv.in_channels, qh + kh, qw + kw)
    probe[:, :, qh:, qw:] = eye.repeat(1, conv.groups, 1, 1)
    bias = 0 if conv.bias is None else conv.bias
    out = conv(probe)[:, :, i, j] - bias  # (per_group * kh * kw, out)
    return out.T.reshape(-1, per_group, kh, kw).movedim(1, -1)


def kept_per_group(rows: torch.Tensor, m: int) -> torch.Tensor:
    """How many of every ``m`` consecutive inputs each output keeps (rows' last axis)."""
    return (rows != 0).reshape(rows.shape[0], -1, m).sum(-1)


def zero_fraction(module: nn.Module) -> float:
    return float((effective_rows(module) == 0).float().mean())


def run_phase(model: nn.Module, sparsity: Any, **spec: Any) -> Sparsifier:
    """Enter a sparse phase on ``model`` with the default selection (plain PyTorch)."""
    exclude = spec.pop("exclude", None)
    phases = resolve_phases([Phase(sparsity=sparsity, **spec)], total_steps=10)
    targets = select_parameters(model, exclude=exclude).targets
    sp = Sparsifier("t", targets, phases, backend="masked")
    sp.on_step_start(0, [])
    return sp


class EffectiveProbe(L.Callback):
    """Records, after every optimizer step, the effective rows of the modules named."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self.rows: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        self.rows.append(
            {n: effective_rows(pl_module.get_submodule(n)) for n in self.modules}
        )


PHASES = [
    {"sparsity": "2:4", "until": 2},  # runtime: straight-through
    {"sparsity": 0.7, "until": 4},  # static: hard masks
    {"sparsity": 0.0},
]
"""Two sparse phases and a dense one over 5 optimizer steps, checked by :func:`assert_phases`."""


def assert_phases(probe: EffectiveProbe, dense_zeros: float = 0.01) -> None:
    """What every probed layer computed after each of the 5 steps of :data:`PHASES`: 2:4 along
    its inputs, then exactly 70% zeros, then no mask (at most ``dense_zeros`` of its weights
    still zero: those that have had no gradient since)."""
    assert len(probe.rows) == 5
    for step, layers in enumerate(probe.rows):
        for name, rows in layers.items():
            zeros = int((rows == 0).sum())
            if step < 2:
                assert bool((kept_per_group(rows, 4) <= 2).all()), (step, name)
                assert zeros >= rows.numel() // 2, (step, name)
            elif step < 4:
                assert zeros == round(0.7 * rows.numel()), (step, name)
            else:
                assert zeros <= dense_zeros * rows.numel(), (step, name)
