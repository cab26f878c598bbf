"""Stored masks on cuSPARSELt: the mask's packing is made when it is installed and at every mask
update, each step gathers only the values, and nothing reads a stale packing. On the CPU, with a
dense stand-in for cuSPARSELt's matmul that unpacks the bytes it is given (our packer's own
layout), so the packed weights themselves are what is compared."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    RepeatedBatch,
    TinyModule,
    assert_packs_as,
    dense_cusparselt,
    fast_trainer,
    pretend_gpu,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.backends import cusparselt
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.cusparselt_packer import packing
from lightning_sparse.backends.semi_structured import install_semi_structured_forward
from lightning_sparse.masks.tiles import transposable_2to4_mask

DTYPE = torch.bfloat16


def tile_mask(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A transposable 2:4 mask (of a random weight)."""
    gen = torch.Generator().manual_seed(seed)
    return transposable_2to4_mask(torch.randn(rows, cols, generator=gen))


def assert_packing_of(found: cusparselt.MaskPacking, matrix: torch.Tensor) -> None:
    """``found`` is the packing of the ``(out, in)`` mask ``matrix`` and of its transpose."""
    assert torch.equal(found.mask, matrix)
    for got, mask in ((found.rows, matrix), (found.columns, matrix.t().contiguous())):
        want = packing(mask)
        assert torch.equal(got.keys, want.keys) and torch.equal(
            got.metadata, want.metadata
        )


def test_the_stored_ops_pass_opcheck(monkeypatch):
    dense_cusparselt(monkeypatch)
    torch.manual_seed(0)
    mask = tile_mask(128, 256)
    p = cusparselt.mask_packing(mask, mask)
    extra = p.op_arguments()
    x = torch.randn(12, 256, dtype=DTYPE, requires_grad=True)
    weight = torch.randn(128, 256, dtype=DTYPE, requires_grad=True)
    bias = torch.randn(128, dtype=DTYPE, requires_grad=True)
    torch.library.opcheck(cusparselt.linear_24_stored, (x, weight, bias, *extra))
    torch.library.opcheck(cusparselt.linear_24_stored, (x, weight, None, *extra))
    grad = torch.randn(12, 128, dtype=DTYPE, requires_grad=True)
    torch.library.opcheck(
        cusparselt.linear_24_stored_input_grad, (grad, weight, *extra)
    )


@pytest.mark.parametrize("ours", [True, False], ids=["our packer", "cslt_compress"])
def test_a_stored_mask_computes_the_masked_linear_with_dense_weight_gradients(
    monkeypatch, ours
):
    calls = dense_cusparselt(monkeypatch, packer_matches=ours)
    packed = []
    stand_in = cusparselt._sparse_mm
    monkeypatch.setattr(
        cusparselt,
        "_sparse_mm",
        lambda p, out, dense, bias: packed.append(p) or stand_in(p, out, dense, bias),
    )
    torch.manual_seed(0)
    mask = tile_mask(128, 256)
    x = torch.randn(20, 256, dtype=DTYPE, requires_grad=True)
    # drawn in float32: some torch versions' bfloat16 randn gives exact zeros, where the
    # stored positions may pad differently from packing W * mask (same weight, other bytes)
    weight = torch.randn(128, 256).to(DTYPE).requires_grad_()
    assert weight.count_nonzero() == weight.numel()
    bias = torch.randn(128, dtype=DTYPE, requires_grad=True)
    out = cusparselt.cusparselt_linear(
        x, weight, bias, mask, cusparselt.mask_packing(mask, mask)
    )
    w24 = weight.detach() * mask
    torch.testing.assert_close(out, F.linear(x.detach(), w24, bias.detach()))
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ w24)
    torch.testing.assert_close(weight.grad, grad.T @ x.detach())  # straight-through
    torch.testing.assert_close(bias.grad, grad.sum(0))
    if ours:  # the bytes of packing W * mask whole, and of its transpose
        assert [c[0] for c in calls] == [(128, 144), (256, 72)]
        assert_packs_as(w24, packed[0])
        assert_packs_as(w24.t().contiguous(), packed[1])
    else:  # torch._cslt_compress (here: the 2:4 weight as it is) of W * mask
        assert [c[0] for c in calls] == [(128, 256), (256, 128)]
        assert torch.equal(packed[0], w24)


