"""The semi_structured backend on the CPU: the layer swap, the emulation (= the masked backend),
the kernel path's control flow with a stand-in kernel, and the callback with a pretend GPU."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import RepeatedBatch, TinyModule, fast_trainer, pretend_gpu
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import SparsityAlgorithm, SparsityCallback, register_algorithm
from lightning_sparse.algorithms import RunLength
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends import speed
from lightning_sparse.backends.masked import (
    install_masked_forward,
    straight_through_mask,
    uninstall_forward,
)
from lightning_sparse.backends.semi_structured import (
    SemiStructuredLinear,
    install_semi_structured_forward,
)
from lightning_sparse.masks import target_mask
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
    transposable_2to4_mask,
)

WIDTH = 128  # TinyNet's fc1 and fc2 become 128x128: eligible for cuSPARSELt


def loader(n: int = 24) -> DataLoader:
    return DataLoader(RepeatedBatch(n=n, batch_size=6, inputs=WIDTH), batch_size=6)


def test_kernel_greedy_example_from_torch_cuda_tests():
    """torch's CUDA test of largest_abs_values_greedy expects this pattern for this tile."""
    tile = torch.tensor(
        [[4, 3, 2, 1], [-1, -3, 0.6, 0.5], [1, 2, 3, 4], [10, 2, -1, 5]],
        dtype=torch.bfloat16,
    )
    assert transposable_2to4_mask(tile).int().tolist() == [
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
        [1, 0, 0, 1],
    ]


def test_swap_keeps_module_parameters_optimizer_state_and_keys():
    layer = nn.Linear(16, 8)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 16)).sum().backward()
    opt.step()
    weight, bias, keys = layer.weight, layer.bias, list(layer.state_dict())
    state = {k: v.clone() for k, v in opt.state[weight].items()}
    install_semi_structured_forward(layer, "cusparselt")
    assert isinstance(layer, SemiStructuredLinear) and isinstance(layer, nn.Linear)
    assert layer.weight is weight and layer.bias is bias
    assert list(layer.state_dict()) == keys
    layer(torch.randn(4, 16)).sum().backward()
    opt.step()  # the optimizer still holds and updates the same Parameter objects
    assert opt.state[weight]["step"] == state["step"] + 1
    install_masked_forward(layer, project=transposable_2to4_mask)  # re-swap
    assert type(layer).__name__ == "MaskedLinear" and layer.weight is weight
    uninstall_forward(layer)
    assert type(layer) is nn.Linear and not any(
        k.startswith("_ls_") for k in vars(layer)
    )


def test_swap_of_a_linear_subclass_keeps_isinstance():
    class MyLinear(nn.Linear):
        pass

    layer = MyLinear(8, 8)
    install_semi_structured_forward(layer, "emulated")
    assert type(layer).__name__ == "SemiStructuredMyLinear" and isinstance(
        layer, MyLinear
    )
    uninstall_forward(layer)
    assert type(layer) is MyLinear
    with pytest.raises(ValueError, match=r"kernel='sparse'; use one of"):
        install_semi_structured_forward(layer, "sparse")
    mask = torch.ones(8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"transposable 2:4 .* this mask is not"):
        install_semi_structured_forward(layer, "emulated", mask)


