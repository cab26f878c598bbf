"""The demo models' ``compile`` option: the network is compiled in place (parameter names,
checkpoint keys and the callback's patterns unchanged) and trains through 2:4 and dense phases
as it does eagerly. ``torch.compile`` runs with ``aot_eager`` here (inductor's C++ builds are
slow on a small CPU); the mode the model asked for is recorded."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import CountingBackend, Recompiles, fast_trainer, pretend_gpu
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback
from lightning_sparse.demo import DINOSelfDistillation, GPTLanguageModel
from lightning_sparse.demo.compiling import COMPILE_MODES
from lightning_sparse.demo.hf import HuggingFaceCausalLM

MLPS = [
    "model.transformer.h.*.mlp.c_fc.weight",
    "model.transformer.h.*.mlp.c_proj.weight",
]
PHASES = [
    {"sparsity": "2:4", "until": 3},  # runtime: the layers' forward is swapped
    {"sparsity": "2:4", "algorithm": "static", "init": "wanda", "until": 5},
    {"sparsity": 0.0},
]


class Compiles:
    """Stands in for ``torch.compile``: records what is compiled and in which mode, and
    compiles it with ``aot_eager``, counting the graphs (``counting``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, str | None]] = []
        self.counting = CountingBackend()
        self.real = torch.compile

    def __call__(self, fn, mode=None, **kwargs):
        self.calls.append((getattr(fn, "__self__", fn), mode))
        return self.real(fn, backend=self.counting, **kwargs)


@pytest.fixture
def compiles(monkeypatch):
    torch._dynamo.reset()
    stand_in = Compiles()
    monkeypatch.setattr(torch, "compile", stand_in)
    yield stand_in
    torch._dynamo.reset()


def token_loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (24, 16), generator=gen)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4)


@pytest.mark.parametrize("pretend", [False, True], ids=["masked", "semi_structured"])
def test_compiled_gpt_trains_through_sparse_phases_like_eager(
    compiles, monkeypatch, tmp_path, pretend
):
    if pretend:  # the 2:4 layers run the semi_structured backend's CPU emulation
        pretend_gpu(monkeypatch)

    def fit(compile):
        L.seed_everything(0, verbose=False)
        lm = GPTLanguageModel(n_layer=1, n_embd=128, block_size=16, compile=compile)
        cb = SparsityCallback(phases=PHASES, params=MLPS, verbose=False)
        steps = Recompiles(compiles.counting)
        trainer = fast_trainer(
            max_steps=7,
            callbacks=[cb, steps],
            precision="bf16-mixed" if pretend else "32-true",
        )
        trainer.fit(lm, token_loader())
        trainer.save_checkpoint(tmp_path / f"{compile}.ckpt")
        return lm, cb, steps.seen

    eager, _, _ = fit(False)
    assert compiles.calls == []
    compiled, cb, seen = fit("reduce-overhead")
    assert compiles.calls == [(compiled.model, "reduce-overhead")]
    assert cb.sparsifier.backends[0, "model.transformer.h.0.mlp.c_fc.weight"].name == (
        "semi_structured" if pretend else "masked"
    )
    # graphs are compiled at phase starts only: none within a phase
    assert seen[0] > 0 and seen[0] == seen[1] == seen[2]
    assert seen[3] == seen[4] and seen[5] == seen[6]
    names = [name for name, _ in eager.named_parameters()]
    assert [name for name, _ in compiled.named_parameters()] == names
    for name, p, q in zip(names, compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    keys = [
        list(torch.load(tmp_path / f"{c}.ckpt", weights_only=False)["state_dict"])
        for c in (False, "reduce-overhead")
    ]
    assert keys[0] == keys[1] and "model.transformer.h.0.mlp.c_fc.weight" in keys[0]
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)


def tiny_hf(compile):
    config = {
        "n_layer": 1,
        "n_embd": 32,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 32,
    }
    return HuggingFaceCausalLM("gpt2", config=config, compile=compile)


def test_dino_and_hf_compile_their_networks_in_place(compiles):
    dino = DINOSelfDistillation(out_dim=128, compile=True)
    hf = tiny_hf("max-autotune")
    keys = [list(m.state_dict()) for m in (dino, hf)]
    for _ in range(
        2
    ):  # Lightning calls configure_model for every fit, validate and test
        dino.configure_model()
        hf.configure_model()
    expected = [
        (dino.student.backbone, "default"),
        (dino.teacher.backbone, "default"),
        (hf.model, "max-autotune"),
    ]
    assert compiles.calls == expected * 2
    assert [list(m.state_dict()) for m in (dino, hf)] == keys
    crops = [torch.randn(2, 3, 32, 32)] * 2 + [torch.randn(2, 3, 16, 16)] * 2
    with torch.no_grad():
        out = dino.student(crops)
        assert compiles.counting.compiles > 0
        with torch.compiler.set_stance("force_eager"):
            torch.testing.assert_close(out, dino.student(crops))


def test_compile_is_off_by_default(compiles):
    for model in (
        GPTLanguageModel(n_layer=1),
        DINOSelfDistillation(out_dim=128),
        tiny_hf(False),
    ):
        assert model.hparams.compile is False
        model.configure_model()
    assert compiles.calls == []


@pytest.mark.parametrize("value", ["fast", "reduce_overhead", 1, None])
@pytest.mark.parametrize(
    "make",
    [
        lambda c: GPTLanguageModel(n_layer=1, compile=c),
        lambda c: DINOSelfDistillation(out_dim=128, compile=c),
        tiny_hf,
    ],
    ids=["gpt", "dino", "hf"],
)
def test_a_bad_compile_value_says_which_values_work(make, value):
    with pytest.raises(ValueError, match=rf"compile={value!r} is invalid") as err:
        make(value)
    assert all(repr(mode) in str(err.value) for mode in COMPILE_MODES)
    assert "false" in str(err.value) and "true" in str(err.value)


@pytest.mark.slow
def test_gpt_compiled_by_inductor_trains_through_sparse_phases_like_eager():
    def fit(compile):
        torch._dynamo.reset()
        L.seed_everything(0, verbose=False)
        lm = GPTLanguageModel(n_layer=1, n_embd=128, block_size=16, compile=compile)
        cb = SparsityCallback(phases=PHASES, params=MLPS, verbose=False)
        fast_trainer(max_steps=7, callbacks=[cb]).fit(lm, token_loader())
        return lm

    eager, compiled = fit(False), fit(True)
    # inductor's fused kernels round differently and AdamW's normalized steps carry that
    # (about 4e-5 here); one step of a wrong mask would move weights by about lr = 2e-3
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-4, msg=name)