def test_install_packs_stored_masks_for_cusparselt_only():
    mask = tile_mask(128, 256)
    layer = nn.Linear(256, 128)
    install_semi_structured_forward(layer, "cusparselt", mask)
    assert_packing_of(layer._ls_packing, mask)
    install_semi_structured_forward(
        layer, "cusparselt"
    )  # a runtime phase: nothing stored
    assert layer._ls_packing is None
    install_semi_structured_forward(layer, "cutlass", mask)
    assert layer._ls_packing is None
    small = nn.Linear(64, 64)  # a shape whose packed layout the packer does not know
    install_semi_structured_forward(small, "cusparselt", tile_mask(64, 64))
    assert small._ls_packing is None


def test_a_conv1d_layer_packs_the_matrix_it_multiplies_by():
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(128, 256)  # weight (in=256, out=128): the matrix is weight.T
    stored = tile_mask(256, 128)
    install_semi_structured_forward(layer, "cusparselt", stored)
    assert_packing_of(layer._ls_packing, stored.t().contiguous())


def test_a_reinstall_after_an_update_repacks_into_the_same_tensors():
    mask = tile_mask(128, 256)
    layer = nn.Linear(256, 128)
    install_semi_structured_forward(layer, "cusparselt", mask)
    first = layer._ls_packing
    mask.copy_(tile_mask(128, 256, seed=1))  # the engine updates masks in place
    install_semi_structured_forward(layer, "cusparselt", mask)
    again = layer._ls_packing
    assert_packing_of(again, mask)
    for old, new in ((first.rows, again.rows), (first.columns, again.columns)):
        assert old.keys is new.keys and old.metadata is new.metadata
    assert again.mask is first.mask


@pytest.fixture
def stored_layer(monkeypatch):
    """A bf16 256->128 Linear on the cuSPARSELt ops (dense stand-in) with a stored mask."""
    dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    monkeypatch.setattr(cusparselt, "require_kernel", lambda *args: None)
    torch.manual_seed(0)
    mask = tile_mask(128, 256)
    layer = nn.Linear(256, 128).to(DTYPE)
    install_semi_structured_forward(layer, "cusparselt", mask)
    return layer, mask


def test_an_eager_forward_repacks_a_mask_changed_without_a_reinstall(stored_layer):
    layer, mask = stored_layer
    mask.copy_(tile_mask(128, 256, seed=1))
    x = torch.randn(8, 256, dtype=DTYPE)
    out = layer(x)
    assert_packing_of(layer._ls_packing, mask)
    torch.testing.assert_close(out, F.linear(x, layer.weight * mask, layer.bias))


def test_a_compiled_layer_reads_the_packing_of_each_new_mask(stored_layer):
    """The compiled graph holds the packing's tensors; a reinstall refreshes them in place."""
    layer, mask = stored_layer
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(layer, backend=recording, fullgraph=True)
    x = torch.randn(8, 256, dtype=DTYPE)
    for seed in (1, 2):
        out = compiled(x)
        torch.testing.assert_close(out, F.linear(x, layer.weight * mask, layer.bias))
        mask.copy_(tile_mask(128, 256, seed=seed))
        install_semi_structured_forward(layer, "cusparselt", mask)
    torch.testing.assert_close(
        compiled(x), F.linear(x, layer.weight * mask, layer.bias)
    )
    assert len(graphs) == 1
    assert "linear_24_stored" in str(graphs[0].graph)


def test_training_with_mask_updates_keeps_every_packing_current(monkeypatch):
    """A stored-mask phase with updates every step, through Trainer.fit on a pretend sm90 GPU:
    after each optimizer step the packing each layer holds is its current mask's."""
    pretend_gpu(monkeypatch, (9, 0))
    calls = dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    seen: list[bool] = []
    masks: list[torch.Tensor] = []

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            for layer in (pl_module.net.fc1, pl_module.net.fc2):
                try:
                    assert_packing_of(layer._ls_packing, layer._ls_mask)
                    seen.append(True)
                except AssertionError:
                    seen.append(False)
            masks.append(pl_module.net.fc1._ls_mask.clone())

    torch.manual_seed(0)
    model = TinyModule(width=128, inputs=128, lr=0.05)
    cb = SparsityCallback(
        phases=[{"sparsity": "2:4", "algorithm": "magnitude", "update_every": 1}],
        verbose=False,
    )
    loader = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=128), batch_size=6)
    trainer = fast_trainer(max_steps=4, callbacks=[cb, Check()], precision="bf16-mixed")
    trainer.fit(model, loader)
    assert cb.sparsifier.backends[0, "net.fc1.weight"].name == "semi_structured"
    assert seen == [True] * 8
    assert any(not torch.equal(a, b) for a, b in itertools.pairwise(masks))  # moved
    packed = {shape for shape, _ in calls}
    assert (128, 72) in packed  # the 128x128 weights, packed by the stored path


