import math

import pytest

from lightning_sparse.core.schedule import (
    Phase,
    parse_boundary,
    parse_sparsity,
    phase_at,
    resolve_phases,
)
from lightning_sparse.masks import NM


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        (0.7, "fraction", 0.7),
        (1.0, "fraction", 1.0),
        ("70%", "fraction", 0.7),
        ("3 epochs", "epochs", 3.0),
        ("1 epoch", "epochs", 1.0),
        ("3ep", "epochs", 3.0),
        ("1.5 epochs", "epochs", 1.5),
        ("1500 steps", "steps", 1500.0),
        ("1 step", "steps", 1.0),
        ("1500", "steps", 1500.0),
        (1500, "steps", 1500.0),
    ],
)
def test_boundary_forms(text, kind, value):
    boundary = parse_boundary(text)
    assert (boundary.kind, boundary.value) == (kind, value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            1.5,
            r"until=1.5: a float boundary is a fraction .* \(for a step count write 1 or '1 steps'\)",
        ),
        (
            0.0,
            r"until=0.0: a float boundary is a fraction of the run and must be in \(0, 1\]",
        ),
        (0, r"until=0: a step boundary must be a positive integer"),
        (-5, r"until=-5: a step boundary"),
        ("150%", r"until='150%': a percentage boundary must be in \(0%, 100%\]"),
        (
            "3 weeks",
            r"until='3 weeks' is not a boundary: use a fraction .* '1500 steps'",
        ),
        (
            "2.5 steps",
            r"until='2.5 steps': a step boundary must be a positive whole number",
        ),
        (True, r"until=True has type bool"),
        ([1], r"until=\[1\] has type list"),
    ],
)
def test_bad_boundaries_name_value_and_fix(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        parse_boundary(value)


def test_sparsity_forms():
    assert parse_sparsity("2:4") == NM(2, 4)
    assert parse_sparsity(" 4 : 8 ") == NM(4, 8)
    assert parse_sparsity(0) == 0.0
    assert parse_sparsity(0.7) == 0.7


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            1.0,
            r"sparsity=1.0 is outside \[0, 1\): it is the fraction of weights pruned",
        ),
        (-0.1, r"sparsity=-0.1 is outside \[0, 1\)"),
        (
            "4:4",
            r"sparsity='4:4' is impossible: N:M keeps N of every M weights, so it needs 0 < N < M",
        ),
        ("0:4", r"sparsity='0:4' is impossible"),
        ("5:4", r"sparsity='5:4' is impossible"),
        ("2/4", r"sparsity='2/4' is not a sparsity: use a float in \[0, 1\) .* '2:4'"),
        ("70%", r"sparsity='70%' is not a sparsity"),
        (None, r"sparsity=None has type NoneType"),
    ],
)
def test_bad_sparsity_names_value_and_fix(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        parse_sparsity(value)


def test_default_algorithms():
    assert Phase(sparsity=0.7).algorithm == "static"
    assert Phase(sparsity="2:4").algorithm == "runtime"
    assert Phase(sparsity=0.0).algorithm is None


def test_dense_phase_rejects_options():
    with pytest.raises(
        ValueError,
        match=r"sparsity=0.0 makes this phase dense, so \['algorithm'\] would do nothing",
    ):
        Phase(sparsity=0.0, algorithm="static")
    with pytest.raises(ValueError, match=r"\['update_every'\] would do nothing"):
        Phase(sparsity=0.0, update_every=5)


def test_phase_from_dict_errors_name_phase_and_key():
    with pytest.raises(
        ValueError,
        match=r"phases\[2\]: unknown key\(s\) \['untill'\] \(did you mean 'until' for "
        r"'untill'\?\); a phase accepts",
    ):
        Phase.from_any({"sparsity": 0.5, "untill": 0.7}, "phases[2]")
    with pytest.raises(ValueError, match=r"phases\[1\]: sparsity=1.2 is outside"):
        Phase.from_any({"sparsity": 1.2}, "phases[1]")
    with pytest.raises(TypeError, match=r"phases\[0\]=0.5: a phase is a dict"):
        Phase.from_any(0.5, "phases[0]")
    with pytest.raises(ValueError, match=r"update_every=0: use a positive integer"):
        Phase(sparsity=0.5, algorithm="magnitude", update_every=0)


def test_resolve_fractions_percent_steps_epochs():
    phases = [
        Phase(sparsity=0.5, until=0.25),
        Phase(sparsity="2:4", until="50%"),
        Phase(sparsity=0.9, until="600 steps"),
        Phase(sparsity=0.3, until="8 epochs"),
        Phase(sparsity=0.0),
    ]
    resolved = resolve_phases(phases, total_steps=1000, steps_per_epoch=100)
    assert [(p.start, p.end) for p in resolved] == [
        (0, 250),
        (250, 500),
        (500, 600),
        (600, 800),
        (800, 1000),
    ]
    assert phase_at(resolved, 249).index == 0
    assert phase_at(resolved, 250).index == 1
    assert phase_at(resolved, 999).index == 4


def test_after_last_bounded_phase_training_is_dense():
    resolved = resolve_phases([Phase(sparsity=0.5, until=10)], total_steps=math.inf)
    assert phase_at(resolved, 9).index == 0
    assert phase_at(resolved, 10) is None


def test_open_ended_phase_must_be_last():
    with pytest.raises(
        ValueError,
        match=r"phases\[0\] has no 'until', so it runs to the end of training and phases\[1\] would never start",
    ):
        resolve_phases([Phase(sparsity=0.5), Phase(sparsity=0.0)], 100)


def test_boundaries_must_increase():
    with pytest.raises(
        ValueError, match=r"phases\[1\].until='50%' is not after phases\[0\].until=0.7"
    ):
        resolve_phases(
            [
                Phase(sparsity=0.5, until=0.7),
                Phase(sparsity="2:4", until="50%"),
                Phase(),
            ],
            100,
        )


def test_boundaries_of_different_kinds_checked_after_resolution():
    phases = [
        Phase(sparsity=0.5, until="5 epochs"),
        Phase(sparsity="2:4", until="300 steps"),
    ]
    with pytest.raises(
        ValueError,
        match=r"phases\[1\].until='300 steps' resolves to optimizer step 300, but the phase starts at step 500, so it would be empty",
    ):
        resolve_phases(phases, total_steps=1000, steps_per_epoch=100)


def test_fraction_needs_known_run_length():
    with pytest.raises(
        ValueError,
        match=r"phases\[0\].until=0.7 is a fraction of the run, but the trainer does not know the run length: set Trainer\(max_steps=...\)",
    ):
        resolve_phases([Phase(sparsity=0.5, until=0.7), Phase()], total_steps=math.inf)


def test_epochs_need_known_epoch_length():
    with pytest.raises(
        ValueError, match=r"counts epochs, but the train dataloader has no length"
    ):
        resolve_phases(
            [Phase(sparsity=0.5, until="2 epochs"), Phase()], total_steps=100
        )


def test_phase_that_rounds_to_nothing_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"resolves to optimizer step 0, but the phase starts at step 0, so it would be empty",
    ):
        resolve_phases([Phase(sparsity=0.5, until=0.001), Phase()], total_steps=100)


def test_empty_open_ended_last_phase_is_explained():
    with pytest.raises(
        ValueError,
        match=r"phases\[1\] \(the last, open-ended phase\) would be empty: the run has 100 optimizer steps and the phases before it end at step 100",
    ):
        resolve_phases([Phase(sparsity=0.5, until=1.0), Phase()], total_steps=100)
