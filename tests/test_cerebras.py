"""Cerebras-format sparsity configs: every form translates, trains, and bad keys are named."""

import lightning as L
import pytest
import torch
import yaml
from helpers import TinyModule, fast_trainer, random_loader

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms.step_values import parse_step_value
from lightning_sparse.formats.cerebras import translate
from lightning_sparse.masks import num_kept


class Record(L.Callback):
    """Per step: each layer's kept fraction and the sparsifier's last update step."""

    def __init__(self):
        self.kept = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.kept[trainer.global_step] = {
            cb.name: {n: int(m.sum()) for n, m in (cb.sparsifier.masks or {}).items()}
            for cb in trainer.callbacks
            if isinstance(cb, SparsityCallback)
        }


def train(callbacks, steps=12):
    record = Record()
    L.seed_everything(0, verbose=False)
    model = TinyModule()
    fast_trainer(max_steps=steps, callbacks=[*callbacks, record]).fit(
        model, random_loader()
    )
    return model, record


def test_legacy_sideband_single_regex():
    config = {
        "type": "sideband",
        "sparsity": 0.75,
        "seed": 3,
        "param_name_patterns": r"fc[12]\.weight",
    }
    (spec,) = translate(config)
    assert spec == {
        "name": "sparsity",
        "params": [r"re:fc[12]\.weight"],
        "exclude": None,
        "phases": [{"sparsity": 0.75, "init": "topk", "seed": 3}],
    }
    callbacks = SparsityCallback.from_config(config, verbose=False)
    model, record = train(callbacks)
    assert record.kept[11]["sparsity"] == {"net.fc1.weight": 32, "net.fc2.weight": 64}
    assert int((model.net.fc1.weight == 0).sum()) >= 96


def test_legacy_list_and_mapping_of_patterns():
    (spec,) = translate(
        {"type": "sideband", "sparsity": 0.5, "param_name_patterns": ["fc1", "fc2"]}
    )
    assert spec["params"] == ["re:fc1", "re:fc2"]
    config = {
        "type": "sideband",
        "sparsity": 0.5,
        "init_method": "random",
        "param_name_patterns": {
            r"fc1\.weight": {"sparsity": 0.25, "init_method": "topk"},
            r".*\.weight": None,  # the rest, with the top-level settings
        },
    }
    specs = translate(config)
    assert [s["name"] for s in specs] == ["sparsity_0", "sparsity_1"]
    assert specs[0]["phases"] == [{"sparsity": 0.25, "init": "topk"}]
    assert specs[1]["phases"] == [{"sparsity": 0.5, "init": "random"}]
    assert specs[1]["exclude"] == [r"re:fc1\.weight"], "first matching group wins"
    callbacks = SparsityCallback.from_config(config, verbose=False)
    _, record = train(callbacks)
    assert record.kept[11] == {
        "sparsity_0": {"net.fc1.weight": 96},
        "sparsity_1": {"net.fc2.weight": 128, "net.head.weight": 32},
    }


def test_newer_static_with_param_filter_globs():
    config = {
        "algorithm": "static",
        "sparsity": 0.5,
        "param_filter": "*.fc2.weight",
        "init_method": "topk",
    }
    (spec,) = translate(config)
    assert spec["params"] == ["*.fc2.weight"]
    assert spec["phases"] == [{"sparsity": 0.5, "init": "topk"}]
    _, record = train(SparsityCallback.from_config(config, verbose=False))
    assert record.kept[0]["sparsity"] == {"net.fc2.weight": 128}
    (spec,) = translate(
        {"type": "sideband", "sparsity": 0.5, "init_method": "from_zeros"}
    )
    assert spec["phases"] == [{"sparsity": 0.5, "init": "from_zeros"}]


