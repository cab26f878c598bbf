"""One ``SparsityCallback`` fitting several models and fits: each model keeps what its fit left
it with, a new Trainer restarts the schedule, the same Trainer goes on exactly, and nothing of a
failed fit reaches the next."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, RepeatedBatch, TinyModule, fast_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict

pytestmark = FEW_UPDATES

PHASES = [  # then dense from step 9
    {"sparsity": 0.5, "algorithm": "magnitude", "update_every": 2, "until": 5},
    {"sparsity": "2:4", "until": 9},
]


def loader() -> DataLoader:
    return DataLoader(RepeatedBatch(n=24, batch_size=6), batch_size=6)


def model(seed: int) -> TinyModule:
    L.seed_everything(seed, verbose=False)
    return TinyModule(lr=0.05, weight_decay=0.1)


def callback(phases=PHASES) -> SparsityCallback:
    return SparsityCallback(phases=phases, verbose=False)


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "phases",
    [[{"sparsity": "2:4"}], [{"sparsity": 0.5, "algorithm": "magnitude"}]],
    ids=["runtime 2:4", "magnitude"],
)
def test_a_second_model_leaves_the_first_its_masked_forward(phases):
    cb = callback(phases)
    first = model(0)
    trainer = fast_trainer(max_steps=3, callbacks=[cb])
    trainer.fit(first, loader())
    with torch.no_grad():
        before = first(X)
    exported = export_state_dict(trainer)
    second = model(1)
    fast_trainer(max_steps=3, callbacks=[cb]).fit(second, loader())
    with torch.no_grad():
        assert torch.equal(first(X), before)  # still the sparse function
        plain = TinyModule()
        plain.load_state_dict(exported)
        assert torch.allclose(plain(X), before, atol=1e-6)
    # the second model trained as with a callback of its own
    alone = model(1)
    fast_trainer(max_steps=3, callbacks=[callback(phases)]).fit(alone, loader())
    assert_equal(weights(second), weights(alone))
    with pytest.raises(
        ValueError,
        match=r"export_state_dict\(trainer\): SparsityCallback\{'name': 'sparsity'\} of the "
        r"trainer has since been fit on another model",
    ):
        export_state_dict(trainer)


def test_a_model_whose_trainer_or_callback_went_on_to_another_model_is_not_exported():
    first, second = model(0), model(1)
    cb = callback([{"sparsity": 0.5}])
    trainer = fast_trainer(max_steps=3, callbacks=[cb])
    trainer.fit(first, loader())
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(second, loader())  # the same trainer (and callback), another model
    with pytest.raises(
        ValueError,
        match=r"export_state_dict\(TinyModule\): the model is no longer attached to the "
        r"Trainer that fit it, which has since fit another model \(TinyModule\) and holds "
        r"that model's weights and masks: export each model right after its fit",
    ):
        export_state_dict(first)
    exported = export_state_dict(second)  # what the trainer holds is the second model's
    assert_equal(exported, export_state_dict(trainer))
    assert float((exported["net.fc1.weight"] == 0).float().mean()) == 0.5

    third = model(2)  # its trainer stays, its callback goes on to another model
    fast_trainer(max_steps=3, callbacks=[cb]).fit(third, loader())
    with pytest.raises(
        ValueError,
        match=r"export_state_dict\(TinyModule\): SparsityCallback\{'name': 'sparsity'\} of "
        r"the trainer has since been fit on another model",
    ):
        export_state_dict(second)


def test_a_second_fit_with_a_new_trainer_restarts_the_schedule():
    reused, fresh = model(0), model(0)
    cb = callback()
    for net, callbacks in ((reused, (cb, cb)), (fresh, (callback(), callback()))):
        for each in callbacks:
            fast_trainer(max_steps=7, callbacks=[each]).fit(net, loader())
    assert_equal(weights(reused), weights(fresh))
    assert cb.sparsifier.history == [(0, 0), (5, 1)]
    with torch.no_grad():
        assert torch.equal(reused(X), fresh(X))  # the 2:4 forward of the second run


class MasksAtStart(L.Callback):
    """Placed after the SparsityCallback: its phase and masks when training starts."""

    def __init__(self, cb: SparsityCallback) -> None:
        self.cb = cb
        self.phase: int | None = None
        self.masks: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        sp = self.cb.sparsifier
        self.phase = None if sp.current is None else sp.current.index
        self.masks = {k: v.clone() for k, v in sp.masks.items()}


def test_a_second_fit_with_the_same_trainer_goes_on_from_where_the_first_stopped():
    net, cb = (
        model(0),
        callback(
            [{"sparsity": 0.5, "algorithm": "set", "update_every": 1, "until": 9}]
        ),
    )
    start = MasksAtStart(cb)
    trainer = fast_trainer(max_steps=7, callbacks=[cb, start])
    trainer.fit(net, loader())
    masks = {k: v.clone() for k, v in cb.sparsifier.masks.items()}
    last_update = cb.sparsifier.last_update_step
    trainer.fit(net, loader())  # nothing left to train: the model stays as it was
    assert cb.state_dict()["phase"] == 0
    assert_equal(cb.sparsifier.masks, masks)
    trainer.fit_loop.epoch_loop.max_steps = 12
    trainer.fit(net, loader())
    assert trainer.global_step == 12
    assert start.phase == 0
    assert_equal(start.masks, masks)  # the drop-and-grow masks, not chosen afresh
    assert cb.sparsifier.history == [(0, 0), (9, None)]
    assert last_update == 6 and cb.sparsifier.last_update_step == 7  # its update_stop


def test_a_second_fit_with_the_same_trainer_keeps_a_straight_through_forward():
    net, cb = model(0), callback()
    trainer = fast_trainer(max_steps=7, callbacks=[cb])
    trainer.fit(net, loader())
    with torch.no_grad():
        inside_2_4 = net(X)
    trainer.fit(net, loader())  # nothing left to train
    with torch.no_grad():
        assert torch.equal(net(X), inside_2_4)
    assert cb.sparsifier.history == [(0, 0), (5, 1)]


def test_a_failed_resume_leaves_nothing_for_the_next_fit(tmp_path):
    fast_trainer(
        max_steps=4,
        callbacks=[callback(), ModelCheckpoint(dirpath=tmp_path, filename="last")],
        enable_checkpointing=True,
    ).fit(model(0), loader())
    cb = callback([{"sparsity": 0.7}])
    with pytest.raises(ValueError, match=r"trained with another schedule"):
        fast_trainer(max_steps=8, callbacks=[cb]).fit(
            model(1), loader(), ckpt_path=tmp_path / "last.ckpt"
        )
    net, alone = model(1), model(1)
    fast_trainer(max_steps=4, callbacks=[cb]).fit(net, loader())
    fast_trainer(max_steps=4, callbacks=[callback([{"sparsity": 0.7}])]).fit(
        alone, loader()
    )
    assert cb.sparsifier.history == [(0, 0)]
    assert_equal(weights(net), weights(alone))
