"""GPT: weight tying, initial loss, presets, and a few training steps on pydoc text."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import demo_trainer

from lightning_sparse.demo import GPT, GPTConfig, GPTLanguageModel, PydocTextDataModule


def test_lm_head_tied_to_wte():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # listed once, as transformer.wte.weight
    assert {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.wpe.weight",
    } <= set(names)


def test_untrained_loss_is_about_ln_256():
    torch.manual_seed(0)
    lm = GPTLanguageModel(n_layer=2, block_size=32)
    dm = PydocTextDataModule(block_size=32, batch_size=16, max_bytes=20_000)
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    assert lm.loss(x, y).item() == pytest.approx(math.log(256), abs=0.1)


def test_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=8)).eval()
    x = torch.randint(0, 256, (1, 8))
    changed = x.clone()
    changed[0, 5] = (x[0, 5] + 1) % 256
    assert torch.allclose(model(x)[:, :5], model(changed)[:, :5], atol=1e-6)
    assert not torch.allclose(model(x)[:, 5:], model(changed)[:, 5:])


def test_gpt2_preset_has_124m_params():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2"))
    assert model.num_params() == 124_439_808
    assert (
        GPTLanguageModel(
            preset="gpt2", n_layer=1, n_embd=64, n_head=4
        ).config.vocab_size
        == 50257
    )


def test_generate_shape():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8))
    out = model.generate(
        torch.zeros(2, 3, dtype=torch.long), max_new_tokens=10, top_k=5
    )
    assert out.shape == (2, 13)


def test_optimizer_skips_decay_on_embeddings_and_1d():
    lm = GPTLanguageModel(n_layer=1, n_embd=32, n_head=2, bias=True)
    lm.trainer = demo_trainer(max_steps=10)
    decay, no_decay = lm.configure_optimizers()["optimizer"].param_groups
    decay_ids, no_decay_ids = (
        {id(p) for p in decay["params"]},
        {id(p) for p in no_decay["params"]},
    )
    t = lm.model.transformer
    assert id(t.wte.weight) in no_decay_ids and id(t.wpe.weight) in no_decay_ids
    assert (
        id(t.h[0].ln_1.weight) in no_decay_ids
        and id(t.h[0].mlp.c_fc.bias) in no_decay_ids
    )
    assert (
        id(t.h[0].mlp.c_fc.weight) in decay_ids
        and id(t.h[0].attn.c_attn.weight) in decay_ids
    )
    assert len(decay_ids | no_decay_ids) == sum(1 for _ in lm.parameters())


def test_gpt_trains_and_logs():
    lm = GPTLanguageModel(n_layer=1, n_embd=32, n_head=2, block_size=16, warmup_steps=1)
    trainer = demo_trainer(val_check_interval=3)
    trainer.fit(lm, PydocTextDataModule(block_size=16, batch_size=8, max_bytes=20_000))
    metrics = trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/ppl"):
        assert key in metrics and math.isfinite(float(metrics[key])), key
    assert float(metrics["val/ppl"]) == pytest.approx(
        math.exp(float(metrics["val/loss"])), rel=1e-3
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"preset": "gpt5"}, ValueError, "preset"),
        ({"n_embd": 100, "n_head": 3}, ValueError, "n_head"),
        ({"n_layer": 0}, ValueError, "n_layer"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"lr": 0.0}, ValueError, "lr"),
        ({"min_lr_ratio": 2.0}, ValueError, "min_lr_ratio"),
    ],
)
def test_gpt_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        GPTLanguageModel(**kwargs)


def test_sequence_longer_than_block_size():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=4))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_checkpoint_round_trip_keeps_weight_tying(tmp_path):
    lm = GPTLanguageModel(n_layer=1, n_embd=32, n_head=2, block_size=16)
    trainer = demo_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(lm, PydocTextDataModule(block_size=16, batch_size=4, max_bytes=5_000))
    path = tmp_path / "gpt.ckpt"
    trainer.save_checkpoint(path)
    loaded = GPTLanguageModel.load_from_checkpoint(path)
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    assert torch.equal(
        loaded.model.transformer.wte.weight, lm.model.transformer.wte.weight
    )
    assert loaded.config == lm.config