def test_newer_gmp_follows_the_sparsity_schedule_at_update_steps():
    config = {
        "sparsity": {
            "algorithm": "gmp",
            "sparsity": {"type": "linear", "init": 0.0, "slope": 0.1},
            "update": {"freq": 2, "stop": 9},
        }
    }
    (spec,) = translate(config)
    assert spec["phases"] == [
        {
            "sparsity": pytest.approx(0.8),
            "algorithm": "gmp",
            "init": "random",
            "ramp": {"type": "linear", "init": 0.0, "slope": 0.1},
            "update_every": 2,
            "update_stop": 8,
        }
    ]
    _, record = train(SparsityCallback.from_config(config, verbose=False))
    fc2 = {s: kept["sparsity"]["net.fc2.weight"] for s, kept in record.kept.items()}
    # Cerebras: sparsity(step) = 0.1 * step at steps 2, 4, 6, 8; stop is exclusive
    expected = {0: 256, 2: 205, 4: 154, 6: 102, 8: 51, 9: 51, 11: 51}
    assert {s: fc2[s] for s in expected} == {
        s: num_kept(256, 0.1 * (s - s % 2) if s <= 8 else 0.8) for s in expected
    }
    assert fc2[3] == fc2[2] and fc2[10] == fc2[8]


@pytest.mark.parametrize("algorithm", ["set", "rigl", "SET", "RigL"])
def test_newer_set_and_rigl_with_drop_fraction_schedule(algorithm):
    config = {
        "algorithm": algorithm,
        "sparsity": 0.75,
        "update": {"freq": 3, "start": 2, "stop": 10},
        "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 9},
        "seed": 7,
    }
    (spec,) = translate(config)
    dense, sparse = spec["phases"]
    assert dense == {"sparsity": 0.0, "until": 2}
    assert sparse == {
        "sparsity": 0.75,
        "algorithm": algorithm.lower(),
        "init": "random",
        "seed": 7,
        "update_every": 3,
        "update_start": 2,
        "update_stop": 8,
        "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 9},
    }
    callbacks = SparsityCallback.from_config(config, verbose=False)
    _, record = train(callbacks)
    assert record.kept[1]["sparsity"] == {}, "dense until update.start"
    assert record.kept[2]["sparsity"] == {"net.fc1.weight": 32, "net.fc2.weight": 64}
    assert callbacks[0].sparsifier.last_update_step == 8
    algo = callbacks[0].sparsifier.algorithm
    schedule = parse_step_value({"type": "cosine", "init": 0.3, "half_period": 9})
    assert algo.drop_fraction_at(5) == pytest.approx(schedule(5))


def test_constant_drop_fraction_and_default_updates():
    (spec,) = translate({"algorithm": "rigl", "sparsity": 0.9, "drop_fraction": 0.2})
    assert spec["phases"] == [
        {
            "sparsity": 0.9,
            "algorithm": "rigl",
            "init": "random",
            "update_every": 1,
            "update_stop": 1.0,
            "drop_fraction": 0.2,
            "drop_fraction_decay": "constant",
        }
    ]