@pytest.mark.parametrize("kernel", ["cusparselt", "emulated"])
def test_cpu_fallback_is_the_masked_backend_bit_for_bit(kernel):
    torch.manual_seed(0)
    sparse, masked = nn.Linear(32, 16), nn.Linear(32, 16)
    masked.load_state_dict(sparse.state_dict())
    install_semi_structured_forward(sparse, kernel)  # on the CPU: emulated
    install_masked_forward(masked, project=transposable_2to4_mask)
    x = torch.randn(2, 5, 32)
    for autocast in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out, ref = sparse(x), masked(x)
        assert torch.equal(out, ref)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        for p, q in zip(sparse.parameters(), masked.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """Run the kernel code path on the CPU: a dense stand-in for the 2:4 kernel (the greedy
    mask times the weight, in the matmul dtype, straight-through), and "the kernel can run"
    everywhere. Records the dtype of every call (the kernel check's included)."""
    calls = []

    def linear(x, weight, bias, mask, packing=None):
        calls.append(
            x.dtype
        )  # the matmul dtype: a kernel is given the weight as stored
        weight = weight.to(x.dtype)
        if mask is None:
            mask = transposable_2to4_mask(weight.detach())
        return F.linear(x, straight_through_mask(weight, mask), bias)

    monkeypatch.setitem(ss.KERNELS, "cusparselt", linear)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    return calls


@pytest.mark.parametrize("contiguous", [True, False])
def test_kernel_path_numerics_under_autocast(stand_in_kernel, contiguous):
    """bf16 autocast, fp32 master weights, a 3-D input: the output is the bf16 matmul with the
    2:4 projection of the bf16 weight; gradients are straight-through, in fp32, to the weight."""
    torch.manual_seed(1)
    layer = nn.Linear(32, 16)
    install_semi_structured_forward(layer, "cusparselt")
    x = torch.randn(5, 3, 32)
    x = (
        x if contiguous else x.transpose(0, 1).contiguous().transpose(0, 1)
    ).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        out = layer(x)
    assert set(stand_in_kernel) == {torch.bfloat16} and out.shape == (5, 3, 16)

    wb = layer.weight.detach().bfloat16()
    w24 = (wb * transposable_2to4_mask(wb)).requires_grad_()
    x2 = x.detach().bfloat16().reshape(-1, 32).requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    ref = F.linear(x2, w24, bias.bfloat16()).view(5, 3, 16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)

    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, w24.grad.float())  # dense: straight-through
    assert torch.equal(x.grad, x2.grad.view(5, 3, 32).float())
    assert torch.equal(layer.bias.grad, bias.grad)


def test_a_transposable_mask_survives_the_greedy_unchanged(stand_in_kernel):
    """Why static/magnitude masks run on the same kernel: tiling ``W * M`` keeps ``W * M``."""
    torch.manual_seed(2)
    w = torch.randn(64, 64)
    mask = optimal_transposable_2to4_mask(
        torch.rand(64, 64)
    )  # a random transposable mask
    assert torch.equal(transposable_2to4_mask(w * mask) | ~mask, torch.ones_like(mask))
    layer = nn.Linear(64, 32)
    install_semi_structured_forward(layer, "cusparselt", mask[:32])
    x = torch.randn(4, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight * mask[:32], layer.bias))
    layer(x).sum().backward()  # straight-through: the gradient is dense
    assert torch.equal(layer.weight.grad, torch.ones(32, 4) @ x)


def fit(backend="auto", phases=None, steps=6, precision="bf16-mixed", **kwargs):
    L.seed_everything(0, verbose=False)
    model = TinyModule(width=WIDTH, inputs=WIDTH, lr=0.05)
    cb = SparsityCallback(
        phases=phases or [{"sparsity": "2:4", "until": 4}, {"sparsity": 0.0}],
        backend=backend,
        verbose=False,
        **kwargs,
    )
    seen = ClassProbe()
    trainer = fast_trainer(max_steps=steps, callbacks=[cb, seen], precision=precision)
    trainer.fit(model, loader())
    return model, cb, seen


class ClassProbe(L.Callback):
    """The class of ``net.fc1`` at every optimizer step."""

    def __init__(self) -> None:
        self.classes: dict[int, str] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.classes[trainer.global_step] = type(pl_module.net.fc1).__name__


