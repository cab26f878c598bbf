"""The accounting of live tensor bytes that the memory tests and the benchmark measure with:
counted by storage, against sizes computed by hand; and a mask choice gathering each weight
once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sparse.cli.memory import PhaseMemory, phase_memory
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.memory_census import PeakBytes, storage_bytes
from lightning_sparse.engine.sparsifier import Sparsifier


def test_storage_bytes_counts_each_storage_once_and_a_freed_one_as_zero():
    w = torch.zeros(64, 32)  # 8192 bytes
    mask = torch.ones(64, 32, dtype=torch.bool)  # 2048 bytes
    assert storage_bytes([w, w.t(), w[3:5], None, mask, mask.view(-1)]) == 8192 + 2048
    gathered = torch.zeros(128, dtype=torch.bfloat16)
    gathered.untyped_storage().resize_(0)  # as FSDP2 frees its gathered parameter
    assert storage_bytes([gathered, w]) == 8192


def test_peak_bytes_follows_what_is_made_and_freed_inside_the_block():
    before = torch.ones(1000)  # made before the block: never counted
    with PeakBytes() as peak:
        a = torch.ones(1000)  # 4000
        before.mul_(2)  # in place, on a tensor from before: nothing new
        view = before[:10]  # a view of it: nothing new
        b = a.to(torch.float64)  # 8000 more: 12000 held
        del a  # 8000
        c = torch.ones(500, dtype=torch.bool)  # 500 more: 8500
        del b  # 500
    assert peak.peak == 12000
    assert peak.held == 500
    assert view.shape == (10,) and c.shape == (500,)


def test_peak_bytes_sees_a_backward():
    layer = nn.Linear(100, 50, bias=False)
    x = torch.randn(8, 100)
    with PeakBytes() as peak:
        out = layer(x)
        out.sum().backward()
    # the output (8x50) and the weight gradient (50x100), float32, and the loss and the
    # gradient that seeds the backward (4 bytes each)
    assert peak.peak == (8 * 50 + 50 * 100) * 4 + 8
    assert peak.held == (8 * 50 + 50 * 100) * 4  # the output and the gradient stay


@pytest.mark.parametrize("distribution", ["uniform", "erk"])
def test_each_weight_is_gathered_once_per_mask_choice(monkeypatch, distribution):
    """A mask choice reads each layer's whole weight once: the layers' shapes, which the
    distribution spreads the target over, come without gathering (under FSDP2 each gather
    is a collective). Convolution weights count too: their shape as rows is 2-D."""
    import lightning_sparse.engine.sparsifier as engine

    gathered: list[tuple[int, ...]] = []

    def counting_gather(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tuple(tensor.shape))
        return tensor

    monkeypatch.setattr(engine, "gather_full", counting_gather)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8, 16))
    phases = resolve_phases([Phase(sparsity=0.5, distribution=distribution)], 10)
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    sp = Sparsifier("g", targets, phases)
    sp.on_step_start(0, [torch.optim.SGD(net.parameters(), lr=0.1)])
    assert sorted(gathered) == [(8, 4, 3, 3), (16, 8)]
    assert {n: tuple(m.shape) for n, m in sp.masks.items()} == {
        "0.weight": (8, 4, 3, 3),
        "2.weight": (16, 8),
    }


def saved_by_sparse_forwards(spec: Phase) -> tuple[list[torch.Tensor], PhaseMemory]:
    """What one forward of two layers in a phase of ``spec`` keeps for the backward (by a
    saved-tensors hook; inputs that need a gradient, as inside a model), beyond the
    parameters and the activations themselves; and plan's count of the phase."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    phases = resolve_phases([spec, Phase(sparsity=0.0)], 10)
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    sp = Sparsifier("g", targets, phases)
    sp.on_step_start(0, [])
    x = torch.randn(4, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t) or t, lambda t: t
    ):
        hidden = net[1](net[0](x))
        net[2](hidden)
    skip = {t.untyped_storage().data_ptr() for t in [*net.parameters(), x, hidden]}
    ours = [t for t in saved if t.untyped_storage().data_ptr() not in skip]
    (memory, _) = phase_memory(sp)
    return ours, memory


@pytest.mark.parametrize("transposable", [False, "tiles"])
def test_plan_counts_what_a_learned_layer_keeps_until_the_backward(transposable):
    """Two learned layers keep the whole sampled mask and the softmax over the candidates,
    as plan counts."""
    spec = Phase(
        sparsity="2:4", algorithm="learned", transposable=transposable, until=5
    )
    saved, memory = saved_by_sparse_forwards(spec)
    # the candidate tables are constants (no grad_fn), not held per layer
    ours = [t for t in saved if t.grad_fn is not None]
    # per layer: the mask (4 bytes a weight; not the product, which the backward makes
    # again), the softmax (6 per 4 weights, or 90 per 16, float32)
    per_weight = 4 + (6 / 4 if not transposable else 90 / 16) * 4
    assert memory.until_backward == (32 * 64 + 64 * 16) * per_weight
    assert storage_bytes(ours) == memory.until_backward


def test_plan_counts_the_bool_mask_a_runtime_linear_keeps_until_the_backward():
    """``runtime`` 2:4 on masked math: a Linear keeps the bool mask it projected (1 byte a
    weight), not the weight times it, as plan counts."""
    ours, memory = saved_by_sparse_forwards(Phase(sparsity="2:4", until=5))
    assert {t.dtype for t in ours} == {torch.bool}
    assert storage_bytes(ours) == memory.until_backward == 32 * 64 + 64 * 16