def test_groups_params_file_and_yaml_path(tmp_path):
    params_file = {
        "model": {"name": "tiny"},
        "optimizer": {"optimizer_type": "adamw"},
        "sparsity": [
            {"algorithm": "rigl", "sparsity": 0.5, "param_filter": ["*fc1.weight"]},
            {"sparsity": 0.25, "init_method": "topk"},
        ],
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params_file))
    for source in (params_file, path, str(path)):
        specs = translate(source)
        assert [s["name"] for s in specs] == ["sparsity_0", "sparsity_1"]
        assert specs[1]["exclude"] == ["*fc1.weight"]
    callbacks = SparsityCallback.from_config(path, verbose=False)
    _, record = train(callbacks)
    assert record.kept[11] == {
        "sparsity_0": {"net.fc1.weight": 64},
        "sparsity_1": {"net.fc2.weight": 192},
    }
    assert translate(0.3)[0]["phases"] == [{"sparsity": 0.3, "init": "random"}]


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        (
            {"algorithm": "rigl", "sparsity": 0.9, "drop_fraktion": 0.1},
            ValueError,
            r"unknown key\(s\) \['drop_fraktion'\]",
        ),
        (
            {"type": "sideband", "sparsity": 0.5, "param_filter": "*"},
            ValueError,
            r"sparsity: unknown key\(s\) \['param_filter'\]",
        ),
        (
            {
                "type": "sideband",
                "sparsity": 0.5,
                "param_name_patterns": {"fc": {"sparsty": 0.1}},
            },
            ValueError,
            r"param_name_patterns\['fc'\]: unknown key\(s\) \['sparsty'\]",
        ),
        (
            {"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 10, "every": 2}},
            ValueError,
            r"sparsity.update: unknown key\(s\) \['every'\]",
        ),
        (
            {"algorithm": "rigl", "sparsity": 0.9, "update": {"steps": [1, 5, 7]}},
            ValueError,
            r"update.steps=\[1, 5, 7\]: the update steps are not evenly spaced",
        ),
        (
            {"algorithm": "rigl", "sparsity": 0.9, "balance_in_groups": 4},
            ValueError,
            r"unknown key\(s\) \['balance_in_groups'\]",
        ),
        (
            {"algorithm": "magic", "sparsity": 0.9},
            ValueError,
            r"algorithm='magic' is not supported; use one of \['static', 'gmp', 'set', 'rigl'\]",
        ),
        (
            {"algorithm": "gmp", "sparsity": 0.9, "update": {"freq": 10, "stop": 100}},
            ValueError,
            r"algorithm 'gmp' needs a sparsity schedule",
        ),
        (
            {
                "algorithm": "gmp",
                "sparsity": {"type": "linear", "init": 0.0, "slope": 0.01},
            },
            ValueError,
            r"algorithm 'gmp' needs update.stop",
        ),
        (
            {
                "algorithm": "gmp",
                "sparsity": {"type": "linear", "init": 0.0, "slope": 0.5},
                "update": {"freq": 1, "stop": 10},
            },
            ValueError,
            r"sparsity: the schedule gives sparsity 4.5 at step 9, which prunes every weight",
        ),
        (
            {"algorithm": "static", "sparsity": 0.5, "update": {"freq": 10}},
            ValueError,
            r"'update' does nothing for algorithm 'static'",
        ),
        (
            {
                "algorithm": "set",
                "sparsity": {"type": "linear", "init": 0.1, "slope": 0.0},
            },
            TypeError,
            r"a sparsity schedule .* needs algorithm 'gmp'",
        ),
        (
            {"algorithm": "rigl", "sparsity": 0.9, "init_method": "checkerboard"},
            ValueError,
            r"init_method='checkerboard' is not supported; use one of \['random', 'topk', 'from_zeros'\]",
        ),
        (
            {"algorithm": "rigl", "type": "rigl", "sparsity": 0.9},
            ValueError,
            r"give 'algorithm' or its old name 'type', not both",
        ),
        (
            {
                "algorithm": "rigl",
                "sparsity": 0.9,
                "update": {"freq": 10, "start": 5, "stop": 12},
            },
            ValueError,
            r"update.stop=12 leaves no update after update.start=5",
        ),
        ({"algorithm": "rigl"}, ValueError, r"give a 'sparsity'"),
        (
            [{"algorithm": "rigl", "sparsity": 0.9}, "dense"],
            TypeError,
            r"sparsity\[1\]='dense': a sparsity group is a mapping",
        ),
    ],
)
def test_bad_configs_name_the_key(config, error, message):
    with pytest.raises(error, match=message):
        translate(config)


def test_missing_yaml_file_is_named(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"sparsity config '.*nope.yaml' is not a file"
    ):
        SparsityCallback.from_config(tmp_path / "nope.yaml")


def test_pruned_weights_are_zeros_not_nans():
    model, _ = train(
        SparsityCallback.from_config(
            {"type": "sideband", "sparsity": 0.5}, verbose=False
        ),
        steps=3,
    )
    assert bool(torch.isfinite(model.net.fc1.weight).all())
    assert int((model.net.fc1.weight == 0).sum()) >= 64
