"""The models people bring (tiny configs, random weights, no downloads): Hugging Face GPT-2
(``Conv1D``, weight ``(in, out)``, ``lm_head`` tied to ``wte``) and Llama, timm ViT, PyTorch's
``nn.MultiheadAttention``, convolutions. Every check reads the map a layer computes (it is fed
an identity), not the stored tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FEW_UPDATES,
    Classifier,
    StopAt,
    TinyModule,
    fast_trainer,
    labelled_loader,
    random_loader,
)
from hf_models import LMModule, tiny_gpt2, tiny_llama, token_loader, transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from probes import PHASES, EffectiveProbe, assert_phases, effective_rows, run_phase
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.algorithms import RunLength
from lightning_sparse.backends.gpus import parse_gpu
from lightning_sparse.backends.semi_structured import install_semi_structured_forward
from lightning_sparse.cli.flops import linear_flops_per_token
from lightning_sparse.core.head import NO_FORWARD
from lightning_sparse.core.layers import CONV, CONV1D, LINEAR, layer_type
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks.tiles import transposable_2to4_mask

pytestmark = FEW_UPDATES


def test_layer_types_of_the_models_people_bring():
    conv1d = transformers.pytorch_utils.Conv1D(12, 8)  # nf=12 outputs, nx=8 inputs
    assert layer_type(conv1d) is CONV1D and conv1d.weight.shape == (8, 12)
    assert CONV1D.inputs(conv1d.weight.shape) == 8
    assert layer_type(nn.Linear(2, 3)) is LINEAR
    assert layer_type(nn.Conv2d(8, 4, 3)) is CONV
    assert layer_type(nn.Embedding(3, 4)).name == "parameter"


def test_gpt2_default_selection_takes_the_conv1d_weights():
    model = tiny_gpt2()
    sel = select_parameters(model)
    names = [t.name for t in sel.targets]
    assert names == [
        f"transformer.h.{i}.{w}.weight"
        for i in range(2)
        for w in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert {t.layer for t in sel.targets} == {CONV1D}
    assert sel.excluded["transformer.wte.weight"] == "tied to an embedding"


def test_gpt2_static_70_percent_is_exact_on_the_effective_weights():
    model = tiny_gpt2()
    sp = run_phase(model, 0.7)
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert int((rows == 0).sum()) == round(0.7 * rows.numel())
    assert sp.actual_sparsity() == pytest.approx(0.7, abs=1e-4)


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
@pytest.mark.parametrize("algorithm", ["static", "runtime"])
def test_gpt2_nm_runs_along_the_input_dimension(pattern, algorithm):
    n, m = map(int, pattern.split(":"))
    model = tiny_gpt2()
    sp = run_phase(model, pattern, algorithm=algorithm)
    for t in sp.targets:
        rows = effective_rows(t.module)  # (out, in)
        kept = (rows != 0).reshape(rows.shape[0], -1, m).sum(-1)
        if pattern == "2:4" and algorithm == "runtime":
            assert (
                int(kept.max()) <= n
            )  # the greedy transposable tile keeps 7 or 8 of 16
            assert torch.equal(rows != 0, transposable_2to4_mask(rows) & (rows != 0))
        else:
            assert bool((kept == n).all()), t.name


def test_gpt2_nm_feasibility_counts_the_inputs_of_the_computation():
    conv1d = transformers.pytorch_utils.Conv1D
    wide_out = nn.Sequential(conv1d(130, 64), nn.GELU(), conv1d(8, 130))
    phases = resolve_phases([Phase(sparsity="2:4")], total_steps=10)
    targets = select_parameters(wide_out, params=["0.weight"]).targets
    Sparsifier("t", targets, phases)  # 64 inputs, 130 outputs: fine
    targets = select_parameters(wide_out, params=["2.weight"]).targets
    with pytest.raises(
        ValueError, match=r"'2.weight': its Conv1D .* 130 inputs per output"
    ):
        Sparsifier("t", targets, phases)


def test_gpt2_tied_head_pattern_names_the_parameter_it_is_tied_to():
    with pytest.raises(
        ValueError, match=r"'lm_head.weight', which is tied to 'transformer.wte.weight'"
    ):
        select_parameters(tiny_gpt2(), params=["lm_head.weight"])


def test_conv1d_semi_structured_emulation_multiplies_by_the_transposed_mask():
    layer = transformers.pytorch_utils.Conv1D(16, 8)  # weight (8, 16): 16 outputs
    install_semi_structured_forward(layer, "emulated")
    rows = effective_rows(layer)
    dense = layer.weight.detach().T
    assert torch.equal(rows, dense * transposable_2to4_mask(dense))


def test_gpt2_runtime_2to4_trains_sparse_then_dense():
    module = LMModule(tiny_gpt2())
    cb = SparsityCallback(
        phases=[{"sparsity": "2:4", "until": 3}, {"sparsity": 0.0}], verbose=False
    )
    seen = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            c_fc = pl_module.model.transformer.h[0].mlp.c_fc
            seen.append(float((effective_rows(c_fc) == 0).float().mean()))

    fast_trainer(max_steps=4, callbacks=[cb, Probe()]).fit(module, token_loader())
    assert all(0.5 <= z < 0.53 for z in seen[:3]) and seen[3] < 0.01, seen


def _mlps_as_linear(model: nn.Module) -> nn.Module:
    """``model`` with every GPT-2 MLP ``Conv1D`` replaced by the ``nn.Linear`` it transposes."""
    for block in model.transformer.h:
        for name in ("c_fc", "c_proj"):
            conv = getattr(block.mlp, name)
            linear = nn.Linear(*conv.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(conv.weight.T)
                linear.bias.copy_(conv.bias)
            setattr(block.mlp, name, linear)
    return model


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def test_gpt2_conv1d_trains_like_the_same_mlps_as_linear_layers():
    # Conv1D is the transposed Linear: the same schedule gives the same losses and weights
    # (equal bit for bit on the machines measured; float32 tolerance for other BLAS kernels)
    mlps = ["transformer.h.*.mlp.c_fc.weight", "transformer.h.*.mlp.c_proj.weight"]
    phases = [{"sparsity": "2:4", "until": 4}, {"sparsity": 0.0}]
    runs = {}
    for layers in ("conv1d", "linear"):
        torch.manual_seed(0)
        model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        module = LMModule(model if layers == "conv1d" else _mlps_as_linear(model))
        losses = _Losses()
        cb = SparsityCallback(params=mlps, phases=phases, verbose=False)
        fast_trainer(max_steps=6, callbacks=[cb, losses]).fit(
            module, token_loader(steps=6)
        )
        c_fc = module.model.transformer.h[0].mlp.c_fc.weight.detach()
        runs[layers] = losses.values, c_fc if layers == "linear" else c_fc.T
    torch.testing.assert_close(runs["conv1d"][0], runs["linear"][0])
    torch.testing.assert_close(runs["conv1d"][1], runs["linear"][1])


def test_llama_default_selection_and_nm_along_inputs():
    model = tiny_llama()
    sel = select_parameters(model)
    assert sel.excluded["lm_head.weight"] == "output head"
    assert sel.excluded["model.embed_tokens.weight"] == "embedding"
    assert len(sel.targets) == 2 * 7  # q, k, v, o, gate, up, down per layer
    sp = run_phase(model, "2:4", algorithm="static")
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert bool(((rows != 0).reshape(rows.shape[0], -1, 4).sum(-1) == 2).all())
    sp = run_phase(tiny_llama(), 0.7)
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert int((rows == 0).sum()) == round(0.7 * rows.numel())


class LitGPTLike(nn.Module):
    """litgpt's ``GPT`` registers ``lm_head`` before the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(32, 16),
                "h": nn.ModuleList(
                    nn.ModuleDict({"fc": nn.Linear(16, 64), "proj": nn.Linear(64, 16)})
                    for _ in range(2)
                ),
            }
        )


