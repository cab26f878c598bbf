"""``restore_rng=True``: checkpoints hold the global random number generators' states, so a model
with dropout, trained on a shuffled loader, resumes from an epoch boundary bit for bit (without
it, the masks and schedule resume exactly but dropout and data order do not), and so do
augmentations drawn from NumPy's and Python's generators; the saved states are checked before
they are set."""

import random

import lightning as L
import numpy as np
import pytest
import torch
from helpers import StopAfterEpoch, TinyModule, WithDropout, fast_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback, export_state_dict, rng_state

EPOCHS = 4  # of 4 batches: rigl updates at steps 2, 4, ... 12


class Jittered(TensorDataset):
    """Samples whose inputs are jittered by NumPy's and Python's global generators, as
    augmentations in a loader's main process draw them."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x * float(np.random.uniform(0.9, 1.1)) + random.gauss(0.0, 0.1), y


def data(shuffle: bool, jitter: bool = False) -> DataLoader:
    """24 samples in batches of 6; shuffled, the order comes from torch's generator;
    ``jitter``: each sample jittered (:class:`Jittered`)."""
    gen = torch.Generator().manual_seed(1)
    tensors = torch.randn(24, 8, generator=gen), torch.randn(24, 4, generator=gen)
    samples = Jittered(*tensors) if jitter else TensorDataset(*tensors)
    return DataLoader(samples, batch_size=6, shuffle=shuffle)


def fit(
    tmp_path, restore_rng, validate, stop=None, ckpt_path=None, seed=0, jitter=False
):
    """4 epochs of :class:`WithDropout` under rigl (``jitter``: of a :class:`TinyModule`,
    without dropout, on the jittered samples in order, so that only NumPy's and Python's
    generators draw); with ``stop``, end after that epoch and write ``epoch=<stop>.ckpt``
    (by ModelCheckpoint after validation, or by ``trainer.save_checkpoint`` after fit)."""
    L.seed_everything(seed, verbose=False)
    model = TinyModule(lr=0.05) if jitter else WithDropout()
    phases = [{"sparsity": 0.5, "algorithm": "rigl", "update_every": 2}]
    callbacks = [
        SparsityCallback(phases=phases, verbose=False, restore_rng=restore_rng)
    ]
    if stop is not None:
        callbacks.append(StopAfterEpoch(stop))
        if validate:
            callbacks.append(ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1))
    val = {"num_sanity_val_steps": 2, "limit_val_batches": 2} if validate else {}
    trainer = fast_trainer(
        max_epochs=EPOCHS,
        callbacks=callbacks,
        enable_checkpointing=stop is not None and validate,
        deterministic=True,
        **val,
    )
    trainer.fit(
        model,
        data(not jitter, jitter),
        data(False) if validate else None,
        ckpt_path=ckpt_path,
    )
    if stop is not None and not validate:
        trainer.save_checkpoint(tmp_path / f"epoch={stop}.ckpt")
    return model


@pytest.mark.parametrize(
    "validate", [True, False], ids=["ModelCheckpoint", "save_checkpoint"]
)
@pytest.mark.parametrize("restore_rng", [True, False])
def test_a_dropout_model_resumes_bitwise_from_an_epoch_boundary(
    tmp_path, validate, restore_rng
):
    reference = fit(tmp_path, restore_rng, validate).state_dict()
    fit(tmp_path, restore_rng, validate, stop=1)
    checkpoint = tmp_path / "epoch=1.ckpt"
    resumed = fit(tmp_path, restore_rng, validate, ckpt_path=checkpoint, seed=123)
    equal = [torch.equal(reference[k], v) for k, v in resumed.state_dict().items()]
    # without the generators, dropout and the shuffled order go their own way
    assert all(equal) if restore_rng else not any(equal)


@pytest.mark.parametrize("restore_rng", [True, False])
def test_numpy_and_python_random_numbers_resume_as_well(tmp_path, restore_rng):
    """Only NumPy's and Python's generators draw here (no dropout, no shuffling)."""
    reference = fit(tmp_path, restore_rng, False, jitter=True).state_dict()
    fit(tmp_path, restore_rng, False, stop=1, jitter=True)
    checkpoint = tmp_path / "epoch=1.ckpt"
    resumed = fit(tmp_path, restore_rng, False, None, checkpoint, 123, jitter=True)
    equal = [torch.equal(reference[k], v) for k, v in resumed.state_dict().items()]
    assert all(equal) if restore_rng else not any(equal)


def test_the_states_load_with_weights_only_and_export_ignores_them(tmp_path):
    fit(tmp_path, True, False, stop=1)
    checkpoint = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)
    (state,) = checkpoint["callbacks"].values()
    (states,) = state["rng"]  # one process
    assert set(states) == {"torch", "cuda", "numpy", "python"}
    assert set(export_state_dict(checkpoint)) == set(checkpoint["state_dict"])


def test_damaged_or_missing_states_are_named(tmp_path):
    fit(tmp_path, True, False, stop=1)
    path = tmp_path / "epoch=1.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    (state,) = checkpoint["callbacks"].values()
    state["rng"][0]["torch"] = torch.zeros(3)  # not a generator state
    torch.save(checkpoint, tmp_path / "damaged.ckpt")
    with pytest.raises(
        ValueError, match=r"\[sparsity\]: the checkpoint's random number"
    ):
        fit(tmp_path, True, False, ckpt_path=tmp_path / "damaged.ckpt")
    del state["rng"]
    torch.save(checkpoint, tmp_path / "without.ckpt")
    with pytest.warns(UserWarning, match=r"holds no random number generator states"):
        fit(tmp_path, True, False, ckpt_path=tmp_path / "without.ckpt")
    with pytest.raises(ValueError, match=r"states of 1 processes, but this run has 2"):
        rng_state.restore_rank([rng_state.capture()], 0, 2, "[sparsity]")


def test_a_state_that_does_not_load_changes_no_generator():
    state = rng_state.capture()
    state["numpy"][1] = torch.zeros(3, dtype=torch.int64)  # too short a Mersenne key
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(
        ValueError, match=r"\[x\]: .* NumPy or Python state that does not"
    ):
        rng_state.restore(state, "[x]")
    assert torch.equal(torch.get_rng_state(), before)
