"""A dynamic phase with too few mask updates for its length (a gmp ramp done in one update,
set or rigl that drop and regrow once) is warned about at fit start and in ``plan``, with the
numbers and an ``update_every`` that fixes it; the steps it counts are those the engine updates
at."""

import warnings

import pytest
from helpers import TinyModule, fast_trainer, random_loader
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms import RunLength, build_algorithm
from lightning_sparse.cli.main import SparseTrainer
from lightning_sparse.core.schedule import Phase, resolve_phases


def fit(cb, steps=20):
    fast_trainer(max_steps=steps, callbacks=[cb]).fit(TinyModule(), random_loader(n=32))


def test_a_gmp_ramp_in_one_update_is_warned_about_with_the_fix():
    with pytest.warns(UserWarning) as record:
        fit(SparsityCallback(sparsity=0.9, algorithm="gmp", verbose=False))
    (message,) = [str(w.message) for w in record if "ramp" in str(w.message)]
    assert message == (
        "[sparsity] phase 1 (90% gmp, steps 0-19): its ramp from 0% to 90% has 1 mask update "
        "(update_every=100, from step 0 to update_stop (step 15)), so the update at step 15 "
        "prunes 90% of the weights at once: set update_every=1 (15 updates over the 15 steps "
        "from update_start to update_stop)"
    )
    with warnings.catch_warnings():  # the fix it names holds
        warnings.filterwarnings("error", message=r"\[sparsity\] phase")
        fit(
            SparsityCallback(
                sparsity=0.9, algorithm="gmp", update_every=1, verbose=False
            )
        )


def test_a_gmp_ramp_from_50_to_90_percent_is_judged_by_its_own_span():
    """Half of a ramp from 50% to 90% is 20 points (not the 45 of a ramp from 0%): every 4
    steps, its first update prunes 24% of the weights, and it is warned about; every 3 steps
    (at most 20%) it is not, nor with the fix the warning names."""
    phase = {"sparsity": 0.9, "algorithm": "gmp", "initial_sparsity": 0.5}
    with pytest.warns(UserWarning) as record:
        fit(SparsityCallback(phases=[{**phase, "update_every": 4}], verbose=False))
    (message,) = [str(w.message) for w in record if "ramp" in str(w.message)]
    assert message == (
        "[sparsity] phase 1 (90% gmp, steps 0-19): its ramp from 50% to 90% has 4 mask "
        "updates (update_every=4, from step 0 to update_stop (step 15)), so the update at "
        "step 4 prunes 24% of the weights at once: set update_every=1 (15 updates over the "
        "15 steps from update_start to update_stop)"
    )
    for every in (3, 1):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r"\[sparsity\] phase")
            cb = SparsityCallback(
                phases=[{**phase, "update_every": every}], verbose=False
            )
            fit(cb)


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_set_and_rigl_with_one_update_are_warned_about(algorithm):
    cb = SparsityCallback(sparsity=0.5, algorithm=algorithm, verbose=False)
    with pytest.warns(
        UserWarning, match=rf"{algorithm} has one mask update \(step 15\)"
    ):
        fit(cb)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"\[sparsity\] phase")
        fit(
            SparsityCallback(
                sparsity=0.5, algorithm=algorithm, update_every=7, verbose=False
            )
        )


def test_a_ramp_that_ends_after_its_phase_and_a_phase_too_short_for_any_ramp():
    phases = [
        {
            "sparsity": 0.8,
            "algorithm": "gmp",
            "update_every": 1,
            "update_stop": 30,
            "until": 20,
        },
        {"sparsity": 0.8, "algorithm": "gmp", "update_every": 1, "until": 24},
    ]
    with pytest.warns(UserWarning) as record:
        fit(SparsityCallback(phases=phases, verbose=False), steps=30)
    messages = [str(w.message) for w in record if "ramp" in str(w.message)]
    assert len(messages) == 2
    assert (
        "phase 1 (80% gmp, steps 0-19): its ramp from 0% to 80% reaches only"
        in messages[0]
    )
    assert "end the ramp inside the phase (update_stop)" in messages[0]
    assert "phase 2 (80% gmp, steps 20-23)" in messages[1]
    assert "lengthen the phase (until) or move update_stop later" in messages[1]


def test_plan_prints_the_warning(capsys):
    cb = SparsityCallback(sparsity=0.9, algorithm="gmp")
    trainer = SparseTrainer(
        max_steps=20, callbacks=[cb], logger=False, accelerator="cpu"
    )
    trainer.plan(TinyModule(), plot=False)
    out = capsys.readouterr().out
    assert "Warning: [sparsity] phase 1 (90% gmp, steps 0-19): its ramp" in out
    assert "set update_every=1" in out


@settings(max_examples=60, deadline=None, database=None)
@given(
    algorithm=st.sampled_from(["gmp", "set", "rigl", "magnitude"]),
    every=st.integers(1, 12),
    start=st.integers(0, 10),
    length=st.integers(1, 40),
    stop=st.none() | st.integers(1, 60),
    total=st.integers(60, 80),
)
def test_the_counted_updates_are_the_engine_s(
    algorithm, every, start, length, stop, total
):
    spec = {"sparsity": 0.5, "algorithm": algorithm, "update_every": every}
    if stop is not None:
        spec["update_stop"] = start + stop
    phases = [Phase(sparsity=0.3, until=start)] if start else []
    phases += [Phase(**spec, until=start + length), Phase(sparsity=0.0)]
    phase = resolve_phases(phases, total)[len(phases) - 2]
    algo = build_algorithm(phase, RunLength(total))
    engine = [s for s in range(total) if phase.contains(s) and algo.is_update_step(s)]
    assert algo.update_steps() == engine
