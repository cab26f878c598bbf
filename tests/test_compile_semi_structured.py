"""torch.compile on the CPU: compiled models train through sparse phases, a phase switch
recompiles (no stale graph), and the 2:4 layer's kernel path traces (with a stand-in kernel)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CompiledTiny,
    CountingBackend,
    Recompiles,
    RepeatedBatch,
    dense_cusparselt,
    fast_trainer,
    pretend_gpu,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.masked import install_masked_forward, uninstall_forward
from lightning_sparse.backends.semi_structured import install_semi_structured_forward
from lightning_sparse.masks.tiles import transposable_2to4_mask


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("pretend", [False, True], ids=["masked", "semi_structured"])
def test_compiled_model_trains_through_phases_like_eager(monkeypatch, pretend):
    if pretend:  # the layers run the semi_structured backend's CPU emulation
        pretend_gpu(monkeypatch)
    phases = [
        {"sparsity": "2:4", "until": 3},
        {"sparsity": "2:4", "algorithm": "static", "until": 5},
        {"sparsity": 0.0},
    ]

    def fit(backend):
        L.seed_everything(0, verbose=False)
        model = CompiledTiny(backend, width=128, inputs=128, lr=0.05)
        callbacks = [SparsityCallback(phases=phases, verbose=False)]
        if backend:
            callbacks.append(Recompiles(backend))
        data = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=128), batch_size=6)
        precision = "bf16-mixed" if pretend else "32-true"
        fast_trainer(max_steps=7, callbacks=callbacks, precision=precision).fit(
            model, data
        )
        return model, callbacks

    eager, _ = fit(None)
    backend = CountingBackend()
    compiled, (cb, counts) = fit(backend)
    assert cb.sparsifier.backends[1, "net.fc1.weight"].name == (
        "semi_structured" if pretend else "masked"
    )
    # a phase change fails the guards on the swapped layers: a new graph at step 3, then none
    # within the phase; at step 5 the dense layers reuse the graph of step 3 (masked: static
    # masks need no forward) or get a new one (semi_structured: the kernel ran the static mask)
    seen = counts.seen
    # (torch before 2.14 may reuse an earlier graph at step 3: then no new one; the
    # parameters below check that what ran is what eager computes)
    assert seen[1] == seen[2] <= seen[3] == seen[4]
    assert seen[5] == seen[6] and seen[4] <= seen[5] <= seen[4] + pretend
    assert type(compiled.net.fc1) is nn.Linear
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    x = torch.randn(3, 128)
    assert torch.equal(compiled(x), compiled.net(x))  # no stale sparse graph


def test_compiled_layer_follows_swaps_both_ways():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    compiled = torch.compile(net, backend="aot_eager")
    x = torch.randn(2, 8, 16)
    for install in (
        lambda m: install_masked_forward(m, project=transposable_2to4_mask),
        lambda m: install_semi_structured_forward(m, "emulated"),
        uninstall_forward,
        lambda m: install_semi_structured_forward(m, "cusparselt"),
    ):
        install(net[0])
        out = compiled(x)
        assert torch.equal(out, net(x))
        out.sum().backward()
        grad = net[0].weight.grad.clone()
        net.zero_grad()
        net(x).sum().backward()
        assert torch.equal(grad, net[0].weight.grad)
        net.zero_grad()


def test_kernel_path_traces_with_a_stand_in_kernel(monkeypatch):
    """The cuSPARSELt custom ops (pruning, matmul, their straight-through backward) and the
    casts under AOTAutograd, with a dense stand-in for cuSPARSELt's matmul."""
    dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    install_semi_structured_forward(layer, "cusparselt")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3, 32)
    with torch.autocast("cpu", torch.bfloat16):
        out, ref = compiled(x), layer(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    ref.float().sum().backward()
    assert torch.equal(grad, layer.weight.grad)
    wb = layer.weight.detach().bfloat16()
    expected = F.linear(
        x.bfloat16(), wb * transposable_2to4_mask(wb), layer.bias.bfloat16()
    )
    assert torch.equal(ref, expected)


def test_compiled_training_on_the_cusparselt_ops_follows_every_mask_update(monkeypatch):
    """The cuSPARSELt custom ops (dense stand-in for the matmul, our packer's bytes unpacked)
    in a compiled model through a runtime 2:4 phase and a magnitude phase that updates its
    stored masks every step: the magnitude phase's graph is reused across the updates, which
    reach it through the packing refreshed in place, so after the last update the compiled
    model computes masked math on the current masks, and training matches eager."""
    pretend_gpu(monkeypatch, (9, 0))
    calls = dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    phases = [
        {"sparsity": "2:4", "until": 2},
        {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 1},
    ]

    class MaskLog(L.Callback):
        def __init__(self) -> None:
            self.masks: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            mask = pl_module.net.fc1._ls_mask  # None in the runtime phase
            if mask is not None:
                self.masks.append(mask.clone())

    def fit(backend):
        L.seed_everything(0, verbose=False)
        model = CompiledTiny(backend, width=128, inputs=128, lr=0.05)
        callbacks = [SparsityCallback(phases=phases, verbose=False), MaskLog()]
        if backend:
            callbacks.append(Recompiles(backend))
        data = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=128), batch_size=6)
        trainer = fast_trainer(max_steps=6, callbacks=callbacks, precision="bf16-mixed")
        trainer.fit(model, data)
        return model, callbacks

    eager, _ = fit(None)
    eager_calls = len(calls)
    backend = CountingBackend()
    compiled, (cb, log, counts) = fit(backend)
    assert cb.sparsifier.backends[1, "net.fc1.weight"].name == "semi_structured"
    assert (128, 72) in {shape for shape, _ in calls[eager_calls:]}  # packed bytes ran
    assert not torch.equal(log.masks[-2], log.masks[-1])  # the last update moved a mask
    seen = counts.seen
    assert seen[3] == seen[4] == seen[5]  # mask updates reuse the graph
    x = torch.randn(3, 128)
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(x)
        monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: False)
        reference = compiled.net(x)  # eager, masked math on the current masks
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-3)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2)
