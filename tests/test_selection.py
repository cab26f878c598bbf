import pytest
import timm
import torch
from torch import nn

from lightning_sparse.core.head import NO_FORWARD, Calls, find_heads, record_calls
from lightning_sparse.core.schedule import Phase, resolve_phases
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
    ) as err:
        select_parameters(
            vit(), params=["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc9.weight"]
        )
    # the names nearest the typo, not the model's first three (cls_token, pos_embed, ...)
    listed = str(err.value).split("the closest names are ")[1].split("]")[0]
    assert listed.count("'") == 6 and listed.count(".mlp.fc") == 3, listed
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


class FcMidOut(nn.Module):
    """A first layer named ``fc`` (a ResNet's head name) and the logits from ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.fc(x)))))


class OutputFirst(nn.Module):
    """A head name on the first layer to run, and the head registered first."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(16, 10)
        self.output = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(torch.relu(self.mid(torch.relu(self.output(x)))))


def forward_of(model: nn.Module, *shape: int) -> Calls:
    return record_calls(model, lambda: model(torch.randn(*shape)), "a forward")


def test_fc_first_is_no_head_without_or_with_a_forward():
    model = FcMidOut()
    sel = select_parameters(model)
    assert sel.excluded["out.weight"] == "output head"
    assert [t.name for t in sel.targets] == ["fc.weight", "mid.weight"]
    assert sel.heads == {"out": f"the last layer registered ({NO_FORWARD})"}
    sel = select_parameters(model, calls=forward_of(model, 2, 8))
    assert sel.excluded["out.weight"] == "output head"
    assert sel.heads == {"out": "returned by a forward"}


def test_a_forward_outweighs_a_head_name_and_registration_order():
    model = OutputFirst()
    by_name = select_parameters(model)  # no forward: the name decides
    assert by_name.heads == {"output": f"named 'output' ({NO_FORWARD})"}
    sel = select_parameters(model, calls=forward_of(model, 2, 8))
    assert sel.heads == {"logits": "returned by a forward"}
    assert [t.name for t in sel.targets] == ["output.weight", "mid.weight"]


class TwoHeads(nn.Module):
    """timm DeiT's eval forward: two named heads, their logits averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.head_dist = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        return (self.head(x) + self.head_dist(x)) / 2


def test_named_heads_among_the_last_to_run_are_heads_too():
    model = TwoHeads()
    heads = find_heads(model, forward_of(model, 2, 8))
    assert heads == {
        "head_dist": "the last layer to run in a forward; named 'head_dist'",
        "head": "named 'head'; among the last to run in a forward",
    }


def test_tuple_and_mapping_outputs_name_every_returned_layer():
    model = TwoHeads()
    model.forward = lambda x: {"logits": (model.head(model.body(x)).view(-1),)}
    assert find_heads(model, forward_of(model, 2, 8)) == {
        "head": "returned by a forward; named 'head'",
        "head_dist": "named 'head_dist'; did not run in a forward",
    }


def test_a_failed_forward_falls_back_to_names_and_says_why():
    model = FcMidOut()
    calls = forward_of(model, 2, 7)  # 7 features where fc takes 8
    assert calls.failed is not None and calls.failed.startswith("RuntimeError: ")
    sel = select_parameters(model, calls=calls)
    (how,) = sel.heads.values()
    assert sel.excluded["out.weight"] == "output head"
    assert how.startswith("the last layer registered (a forward failed: RuntimeError")


def test_explicit_params_select_an_nm_misfit_and_find_no_head():
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    phases = resolve_phases([Phase(sparsity="2:4")], total_steps=10)
    sel = select_parameters(net, phases=phases)
    assert sel.targets == [] and sel.excluded["0.weight"].startswith("6 inputs")
    sel = select_parameters(net, params=["0.weight"], phases=phases)
    assert [t.name for t in sel.targets] == ["0.weight"] and sel.heads == {}
    # a float schedule fits every layer
    sel = select_parameters(net, phases=resolve_phases([Phase(sparsity=0.5)], 10))
    assert [t.name for t in sel.targets] == ["0.weight"]