def test_head_is_found_by_name_not_by_registration_order():
    sel = select_parameters(LitGPTLike())
    assert sel.excluded["lm_head.weight"] == "output head"
    assert "transformer.h.1.proj.weight" in [t.name for t in sel.targets]


def test_an_empty_selection_with_a_target_says_what_was_found():
    class OnlyHead(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8)

    cb = SparsityCallback(sparsity=0.5)
    with pytest.raises(ValueError, match=r"selects no parameter of OnlyHead") as err:
        cb.build(OnlyHead(), RunLength(10))
    assert "emb.weight: embedding" in str(err.value)
    assert "head.weight: output head" in str(err.value)


class Encoder(L.LightningModule):
    """``nn.TransformerEncoderLayer``: attention by ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            32, 2, 64, dropout=0.0, batch_first=True
        )
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(x)).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def sequences() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4, 32)), batch_size=2)


def attention_reference(attn: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """Self-attention computed by hand from the weights the forward should see."""
    in_w, out_w = attn.in_proj_weight, attn.out_proj.weight  # sparse reads
    q, k, v = F.linear(x, in_w, attn.in_proj_bias).chunk(3, -1)
    b, t, e = x.shape
    heads = [y.view(b, t, attn.num_heads, -1).transpose(1, 2) for y in (q, k, v)]
    mixed = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b, t, e)
    return F.linear(mixed, out_w, attn.out_proj.bias)


@pytest.mark.parametrize("algorithm", ["runtime", "magnitude"])
def test_multihead_attention_is_sparse_in_every_forward_straight_through(algorithm):
    model = Encoder()
    attn = model.layer.self_attn
    in_w, out_w = attn.in_proj_weight, attn.out_proj.weight
    cb = SparsityCallback(
        phases=[{"sparsity": "2:4", "algorithm": algorithm}],
        params=["*.in_proj_weight", "*.out_proj.weight", "*.linear1.weight"],
        verbose=False,
    )
    fast_trainer(max_steps=2, callbacks=[cb]).fit(model, sequences())
    # the model's Parameters, names and state_dict are unchanged; reads are sparse
    assert dict(model.named_parameters())["layer.self_attn.in_proj_weight"] is in_w
    assert model.state_dict()["layer.self_attn.out_proj.weight"] is not None
    assert attn._parameters["in_proj_weight"] is in_w
    assert attn.out_proj._parameters["weight"] is out_w
    for w in (attn.in_proj_weight, attn.out_proj.weight):  # what MHA reads
        assert float((w == 0).float().mean()) >= 0.49
        assert bool(((w != 0).reshape(w.shape[0], -1, 4).sum(-1) <= 2).all())
    assert float((in_w == 0).float().mean()) < 0.01  # stored dense (straight-through)
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        reference = attention_reference(attn, x)
        torch.testing.assert_close(attn(x, x, x, need_weights=False)[0], reference)
        model.eval()  # the fused inference path of nn.MultiheadAttention
        torch.testing.assert_close(attn(x, x, x, need_weights=False)[0], reference)


def test_separate_qkv_weights_are_refused_for_straight_through():
    attn = nn.MultiheadAttention(32, 2, kdim=16, vdim=16, batch_first=True)
    phases = resolve_phases([Phase(sparsity="2:4")], total_steps=10)
    targets = select_parameters(attn, params=["k_proj_weight"]).targets
    with pytest.raises(
        ValueError,
        match=r"'k_proj_weight' .* hands k_proj_weight to F.multi_head_attention_forward "
        r".* use a hard-mask algorithm \('static'\) or exclude",
    ):
        Sparsifier("t", targets, phases)


def test_multihead_attention_with_hard_masks_computes_sparse():
    model = Encoder()
    sp = run_phase(model, "2:4", algorithm="static")
    assert "layer.self_attn.out_proj.weight" in [t.name for t in sp.targets]
    attn = model.layer.self_attn
    x = torch.randn(2, 4, 32)
    out, _ = attn(x, x, x, need_weights=False)
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
    heads = [t.view(2, 4, 2, 16).transpose(1, 2) for t in (q, k, v)]
    mixed = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 4, 32)
    w = attn.out_proj.weight
    assert bool(((w != 0).reshape(32, -1, 4).sum(-1) <= 2).all())
    torch.testing.assert_close(out, F.linear(mixed, w, attn.out_proj.bias))


def test_transformer_encoder_layer_runtime_without_out_proj_is_sparse_in_eval():
    model = Encoder()
    cb = SparsityCallback(sparsity="2:4", exclude=["*.out_proj.weight"], verbose=False)
    fast_trainer(max_steps=2, callbacks=[cb]).fit(model, sequences())
    layer = model.layer
    model.eval()
    x = torch.randn(2, 4, 32)
    with torch.no_grad():  # the inference fast path of nn.TransformerEncoderLayer
        out = layer(x)
        w1 = layer.linear1.sparse_weight(torch.float32)
        w2 = layer.linear2.sparse_weight(torch.float32)
        attn, _ = layer.self_attn(x, x, x, need_weights=False)
        h = layer.norm1(x + attn)
        expected = layer.norm2(
            h
            + F.linear(
                F.relu(F.linear(h, w1, layer.linear1.bias)), w2, layer.linear2.bias
            )
        )
    torch.testing.assert_close(out, expected)


def test_a_weight_read_around_its_layer_stops_the_first_sparse_step():
    class Functional(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.head(F.linear(batch[0], self.proj.weight)).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    cb = SparsityCallback(sparsity="2:4", verbose=False)
    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)
    with pytest.raises(
        RuntimeError, match=r"did not run in the first sparse step: \['proj.weight"
    ):
        fast_trainer(max_steps=2, callbacks=[cb]).fit(Functional(), data)


class IdleAttention(L.LightningModule):
    """An ``nn.MultiheadAttention`` that the training step never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(batch[0]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("param", ["attn.in_proj_weight", "attn.out_proj.weight"])
def test_an_attention_that_never_runs_stops_the_first_sparse_step(param):
    cb = SparsityCallback(sparsity="2:4", params=[param], verbose=False)
    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)
    with pytest.raises(
        RuntimeError, match=rf"did not run in the first sparse step: \['{param} "
    ):
        fast_trainer(max_steps=2, callbacks=[cb]).fit(IdleAttention(), data)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)


