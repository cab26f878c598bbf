"""A custom algorithm, registered by name, end to end from Python and from a LightningCLI YAML."""

import lightning as L
import pytest
import torch
import yaml
from helpers import FEW_UPDATES, TinyModule, fast_trainer, random_loader
from lightning.pytorch.cli import LightningCLI

from lightning_sparse import (
    DropAndGrow,
    SparsityAlgorithm,
    SparsityCallback,
    register_algorithm,
)
from lightning_sparse.masks import num_kept

pytestmark = FEW_UPDATES


# The example of docs/algorithms.md, verbatim.
@register_algorithm("weight_x_grad")
class WeightTimesGradient(SparsityAlgorithm):
    """Keep the weights with the largest |weight x gradient|, re-chosen at every update."""

    straight_through = True  # stored weights stay dense, so pruned ones can come back
    dynamic = True  # update_mask runs every update_every steps
    needs_grad = True  # ctx.grad is the dense gradient

    def update_mask(self, weight, mask, target, ctx):
        return self.select((weight * ctx.grad).abs(), target)


class Masks(L.Callback):
    def __init__(self, cb):
        self.cb = cb
        self.masks = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sp = self.cb.sparsifier
        self.masks[trainer.global_step] = sp.masks["net.fc2.weight"].clone()


def test_custom_algorithm_by_name_in_python():
    cb = SparsityCallback(
        phases=[{"sparsity": 0.8, "algorithm": "weight_x_grad", "update_every": 3}],
        verbose=False,
    )
    probe = Masks(cb)
    model = TinyModule()
    fast_trainer(max_steps=10, callbacks=[cb, probe]).fit(model, random_loader())
    assert isinstance(cb.sparsifier.algorithm, WeightTimesGradient)
    assert cb.sparsifier.last_update_step == 9
    masks = probe.masks
    assert all(int(m.sum()) == num_kept(256, 0.8) for m in masks.values())
    assert torch.equal(masks[1], masks[3]) and not torch.equal(masks[3], masks[4])
    assert int((model.net.fc2.weight == 0).sum()) == 0, "straight-through: stored dense"


def test_custom_algorithm_by_name_in_a_lightning_cli_yaml(tmp_path):
    config = yaml.safe_load(
        """
        trainer:
          max_steps: 7
          accelerator: cpu
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          callbacks:
            - class_path: lightning_sparse.SparsityCallback
              init_args:
                verbose: false
                params: ["net.fc1.weight", "net.fc2.weight"]
                phases:
                  - {sparsity: 0.75, algorithm: weight_x_grad, update_every: 2, until: 5}
                  - {sparsity: 0.5, algorithm: grow_by_gradient, update_every: 1}
        """
    )
    cli = LightningCLI(TinyModule, run=False, args=config, save_config_callback=None)
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback))
    cli.trainer.fit(cli.model, random_loader())
    assert cb.sparsifier.history == [(0, 0), (5, 1)]
    assert isinstance(cb.sparsifier.algorithm, GrowByGradient)
    assert cb.sparsifier.last_update_step == 6
    assert int(cb.sparsifier.masks["net.fc1.weight"].sum()) == 64


@register_algorithm("grow_by_gradient")
class GrowByGradient(DropAndGrow):
    """A custom drop-and-grow rule: regrow where the gradient is most negative."""

    needs_grad = True

    def grow_score(self, weight, mask, ctx):
        return None if ctx.grad is None else -ctx.grad


def test_unregistered_name_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"algorithm='nope' is not a registered algorithm"
    ):
        SparsityCallback(phases=[{"sparsity": 0.5, "algorithm": "nope"}], verbose=False)
