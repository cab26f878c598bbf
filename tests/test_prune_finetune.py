"""The "prune a trained model, then fine-tune it sparse" workflow, end to end through the
``lightning-sparse`` command, as recipes/gpt/prune_finetune_cpu.yaml runs it (shrunk to a few
steps of a one-block GPT): train dense, load its weights with ``--init_from`` (no trainer
state), prune to 2:4 with ``init: wanda`` at step 0, fine-tune with the masks fixed, export
compressed with ``--export_to``; then load the compressed file back."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import WeightsAtTrainStart
from safetensors import safe_open

from lightning_sparse import SparsityCallback, export_state_dict, load_compressed
from lightning_sparse.cli.main import SparseCLI
from lightning_sparse.masks import NM, is_nm
from lightning_sparse.masks.tiles import is_transposable_2to4

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "gpt"
TINY = [
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.block_size=16",
    "--data.init_args.block_size=16",
    "--data.init_args.batch_size=4",
    "--data.init_args.samples_per_epoch=24",
    "--data.init_args.max_bytes=20000",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory) -> Path:
    """Step 1 of the recipe: the dense demo GPT, 4 steps."""
    root = tmp_path_factory.mktemp("dense")
    SparseCLI(
        args=[
            "fit",
            f"--config={RECIPES / 'cpu_demo.yaml'}",
            "--trainer.callbacks=[]",
            "--trainer.enable_checkpointing=true",
            f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=4",
            *TINY,
        ]
    )
    (ckpt,) = (root / "checkpoints").glob("*.ckpt")
    return ckpt


def test_prune_with_wanda_fine_tune_and_export_compressed(dense_checkpoint, tmp_path):
    export = tmp_path / "out" / "model.safetensors"
    cli = SparseCLI(
        args=[
            "fit",
            f"--config={RECIPES / 'prune_finetune_cpu.yaml'}",
            f"--init_from={dense_checkpoint}",
            f"--export_to={export}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=3",
            "--trainer.callbacks+=helpers.WeightsAtTrainStart",
            *TINY,
        ]
    )
    trainer = cli.trainer
    sparsity = next(c for c in trainer.callbacks if isinstance(c, SparsityCallback))
    probe = next(c for c in trainer.callbacks if isinstance(c, WeightsAtTrainStart))
    start = probe.weights
    # weights only: the run counted its own 3 steps from 0 (a resume would have stopped at 4)
    assert trainer.global_step == 3
    assert sparsity.sparsifier.history == [(0, 0)]
    dense = export_state_dict(dense_checkpoint)
    masks = sparsity.sparsifier.masks
    assert sorted(masks) == [
        f"model.transformer.h.0.{layer}.weight"
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    for name, weight in start.items():  # at step 0: the dense model, pruned
        expected = dense[name] * masks[name] if name in masks else dense[name]
        assert torch.equal(weight, expected), name
    for name, mask in masks.items():
        assert is_nm(mask, NM(2, 4)) and is_transposable_2to4(mask), name
    # fine-tuned with the masks fixed, then exported compressed
    exported = export_state_dict(trainer)
    assert not torch.equal(exported[next(iter(masks))], start[next(iter(masks))])
    loaded = load_compressed(export)
    assert loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[k], exported[k]) for k in loaded)
    with safe_open(str(export), framework="pt") as f:
        sparse = json.loads(f.metadata()["sparse"])
    assert {name: sparse[name]["pattern"] for name in masks} == dict.fromkeys(
        masks, "2:4"
    )

    # the compressed file is a model to start from, too
    again = SparseCLI(
        args=[
            "validate",
            f"--config={RECIPES / 'prune_finetune_cpu.yaml'}",
            f"--init_from={export}",
            "--export_to=null",
            f"--trainer.default_root_dir={tmp_path / 'validate'}",
            *TINY,
        ]
    )
    state = again.model.state_dict()
    assert all(torch.equal(state[k], loaded[k]) for k in loaded)


def test_init_from_a_file_of_another_model_or_no_file_ends_with_the_reason(
    dense_checkpoint, tmp_path
):
    common = [
        "fit",
        f"--config={RECIPES / 'prune_finetune_cpu.yaml'}",
        f"--trainer.default_root_dir={tmp_path}",
        *TINY,
    ]
    wider = [*common, f"--init_from={dense_checkpoint}", "--model.init_args.n_embd=64"]
    with pytest.raises(SystemExit, match="holds the weights of another model.*shapes"):
        SparseCLI(args=wider)
    with pytest.raises(SystemExit, match="init_from='nowhere.ckpt': no such file"):
        SparseCLI(args=[*common, "--init_from=nowhere.ckpt"])
    validate = ["validate", *common[1:], f"--init_from={dense_checkpoint}"]
    with pytest.raises(
        SystemExit,
        match=r"export_to writes the model that fit trained; .*--export_to=null on the command",
    ):
        SparseCLI(args=validate)
    cli = SparseCLI(args=[*validate, "--export_to=null"])  # the fix it gives
    assert "val/loss" in cli.trainer.callback_metrics


def test_learn_masks_fix_them_fine_tune_and_export_compressed(
    dense_checkpoint, tmp_path, caplog
):
    """recipes/gpt/learn_masks_cpu.yaml: masks learned for 30 steps from Wanda's prior with the
    weights frozen, then handed to a static phase, which zeroes the pruned weights and
    fine-tunes the rest; the export holds the learned 2:4 masks as it holds any other
    phase's."""
    export = tmp_path / "out" / "model.safetensors"
    with caplog.at_level(logging.INFO):
        cli = SparseCLI(
            args=[
                "fit",
                f"--config={RECIPES / 'learn_masks_cpu.yaml'}",
                f"--init_from={dense_checkpoint}",
                f"--export_to={export}",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.max_steps=34",
                "--trainer.val_check_interval=6",
                "--trainer.callbacks+=helpers.WeightsAtTrainStart",
                *TINY,
            ]
        )
    trainer = cli.trainer
    sparsity = next(c for c in trainer.callbacks if isinstance(c, SparsityCallback))
    start = next(
        c for c in trainer.callbacks if isinstance(c, WeightsAtTrainStart)
    ).weights
    assert trainer.global_step == 34
    assert sparsity.sparsifier.history == [(0, 0), (30, 1)]
    assert "phase 1 learned its masks" in caplog.text
    assert "phase 2 starts from these masks" in caplog.text
    masks = sparsity.sparsifier.masks
    assert sorted(masks) == sorted(sparsity.sparsifier.learned_reports[0])
    dense = export_state_dict(dense_checkpoint)
    weights = trainer.lightning_module.state_dict()
    for name, mask in masks.items():
        assert is_nm(mask, NM(2, 4)), name
        # straight-through while learning: the stored weights start dense
        assert torch.equal(start[name], dense[name]), name
        # static from step 30: the pruned weights are stored as zeros, the rest fine-tuned
        assert torch.equal(weights[name], weights[name] * mask), name
        assert not torch.equal(weights[name], dense[name] * mask), name
    exported = export_state_dict(trainer)
    loaded = load_compressed(export)
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)
    assert all(torch.equal(exported[name], weights[name]) for name in masks)
    with safe_open(str(export), framework="pt") as f:
        sparse = json.loads(f.metadata()["sparse"])
    assert {name: sparse[name]["pattern"] for name in masks} == dict.fromkeys(
        masks, "2:4"
    )
