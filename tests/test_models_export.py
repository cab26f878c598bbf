"""Exports of a Hugging Face GPT-2 (``Conv1D``: weight stored ``(in, out)``): the compressed file
loads back to the same effective weights and logits, with its N:M pattern recorded along the
computation's inputs; the 2:4 inference tensors multiply by ``W.T``."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from helpers import fast_trainer
from hf_models import LMModule, tiny_gpt2, token_loader, transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from probes import effective_rows, kept_per_group

from lightning_sparse import (
    SparsityCallback,
    load_compressed,
    save_compressed,
    to_semi_structured,
)
from lightning_sparse.masks import NM, target_mask

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
CONV1D = [
    f"model.transformer.h.{i}.{w}.weight"
    for i in range(2)
    for w in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]


def train(tmp_path, phase):
    """A GPT-2 trained 3 steps in one sparse phase (still in it), and its checkpoint."""
    L.seed_everything(0, verbose=False)
    module = LMModule(tiny_gpt2(**NO_DROPOUT))
    callbacks = [
        SparsityCallback(phases=[phase], verbose=False),
        ModelCheckpoint(dirpath=tmp_path, filename="last"),
    ]
    trainer = fast_trainer(max_steps=3, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(module, token_loader(3))
    return trainer, module, tmp_path / "last.ckpt"


def metadata(path):
    # imported here: collecting the GPU tests of this module needs no safetensors
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return meta["format"], json.loads(meta["sparse"])


@pytest.mark.parametrize(
    "phase",
    [
        {"sparsity": "2:4", "algorithm": "static"},
        {"sparsity": "2:4"},  # runtime: straight-through, projected at export
        {"sparsity": "1:4", "algorithm": "static"},  # 2:4 along the inputs only
    ],
)
def test_gpt2_compressed_file_loads_back_to_the_same_weights_and_logits(
    tmp_path, phase
):
    trainer, module, ckpt = train(tmp_path, phase)
    path = tmp_path / "gpt2.safetensors"
    save_compressed(trainer, path, verbose=False)
    version, sparse = metadata(path)
    assert version == "lightning_sparse.compressed/2"
    for name in CONV1D:  # (in, out): the inputs are dimension 0
        assert sparse[name] == {
            "shape": list(module.get_parameter(name).shape),
            "pattern": "2:4",
            "inputs": 0,
        }, name
    fresh = LMModule(tiny_gpt2(**NO_DROPOUT))
    fresh.load_state_dict(load_compressed(path), strict=True)
    for name in CONV1D:
        layer = name.removesuffix(".weight")
        rows = effective_rows(fresh.get_submodule(layer))
        assert torch.equal(rows, effective_rows(module.get_submodule(layer))), name
        n = int(phase["sparsity"][0])
        assert bool((kept_per_group(rows, 4) <= n).all()), name
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    module.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.model(input_ids=ids).logits, module.model(input_ids=ids).logits
        )
    # from the checkpoint, given the module whose state it is: the same file contents
    save_compressed(
        ckpt, tmp_path / "from_ckpt.safetensors", model=module, verbose=False
    )
    assert metadata(tmp_path / "from_ckpt.safetensors")[1] == sparse
    from_ckpt = load_compressed(tmp_path / "from_ckpt.safetensors")
    for key, value in load_compressed(path).items():
        assert torch.equal(from_ckpt[key], value), key


def test_without_the_model_patterns_are_looked_for_along_the_stored_rows(tmp_path):
    _, module, ckpt = train(tmp_path, {"sparsity": "1:4", "algorithm": "static"})
    path = tmp_path / "plain.safetensors"
    save_compressed(ckpt, path, verbose=False)  # no model: the version 1 layout
    version, sparse = metadata(path)
    assert version == "lightning_sparse.compressed/1"
    # 1 of every 4 inputs kept; along the stored rows (the outputs) that is no 2:4
    assert {sparse[name]["pattern"] for name in CONV1D} == {None}
    with_model = tmp_path / "model.safetensors"
    save_compressed(ckpt, with_model, model=module, verbose=False)
    loaded, plain = load_compressed(with_model), load_compressed(path)
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)


def test_a_conv1d_pattern_needs_groups_of_inputs_only(tmp_path):
    layer = transformers.pytorch_utils.Conv1D(130, 64)  # 64 inputs, 130 outputs
    with torch.no_grad():
        layer.weight.mul_(target_mask(layer.weight.T.abs(), NM(2, 4)).T)
    path = tmp_path / "layer.safetensors"
    save_compressed(layer.state_dict(), path, model=layer, verbose=False)
    assert metadata(path)[1]["weight"] == {
        "shape": [64, 130],
        "pattern": "2:4",
        "inputs": 0,
    }
    assert torch.equal(load_compressed(path)["weight"], layer.weight)


def test_semi_structured_export_covers_conv1d_and_explains_what_it_skips_on_cpu():
    model = tiny_gpt2()
    report = to_semi_structured(model)
    names = [name.removeprefix("model.") for name in CONV1D]
    assert {report[name] for name in names} == {"no CUDA GPU"}
    assert "lm_head.weight" in report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_semi_structured_export_runs_conv1d_on_sparse_kernels():
    torch.manual_seed(0)
    model = tiny_gpt2(n_embd=128, **NO_DROPOUT).half().cuda().eval()
    names = [name.removeprefix("model.") for name in CONV1D]
    with torch.no_grad():
        for name in names:  # 2:4 along the inputs: the rows of the stored (in, out)
            weight = model.get_parameter(name)
            weight.mul_(target_mask(weight.T.abs(), NM(2, 4)).T)
        ids = torch.randint(0, 256, (4, 64), device="cuda")
        expected = model(input_ids=ids).logits
        report = to_semi_structured(model)
        got = model(input_ids=ids).logits
    assert {report[name] for name in names} == {"converted"}
    weight = model.get_parameter("transformer.h.0.mlp.c_fc.weight")
    assert type(weight).__name__.startswith("SparseSemiStructuredTensor")
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
