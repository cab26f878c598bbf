"""Checkpoints: exact resume (also after a crash), the saved mask format, a checkpoint written
on a mask-update step, export, and bad checkpoints."""

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, RepeatedBatch, StopAt, TinyModule, fast_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, export_state_dict

pytestmark = FEW_UPDATES

PHASES = [
    {"sparsity": 0.5, "algorithm": "magnitude", "update_every": 2, "until": 4},
    {"sparsity": "2:4", "until": 7},
    {"sparsity": 0.6, "algorithm": "gmp", "update_every": 1, "until": 10},
    {"sparsity": 0.4, "init": "random", "seed": 3, "until": 12},
    {"sparsity": 0.0},
]


def loader():
    return DataLoader(
        RepeatedBatch(n=24, batch_size=6), batch_size=6
    )  # 4 identical batches per epoch


def run(tmp_path, stop_at=None, ckpt_path=None, every=None, seed=0, extra=()):
    L.seed_everything(seed, verbose=False)
    model = TinyModule(lr=0.05, weight_decay=0.1)
    callbacks = [SparsityCallback(phases=PHASES, verbose=False), *extra]
    if stop_at:
        callbacks.append(StopAt(stop_at))
    if every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=tmp_path,
                every_n_train_steps=every,
                save_top_k=-1,
                save_last=True,
                filename="{step}",
            )
        )
    trainer = fast_trainer(
        max_steps=14,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(every),
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, trainer, callbacks[0]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("resume_step", [2, 3, 5, 7, 9, 11])
def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, resume_step):
    reference, _, ref_cb = run(tmp_path / "ref")
    run(tmp_path / "ck", stop_at=resume_step, every=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed, trainer, cb = run(tmp_path / "resumed", ckpt_path=ckpt, seed=123)
    assert trainer.global_step == 14
    expected, got = weights(reference), weights(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert cb.sparsifier.history == ref_cb.sparsifier.history


class CrashAt(L.Callback):
    """Raises in the middle of an epoch, as a failing node or a bug would."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def test_resume_after_a_crash_mid_epoch_matches_the_uninterrupted_run(tmp_path):
    reference, _, ref_cb = run(tmp_path / "ref")
    # checkpoints after steps 3, 6, 9 (and last.ckpt); the crash hits step 11, the 4th batch of
    # the 3rd epoch, after the gmp phase's updates and the change to a random-mask phase
    with pytest.raises(RuntimeError, match="simulated crash at step 11"):
        run(tmp_path / "ck", every=3, extra=[CrashAt(11)])
    last = tmp_path / "ck" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 9
    resumed, trainer, cb = run(tmp_path / "resumed", ckpt_path=last, seed=123)
    assert trainer.global_step == 14
    expected = weights(reference)
    for key, value in weights(resumed).items():
        assert torch.equal(expected[key], value), key
    assert cb.sparsifier.history == ref_cb.sparsifier.history


class MasksAt(L.Callback):
    """After the SparsityCallback: the masks each optimizer step uses (after its update)."""

    def __init__(self, cb):
        self.cb = cb
        self.masks = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sp = self.cb.sparsifier
        if sp.algorithm is not None:
            self.masks[trainer.global_step] = {
                f"{t.name}_mask": sp.current_mask(t).clone() for t in sp.targets
            }


@pytest.mark.parametrize("algorithm", ["magnitude", "gmp"])
@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_checkpoint_on_an_update_step_holds_the_updated_masks(
    tmp_path, algorithm, checkpoint_first
):
    # updates at steps 3 and 6; ModelCheckpoint saves after step 3 (global_step 4)
    phases = [
        {"sparsity": 0.6, "algorithm": algorithm, "update_every": 3, "until": 8},
        {"sparsity": 0.0},
    ]
    cb = SparsityCallback(phases=phases, verbose=False)
    probe = MasksAt(cb)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    callbacks = [ckpt, cb, probe] if checkpoint_first else [cb, probe, ckpt]
    trainer = fast_trainer(max_steps=9, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(TinyModule(lr=0.05), loader())
    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=False)
    state = saved["callbacks"]["SparsityCallback{'name': 'sparsity'}"]
    assert state["last_update_step"] == 3
    before, after = probe.masks[2], probe.masks[3]
    assert before.keys() == after.keys() == state["masks"].keys()
    for key, mask in state["masks"].items():
        assert torch.equal(mask, after[key]), key
        assert not torch.equal(mask, before[key]), key  # the update changed it
        if algorithm == "gmp":  # hard mask: the saved weights hold the zeros too
            weight = saved["state_dict"][key.removesuffix("_mask")]
            assert bool((weight[~mask] == 0).all())


def test_checkpoint_holds_bool_masks_named_after_parameters(tmp_path):
    run(tmp_path, stop_at=5, every=5)
    ckpt = torch.load(tmp_path / "step=5.ckpt", weights_only=False)
    state = ckpt["callbacks"]["SparsityCallback{'name': 'sparsity'}"]
    assert state["phase"] == 1 and state["last_update_step"] == 2
    assert sorted(state["masks"]) == ["net.fc1.weight_mask", "net.fc2.weight_mask"]
    assert all(m.dtype == torch.bool for m in state["masks"].values())
    # the model's own state dict keeps its plain keys (loads into the unmodified model)
    TinyModule().load_state_dict(ckpt["state_dict"], strict=True)


@pytest.mark.parametrize("max_steps", [3, 5, 9])
def test_export_folds_masks_and_loads_into_plain_model(tmp_path, max_steps):
    model, trainer, _ = run(tmp_path, stop_at=max_steps, every=max_steps)
    x = torch.randn(4, 8)
    model.eval()
    expected = model(x)
    for source in (trainer, tmp_path / f"step={max_steps}.ckpt"):
        plain = TinyModule()
        plain.load_state_dict(export_state_dict(source), strict=True)
        plain.eval()
        assert torch.allclose(plain(x), expected, atol=1e-6)
        assert int((plain.net.fc1.weight == 0).sum()) >= 64


def test_missing_or_misshaped_mask_is_named(tmp_path):
    run(tmp_path, stop_at=5, every=5)
    path = tmp_path / "step=5.ckpt"
    ckpt = torch.load(path, weights_only=False)
    masks = ckpt["callbacks"]["SparsityCallback{'name': 'sparsity'}"]["masks"]
    del masks["net.fc2.weight_mask"]
    torch.save(ckpt, tmp_path / "missing.ckpt")
    with pytest.raises(
        ValueError,
        match=r"the checkpoint has no mask for parameter 'net.fc2.weight' \(net.fc2.weight_mask\)",
    ):
        run(tmp_path, ckpt_path=tmp_path / "missing.ckpt")
    masks["net.fc2.weight_mask"] = torch.ones(3, 3, dtype=torch.bool)
    torch.save(ckpt, tmp_path / "shape.ckpt")
    with pytest.raises(
        ValueError,
        match=r"mask for parameter 'net.fc2.weight' has shape \(3, 3\), but the parameter has shape \(16, 16\)",
    ):
        run(tmp_path, ckpt_path=tmp_path / "shape.ckpt")


def test_export_rejects_what_is_not_a_checkpoint():
    with pytest.raises(
        KeyError, match=r"export_state_dict needs a Lightning checkpoint"
    ):
        export_state_dict({"weights": 1})
