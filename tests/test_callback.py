"""Trainer-level behaviour of SparsityCallback with a tiny model."""

import csv
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TinyModule, fast_trainer, random_loader
from lightning.pytorch.loggers import CSVLogger
from probes import effective_rows
from torch.utils.data import DataLoader, IterableDataset

from lightning_sparse import SparsityCallback
from lightning_sparse.masks import NM, is_nm
from lightning_sparse.masks.tiles import transposable_2to4_mask


@pytest.fixture
def lightning_log(caplog):
    """Capture Lightning's INFO messages whether or not its logger propagates to the root."""
    logger = logging.getLogger("lightning.pytorch")
    direct = not logger.propagate
    if direct:
        logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    if direct:
        logger.removeHandler(caplog.handler)


class GradProbe(L.Callback):
    """Placed after the SparsityCallback: sees gradients as the optimizer will."""

    def __init__(self, sparsity_cb: SparsityCallback) -> None:
        self.cb = sparsity_cb
        self.phase: dict[int, int | None] = {}
        self.pruned_grad_is_zero: dict[int, bool] = {}
        self.stored_zeros: dict[int, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        current = self.cb.sparsifier.current
        self.phase[step] = None if current is None else current.index
        w = pl_module.net.fc1.weight
        self.stored_zeros[step] = int((w == 0).sum())
        pruned = w == 0
        self.pruned_grad_is_zero[step] = (
            bool((w.grad[pruned] == 0).all()) if pruned.any() else True
        )


def test_phase_changes_exactly_at_boundary_with_gradient_accumulation(lightning_log):
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "until": "5 steps"}, {"sparsity": 0.0}]
    )
    probe = GradProbe(cb)
    # 16 batches per epoch, 2 per optimizer step: 8 optimizer steps per epoch
    trainer = fast_trainer(
        max_epochs=2, accumulate_grad_batches=2, callbacks=[cb, probe]
    )
    trainer.fit(TinyModule(), random_loader(n=128))
    assert trainer.global_step == 16
    assert [probe.phase[s] for s in range(16)] == [0] * 5 + [1] * 11
    assert all(probe.pruned_grad_is_zero[s] for s in range(5))
    assert not probe.pruned_grad_is_zero[5]  # dense: pruned weights get gradients again
    assert probe.stored_zeros[4] == 16 * 8 // 2
    messages = [r.getMessage() for r in lightning_log.records]
    assert sum("step 5: phase 2/2 begins: dense" in m for m in messages) == 1
    assert sum("step 0: phase 1/2 begins: 50% static" in m for m in messages) == 1


def test_epoch_boundaries_count_optimizer_steps():
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "until": "1 epoch"}, {"sparsity": 0.0}], verbose=False
    )
    probe = GradProbe(cb)
    trainer = fast_trainer(
        max_epochs=2, accumulate_grad_batches=3, callbacks=[cb, probe]
    )
    trainer.fit(
        TinyModule(), random_loader(n=64)
    )  # 8 batches: steps after batches 3, 6 and 8
    assert trainer.global_step == 6
    assert [probe.phase[s] for s in range(6)] == [0, 0, 0, 1, 1, 1]


def test_fraction_boundaries_resolve_against_max_steps():
    cb = SparsityCallback(
        phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}], verbose=False
    )
    probe = GradProbe(cb)
    fast_trainer(max_steps=10, callbacks=[cb, probe]).fit(TinyModule(), random_loader())
    assert [probe.phase[s] for s in range(10)] == [0] * 7 + [1] * 3


class Recorder(L.Callback):
    def __init__(self):
        self.val_zero_fraction = []

    def on_validation_batch_start(
        self, trainer, pl_module, batch, batch_idx, dataloader_idx=0
    ):
        self.val_zero_fraction.append(
            float((pl_module.net.fc1.weight == 0).float().mean())
        )


def test_hard_mask_holds_in_evaluation_and_sanity_check():
    cb = SparsityCallback(sparsity=0.75, verbose=False)
    rec = Recorder()
    trainer = fast_trainer(
        max_steps=6,
        callbacks=[cb, rec],
        limit_val_batches=2,
        num_sanity_val_steps=1,
        val_check_interval=3,
    )
    trainer.fit(TinyModule(), random_loader(), random_loader())
    assert rec.val_zero_fraction and all(f == 0.75 for f in rec.val_zero_fraction)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_pruned_weights_and_optimizer_state_stay_zero_at_high_lr_with_weight_decay(
    optimizer,
):
    cb = SparsityCallback(
        phases=[{"sparsity": 0.3, "until": 10}, {"sparsity": 0.7}], verbose=False
    )

    class Check(L.Callback):
        def __init__(self):
            self.bad_steps = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            for t in cb.sparsifier.targets:
                mask = cb.sparsifier.masks[t.name]
                pruned_values = t.param.detach()[~mask]
                state = [
                    v[~mask]
                    for v in opt.state[t.param].values()
                    if torch.is_tensor(v) and v.shape == t.param.shape
                ]
                if pruned_values.abs().max() != 0 or any(
                    s.abs().max() != 0 for s in state
                ):
                    self.bad_steps.append(trainer.global_step)

    check = Check()
    model = TinyModule(optimizer=optimizer, lr=1.0, weight_decay=0.5)
    fast_trainer(max_steps=20, callbacks=[cb, check]).fit(model, random_loader())
    assert check.bad_steps == []
    assert int((model.net.fc1.weight == 0).sum()) == round(
        0.7 * model.net.fc1.weight.numel()
    )


