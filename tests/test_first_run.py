"""What a first run meets: exporting the trained LightningModule, two callbacks of one name
(an overlay on a recipe that has one), a TransformerEncoder's nested-tensor fast path, and a
model that skips a layer on purpose."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from helpers import TinyModule, fast_trainer
from test_models import Supervised, classify, images, tiny_torchvision_vit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback, export_state_dict
from lightning_sparse.callback import check_distinct_names
from lightning_sparse.cli.main import SparseCLI

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
OVERLAY = RECIPES / "overlays" / "sparsity_24_70pct.yaml"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_export_takes_the_trained_lightning_module():
    torch.manual_seed(0)
    module = Supervised(tiny_torchvision_vit(), classify)
    cb = SparsityCallback(sparsity="2:4", exclude=["conv_proj.weight"], verbose=False)
    trainer = fast_trainer(max_steps=3, callbacks=[cb])
    trainer.fit(module, images(16))
    exported = export_state_dict(module)  # what a user holds after fit
    expected = export_state_dict(trainer)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    plain = Supervised(tiny_torchvision_vit(), classify)
    plain.load_state_dict(exported, strict=True)
    fc1 = plain.model.encoder.layers[0].mlp[0].weight  # runtime 2:4, folded in
    assert bool(((fc1 != 0).reshape(fc1.shape[0], -1, 4).sum(-1) <= 2).all())
    assert float((fc1 == 0).float().mean()) >= 0.5
    x = torch.randn(2, 3, 16, 16)
    module.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain.model(x), module.model(x))


def test_export_names_what_it_takes():
    with pytest.raises(
        ValueError, match=r"not attached to the Trainer.*export_state_dict\(trainer\)"
    ):
        export_state_dict(TinyModule())  # never fit: no trainer holds its masks
    with pytest.raises(
        ValueError,
        match=r"export_state_dict\(trainer\): the trainer holds no model yet.*after "
        r"trainer.fit\(model",
    ):
        export_state_dict(L.Trainer(logger=False, accelerator="cpu"))  # before its fit
    with pytest.raises(
        TypeError,
        match=r"source=.*Trainer that ran fit, the LightningModule.*got a Linear",
    ):
        export_state_dict(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"trusted='yes'\): use True or False"):
        export_state_dict({"state_dict": {}}, trusted="yes")


def test_two_callbacks_of_one_name_are_named_with_the_fix():
    with pytest.raises(ValueError) as err:
        check_distinct_names(
            [
                SparsityCallback(sparsity=0.5),
                L.Callback(),
                SparsityCallback(sparsity="2:4"),
            ]
        )
    message = str(err.value)
    assert "trainer.callbacks[0] (phases: 50% static)" in message
    assert "trainer.callbacks[2] (phases: 2:4 runtime)" in message
    assert "distinct name" in message and "or remove one" in message
    check_distinct_names(
        [SparsityCallback(sparsity=0.5), SparsityCallback(sparsity=0.5, name="b")]
    )


@pytest.mark.parametrize("subcommand", ["fit", "plan"])
def test_the_overlay_on_a_recipe_with_a_callback_ends_with_a_message(
    subcommand, tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    base = RECIPES / "vit" / "cpu_demo.yaml"
    assert yaml.safe_load(base.read_text())["trainer"][
        "callbacks"
    ]  # it has one already
    args = [subcommand, f"--config={base}", f"--config={OVERLAY}"]
    args += [f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as err:
        SparseCLI(args=args)
    message = str(err.value)
    assert message.startswith(
        f"lightning-sparse {subcommand}: trainer.callbacks[0] (params="
    )
    assert "trainer.callbacks[1] (phases: 2:4 runtime, dense)" in message
    assert "named 'sparsity'" in message and "distinct name" in message
    assert "recipes/overlays/sparsity_24_70pct.yaml" in message
    assert "Traceback" not in message


class NestedEncoder(L.LightningModule):
    """``nn.TransformerEncoder`` with its nested-tensor fast path on (the default)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.encoder(x, src_key_padding_mask=pad))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    "params",
    [["*.in_proj_weight", "*.out_proj.weight"], ["*.self_attn.*", "*.linear1.weight"]],
    ids=["attention", "attention-and-mlp"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nested_tensor_fast_path_computes_with_the_sparse_weights(params):
    torch.manual_seed(0)
    model = NestedEncoder()
    assert model.encoder.use_nested_tensor
    cb = SparsityCallback(sparsity="2:4", params=params, verbose=False)  # runtime
    data = DataLoader(TensorDataset(torch.randn(8, 4, 32)), batch_size=2)
    fast_trainer(max_steps=2, callbacks=[cb]).fit(model, data)
    sparse, dense = NestedEncoder(), NestedEncoder()
    sparse.load_state_dict(export_state_dict(model))  # the sparse weights, stored
    dense.load_state_dict(
        model.state_dict()
    )  # the dense weights straight-through keeps
    x = torch.randn(3, 5, 32)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    for m in (model, sparse, dense):
        m.eval()
    sparse.encoder.use_nested_tensor = dense.encoder.use_nested_tensor = False
    with torch.no_grad():  # eval, no grad, a padding mask: the nested-tensor fast path
        got, expected, bypassed = (m(x, pad)[~pad] for m in (model, sparse, dense))
    torch.testing.assert_close(got, expected)
    assert (got - bypassed).abs().max() > 1e-2  # the dense weights would differ


class SkipsALayer(L.LightningModule):
    """Runs ``extra`` only from the second optimizer step (layer drop, routed experts...)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = self.body(batch[0])
        if self.global_step > 0:
            h = self.extra(h)
        return self.head(h).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_layer_skipped_on_purpose_needs_allow_skipped_layers(lightning_log):
    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)
    cb = SparsityCallback(sparsity="2:4", verbose=False)
    with pytest.raises(
        RuntimeError,
        # the user's own class, not the class the sparse forward swapped in
        match=r"first sparse step: \['extra.weight \(extra, Linear\)'\].*allow_skipped_layers=True",
    ):
        fast_trainer(max_steps=2, callbacks=[cb]).fit(SkipsALayer(), data)
    torch.manual_seed(0)
    model = SkipsALayer()
    cb = SparsityCallback(sparsity="2:4", verbose=False, allow_skipped_layers=True)
    fast_trainer(max_steps=3, callbacks=[cb]).fit(model, data)
    assert (
        "(allow_skipped_layers=True): ['extra.weight (extra, Linear)']"
        in lightning_log.text
    )
    x = torch.randn(2, 8)
    weight = model.extra.sparse_weight(torch.float32)  # when it runs, it runs sparse
    assert bool(((weight != 0).reshape(8, -1, 4).sum(-1) <= 2).all())
    torch.testing.assert_close(model.extra(x), x @ weight.T + model.extra.bias)
    with pytest.raises(TypeError, match=r"allow_skipped_layers=1: use True"):
        SparsityCallback(sparsity="2:4", allow_skipped_layers=1)
