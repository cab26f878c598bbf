"""Every option is validated when the callback is built: generated phase lists and option
values, valid and invalid, either build a SparsityCallback or raise a ValueError/TypeError whose
message names the offending key; nothing else escapes (a property-based test)."""

import math

import pytest
from helpers import FEW_UPDATES, TinyModule, fast_trainer, random_loader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.cli import LightningCLI

from lightning_sparse import SparsityCallback

pytestmark = FEW_UPDATES

SETTINGS = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(
        ["0.5", "1", "-3", "2:4", "5:4", "0:4", "1e3", " 7 ", "nan", "inf"]
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=4,
)
FRACTION = st.floats(0.05, 0.95)
BOUNDARY = st.sampled_from([0.3, "40%", "2 steps", 3, "1ep", "1 epochs"])
SCHEDULE = st.sampled_from(
    [
        {"type": "linear", "init": 0.1, "slope": 0.01},
        {"type": "cosine", "init": 0.3, "half_period": 10},
        [0.2, 0.5],
        {"type": "cycling", "values": [0.4, 0.1]},
    ]
)
BAD = {  # values of each option that are wrong in type or range
    "sparsity": [
        1.0,
        -0.1,
        float("nan"),
        float("inf"),
        "5:4",
        "2:0",
        "a:b",
        124,
        True,
        [0.5],
    ],
    "until": [
        0,
        -3,
        1.5,
        float("nan"),
        float("inf"),
        "0%",
        "150%",
        "2.5 steps",
        "soon",
        True,
    ],
    "algorithm": ["prune_it", 3, ["gmp"]],
    "init": ["zeros", 1, ["topk"]],
    "seed": ["abc", 1.5, True, [1], "1.0", float("nan")],
    "update_every": [0, -1, "x", 2.5, True, float("inf")],
    "update_start": [0, -1, float("nan"), "never", [1]],
    "update_stop": [0, float("inf"), "3 weeks", {"a": 1}],
    "drop_fraction": [
        1.5,
        -0.1,
        float("nan"),
        "0.3",
        {"type": "sine"},
        {"init": 0.3},
        [],
    ],
    "drop_fraction_decay": ["sine", 3, ["cosine"]],
    "ramp": [
        "square",
        3,
        {"type": "linear", "init": float("nan"), "slope": 0.1},
        [float("inf")],
    ],
    "initial_sparsity": [0.99, "2:4", -1, float("nan"), "x"],
    "distribution": ["erk_typo", 3, ["erk"]],
    "options": [3, "x", [1]],
}
# the options each built-in algorithm reads (beyond sparsity, until, algorithm)
OPTIONS = {
    "static": {"init": st.sampled_from(["topk", "random"]), "seed": st.integers(0, 99)},
    "magnitude": {"update_every": st.integers(1, 5), "update_stop": BOUNDARY},
    "gmp": {
        "update_every": st.integers(1, 3),
        "ramp": st.sampled_from(["cubic", "linear", "cosine"]) | SCHEDULE,
        "distribution": st.sampled_from(["uniform", "erk", "global"]),
    },
    "set": {
        "drop_fraction": FRACTION | SCHEDULE,
        "seed": st.integers(0, 99) | st.sampled_from(["0", "12"]),
        "update_every": st.integers(1, 3),
    },
    "rigl": {
        "drop_fraction": FRACTION,
        "drop_fraction_decay": st.sampled_from(["cosine", "linear", "constant"]),
    },
}


@st.composite
def valid_phase(draw, until):
    algorithm = draw(st.sampled_from(sorted(OPTIONS)))
    phase = {"sparsity": draw(FRACTION), "algorithm": algorithm}
    for key, values in OPTIONS[algorithm].items():
        if draw(st.booleans()):
            phase[key] = draw(values)
    if until is not None:
        phase["until"] = until
    return phase


@st.composite
def valid_phases(draw):
    n = draw(st.integers(1, 3))
    untils = ["3 steps", "6 steps"][: n - 1]
    phases = [draw(valid_phase(u)) for u in untils]
    return [*phases, draw(valid_phase(None))]