@pytest.mark.parametrize("algorithm", ["static", "runtime"])
def test_conv_nm_groups_run_along_input_channels(algorithm):
    model = ConvNet()
    phases = resolve_phases(
        [Phase(sparsity="2:4", algorithm=algorithm)], total_steps=10
    )
    with pytest.raises(
        ValueError, match=r"'stem.weight': its ConvNd .*3 input channels"
    ):
        Sparsifier("t", select_parameters(model).targets, phases)
    targets = select_parameters(model, exclude=["stem.weight"]).targets
    assert [t.name for t in targets] == ["conv.weight"]
    sp = Sparsifier("t", targets, phases, backend="masked")
    sp.on_step_start(0, [])
    rows = effective_rows(model.conv)  # (16, 3, 3, 8)
    kept = (rows != 0).reshape(16, -1, 4).sum(-1)
    assert bool((kept <= 2).all()) and int(kept.sum()) >= 0.45 * rows.numel() / 2
    if algorithm == "static":
        assert bool((kept == 2).all())


def test_a_stem_that_cannot_hold_a_later_phases_nm_stays_dense_all_run():
    model = ConvNet()
    phases = resolve_phases(
        [Phase(sparsity=0.0, until=2), Phase(sparsity="2:4")], total_steps=10
    )
    selection = select_parameters(model, phases=phases)
    assert [t.name for t in selection.targets] == ["conv.weight"]
    assert selection.excluded["stem.weight"] == (
        "3 input channels, not a multiple of M=4 (2:4 in phase 2)"
    )
    sp = Sparsifier("t", selection.targets, phases, backend="masked")
    sp.on_step_start(2, [])
    assert sp.current.index == 1 and bool((model.stem.weight != 0).all())