def test_dense_phase_after_hard_pruning_restarts_pruned_weights_from_zero():
    L.seed_everything(
        0, verbose=False
    )  # unseeded, a dead ReLU unit could get no gradient
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "until": 4}, {"sparsity": 0.0}], verbose=False
    )
    probe = GradProbe(cb)
    model = TinyModule()
    fast_trainer(max_steps=8, callbacks=[cb, probe]).fit(model, random_loader())
    assert probe.stored_zeros[4] == 64  # still zero when the dense phase starts
    assert int((model.net.fc1.weight == 0).sum()) == 0  # and they learned afterwards
    assert cb.sparsifier.masks == {}


def test_magnitude_is_straight_through():
    L.seed_everything(
        0, verbose=False
    )  # unseeded, a dead ReLU unit could get no gradient
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "algorithm": "magnitude", "update_every": 2}],
        verbose=False,
    )
    model = TinyModule()
    before = model.net.fc1.weight.detach().clone()
    fast_trainer(max_steps=6, callbacks=[cb]).fit(model, random_loader())
    w = model.net.fc1.weight.detach()
    mask = cb.sparsifier.masks["net.fc1.weight"]
    assert int((w == 0).sum()) == 0, "stored weights stay dense"
    assert bool((w[~mask] != before[~mask]).all()), (
        "pruned weights learn from the dense gradient"
    )
    assert int(mask.sum()) == w.numel() // 2
    # the forward (here in eval, after fit) uses the masked weight, with the same Parameter objects
    x = torch.randn(3, 8)
    expected = torch.nn.functional.linear(x, w * mask, model.net.fc1.bias)
    assert torch.allclose(model.net.fc1(x), expected)
    assert model.net.fc1.weight is dict(model.named_parameters())["net.fc1.weight"]
    # mask was re-chosen from the dense weights at the last update step (4)
    assert cb.sparsifier.last_update_step == 4


def test_runtime_nm_forward_and_dense_gradient():
    cb = SparsityCallback(sparsity="2:4", verbose=False)
    model = TinyModule()
    fast_trainer(max_steps=3, callbacks=[cb]).fit(model, random_loader())
    layer = model.net.fc2
    w = layer.weight.detach().clone()
    x = torch.randn(5, 16, requires_grad=True)
    layer.weight.grad = None
    out = layer(x)
    mask = cb.sparsifier.current_mask(cb.sparsifier.targets[1])
    assert is_nm(mask, NM(2, 4)) and torch.equal(mask, transposable_2to4_mask(w))
    ref_w = (w * mask).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, ref_w, layer.bias.detach())
    assert torch.allclose(out, ref)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out)
    assert torch.allclose(x.grad, ref_x.grad)
    assert torch.allclose(
        layer.weight.grad, ref_w.grad
    )  # straight-through: dense gradient


def test_two_groups_with_different_schedules():
    a = SparsityCallback(
        name="first", sparsity=0.5, params=["net.fc1.weight"], verbose=False
    )
    b = SparsityCallback(
        name="second",
        phases=[{"sparsity": "2:4", "until": 3}, {"sparsity": 0.0}],
        params=["net.fc2.weight"],
        verbose=False,
    )
    model = TinyModule()
    trainer = fast_trainer(max_steps=5, callbacks=[a, b])
    trainer.fit(model, random_loader())
    assert int((model.net.fc1.weight == 0).sum()) == 64
    assert b.sparsifier.current.index == 1
    assert a.state_key != b.state_key


def test_two_groups_claiming_one_parameter_is_an_error():
    a = SparsityCallback(name="a", sparsity=0.5, params=["net.fc*.weight"])
    b = SparsityCallback(name="b", sparsity=0.3, params=["net.fc2.weight"])
    with pytest.raises(
        ValueError,
        match=r"parameter 'net.fc2.weight' is claimed by SparsityCallback 'a' and SparsityCallback 'b'",
    ):
        fast_trainer(max_steps=1, callbacks=[a, b]).fit(TinyModule(), random_loader())