@pytest.mark.parametrize(
    "phases",
    [
        [{"sparsity": "2:4", "until": 4}, {"sparsity": 0.0}],
        [{"sparsity": "2:4", "algorithm": "static", "until": 4}, {"sparsity": 0.0}],
        [{"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2}],
        [{"sparsity": "2:4", "decay": 0.05, "until": 4}, {"sparsity": 0.0}],
    ],
    ids=["runtime", "static", "magnitude", "runtime with decay"],
)
def test_auto_picks_the_kernel_per_layer_and_trains_like_masked(monkeypatch, phases):
    reference, _, _ = fit("masked", phases)
    pretend_gpu(monkeypatch)
    model, cb, seen = fit("auto", phases)
    choices = {name: c for (_, name), c in cb.sparsifier.backends.items()}
    assert choices["net.fc1.weight"].name == "semi_structured"
    assert choices["net.fc1.weight"].kernel == "cusparselt"
    assert seen.classes[0] == "SemiStructuredLinear"
    if phases[-1]["sparsity"] == 0.0:
        assert seen.classes[5] == "Linear"  # swapped back when the phase ended
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # the same function, computed the same way on the CPU


def test_fit_start_table_says_where_each_layer_runs(monkeypatch, lightning_log):
    pretend_gpu(monkeypatch, (8, 6))
    L.seed_everything(0, verbose=False)
    model = TinyModule(width=WIDTH, inputs=192)
    cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 2}, {"sparsity": 0.7}])
    fast_trainer(max_steps=3, callbacks=[cb], precision="bf16-mixed").fit(
        model, DataLoader(RepeatedBatch(n=12, batch_size=6, inputs=192), batch_size=6)
    )
    text = "\n".join(r.getMessage() for r in lightning_log.records)
    fc1 = next(line for line in text.splitlines() if "net.fc1.weight" in line)
    fc2 = next(line for line in text.splitlines() if "net.fc2.weight" in line)
    assert "masked/semi_structured" in fc1 and "CUTLASS, sm86, bfloat16" in fc1
    assert "70% has no sparse kernel" in fc1
    assert "cuSPARSELt, sm86, bfloat16" in fc2


def test_semi_structured_without_a_gpu_lists_every_layer(lightning_log):
    with pytest.raises(ValueError) as info:
        fit("semi_structured")
    message = str(info.value)
    assert "cannot run these layers on 2:4 sparse tensor cores" in message
    assert "phase 1 net.fc1.weight: no CUDA GPU" in message
    assert "phase 1 net.fc2.weight: no CUDA GPU" in message
    assert "backend='auto'" in message


def test_semi_structured_where_possible_runs(monkeypatch):
    pretend_gpu(monkeypatch)
    _, _, seen = fit("semi_structured")
    assert seen.classes[0] == "SemiStructuredLinear"
    pretend_gpu(monkeypatch)
    with pytest.raises(ValueError, match=r"phase 1 net.fc1.weight: matmuls in float32"):
        fit("semi_structured", precision="32-true")


@register_algorithm("rowwise_test")
class RowWise(SparsityAlgorithm):
    """A custom algorithm with plain row-wise 2:4 masks (not transposable)."""

    straight_through = True

    def initial_mask(self, weight, target, ctx):
        return target_mask(weight.abs(), target)


def test_a_non_transposable_custom_mask_runs_masked_or_raises(
    monkeypatch, lightning_log
):
    pretend_gpu(monkeypatch)
    phases = [{"sparsity": "2:4", "algorithm": "rowwise_test"}]
    _, cb, seen = fit("auto", phases, steps=2)
    assert seen.classes[0] == "MaskedLinear"
    choice = cb.sparsifier.backends[0, "net.fc1.weight"]
    assert choice.name == "masked" and "not transposable" in choice.reason
    assert "it runs with masked dense math" in lightning_log.text
    assert not is_transposable_2to4(cb.sparsifier.masks["net.fc1.weight"])
    with pytest.raises(
        ValueError, match=r"mask that is not transposable .* backend='auto'"
    ):
        fit("semi_structured", phases, steps=2)