def test_timm_vit_runtime_2to4_selects_the_block_linears_and_trains():
    timm = pytest.importorskip("timm")
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=2,
        num_heads=2,
        num_classes=4,
    )
    sel = select_parameters(vit)
    assert sel.excluded["head.weight"] == "output head"
    assert {t.name.split(".", 2)[-1] for t in sel.targets} == {
        "attn.qkv.weight",
        "attn.proj.weight",
        "mlp.fc1.weight",
        "mlp.fc2.weight",
    }

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.vit = vit

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.vit(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = DataLoader(
        TensorDataset(torch.randn(4, 3, 32, 32), torch.randint(0, 4, (4,))),
        batch_size=2,
    )
    cb = SparsityCallback(sparsity="2:4", verbose=False)
    fast_trainer(max_steps=2, callbacks=[cb]).fit(Classifier(), data)
    fc1 = vit.blocks[1].mlp.fc1
    rows = effective_rows(fc1)
    assert math.isclose(float((rows == 0).float().mean()), 0.5, abs_tol=0.03)


GPT2_PHASES = [
    {"sparsity": "2:4", "algorithm": "magnitude", "update_every": 2, "until": 3},
    {"sparsity": 0.7, "algorithm": "gmp", "update_every": 1, "until": 6},
    {"sparsity": 0.0},
]


def gpt2_run(tmp_path, stop_at=None, ckpt_path=None, seed=0):
    L.seed_everything(seed, verbose=False)
    model = tiny_gpt2(n_layer=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = LMModule(model)
    callbacks: list[L.Callback] = [SparsityCallback(phases=GPT2_PHASES, verbose=False)]
    if stop_at:
        callbacks.append(
            ModelCheckpoint(
                dirpath=tmp_path, every_n_train_steps=stop_at, filename="{step}"
            )
        )
        callbacks.append(StopAt(stop_at))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    data = DataLoader(
        TensorDataset(ids.repeat(4, 1)), batch_size=2
    )  # identical batches
    trainer = fast_trainer(
        max_steps=7,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(stop_at),
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize(
    "resume_step", [2, 5]
)  # in the magnitude 2:4 and the gmp phase
def test_gpt2_resume_is_bitwise_and_the_export_loads_strictly(tmp_path, resume_step):
    reference = gpt2_run(tmp_path / "ref")
    gpt2_run(tmp_path / "ck", stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed = gpt2_run(tmp_path / "resumed", ckpt_path=ckpt, seed=1)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    exported = export_state_dict(ckpt)
    fresh = LMModule(tiny_gpt2().__class__(reference.model.config))
    fresh.load_state_dict(exported, strict=True)
    rows = effective_rows(fresh.model.transformer.h[0].mlp.c_fc)
    kept = (rows != 0).reshape(rows.shape[0], -1, 4).sum(-1)
    if resume_step == 2:  # the magnitude phase's 2:4 folded in, along the inputs
        assert bool((kept == 2).all())
    else:
        assert float((rows == 0).float().mean()) > 0.5


def tiny_torchvision_vit() -> nn.Module:
    """torchvision's ViT (attention through nn.MultiheadAttention), one tiny layer."""
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    return vision_transformer.VisionTransformer(
        image_size=16,
        patch_size=8,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=4,
    )


def test_torchvision_vit_attention_is_sparse_with_hard_masks():
    vit = tiny_torchvision_vit()
    sel = select_parameters(vit, exclude=["conv_proj.weight"])
    assert sel.excluded["heads.head.weight"] == "output head"
    out_proj = "encoder.layers.encoder_layer_0.self_attention.out_proj.weight"
    assert out_proj in [t.name for t in sel.targets]
    phases = resolve_phases([Phase(sparsity="2:4", algorithm="static")], total_steps=10)
    sp = Sparsifier("t", sel.targets, phases)
    sp.on_step_start(0, [])
    attn = vit.encoder.layers[0].self_attention
    w = attn.out_proj.weight  # what F.multi_head_attention_forward reads: stored zeros
    assert bool(((w != 0).reshape(32, -1, 4).sum(-1) == 2).all())
    assert vit(torch.randn(2, 3, 16, 16)).shape == (2, 4)


def test_torchvision_resnet_head_by_name_and_nm_along_input_channels():
    models = pytest.importorskip("torchvision.models")
    resnet = models.resnet18(num_classes=4)
    phases = resolve_phases([Phase(sparsity="2:4", algorithm="static")], total_steps=10)
    with pytest.raises(
        ValueError, match=r"3 input channels.*exclude=\['re:\^conv1\\\\.weight\$'\]"
    ):
        Sparsifier("t", select_parameters(resnet).targets, phases)
    sel = select_parameters(resnet, exclude=["re:^conv1\\.weight$"])
    assert sel.excluded["fc.weight"] == "output head"
    Sparsifier("t", sel.targets, phases, backend="masked").on_step_start(0, [])
    rows = effective_rows(resnet.layer1[0].conv1)  # (64, 3, 3, 64)
    assert bool(((rows != 0).reshape(64, -1, 4).sum(-1) == 2).all())


def test_attention_out_proj_never_gets_a_kernel_forward_it_would_not_run():
    layer = nn.TransformerEncoderLayer(128, 2, 256, batch_first=True)
    phases = resolve_phases([Phase(sparsity="2:4", algorithm="static")], total_steps=10)
    targets = select_parameters(layer).targets
    sp = Sparsifier(
        "t", targets, phases, compute_dtype=torch.bfloat16, gpu=parse_gpu("H100")
    )
    choices = {name: choice for (_, name), choice in sp.backends.items()}
    assert choices["linear1.weight"].name == "semi_structured"
    assert choices["self_attn.out_proj.weight"].name == "masked"
    assert "never calls out_proj" in choices["self_attn.out_proj.weight"].reason


def test_plan_flops_count_the_conv1d_matmuls():
    flops = linear_flops_per_token(tiny_gpt2())
    assert flops["transformer.h.0.mlp.c_fc.weight"] == 2 * 64 * 256
    assert flops["transformer.h.1.attn.c_attn.weight"] == 2 * 64 * 192
    assert (
        flops["transformer.wte.weight"] == 2 * 64 * 256
    )  # lm_head, tied: counted once


def test_hf_bert_and_vit_encoders_default_selection():
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )
    sel = select_parameters(bert)
    assert (
        sel.excluded["bert.embeddings.word_embeddings.weight"] == "tied to an embedding"
    )
    names = [t.name for t in sel.targets]
    assert "bert.encoder.layer.0.intermediate.dense.weight" in names
    assert "bert.encoder.layer.0.attention.output.dense.weight" in names
    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=16,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
        )
    )
    sel = select_parameters(vit)
    assert sel.excluded["classifier.weight"] == "output head"
    assert (
        sel.excluded["vit.embeddings.patch_embeddings.projection.weight"] == "embedding"
    )
    sp = run_phase(vit, "2:4", algorithm="static")
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert bool(((rows != 0).reshape(rows.shape[0], -1, 4).sum(-1) == 2).all())


class Supervised(L.LightningModule):
    """Any model trained on ``loss(model, batch)`` with AdamW."""

    def __init__(self, model: nn.Module, loss: Any) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def images(size: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(8, 3, size, size, generator=gen),
        torch.randint(0, 4, (8,), generator=gen),
    )
    return DataLoader(data, batch_size=4)


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@dataclass
class Fit:
    module: L.LightningModule
    data: DataLoader
    layers: list[str] | None = None  #: the modules checked; None: every one selected
    exclude: list[str] | None = None  #: what 2:4 cannot run on (3 input channels)
    dense_zeros: float = 0.01  #: see probes.assert_phases


def tiny_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config)