def named(err, *keys):
    text = str(err)
    return any(key in text for key in keys)


@SETTINGS
@given(phases=valid_phases(), data=st.data())
def test_one_wrong_option_is_refused_naming_it(phases, data):
    SparsityCallback(phases=phases, verbose=False)  # the unchanged phases build
    index = data.draw(st.integers(0, len(phases) - 1))
    key = data.draw(st.sampled_from(sorted(BAD)))
    value = data.draw(st.sampled_from(BAD[key]))
    phases[index] = {**phases[index], key: value}
    with pytest.raises((ValueError, TypeError)) as err:
        SparsityCallback(phases=phases, verbose=False)
    assert f"phases[{index}]" in str(err.value) or key == "until", err.value
    assert named(err.value, key), err.value


@SETTINGS
@given(phases=valid_phases(), data=st.data())
def test_any_value_of_an_option_builds_or_is_named(phases, data):
    index = data.draw(st.integers(0, len(phases) - 1))
    key = data.draw(st.sampled_from([*sorted(BAD), "untill", "sparsty"]))
    phases[index] = {**phases[index], key: data.draw(ANY)}
    try:
        cb = SparsityCallback(phases=phases, verbose=False)
    except (ValueError, TypeError) as err:
        assert named(err, key, "sparsity"), err
        return
    for phase in cb.phases:  # what built is clean: numbers are numbers
        assert phase.seed is None or type(phase.seed) is int
        assert phase.update_every is None or type(phase.update_every) is int


CALLBACK_ARGS = {
    "sparsity": ANY,
    "phases": ANY,
    "params": ANY | st.sampled_from(["re:(", "", ["*.weight", 3]]),
    "exclude": ANY,
    "backend": ANY | st.sampled_from(["auto", "masked"]),
    "name": ANY,
    "log_every_n_steps": ANY,
    "verbose": ANY,
    "verify_speed": ANY,
    "allow_skipped_layers": ANY,
    "restore_rng": ANY,
}


@SETTINGS
@given(data=st.data())
def test_callback_arguments_build_or_are_named(data):
    key = data.draw(st.sampled_from(sorted(CALLBACK_ARGS)))
    kwargs = {"sparsity": 0.5, key: data.draw(CALLBACK_ARGS[key])}
    if key == "phases":
        kwargs.pop("sparsity")
    try:
        SparsityCallback(**kwargs)
    except (ValueError, TypeError) as err:
        assert named(err, key, "phases"), err


@settings(max_examples=6, deadline=None, database=None)
@given(phases=valid_phases())
def test_a_sample_of_valid_phase_lists_trains(phases):
    cb = SparsityCallback(phases=phases, verbose=False)
    trainer = fast_trainer(max_steps=8, callbacks=[cb])
    try:
        trainer.fit(TinyModule(), random_loader(n=32))
    except ValueError as err:  # a window the run length empties: named at fit start
        assert named(err, "update_stop", "until"), err
        return
    assert trainer.global_step == 8
    assert math.isfinite(cb.sparsifier.actual_sparsity())


CLI_YAML = """
trainer:
  callbacks:
    - class_path: lightning_sparse.SparsityCallback
      init_args:
        phases: [{{sparsity: {sparsity}, algorithm: set, seed: '7', update_every: '2'}}]
"""


def test_yaml_strings_of_digits_are_integers_and_nan_is_refused(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CLI_YAML.format(sparsity=0.5))
    cli = LightningCLI(TinyModule, run=False, args=["--config", str(config)])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
    assert (cb.phases[0].seed, cb.phases[0].update_every) == (7, 2)
    config.write_text(CLI_YAML.format(sparsity=".nan"))
    with pytest.raises(ValueError, match=r"sparsity=nan is not a finite number"):
        LightningCLI(TinyModule, run=False, args=["--config", str(config)])