def test_two_groups_with_the_same_name_is_an_error():
    a = SparsityCallback(sparsity=0.5, params=["net.fc1.weight"])
    b = SparsityCallback(sparsity=0.3, params=["net.fc2.weight"])
    assert a.state_key == b.state_key == "SparsityCallback{'name': 'sparsity'}"
    with pytest.raises(RuntimeError, match=r"The `callback.state_key` must be unique"):
        fast_trainer(max_steps=1, callbacks=[a, b])


def test_target_and_actual_sparsity_reach_csv_logs_and_phase_the_progress_bar(tmp_path):
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "until": 4}, {"sparsity": "2:4"}],
        log_every_n_steps=2,
        verbose=False,
    )
    trainer = fast_trainer(
        max_steps=8, callbacks=[cb], logger=CSVLogger(tmp_path, name="run")
    )
    trainer.fit(TinyModule(), random_loader())
    with open(next(Path(tmp_path).rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = {
        int(r["step"]): (r["sparsity/sparsity/target"], r["sparsity/sparsity/actual"])
        for r in rows
        if r.get("sparsity/sparsity/target")
    }
    assert sorted(logged) == [0, 2, 4, 6, 8]
    assert float(logged[2][0]) == 0.5 and float(logged[2][1]) == 0.5
    assert float(logged[6][0]) == 0.5 and float(logged[6][1]) >= 0.5
    assert trainer.progress_bar_metrics["sparsity_phase"] == 2.0


class BarRecorder(L.Callback):
    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen.append(trainer.progress_bar_metrics.get("sparsity_phase"))


def test_progress_bar_shows_the_phase_at_every_step_across_epochs():
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "until": "5 steps"}, {"sparsity": 0.0}],
        verbose=False,
    )
    bar = BarRecorder()
    trainer = fast_trainer(max_epochs=3, callbacks=[cb, bar], limit_val_batches=2)
    loader = random_loader(n=16, batch_size=4)
    trainer.fit(TinyModule(), loader, loader)  # validation between the epochs
    assert bar.seen == [1.0] * 5 + [2.0] * 7


def test_fit_start_table_lists_parameters_phases_backend_and_reasons(lightning_log):
    cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.5}, {"sparsity": 0.0}])
    fast_trainer(max_steps=2, callbacks=[cb]).fit(TinyModule(), random_loader())
    text = "\n".join(r.getMessage() for r in lightning_log.records)
    assert "SparsityCallback 'sparsity': 2 parameters, 2 phase(s)" in text
    assert "phase 1: steps 0-0" in text and "2:4 runtime" in text
    assert "net.fc1.weight" in text and "16x8" in text and "masked" in text
    assert "output head: net.head.weight" in text
    assert "summary" in text and "final sparsity" in text


def test_summary_says_where_straight_through_masks_live(lightning_log):
    """After a ``runtime`` 2:4 run the stored weights hold no zeros: the summary says so."""
    model = TinyModule()
    cb = SparsityCallback(sparsity="2:4")
    fast_trainer(max_steps=2, callbacks=[cb]).fit(model, random_loader())
    text = "\n".join(r.getMessage() for r in lightning_log.records)
    assert "final sparsity: 5" in text  # runtime's greedy tiles keep at most 2 of 4
    assert (
        "  runtime: applied in the forward; stored weights stay dense; export_state_dict "
        "folds the masks in" in text
    )
    assert bool((model.net.fc1.weight != 0).all())
    lightning_log.clear()
    fast_trainer(max_steps=2, callbacks=[SparsityCallback(sparsity=0.5)]).fit(
        TinyModule(), random_loader()
    )
    text = "\n".join(r.getMessage() for r in lightning_log.records)
    assert "final sparsity: 50.0%" in text and "applied in the forward" not in text


def test_constructor_errors_name_the_argument_and_fix():
    with pytest.raises(
        ValueError, match=r"needs exactly one of sparsity= .* or phases="
    ):
        SparsityCallback()
    with pytest.raises(ValueError, match=r"needs exactly one of sparsity="):
        SparsityCallback(sparsity=0.5, phases=[{"sparsity": 0.5}])
    with pytest.raises(
        ValueError, match=r"phases\[1\]: sparsity=2 is outside \[0, 1\)"
    ):
        SparsityCallback(phases=[{"sparsity": 0.5, "until": 0.5}, {"sparsity": 2}])
    with pytest.raises(ValueError, match=r"phases\[0\] has no 'until'"):
        SparsityCallback(phases=[{"sparsity": 0.5}, {"sparsity": 0.0}])
    with pytest.raises(
        TypeError, match=r"phases=\{'sparsity': 0.5\}: give a list of phases"
    ):
        SparsityCallback(phases={"sparsity": 0.5})
    with pytest.raises(
        ValueError,
        match=r"backend='cuda'; use one of \['auto', 'masked', 'semi_structured'\]",
    ):
        SparsityCallback(sparsity=0.5, backend="cuda")
    with pytest.raises(
        ValueError, match=r"params\[0\]: 're:\[' is not a valid regular expression"
    ):
        SparsityCallback(sparsity=0.5, params=["re:["])
    with pytest.raises(
        ValueError, match=r"name='': give the group a non-empty string name"
    ):
        SparsityCallback(sparsity=0.5, name="")