def hf_vit() -> Fit:
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=4,
    )
    model = transformers.ViTForImageClassification(config)
    return Fit(
        Supervised(model, lambda m, b: m(pixel_values=b[0], labels=b[1]).loss),
        images(16),
    )


def torchvision_vit() -> Fit:
    model = tiny_torchvision_vit()
    layer = "model.encoder.layers.encoder_layer_0"
    return Fit(
        Supervised(model, classify),
        images(16),
        [f"{layer}.self_attention.out_proj", f"{layer}.mlp.0"],  # out_proj: MHA's
        exclude=["conv_proj.weight"],
    )


def torchvision_resnet() -> Fit:
    models = pytest.importorskip("torchvision.models")
    return Fit(
        Supervised(models.resnet18(num_classes=4), classify),
        images(64),
        ["model.layer1.0.conv1", "model.layer2.0.downsample.0"],
        exclude=["re:^model\\.conv1\\.weight$"],
        dense_zeros=0.05,  # weights a ReLU cut off in every example have no gradient
    )


FITS = {
    "gpt2": lambda: Fit(LMModule(tiny_gpt2()), token_loader(5)),
    "llama": lambda: Fit(LMModule(tiny_llama()), token_loader(5)),
    "bert": lambda: Fit(LMModule(tiny_bert()), token_loader(5)),
    "hf_vit": hf_vit,
    "torchvision_vit": torchvision_vit,
    "torchvision_resnet": torchvision_resnet,
    "transformer_encoder_layer": lambda: Fit(Encoder(), sequences()),
}


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            f, marks=pytest.mark.slow
        )  # 11 M parameters; timm's ResNet is fast
        if f == "torchvision_resnet"
        else f
        for f in FITS
    ],
)
def test_fit_through_2to4_70_percent_and_dense_phases(family):
    torch.manual_seed(0)
    fit = FITS[family]()
    targets = select_parameters(fit.module, exclude=fit.exclude).targets
    probe = EffectiveProbe(fit.layers or [t.module_name for t in targets])
    cb = SparsityCallback(phases=PHASES, exclude=fit.exclude, verbose=False)
    fast_trainer(max_steps=5, callbacks=[cb, probe]).fit(fit.module, fit.data)
    assert_phases(probe, fit.dense_zeros)


