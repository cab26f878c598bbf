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
        self.kept, self.masks = {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        groups = [cb for cb in trainer.callbacks if isinstance(cb, SparsityCallback)]
        self.masks[trainer.global_step] = {
            cb.name: {n: m.clone() for n, m in (cb.sparsifier.masks or {}).items()}
            for cb in groups
        }
        self.kept[trainer.global_step] = {
            name: {n: int(m.sum()) for n, m in masks.items()}
            for name, masks in self.masks[trainer.global_step].items()
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


# -- the layouts and forms the Model Zoo has shipped ---------------------------------------------

RIGL_BLOCK = {
    "sparsity": 0.75,
    "init_method": "random",
    "algorithm": "rigl",
    "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 9},
    "update": {"freq": 3, "stop": 9},
    "param_filter": ["*fc1.weight", "*fc2.weight"],
}


def params_file(sparsity):
    """A params file in the layout of release 2.4 and later: everything under ``trainer``, with
    many keys besides the sparsity block (all of them ignored by the translation)."""
    return {
        "trainer": {
            "init": {
                "backend": {"backend_type": "CSX"},
                "model": {"name": "gpt3", "hidden_size": 768, "num_heads": 12},
                "optimizer": {"AdamW": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
                "schedulers": [{"LinearLR": {"total_iters": 716}}],
                "precision": {"enabled": True, "fp16_type": "cbfloat16"},
                "sparsity": sparsity,
                "loop": {"max_steps": 4778, "eval_frequency": 956},
                "checkpoint": {"steps": 956},
                "logging": {"log_steps": 50},
                "callbacks": [
                    {"ScopedTrainFlags": {"csx.performance.micro_batch_size": 8}}
                ],
            },
            "fit": {"train_dataloader": {"data_processor": "GptHDF5MapDataProcessor"}},
        }
    }


def test_params_file_of_release_2_4_reads_trainer_init_sparsity(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params_file(RIGL_BLOCK)))
    expected = translate(RIGL_BLOCK)
    assert translate(path) == translate(str(path)) == expected
    assert expected[0]["params"] == ["*fc1.weight", "*fc2.weight"]
    # one trainer in a list of trainers, or one entry of that list passed on its own
    listed = {"trainer": [params_file(RIGL_BLOCK)]}
    assert translate(listed) == translate(listed["trainer"][0]) == expected
    callbacks = SparsityCallback.from_config(path, verbose=False)
    _, record = train(callbacks, steps=10)
    assert record.kept[9]["sparsity"] == {"net.fc1.weight": 32, "net.fc2.weight": 64}
    assert callbacks[0].sparsifier.last_update_step == 6


def test_params_file_errors_say_where_the_block_lives():
    two = {"trainer": [params_file(0.5), params_file(0.7)]}
    with pytest.raises(
        ValueError, match=r"lists 2 trainers.*from_config\(params\['trainer'\]\[0\]\)"
    ):
        translate(two)
    assert translate(two["trainer"][1])[0]["phases"] == [
        {"sparsity": 0.7, "init": "random"}
    ]
    with pytest.raises(
        ValueError, match=r"no sparsity block \(trainer.init.sparsity\)"
    ):
        translate(params_file(None))
    with pytest.raises(
        TypeError, match=r"'trainer' has no 'init' mapping.*trainer.init.sparsity"
    ):
        translate({"trainer": {"fit": {}}})
    both = {**params_file(0.5), "sparsity": 0.5}
    with pytest.raises(
        ValueError, match=r"both a top-level 'sparsity' and a 'trainer'"
    ):
        translate(both)


V20_RIGL = {
    "sparsity": 0.75,
    "init_method": "random",
    "type": "rigl",
    "drop_fraction": {"type": "cosine", "init": 0.3, "half_period": 9},
    "schedule": {"freq": 3, "stop": 9},  # the update schedule in this form
    "param_name_patterns": [r".*fc1\.weight", r".*fc2\.weight"],
}


def test_release_2_0_form_reads_schedule_as_the_update_schedule():
    (old,) = translate({"sparsity": V20_RIGL})
    (new,) = translate(RIGL_BLOCK)
    assert old["phases"] == new["phases"]
    assert old["params"] == [r"re:.*fc1\.weight", r"re:.*fc2\.weight"]
    _, record = train(SparsityCallback.from_config(V20_RIGL, verbose=False), steps=10)
    assert record.kept[9]["sparsity"] == {"net.fc1.weight": 32, "net.fc2.weight": 64}
    static = {"type": "static", "sparsity": 0.5, "param_name_patterns": "fc2"}
    assert translate(static)[0]["phases"] == [{"sparsity": 0.5, "init": "random"}]


@pytest.mark.parametrize(
    "schedule",
    [{"freq": 4, "stop": 9}, 4, [0, 4, 8], {"steps": [8, 0, 4]}],
    ids=["grid", "frequency", "steps", "steps-mapping"],
)
def test_update_schedules_of_every_form_give_one_grid(schedule):
    base = {"type": "set", "sparsity": 0.5, "schedule": schedule}
    (phase,) = translate(base)[0]["phases"]
    stop = 1.0 if schedule == 4 else 8
    assert (phase["update_every"], phase.get("update_start", 0)) == (4, 0)
    assert phase["update_stop"] == stop
    current = {"algorithm": "set", "sparsity": 0.5, "update": schedule}
    assert translate(current)[0]["phases"] == [phase]


def test_release_2_0_sparsity_schedule_and_per_pattern_settings():
    config = {
        "type": "gmp",
        "param_name_patterns": {
            r"fc1\.weight": {"sparsity_schedule": [[0, 0.5], [4, 0.25], [8, 0.75]]},
            r"fc2\.weight": {
                "sparsity": [0.5, 0.75],
                "schedule": {"freq": 4, "stop": 9},
            },
        },
    }
    first, second = translate(config)
    assert first["phases"] == [
        {
            "sparsity": 0.75,
            "algorithm": "gmp",
            "init": "random",
            "ramp": [0.5, 0.25, 0.75],
            "update_every": 4,
            "update_stop": 8,
        }
    ]
    assert second["phases"][0]["ramp"] == [0.5, 0.75]
    assert second["exclude"] == [r"re:fc1\.weight"]
    _, record = train(SparsityCallback.from_config(config, verbose=False), steps=10)
    fc1 = [record.kept[s]["sparsity_0"]["net.fc1.weight"] for s in (0, 4, 8, 9)]
    fc2 = [record.kept[s]["sparsity_1"]["net.fc2.weight"] for s in (0, 4, 8, 9)]
    assert fc1 == [num_kept(128, v) for v in (0.5, 0.25, 0.75, 0.75)]
    assert fc2 == [num_kept(256, v) for v in (0.5, 0.75, 0.5, 0.5)]


def cstorch_targets(schedule, freq, stop, steps):
    """The sparsity cstorch's GMP applies at each step: the schedule's value at the mask
    choices (step 0 and each update ``j * freq < stop``, the ``j``-th one cycling to
    ``values[j % len]``), clamped to [0, 1], held between choices."""
    value = parse_step_value(schedule)
    held, targets = None, {}
    for step in range(steps):
        if step % freq == 0 and step < stop:
            held = min(1.0, max(0.0, value(step, step // freq)))
        targets[step] = held
    return targets


@pytest.mark.parametrize(
    "schedule",
    [
        [0.3, 0.4, 0.5],  # the Group example of the Cerebras docs
        {"type": "cycling", "values": [0.5, 0.25]},
        {"type": "linear", "init": 0.9, "slope": -0.05},
        {"type": "cosine", "init": 0.6, "half_period": 4, "minimum": 0.2},
        {"type": "linear", "init": 0.1, "slope": 0.05},
    ],
    ids=["list", "cycling", "negative-slope", "cosine", "increasing"],
)
def test_gmp_follows_every_schedule_as_cstorch_evaluates_it(schedule):
    config = {
        "algorithm": "gmp",
        "sparsity": schedule,
        "update": {"freq": 2, "stop": 11},
    }
    _, record = train(SparsityCallback.from_config(config, verbose=False), steps=14)
    targets = cstorch_targets(schedule, 2, 11, 14)
    for step, kept in record.kept.items():
        expected = {"net.fc1.weight": 128, "net.fc2.weight": 256}
        assert kept["sparsity"] == {
            name: num_kept(numel, targets[step]) for name, numel in expected.items()
        }, step
    distinct = {tuple(k["sparsity"].values()) for k in record.kept.values()}
    assert len(distinct) == len({num_kept(256, t) for t in targets.values()}) > 1


def test_keys_of_one_form_in_another_name_the_key_to_use():
    with pytest.raises(
        ValueError, match=r"'update' is a key of the current form.*calls it 'schedule'"
    ):
        translate({**V20_RIGL, "update": {"freq": 3}})
    with pytest.raises(
        ValueError, match=r"'algorithm' is a key of the current form.*calls it 'type'"
    ):
        translate({"algorithm": "rigl", "sparsity": 0.9, "schedule": {"freq": 3}})
    with pytest.raises(
        ValueError, match=r"'param_filter' is a key.*calls it 'param_name_patterns'"
    ):
        translate({"type": "rigl", "sparsity": 0.9, "schedule": 3, "param_filter": "*"})
    with pytest.raises(ValueError, match=r"the 2.0-2.1 form needs 'type'"):
        translate(
            {"sparsity": 0.9, "schedule": {"freq": 3}, "param_name_patterns": "fc"}
        )
    with pytest.raises(
        ValueError, match=r"'sparsity_schedule' gives both.*remove 'sparsity'"
    ):
        translate(
            {"type": "gmp", "sparsity": 0.5, "sparsity_schedule": [[0, 0.5], [4, 0.6]]}
        )
    with pytest.raises(ValueError, match=r"schedule=\[3\]: a single update step"):
        translate({"type": "gmp", "sparsity": [0.5], "schedule": [3]})
    with pytest.raises(ValueError, match=r"param_name_patterns: '\(' is not a regex"):
        translate({"type": "static", "sparsity": 0.5, "param_name_patterns": "("})


def test_schedule_alone_is_the_current_forms_alias_of_sparsity():
    ramp = {"type": "linear", "init": 0.1, "slope": 0.05}
    alias = {"algorithm": "gmp", "schedule": ramp, "update": {"freq": 2, "stop": 9}}
    named = {"algorithm": "gmp", "sparsity": ramp, "update": {"freq": 2, "stop": 9}}
    assert translate(alias) == translate(named)
    with pytest.raises(
        ValueError, match=r"sparsity.schedule.slope=nan is not a finite number"
    ):
        translate({**alias, "schedule": {**ramp, "slope": float("nan")}})


def test_gmp_starting_late_chooses_its_first_mask_by_magnitude_as_cstorch():
    """cstorch's GMP with ``update.start > 0`` keeps the weights dense (its schedule is 0 at
    step 0) and chooses its first mask at ``start`` by its update rule, the top-k of ``|w|``,
    whatever ``init_method`` says."""
    config = {
        "algorithm": "gmp",
        "init_method": "random",
        "sparsity": {"type": "linear", "init": 0.0, "slope": 0.1},
        "update": {"freq": 2, "start": 3, "stop": 8},
    }
    (spec,) = translate(config)
    assert spec["phases"][1]["init"] == "topk"

    class WeightsAtStart(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:  # before the callback chooses the mask
                self.weights = {
                    n: p.detach().clone() for n, p in pl_module.named_parameters()
                }

    seen = WeightsAtStart()
    callbacks = SparsityCallback.from_config(config, verbose=False)
    _, record = train([seen, *callbacks], steps=6)
    assert record.kept[2]["sparsity"] == {}, "dense until update.start"
    masks = record.masks[3]["sparsity"]
    for name, mask in masks.items():
        weight = seen.weights[name].abs().flatten()
        kept = num_kept(weight.numel(), 0.3)  # the schedule at step 3
        top = torch.zeros_like(weight, dtype=torch.bool)
        top[weight.topk(kept).indices] = True
        assert torch.equal(mask.flatten(), top), name
