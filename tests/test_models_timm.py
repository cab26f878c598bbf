"""timm backbones from tiny configs (random weights, no downloads): a DINOv2 ViT, a distilled
DeiT (two heads), ConvNeXt (depthwise and 1x1 convolutions) and ResNet (a deep stem, strided
convolutions). Every check reads the map a layer computes (it is fed an identity), not the
stored tensor; convolutions are read as ``(out, kh, kw, in_channels)`` rows, so N:M groups
along input channels (NVIDIA ASP's layout) are what is measured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import fast_trainer
from probes import (
    PHASES,
    EffectiveProbe,
    assert_phases,
    effective_rows,
    kept_per_group,
    run_phase,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

timm = pytest.importorskip("timm")

VIT = {"embed_dim": 64, "depth": 2, "num_heads": 2, "num_classes": 4}
FAMILIES: dict[str, tuple[Callable[[], nn.Module], int]] = {  # model, image size
    "dinov2": (
        lambda: timm.create_model(
            "vit_small_patch14_dinov2", img_size=28, patch_size=14, **VIT
        ),
        28,
    ),
    "deit": (
        lambda: timm.create_model(
            "deit_tiny_distilled_patch16_224", img_size=32, patch_size=16, **VIT
        ),
        32,
    ),
    "convnext": (
        lambda: timm.create_model(
            "convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), num_classes=4
        ),
        32,
    ),
    "resnet": (
        lambda: timm.create_model(
            "resnet10t", channels=(16, 32, 64, 128), stem_width=16, num_classes=4
        ),
        64,  # at 32, the last stages' corner taps only ever read padding: no gradient
    ),
}
HEADS = {
    "dinov2": ["head.weight"],
    "deit": ["head.weight", "head_dist.weight"],
    "convnext": ["head.fc.weight"],
    "resnet": ["fc.weight"],
}
# what N:M cannot run on: 3 input channels (the stems), 1 input channel per group (depthwise)
NM_EXCLUDE = {
    "dinov2": None,
    "deit": None,
    "convnext": ["stem.0.weight", "*.conv_dw.weight"],
    "resnet": ["conv1.0.weight"],
}


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family][0]()


@pytest.mark.parametrize("family", FAMILIES)
def test_default_selection_leaves_heads_and_embeddings_dense(family):
    model = build(family)
    sel = select_parameters(model)
    for head in HEADS[family]:
        assert sel.excluded[head] == "output head", head
    selected = {t.name for t in sel.targets}
    layers = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d))
    }
    expected = layers - set(HEADS[family]) - {"patch_embed.proj.weight"}
    assert selected == expected
    if "patch_embed.proj.weight" in layers:
        assert sel.excluded["patch_embed.proj.weight"] == "embedding"


@pytest.mark.parametrize("family", FAMILIES)
def test_static_70_percent_is_exact_on_the_effective_weights(family):
    sp = run_phase(build(family), 0.7)
    for t in sp.targets:
        rows = effective_rows(t.module)
        assert int((rows == 0).sum()) == round(0.7 * rows.numel()), t.name


@pytest.mark.parametrize("algorithm", ["static", "runtime"])
@pytest.mark.parametrize("family", FAMILIES)
def test_2to4_runs_along_the_inputs(family, algorithm):
    sp = run_phase(
        build(family), "2:4", algorithm=algorithm, exclude=NM_EXCLUDE[family]
    )
    for t in sp.targets:
        rows = effective_rows(t.module)  # (out, in) or (out, kh, kw, in_channels)
        kept = kept_per_group(rows, 4)
        if algorithm == "static":
            assert bool((kept == 2).all()), t.name
        else:  # straight-through: 2:4 groups, transposable tiles on a Linear (7 or 8 of 16)
            assert bool((kept <= 2).all()), t.name
            assert 0.5 <= float((rows == 0).float().mean()) <= 0.5625, t.name


@pytest.mark.parametrize(
    ("family", "exclude", "refused", "what"),
    [
        ("convnext", ["*.conv_dw.weight"], "stem.0.weight", "3 input channels"),
        ("convnext", ["stem.0.weight"], "stages.0.blocks.0.conv_dw.weight", "1 input"),
        ("resnet", None, "conv1.0.weight", "3 input channels"),
    ],
)
def test_2to4_refuses_convolutions_without_groups_of_input_channels(
    family, exclude, refused, what
):
    targets = select_parameters(build(family), exclude=exclude).targets
    phases = resolve_phases([Phase(sparsity="2:4")], total_steps=10)
    with pytest.raises(ValueError, match=rf"'{refused}': its ConvNd .*{what}"):
        Sparsifier("t", targets, phases)


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_through_2to4_70_percent_and_dense_phases(family):
    model, size = build(family), FAMILIES[family][1]
    exclude = NM_EXCLUDE[family]
    targets = select_parameters(model, exclude=exclude).targets
    probe = EffectiveProbe([f"net.{t.module_name}" for t in targets])
    cb = SparsityCallback(phases=PHASES, exclude=exclude, verbose=False)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(8, 3, size, size, generator=gen),
        torch.randint(0, 4, (8,), generator=gen),
    )
    fast_trainer(max_steps=5, callbacks=[cb, probe]).fit(
        Classifier(model), DataLoader(data, batch_size=4)
    )
    # dense: the weights a ReLU cut off in every example of the batch have had no gradient
    assert_phases(probe, dense_zeros=0.05)
    for name, rows in probe.rows[-1].items():  # and no mask: what is stored is computed
        stored = model.get_submodule(name[4:]).weight.detach().movedim(1, -1)
        torch.testing.assert_close(rows, stored, rtol=1e-5, atol=1e-6)
