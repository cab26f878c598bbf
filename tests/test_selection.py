import pytest
import timm
import torch
from torch import nn

from lightning_sparse.core.selection import select_parameters


def vit() -> nn.Module:
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10
    )


class TiedLM(nn.Module):
    """nanoGPT-style: lm_head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(32, 16),
                "wpe": nn.Embedding(8, 16),
                "h": nn.ModuleList([nn.Linear(16, 16)]),
                "ln_f": nn.LayerNorm(16),
            }
        )
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def test_default_heuristic_on_vit():
    sel = select_parameters(vit())
    names = [t.name for t in sel.targets]
    assert names == [
        f"blocks.{i}.{layer}.weight"
        for i in range(2)
        for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ]
    assert sel.excluded["head.weight"] == "output head"
    assert sel.excluded["patch_embed.proj.weight"] == "embedding"
    assert sel.excluded["blocks.0.norm1.weight"] == "1-D"
    assert sel.excluded["blocks.0.mlp.fc1.bias"] == "1-D"


def test_default_heuristic_leaves_tied_head_and_embeddings_dense():
    model = TiedLM()
    sel = select_parameters(model)
    assert [t.name for t in sel.targets] == ["transformer.h.0.weight"]
    # named_parameters() lists the tied weight once, under the embedding's name
    assert sel.excluded["transformer.wte.weight"] == "tied to an embedding"
    assert sel.excluded["transformer.wpe.weight"] == "embedding"


def test_requires_dense_is_never_touched():
    model = vit()
    model.blocks[0].mlp.fc1.weight.requires_dense = True
    sel = select_parameters(model)
    assert "blocks.0.mlp.fc1.weight" not in [t.name for t in sel.targets]
    assert sel.excluded["blocks.0.mlp.fc1.weight"] == "requires_dense"
    sel = select_parameters(model, params=["blocks.*.mlp.fc1.weight"])
    assert [t.name for t in sel.targets] == ["blocks.1.mlp.fc1.weight"]


def test_glob_matches_dotted_suffix_and_regex_searches():
    wrapper = nn.Module()
    wrapper.model = vit()
    sel = select_parameters(wrapper, params=["blocks.*.mlp.fc1.weight"])
    assert [t.name for t in sel.targets] == [
        "model.blocks.0.mlp.fc1.weight",
        "model.blocks.1.mlp.fc1.weight",
    ]
    sel = select_parameters(wrapper, params=[r"re:blocks\.1\..*fc\d\.weight$"])
    assert [t.name for t in sel.targets] == [
        "model.blocks.1.mlp.fc1.weight",
        "model.blocks.1.mlp.fc2.weight",
    ]
    sel = select_parameters(
        wrapper, params="*.weight", exclude=["*attn*", "head.weight", "patch_embed.*"]
    )
    assert all("mlp" in t.name for t in sel.targets) and len(sel.targets) == 4
    # explicit params may select a layer the default leaves dense, but never a 1-D tensor
    sel = select_parameters(wrapper, params=["head.*"])
    assert [t.name for t in sel.targets] == ["model.head.weight"]
    assert sel.excluded["model.head.bias"] == "1-D"


def test_owners_track_every_module_holding_a_parameter():
    model = TiedLM()
    sel = select_parameters(model, params=["transformer.wte.weight"])
    owners = {name for name, _, _ in sel.targets[0].owners}
    assert owners == {"transformer.wte", "lm_head"}


def test_pattern_matching_nothing_is_named():
    with pytest.raises(
        ValueError,
        match=r"params pattern 'blocks.\*.mlp.fc9.weight' matches no parameter of VisionTransformer",
    ):
        select_parameters(
            vit(), params=["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc9.weight"]
        )
    with pytest.raises(
        ValueError, match=r"exclude pattern 'nothing' matches no parameter"
    ):
        select_parameters(vit(), exclude="nothing")


def test_pattern_matching_only_unsparsifiable_parameters_says_why():
    with pytest.raises(
        ValueError,
        match=r"params pattern '\*norm\*' matches only parameters that cannot be sparsified: \{'blocks.0.norm1.weight': '1-D'",
    ):
        select_parameters(vit(), params=["*norm*"])


def test_bad_patterns_are_rejected():
    with pytest.raises(
        ValueError, match=r"params\[0\]: 're:\(' is not a valid regular expression"
    ):
        select_parameters(vit(), params=["re:("])
    with pytest.raises(TypeError, match=r"params\[0\]: 3 is not a pattern"):
        select_parameters(vit(), params=[3])


def test_conv_weights_selected_by_default():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 3),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    net(torch.randn(1, 3, 8, 8))
    sel = select_parameters(net)
    assert [t.name for t in sel.targets] == ["0.weight", "2.weight"]
    assert sel.excluded["4.weight"] == "output head"