def test_unmatched_pattern_fails_at_fit_start():
    cb = SparsityCallback(sparsity=0.5, params=["net.fc1.weight", "encoder.*"])
    with pytest.raises(
        ValueError,
        match=r"params pattern 'encoder.\*' matches no parameter of TinyModule",
    ):
        fast_trainer(max_steps=1, callbacks=[cb]).fit(TinyModule(), random_loader())


def test_impossible_nm_for_a_parameter_is_named():
    # named in params: the user asked for it, so the group refuses rather than drop it
    cb = SparsityCallback(sparsity="2:4", params=["net.fc1.weight", "net.fc2.weight"])
    with pytest.raises(
        ValueError,
        match=r"sparsity '2:4' is impossible for parameter 'net.fc1.weight': .* 6 inputs per output, not a multiple of M=4",
    ):
        fast_trainer(max_steps=1, callbacks=[cb]).fit(
            TinyModule(inputs=6), random_loader(inputs=6)
        )


TWO_FOUR_FIRST = [{"sparsity": "2:4", "until": 2}, {"sparsity": 0.5}]


@pytest.mark.parametrize(
    ("phases", "exclude", "nm_phase"),
    [
        (TWO_FOUR_FIRST, None, 1),
        (TWO_FOUR_FIRST, ["net.fc2.bias"], 1),
        ([{"sparsity": 0.0, "until": 2}, {"sparsity": "2:4"}], None, 2),
        ([{"sparsity": 0.5, "until": 2}, {"sparsity": "2:4"}], None, 2),
    ],
    ids=["2:4 first", "2:4 first, exclude", "dense first", "unstructured first"],
)
def test_default_selection_leaves_a_layer_that_cannot_hold_nm_dense_all_run(
    lightning_log, phases, exclude, nm_phase
):
    # fc1 (6 inputs) could take the unstructured or dense phase, but a group keeps one set of
    # parameters for the whole run, so it stays dense throughout, whichever phase is 2:4
    cb = SparsityCallback(phases=phases, exclude=exclude)
    model = TinyModule(inputs=6)
    fast_trainer(max_steps=4, callbacks=[cb]).fit(model, random_loader(inputs=6))
    assert [t.name for t in cb.selection.targets] == ["net.fc2.weight"]
    text = "\n".join(r.getMessage() for r in lightning_log.records)
    assert (
        f"6 inputs per output, not a multiple of M=4 (2:4 in phase {nm_phase}): "
        f"net.fc1.weight" in text
    )
    assert cb.sparsifier.current.index == 1
    with torch.no_grad():
        assert bool((effective_rows(model.net.fc1) != 0).all())
        fc2 = effective_rows(model.net.fc2)
    if phases[-1]["sparsity"] == "2:4":
        assert is_nm(fc2 != 0, NM(2, 4))
    else:
        assert float((fc2 == 0).float().mean()) == 0.5


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.randn(8), torch.randn(4)


def test_fraction_with_unknown_run_length_says_to_set_max_steps():
    cb = SparsityCallback(phases=[{"sparsity": 0.5, "until": 0.5}, {"sparsity": 0.0}])
    trainer = fast_trainer(max_epochs=-1, callbacks=[cb])
    with pytest.raises(
        ValueError,
        match=r"phases\[0\].until=0.5 is a fraction of the run, but the trainer does not know the run length: set Trainer\(max_steps=...\)",
    ):
        trainer.fit(TinyModule(), DataLoader(Endless(), batch_size=4))


def test_straight_through_on_a_custom_forward_layer_is_refused():
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = TinyModule()
    model.net.fc1 = ScaledLinear(8, 16)
    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "algorithm": "magnitude"}], params=["net.fc1.weight"]
    )
    with pytest.raises(
        ValueError,
        match=r"algorithm 'magnitude' masks the forward of each layer, but parameter 'net.fc1.weight' \(net.fc1\) cannot: ScaledLinear overrides forward\(\)",
    ):
        fast_trainer(max_steps=1, callbacks=[cb]).fit(model, random_loader())
