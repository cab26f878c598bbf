"""A mask update takes effect bit for bit as the plain rule says: the weight multiplied by the new
mask (signed zeros), optimizer state zeroed exactly where the mask changed, gradients multiplied
by the new mask; whether the update edits few entries (by index) or many (whole tensors)."""

import pytest
import torch
from helpers import dst_updates, on_both_paths
from torch import nn

from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine import gradients, layer_threads
from lightning_sparse.engine.sparsifier import Sparsifier


def bits(tensor):
    return tensor.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize(
    ("algorithm", "drop_fraction"),
    [("rigl", 0.004), ("rigl", 0.3), ("set", 0.004), ("set", 0.3), ("gmp", None)],
)
def test_update_applies_exactly_the_new_mask(algorithm, drop_fraction):
    torch.manual_seed(0)
    net = nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    options = {"update_every": 1, "update_stop": 50}
    if drop_fraction is not None:
        options |= {"drop_fraction": drop_fraction, "drop_fraction_decay": "constant"}
    phase = Phase(sparsity=0.5, algorithm=algorithm, **options)
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["weight"]).targets,
        resolve_phases([phase], 100),
    )
    sp.on_step_start(0, [opt])
    for step in range(4):
        net.weight.grad = torch.randn(256, 256)
        grad = net.weight.grad.clone()
        weight = net.weight.detach().clone()
        state = {k: v.clone() for k, v in opt.state[net.weight].items()}
        mask = sp.masks["weight"].clone()
        sp.before_optimizer_step(step, opt, [opt])
        new = sp.masks["weight"]
        changed = mask ^ new
        if step:  # an update step: some entries changed
            assert changed.any()
        assert torch.equal(bits(net.weight), bits(weight * new))
        assert torch.equal(bits(net.weight.grad), bits(grad * new))
        for key, value in opt.state[net.weight].items():
            if value.shape == weight.shape:
                expected = state[key].masked_fill(changed, 0)
                assert torch.equal(bits(value), bits(expected)), key
        opt.step()


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
@pytest.mark.parametrize("sparsity", [0.9, "2:4", "1:4"])
def test_torch_and_compiled_paths_give_the_same_masks(algorithm, sparsity):
    """The compiled CPU loops and the torch operations give the same masks and weights
    through whole updates."""
    reference, compiled = on_both_paths(lambda: dst_updates(algorithm, sparsity))
    for a, b in zip(reference, compiled):
        assert torch.equal(a, b)


def test_bfloat16_weights_update_exactly():
    torch.manual_seed(0)
    net = nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for sparsity in (0.75, "2:4"):
        for algorithm in ("set", "rigl"):
            phase = Phase(sparsity=sparsity, algorithm=algorithm, update_every=1)
            sp = Sparsifier(
                "g",
                select_parameters(net, params=["weight"]).targets,
                resolve_phases([phase], 100),
            )
            sp.on_step_start(0, [opt])
            for step in (1, 2):
                net.weight.grad = torch.randn(256, 256).bfloat16()
                sp.before_optimizer_step(step, opt, [opt])
                mask = sp.masks["weight"]
                assert int(mask.sum()) == 256 * 256 // 4 * (
                    1 if sparsity == 0.75 else 2
                )
                assert not bool((net.weight[~mask] != 0).any())
            sp.close()


def mask_gradients_at(net, grads, threads, monkeypatch):
    """One hard-mask step (static 50%) of ``net`` with ``grads`` at ``threads`` torch threads:
    the masks, and the worker counts gradient masking asked ``for_each_layer`` for."""
    workers = []

    def for_each_layer(work, items, sizes, n):
        workers.append(n)
        return layer_threads.for_each_layer(work, items, sizes, n)

    monkeypatch.setattr(gradients, "for_each_layer", for_each_layer)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["weight"]).targets,
        resolve_phases([Phase(sparsity=0.5)], 10),
    )
    sp.on_step_start(0, [opt])
    for p, grad in zip(net.parameters(), grads):
        p.grad = grad.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sp.before_optimizer_step(1, opt, [opt])
    finally:
        torch.set_num_threads(before)
    return list(sp.masks.values()), workers


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "dtypes", [(torch.float32, torch.float64), (torch.float16, torch.bfloat16)]
)
def test_gradients_are_masked_bit_for_bit_whatever_the_dtype_and_threads(
    mask_path, dtypes, threads, monkeypatch
):
    """Many plain CPU gradients are masked by compiled loops on torch's threads (float32/64
    with the [cpu] extra), else by torch's fused multiply: always the bits of
    ``grad * mask`` (signed zeros, NaN)."""
    monkeypatch.setattr(gradients, "COMPILED_GRADIENT_MASKING", 0)  # any size
    torch.manual_seed(0)
    net = nn.ModuleList(nn.Linear(64, 32, bias=False).to(dtype) for dtype in dtypes)
    grads = []
    for layer in net:  # pruned: their first entries, where the gradients are special
        layer.weight.data.view(-1)[:4] = 0
        grad = torch.randn(32, 64).to(layer.weight.dtype)
        grad.view(-1)[:4] = torch.tensor([float("nan"), -1.0, float("-inf"), 0.0])
        grads.append(grad)
    masks, workers = mask_gradients_at(net, grads, threads, monkeypatch)
    compiled = mask_path == "compiled" and torch.float16 not in dtypes
    assert workers == ([threads] if compiled else [])
    for layer, grad, mask in zip(net, grads, masks):
        want = grad * mask
        kind = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        assert torch.equal(layer.weight.grad.view(kind), want.view(kind))


def test_small_gradients_are_masked_by_torchs_fused_multiply(monkeypatch):
    """Below COMPILED_GRADIENT_MASKING entries (gradients still in the CPU cache), torch's
    fused multiply masks them: no compiled loops, no threads."""
    net = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    grads = [torch.randn(64, 64), torch.randn(64, 64)]
    masks, workers = mask_gradients_at(net, grads, 2, monkeypatch)
    assert workers == []
    for p, grad, mask in zip(net.parameters(), grads, masks):
        assert torch.equal(p.grad, grad * mask)
