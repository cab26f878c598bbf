"""Flip rate: the fraction of a group's mask entries one optimizer step changed, logged at the
logging interval through the trainer's loggers, summarized at the end of fit, kept in checkpoints."""

from __future__ import annotations

import lightning as L
import pytest
from helpers import FEW_UPDATES, MetricsLog, TinyModule, fast_trainer, random_loader

from lightning_sparse import SparsityAlgorithm, SparsityCallback, register_algorithm

pytestmark = FEW_UPDATES

FLIP = "sparsity/sparsity/flip_rate"
WEIGHTS = 16 * 8 + 16 * 16  # TinyNet's fc1 and fc2


@register_algorithm("flip_first_row_test")
class FlipFirstRow(SparsityAlgorithm):
    """Straight-through; every update inverts the mask's first row (fc1: 8 entries, fc2: 16)."""

    straight_through = True
    dynamic = True

    def update_mask(self, weight, mask, target, ctx):
        new = mask.clone()
        new[0] = ~new[0]
        return new


class Pending(L.Callback):
    """After the SparsityCallback: at which optimizer steps a mask snapshot is held."""

    def __init__(self, cb: SparsityCallback) -> None:
        self.cb = cb
        self.held: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.cb.flips.pending:
            self.held.append(trainer.global_step)


def fit(phases, steps=8, every=1, logger=True, verbose=False, **kwargs):
    L.seed_everything(0, verbose=False)
    cb = SparsityCallback(
        phases=phases, log_every_n_steps=every, verbose=verbose, **kwargs
    )
    pending = Pending(cb)
    log = MetricsLog() if logger else False
    trainer = fast_trainer(max_steps=steps, callbacks=[cb, pending], logger=log)
    trainer.fit(TinyModule(lr=0.05), random_loader())
    return cb, (log.series(FLIP) if logger else None), pending.held


def test_flip_rate_is_exact_on_known_mask_changes():
    # updates at steps 2 and 4 (every 2 from the phase start), each inverting 8 + 16 entries;
    # the phase boundary at step 6 (to a static phase) is not a step's change
    phases = [
        {
            "sparsity": 0.5,
            "algorithm": "flip_first_row_test",
            "update_every": 2,
            "until": 6,
        },
        {"sparsity": 0.5},
    ]
    cb, flips, _ = fit(phases)
    changed = 24 / WEIGHTS
    assert flips == {
        0: 0.0,
        1: 0.0,
        2: changed,
        3: 0.0,
        4: changed,
        5: 0.0,
        6: 0.0,
        7: 0.0,
    }
    assert cb.flips.first == (0, 0.0)
    assert cb.flips.last == (7, 0.0)
    assert cb.flips.peak == (2, changed)  # the first of the equal peaks


def test_flip_rate_is_logged_only_at_logging_steps_and_held_only_there():
    phases = [{"sparsity": "2:4", "until": 7}, {"sparsity": 0.0}]
    cb, flips, held = fit(phases, steps=10, every=3)
    assert sorted(flips) == [0, 3, 6]  # step 9 is dense
    assert held == [0, 3, 6]  # a copy of the masks lives within a logged step only
    assert all(0.0 < rate < 0.5 for rate in flips.values())  # runtime masks move
    assert not cb.flips.pending


def test_the_trainer_log_interval_is_the_default():
    phases = [{"sparsity": "2:4"}]
    L.seed_everything(0, verbose=False)
    cb = SparsityCallback(phases=phases, verbose=False)
    log = MetricsLog()
    fast_trainer(max_steps=7, callbacks=[cb], logger=log, log_every_n_steps=2).fit(
        TinyModule(), random_loader()
    )
    assert sorted(log.series(FLIP)) == [0, 2, 4, 6]


@pytest.mark.parametrize(
    "phase",
    [{"sparsity": 0.5}, {"sparsity": "2:4", "algorithm": "static"}],
    ids=["static", "static 2:4"],
)
def test_a_static_mask_never_flips(phase):
    cb, flips, _ = fit([phase])
    assert sorted(flips) == list(range(8)) and set(flips.values()) == {0.0}
    assert cb.flips.peak == (0, 0.0)


def test_dynamic_sparse_training_flips_at_its_updates_only():
    phases = [{"sparsity": 0.5, "algorithm": "rigl", "update_every": 3}]
    _, flips, _ = fit(phases, steps=9)
    # updates at 3 and 6 (update_stop: 75% of the phase); drop_fraction decays from 0.3
    assert {s for s, rate in flips.items() if rate > 0} == {3, 6}
    assert flips[3] > flips[6] > 0


def test_without_loggers_nothing_is_held_unless_the_summary_shows_it(lightning_log):
    phases = [{"sparsity": "2:4"}]
    _, _, held = fit(phases, every=2, logger=False)
    assert held == []
    cb, _, held = fit(phases, every=2, logger=False, verbose=True)
    assert held == [0, 2, 4, 6]
    summary = lightning_log.text[lightning_log.text.index("summary") :]
    first, last, peak = cb.flips.first, cb.flips.last, cb.flips.peak
    assert (
        f"flip rate: first {first[1]:.2%} (step {first[0]}), last {last[1]:.2%} "
        f"(step {last[0]}), peak {peak[1]:.2%} (step {peak[0]})" in summary
    )


def test_flip_rate_is_measured_only_while_sparse(lightning_log):
    _, flips, held = fit([{"sparsity": 0.5, "until": 1}, {"sparsity": 0.0}])
    assert flips == {0: 0.0} and held == [0]
    _, flips, _ = fit([{"sparsity": 0.0, "until": 4}, {"sparsity": "2:4"}], steps=6)
    assert sorted(flips) == [4, 5]
    _, flips, held = fit([{"sparsity": 0.0}], steps=3, verbose=True)
    assert flips == {} and held == []
    assert "summary" in lightning_log.text and "flip rate" not in lightning_log.text


def test_checkpoint_state_holds_the_records_and_refuses_damaged_ones():
    cb, _, _ = fit([{"sparsity": "2:4"}], steps=4)
    state = cb.state_dict()
    assert state["flip_rate"] == {
        name: list(getattr(cb.flips, name)) for name in ("first", "last", "peak")
    }
    restored = SparsityCallback(sparsity="2:4")
    restored.load_state_dict(state)
    assert (restored.flips.first, restored.flips.last, restored.flips.peak) == (
        cb.flips.first,
        cb.flips.last,
        cb.flips.peak,
    )
    # a checkpoint written before flip rates were measured
    older = {k: v for k, v in state.items() if k != "flip_rate"}
    restored.load_state_dict(older)
    assert restored.flips.first is None and restored.flips.describe() is None
    for bad in ({"first": [1, 2.0]}, {"peak": "high"}, [0.1]):
        with pytest.raises(
            ValueError, match=r"\[sparsity\] the checkpoint's flip_rate"
        ):
            restored.load_state_dict({**state, "flip_rate": bad})


def test_flip_rate_counts_the_group_s_weights_only():
    phases = [{"sparsity": 0.5, "algorithm": "flip_first_row_test", "update_every": 1}]
    _, flips, _ = fit(phases, steps=3, params=["net.fc2.weight"])
    assert flips == {0: 0.0, 1: 16 / 256, 2: 16 / 256}