def _log_text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_torchvision_vit_default_2to4_leaves_conv_proj_dense_and_trains(lightning_log):
    module = Classifier(tiny_torchvision_vit(), example=torch.randn(1, 3, 16, 16))
    cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 2}, {"sparsity": 0.5}])
    fast_trainer(max_steps=3, callbacks=[cb]).fit(
        module, labelled_loader((3, 16, 16), classes=4)
    )
    text = _log_text(lightning_log)
    assert (
        "3 input channels, not a multiple of M=4 (2:4 in phase 1): model.conv_proj.weight"
        in text
    )
    assert (
        "output head model.heads.head: returned by the forward of example_input_array; "
        "named 'head'" in text
    )
    assert bool((module.model.conv_proj.weight != 0).all())  # dense in both phases
    fc1 = module.model.encoder.layers[0].mlp[0].weight
    assert float((fc1 == 0).float().mean()) == 0.5


def test_torchvision_resnet_default_2to4_leaves_the_stem_dense_and_trains(
    lightning_log,
):
    models = pytest.importorskip("torchvision.models")
    module = Classifier(models.resnet18(num_classes=4))  # no example: the head by name
    cb = SparsityCallback(sparsity="2:4")
    fast_trainer(max_steps=2, callbacks=[cb]).fit(
        module, labelled_loader((3, 32, 32), classes=4, n=4, batch_size=2)
    )
    text = _log_text(lightning_log)
    assert (
        "3 input channels, not a multiple of M=4 (2:4 in phase 1): model.conv1.weight"
        in text
    )
    assert (
        "output head model.fc: named 'fc' (no forward seen: set example_input_array"
        in text
    )
    assert "model.layer1.0.conv1.weight" in [t.name for t in cb.selection.targets]


