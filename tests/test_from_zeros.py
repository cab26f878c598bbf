"""``init: from_zeros``: fine-tuning a pruned model keeps its zeros pruned."""

import lightning as L
import pytest
import torch
from helpers import TinyModule, fast_trainer, random_loader

from lightning_sparse import Phase, SparsityCallback, export_state_dict
from lightning_sparse.masks import NM, from_zeros_mask, is_nm

PARAMS = ("net.fc1.weight", "net.fc2.weight")


def pruned_model(phases) -> TinyModule:
    """A plain TinyModule loaded from the export of a sparse run."""
    L.seed_everything(0, verbose=False)
    trainer = fast_trainer(
        max_steps=6, callbacks=[SparsityCallback(phases=phases, verbose=False)]
    )
    trainer.fit(TinyModule(), random_loader(seed=1))
    model = TinyModule()
    model.load_state_dict(export_state_dict(trainer), strict=True)
    return model


def fine_tune(model: TinyModule, phase: dict) -> SparsityCallback:
    cb = SparsityCallback(phases=[phase], verbose=False)
    fast_trainer(max_steps=8, callbacks=[cb]).fit(model, random_loader(seed=2))
    return cb


def zeros(model: TinyModule) -> dict[str, torch.Tensor]:
    return {n: model.get_parameter(n).detach() == 0 for n in PARAMS}


def test_fine_tuning_a_pruned_model_keeps_its_zeros():
    model = pruned_model([{"sparsity": 0.6}])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pruned = zeros(model)
    assert all(int(z.sum()) == round(0.6 * z.numel()) for z in pruned.values())
    cb = fine_tune(model, {"sparsity": 0.6, "init": "from_zeros"})
    for name in PARAMS:
        weight = model.get_parameter(name).detach()
        assert torch.equal(weight == 0, pruned[name]), name  # the same zeros, no more
        assert not torch.equal(weight, before[name])  # and the rest trained
        assert torch.equal(cb.sparsifier.masks[name], ~pruned[name])


def test_a_higher_target_prunes_the_smallest_survivors_on_top():
    model = pruned_model([{"sparsity": 0.5}])
    pruned = zeros(model)
    survivors = {n: model.get_parameter(n).detach().abs().clone() for n in PARAMS}
    cb = fine_tune(model, {"sparsity": 0.75, "init": "from_zeros"})
    for name in PARAMS:
        mask = cb.sparsifier.masks[name]
        assert not (mask & pruned[name]).any()  # every old zero stays pruned
        assert int(mask.sum()) == mask.numel() // 4  # exactly 75% pruned
        newly_pruned = ~mask & ~pruned[name]
        # the extra ones were the smallest survivors
        assert survivors[name][newly_pruned].max() <= survivors[name][mask].min()


def test_a_2_4_pruned_model_keeps_its_pattern():
    model = pruned_model([{"sparsity": "2:4", "algorithm": "static"}])
    pruned = zeros(model)
    cb = fine_tune(
        model, {"sparsity": "2:4", "algorithm": "static", "init": "from_zeros"}
    )
    for name in PARAMS:
        weight = model.get_parameter(name).detach()
        assert torch.equal(weight == 0, pruned[name])
        assert is_nm(cb.sparsifier.masks[name], NM(2, 4))


def test_more_zeros_than_the_target_is_an_error_naming_the_parameter():
    model = pruned_model([{"sparsity": 0.6}])
    with pytest.raises(
        ValueError,
        match=r"init='from_zeros': parameter 'net.fc1.weight': 77 of its 128 weights are zero, "
        r"more than the target 50% prunes; use a sparsity of at least 0.6016",
    ):
        fine_tune(model, {"sparsity": 0.5, "init": "from_zeros"})


def test_an_nm_group_with_too_many_zeros_is_an_error():
    weight = torch.tensor([[0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 4.0]])
    with pytest.raises(
        ValueError,
        match=r"parameter 'w': 1 of its groups of 4 hold more than 2 zeros, which the "
        r"pattern 2:4 cannot keep pruned; use a sparsity of at least 0.5",
    ):
        from_zeros_mask(weight, NM(2, 4), "w")


def test_init_names_from_zeros_among_its_choices():
    assert Phase(sparsity=0.5, init="from_zeros").init == "from_zeros"
    with pytest.raises(ValueError, match=r"init='zeros'.*'from_zeros'"):
        Phase(sparsity=0.5, init="zeros")


@pytest.mark.parametrize("nonzero", [0, 1])
def test_the_suggestion_for_a_nearly_or_wholly_zero_weight_is_valid(nonzero):
    weight = torch.zeros(4, 5000)
    weight[0, :nonzero] = 1.0
    with pytest.raises(ValueError, match=r"init='from_zeros': parameter 'w'") as err:
        from_zeros_mask(weight, 0.5, "w")
    message = str(err.value)
    assert "at least 1.0" not in message
    if nonzero == 0:
        assert "every weight is zero" in message and "init='topk'" in message
        return
    fits = float(message.split("sparsity of at least ")[1].split(" ")[0])
    assert fits < 1.0
    assert int(from_zeros_mask(weight, fits, "w").sum()) == nonzero
