"""How ``verify_speed`` times a layer: as the model runs, eagerly or replayed as a CUDA graph.
Compiling is lazy, so these models are compiled but never run (no GPU needed)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled
from torch import nn

from lightning_sparse.backends import speed
from lightning_sparse.backends.cuda_graphs import compiled_with_cuda_graphs


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.mark.parametrize(
    ("mode", "graphs"),
    [
        ("default", False),
        ("reduce-overhead", True),
        ("max-autotune", True),
        ("max-autotune-no-cudagraphs", False),
    ],
)
def test_the_compile_mode_says_whether_the_model_runs_as_cuda_graphs(mode, graphs):
    inner = mlp()
    inner[0].compile(mode=mode)  # a submodule compiled in place
    assert compiled_with_cuda_graphs(inner) is graphs
    assert compiled_with_cuda_graphs(torch.compile(mlp(), mode=mode)) is graphs
    assert speed.timing_for(True, inner) == ("cuda_graphs" if graphs else "eager")


def test_other_backends_and_options_and_plain_models():
    assert not compiled_with_cuda_graphs(mlp())
    aot = mlp()
    aot.compile(backend="aot_eager")  # no inductor, no CUDA graphs
    assert not compiled_with_cuda_graphs(aot)
    options = mlp()
    options.compile(options={"triton.cudagraphs": True})
    assert compiled_with_cuda_graphs(options)


def test_a_lightning_module_unwrapped_from_torch_compile():
    """``Trainer.fit(torch.compile(module))``: Lightning unwraps it and keeps the compile
    context, which says how it runs."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

    unwrapped = from_compiled(torch.compile(Module(), mode="reduce-overhead"))
    assert compiled_with_cuda_graphs(unwrapped)
    assert not compiled_with_cuda_graphs(from_compiled(torch.compile(Module())))


def test_explicit_timings_and_a_wrong_one():
    net = mlp()
    assert speed.timing_for("cuda_graphs", net) == "cuda_graphs"
    assert (
        speed.timing_for("eager", torch.compile(net, mode="reduce-overhead")) == "eager"
    )
    assert speed.timing_for(False, net) is None
    with pytest.raises(ValueError, match=r"verify_speed='graphs'; use True, False"):
        speed.timing_for("graphs", net)


def test_cuda_graph_timing_captures_both_steps_or_says_why_it_could_not(monkeypatch):
    def dense() -> None: ...

    def sparse() -> None: ...

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    captured = []
    monkeypatch.setattr(
        speed, "cuda_graphed", lambda step: captured.append(step) or step
    )
    assert speed._as_timed(dense, sparse, cuda, "cuda_graphs")[2] == "as CUDA graphs"
    assert captured == [dense, sparse]
    assert speed._as_timed(dense, sparse, cuda, "eager")[2] == "eager"
    assert speed._as_timed(dense, sparse, cpu, "cuda_graphs")[2] == "eager"  # no GPU

    def refuses(step):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(speed, "cuda_graphed", refuses)
    *steps, how = speed._as_timed(dense, sparse, cuda, "cuda_graphs")
    assert steps == [dense, sparse]
    assert how == (
        "eager: CUDA graph capture failed (operation not permitted when stream is capturing)"
    )