class FcMidOutModule(Classifier):
    """``fc -> mid -> out`` (10 logits from ``out``), ``out`` registered first."""

    def __init__(self, example: bool) -> None:
        net = nn.Module()
        net.out = nn.Linear(16, 10)
        net.fc = nn.Linear(8, 16)
        net.mid = nn.Linear(16, 16)
        net.forward = lambda x: net.out(torch.relu(net.mid(torch.relu(net.fc(x)))))
        super().__init__(net, torch.randn(2, 8) if example else None)


def test_hand_written_head_is_found_by_the_forward_of_example_input_array(
    lightning_log,
):
    module = FcMidOutModule(example=True)
    cb = SparsityCallback(sparsity=0.5)
    fast_trainer(max_steps=2, callbacks=[cb]).fit(
        module, labelled_loader((8,), classes=10)
    )
    assert [t.name for t in cb.selection.targets] == [
        "model.fc.weight",
        "model.mid.weight",
    ]
    assert cb.selection.excluded["model.out.weight"] == "output head"
    assert (
        "output head model.out: returned by the forward of example_input_array"
        in _log_text(lightning_log)
    )
    assert bool((module.model.out.weight != 0).all())
    # without the example, registration order is the only evidence left: it names mid, and
    # the table says which evidence it used and how to give a better one
    cb = SparsityCallback(sparsity=0.5)
    fast_trainer(max_steps=1, callbacks=[cb]).fit(
        FcMidOutModule(example=False), labelled_loader((8,), classes=10)
    )
    assert cb.selection.heads == {
        "model.mid": f"the last layer registered ({NO_FORWARD})"
    }


class NoisyTiny(TinyModule):
    """TinyModule with BatchNorm and dropout: state and randomness a forward could disturb."""

    def __init__(self, example: bool) -> None:
        super().__init__()
        self.net.fc2 = nn.Sequential(
            nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3)
        )
        # drawn from a generator of its own: the runs share every global random number
        gen = torch.Generator().manual_seed(1)
        self.example_input_array = torch.randn(3, 8, generator=gen) if example else None


def test_the_example_forward_changes_no_mask_or_weight_bit_for_bit():
    weights = {}
    for example in (False, True):
        torch.manual_seed(0)
        module = NoisyTiny(example)
        cb = SparsityCallback(
            phases=[{"sparsity": "2:4", "until": 3}, {"sparsity": 0.5}], verbose=False
        )
        fast_trainer(max_steps=5, callbacks=[cb]).fit(module, random_loader())
        assert ("returned by" in cb.selection.heads["net.head"]) is example
        weights[example] = {k: v.clone() for k, v in module.state_dict().items()}
        masks = {k: v.clone() for k, v in cb.sparsifier.masks.items()}
        weights[example].update({f"{k}_mask": v for k, v in masks.items()})
    assert weights[True].keys() == weights[False].keys()
    for key, value in weights[False].items():
        assert torch.equal(value, weights[True][key]), key