SPEED_YAML = """
trainer:
  callbacks:
    - class_path: lightning_sparse.SparsityCallback
      init_args: {{sparsity: '2:4', verify_speed: {value}}}
"""


def test_verify_speed_in_a_config_takes_its_values_and_names_them_otherwise(tmp_path):
    config = tmp_path / "config.yaml"
    for value, parsed in (
        ("true", True),
        ("cuda_graphs", "cuda_graphs"),
        ("eager", "eager"),
    ):
        config.write_text(SPEED_YAML.format(value=value))
        cli = LightningCLI(TinyModule, run=False, args=["--config", str(config)])
        (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
        assert cb.verify_speed == parsed
    config.write_text(SPEED_YAML.format(value="graphs"))
    with pytest.raises(
        (TypeError, ValueError), match=r"verify_speed='graphs'; use True"
    ):
        LightningCLI(TinyModule, run=False, args=["--config", str(config)])


def test_cerebras_configs_are_validated_when_translated():
    (cb,) = SparsityCallback.from_config(
        {"type": "sideband", "sparsity": 0.5, "seed": "1"}, verbose=False
    )
    assert cb.phases[0].seed == 1
    with pytest.raises(
        ValueError, match=r"sparsity.sparsity=nan is not a finite number"
    ):
        SparsityCallback.from_config({"sparsity": {"sparsity": float("nan")}})
    with pytest.raises(TypeError, match=r"sparsity.seed='one' has type str"):
        SparsityCallback.from_config(
            {"algorithm": "static", "sparsity": 0.5, "seed": "one"}
        )


@SETTINGS
@given(data=st.data())
def test_phase_keys_beside_sparsity_build_or_are_named(data):
    """``SparsityCallback(sparsity=..., algorithm=..., update_every=...)``: the keys of the one
    phase, wrong values named as in a phase list."""
    algorithm = data.draw(st.sampled_from(sorted(OPTIONS)))
    kwargs = {key: data.draw(values) for key, values in OPTIONS[algorithm].items()}
    cb = SparsityCallback(sparsity=0.5, algorithm=algorithm, **kwargs)
    assert len(cb.phases) == 1 and cb.phases[0].algorithm == algorithm
    assert set(cb.phases[0].explicit_options()) == set(kwargs)
    key = data.draw(st.sampled_from(sorted(set(BAD) - {"sparsity"})))
    with pytest.raises((ValueError, TypeError)) as err:
        SparsityCallback(sparsity=0.5, **{key: data.draw(st.sampled_from(BAD[key]))})
    assert named(err.value, key), err.value


def test_phase_keys_go_inside_the_phases_of_a_phase_list_and_unknown_ones_are_named():
    with pytest.raises(
        ValueError, match=r"algorithm='gmp' is a key of one phase: with phases="
    ):
        SparsityCallback(phases=[{"sparsity": 0.9}], algorithm="gmp")
    with pytest.raises(
        TypeError, match=r"unknown argument\(s\) \['update_evry'\].*update_every"
    ):
        SparsityCallback(sparsity=0.9, algorithm="gmp", update_evry=10)


def test_phase_keys_beside_sparsity_in_a_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_sparse.SparsityCallback\n"
        "      init_args: {sparsity: 0.9, algorithm: gmp, update_every: '10'}\n"
    )
    cli = LightningCLI(TinyModule, run=False, args=["--config", str(config)])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
    assert (cb.phases[0].algorithm, cb.phases[0].update_every) == ("gmp", 10)


def test_a_percentage_from_python_is_not_read_as_yaml_base_60():
    with pytest.raises(
        ValueError, match=r"outside \[0, 1\).*\(for 90% zeros, write 0.9\)$"
    ) as err:
        SparsityCallback(sparsity=90)
    assert "YAML" not in str(err.value)
    # 124 is what YAML 1.1 makes of an unquoted 2:4: that hint stays
    with pytest.raises(
        ValueError, match=r"how YAML 1.1 reads an unquoted 2:4.*quote it"
    ):
        SparsityCallback(sparsity=124)
