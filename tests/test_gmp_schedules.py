"""gmp with a sparsity schedule that goes down: each mask choice meets the schedule's value,
regrown weights restart at zero with zeroed optimizer state, chosen by the dense gradient, and
a resumed run matches the uninterrupted one bit for bit."""

import lightning as L
import pytest
import torch
from helpers import FEW_UPDATES, RepeatedBatch, TinyModule, fast_trainer, resume_run
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms import build_algorithm
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.masks import num_kept

pytestmark = FEW_UPDATES

VALUES = [0.5, 0.25, 0.75]  # down, then up, then down again (from 0.75 to 0.5)
PHASE = {
    "sparsity": 0.75,
    "algorithm": "gmp",
    "update_every": 2,
    "update_stop": 10,
    "ramp": VALUES,
}
NAME = "net.fc2.weight"


class Snapshot(L.Callback):
    """At every optimizer step: fc2's mask, weight, dense gradient and Adam moments (before the
    SparsityCallback's update when placed before it, after the update when placed after it)."""

    def __init__(self):
        self.seen = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        cb = next(c for c in trainer.callbacks if isinstance(c, SparsityCallback))
        param = pl_module.get_parameter(NAME)
        state = optimizer.state.get(param, {})
        self.seen[trainer.global_step] = {
            "mask": cb.sparsifier.masks[NAME].clone(),
            "weight": param.detach().clone(),
            "grad": param.grad.detach().clone(),
            **{k: state[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in state},
        }


def test_a_falling_schedule_regrows_at_zero_where_the_gradient_is_largest():
    before, after = Snapshot(), Snapshot()
    L.seed_everything(0, verbose=False)
    cb = SparsityCallback(phases=[PHASE], verbose=False)
    trainer = fast_trainer(max_steps=12, callbacks=[before, cb, after])
    data = DataLoader(RepeatedBatch(n=32, batch_size=8), batch_size=8)
    trainer.fit(TinyModule(), data)
    kept = {step: int(s["mask"].sum()) for step, s in after.seen.items()}
    choice = {0: 0, 2: 1, 4: 2, 6: 3, 8: 4, 10: 5}
    for step in range(12):
        j = choice[step - step % 2] if step <= 10 else 5
        assert kept[step] == num_kept(256, VALUES[j % 3]), step
    for step in (2, 6, 8):  # 0.5 -> 0.25, 0.75 -> 0.5, 0.5 -> 0.25: weights come back
        old, new = before.seen[step]["mask"], after.seen[step]["mask"]
        grown = new & ~old
        assert not (old & ~new).any(), "a falling sparsity keeps every survivor"
        assert int(grown.sum()) == kept[step] - int(old.sum()) > 0
        snap = after.seen[step]
        assert not snap["weight"][grown].any(), "regrown weights restart at zero"
        assert not snap["exp_avg"][grown].any() and not snap["exp_avg_sq"][grown].any()
        grad = before.seen[step]["grad"].abs()
        assert grad[grown].min() >= grad[~new].max(), "largest dense gradients regrow"


@pytest.mark.parametrize("resume_step", [3, 8])
def test_resume_through_regrowth_is_bitwise_equal(tmp_path, resume_step):
    reference, ref_cb = resume_run(tmp_path / "ref", [PHASE])
    resume_run(tmp_path / "ck", [PHASE], stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed, cb = resume_run(tmp_path / "resumed", [PHASE], ckpt_path=ckpt, seed=123)
    expected, got = reference.state_dict(), resumed.state_dict()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert torch.equal(cb.sparsifier.masks[NAME], ref_cb.sparsifier.masks[NAME])


def test_the_value_at_update_stop_holds_and_the_sparsity_caps_the_schedule():
    phase = Phase(
        sparsity=0.5,
        algorithm="gmp",
        update_every=10,
        update_stop=50,
        ramp={"type": "linear", "init": 0.8, "slope": -0.01},
    )
    algo = build_algorithm(resolve_phases([phase], 100)[0])
    targets = [algo.target_at(s) for s in (0, 30, 40, 50, 99)]
    assert targets == pytest.approx([0.5, 0.5, 0.4, 0.3, 0.3])