@pytest.mark.parametrize("algorithm", ["runtime", "static"])
def test_verify_speed_measures_each_shape_once_and_keeps_slow_layers_dense(
    monkeypatch, algorithm
):
    """Each shape is timed once, as its phase runs: a mask projected per forward
    (``runtime``) or a stored one (``static``, packed ahead of the steps)."""
    pretend_gpu(monkeypatch)
    measured = []

    def fake_measure(shape, dtype, kernel, device, tokens, timing, stored):
        measured.append((shape, dtype, kernel, timing, stored))
        return speed.SpeedMeasurement(0.8, 0.0, timing=timing, stored=stored)

    monkeypatch.setattr(speed, "measure_speedup", fake_measure)
    phases = [
        {"sparsity": "2:4", "algorithm": algorithm, "until": 4},
        {"sparsity": 0.0},
    ]
    _, cb, seen = fit("auto", phases, verify_speed=True)
    stored = algorithm == "static"
    # fc1 = fc2, measured once; eagerly, as the model (not compiled) runs
    assert measured == [((WIDTH, WIDTH), torch.bfloat16, "cusparselt", "eager", stored)]
    choice = cb.sparsifier.backends[0, "net.fc2.weight"]
    details = "stored mask, eager" if stored else "eager"
    details += ", 8192 tokens"
    assert choice.name == "masked"
    assert f"sparse 0.80x dense ({details}), so kept dense" in choice.reason
    # masked math: a projecting forward, or the stored zeros of a hard mask in a plain layer
    assert seen.classes[0] == ("Linear" if stored else "MaskedLinear")
    with pytest.raises(ValueError, match=r"verify_speed=True .* use backend='auto'"):
        SparsityCallback(sparsity="2:4", backend="masked", verify_speed=True)


def test_verify_speed_times_a_model_compiled_with_cuda_graphs_as_cuda_graphs(
    monkeypatch,
):
    """``verify_speed=True`` on a model compiled with ``mode="reduce-overhead"`` (compiled
    lazily, never run here) times each layer replayed as a CUDA graph; naming
    ``"cuda_graphs"`` for a model that is not compiled so warns at fit start."""
    pretend_gpu(monkeypatch)
    timings = []

    def fake_measure(shape, dtype, kernel, device, tokens, timing, stored):
        timings.append(timing)
        return speed.SpeedMeasurement(ratio=1.3, error=0.0, timing="as CUDA graphs")

    monkeypatch.setattr(speed, "measure_speedup", fake_measure)
    run = RunLength(total_steps=10)
    compiled = TinyModule(width=WIDTH, inputs=WIDTH)
    compiled.net.compile(mode="reduce-overhead")
    cb = SparsityCallback(sparsity="2:4", verify_speed=True, verbose=False)
    sparsifier, _ = cb.build(compiled, run, torch.bfloat16)
    assert timings == ["cuda_graphs"]
    assert sparsifier.backends[0, "net.fc1.weight"].reason.endswith(
        "1.30x dense (as CUDA graphs, 8192 tokens)"
    )
    with pytest.warns(UserWarning, match="not compiled with CUDA graphs"):
        fit("auto", verify_speed="cuda_graphs")  # fit start says so (a plan does not)


@pytest.mark.parametrize("stored", [False, True])
def test_measure_speedup_runs_end_to_end_on_the_emulation(stored):
    measured = speed.measure_speedup(
        (32, 64), torch.float32, "emulated", torch.device("cpu"), 16, stored=stored
    )
    assert 0 < measured.ratio < float("inf") and measured.error < 1e-6
    assert measured.stored is stored


class StopAfter(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = trainer.global_step >= self.step


def test_resume_with_the_kernel_backend_is_exact(monkeypatch, tmp_path):
    pretend_gpu(monkeypatch)
    phases = [
        {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2, "until": 5},
        {"sparsity": "2:4", "until": 8},
        {"sparsity": 0.0},
    ]

    def run(stop=None, ckpt_path=None):
        L.seed_everything(0, verbose=False)
        model = TinyModule(width=WIDTH, inputs=WIDTH, lr=0.05)
        callbacks = [SparsityCallback(phases=phases, verbose=False)]
        if stop:
            callbacks += [
                StopAfter(stop),
                ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=stop),
            ]
        trainer = fast_trainer(
            max_steps=10,
            callbacks=callbacks,
            precision="bf16-mixed",
            enable_checkpointing=bool(stop),
            deterministic=True,
        )
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
        return model

    reference = run()
    run(stop=3)  # in the magnitude phase, between two mask updates
    resumed = run(ckpt_path=tmp_path / "step=3.ckpt")
    for p, q in zip(resumed.parameters(), reference.parameters()):
        assert torch.equal(p, q)