def sparsified_layer(monkeypatch):
    """A bf16 256->128 Linear in a straight-through 2:4 ``magnitude`` phase (a stored mask,
    dense weights) on the cuSPARSELt ops (dense stand-in, a pretend sm90 GPU), with its
    sparsifier."""
    from lightning_sparse.core.schedule import Phase, resolve_phases
    from lightning_sparse.core.selection import select_parameters
    from lightning_sparse.engine.sparsifier import Sparsifier

    pretend_gpu(monkeypatch, (9, 0))
    dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 128)).to(DTYPE)
    phase = Phase(sparsity="2:4", algorithm="magnitude", update_every=100)
    targets = select_parameters(net, params=["0.weight"]).targets
    sp = Sparsifier("g", targets, resolve_phases([phase], 100))
    sp.on_step_start(0, [])
    assert sp.backends[0, "0.weight"].name == "semi_structured"
    assert net[0]._ls_packing is not None
    return net[0], sp


def test_masks_set_through_the_sparsifier_reach_compiled_and_eager_forwards(
    monkeypatch,
):
    layer, sp = sparsified_layer(monkeypatch)
    compiled = torch.compile(layer, backend=lambda gm, inputs: gm, fullgraph=True)
    x = torch.randn(8, 256, dtype=DTYPE)
    with torch.no_grad():
        compiled(x)  # the graph holds the packing's tensors from here on
    new = tile_mask(128, 256, seed=5)
    assert not torch.equal(new, sp.masks["0.weight"])
    sp.set_masks({"0.weight": new})
    expected = F.linear(x, layer.weight * new, layer.bias)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(layer(x), expected)
    assert_packing_of(layer._ls_packing, new)


def test_a_mask_changed_in_place_is_refused_at_the_next_step(monkeypatch):
    _, sp = sparsified_layer(monkeypatch)
    sp.on_step_start(1, [])  # nothing changed
    sp.masks["0.weight"].copy_(tile_mask(128, 256, seed=5))
    with pytest.raises(RuntimeError, match=r"changed in place.*Sparsifier\.set_masks"):
        sp.on_step_start(2, [])


@pytest.mark.parametrize(
    ("mask", "problem"),
    [
        (torch.ones(128, 256, dtype=torch.bool), "not 2:4 (at most 2 kept of every 4"),
        (torch.ones(128, 256), "a torch.float32 torch.strided tensor"),
        (torch.ones(256, 128, dtype=torch.bool), "of shape (256, 128), not (128, 256)"),
    ],
    ids=["pattern", "dtype", "shape"],
)
def test_set_masks_refuses_a_mask_the_phase_cannot_run(monkeypatch, mask, problem):
    _, sp = sparsified_layer(monkeypatch)
    before = sp.masks["0.weight"].clone()
    with pytest.raises(
        ValueError, match="set_masks: the mask for '0.weight' is"
    ) as err:
        sp.set_masks({"0.weight": mask})
    assert problem in str(err.value) and "which phase 1 (2:4" in str(err.value)
    with pytest.raises(
        ValueError, match="'fc.weight' is not a parameter of this group"
    ):
        sp.set_masks({"fc.weight": before})
    assert torch.equal(sp.masks["0.weight"], before)  # nothing changed


@pytest.mark.parametrize(
    ("phase", "problem"),
    [
        ({"sparsity": "2:4"}, "its algorithm 'runtime' derives them at every forward"),
        ({"sparsity": 0.0}, "the current phase is dense, so it has no masks to set"),
    ],
)
def test_set_masks_needs_a_phase_with_stored_masks(phase, problem):
    from lightning_sparse.core.schedule import Phase, resolve_phases
    from lightning_sparse.core.selection import select_parameters
    from lightning_sparse.engine.sparsifier import Sparsifier

    net = nn.Linear(8, 4)
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["weight"]).targets,
        resolve_phases([Phase(**phase)], 10),
    )
    sp.on_step_start(0, [])
    with pytest.raises(ValueError, match=problem):
        sp.set_masks({"weight": torch.ones(4, 8, dtype=torch.bool)})
