"""A mistake on the command line or in a config ends ``lightning-sparse`` with one paragraph: the
key, the value given, the closest valid key or value, and a fix that works (each test applies
the fix and runs the command again)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_sparse.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BASE = """
seed_everything: 0
trainer:
  max_steps: 4
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
    - class_path: lightning_sparse.SparsityCallback
      init_args:
        {key}: ["layer.weight"]
        phases:
          - {{sparsity: 0.5, {until}: 0.5}}
          - {{sparsity: 0.0}}
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
data:
  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule
"""


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    monkeypatch.chdir(tmp_path)


def config(tmp_path: Path, key: str = "params", until: str = "until") -> str:
    path = tmp_path / f"{key}_{until}.yaml"
    path.write_text(BASE.format(key=key, until=until))
    return f"--config={path}"


def error(args: list[str]) -> str:
    """The message ``lightning-sparse ARGS`` ends with, checked to be one paragraph."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    message = str(exit_info.value.code)
    assert message.startswith("lightning-sparse"), message
    assert "\n" not in message, message
    return message


def plans(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``lightning-sparse plan ARGS`` runs to its end."""
    main(["plan", *args, "--plot=false"])
    assert "Theoretical forward FLOP savings" in capsys.readouterr().out


def test_a_typo_inside_the_callbacks_init_args_names_the_item_the_key_and_the_fix(
    tmp_path, capsys
):
    message = error(["plan", config(tmp_path, key="parms")])
    assert message == (
        "lightning-sparse: trainer.callbacks[1]: lightning_sparse.SparsityCallback takes no "
        "argument 'parms': did you mean 'params'? Rename parms: to params: in its init_args "
        "(lightning-sparse plan --trainer.callbacks.help lightning_sparse.SparsityCallback "
        "lists its arguments)"
    )
    plans([config(tmp_path, key="params")], capsys)
    # the command it names lists the callback's arguments
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--trainer.callbacks.help", "lightning_sparse.SparsityCallback"])
    assert exit_info.value.code == 0
    assert "--trainer.callbacks.params PARAMS" in capsys.readouterr().out


def test_a_typo_in_a_phase_names_the_key_it_meant(tmp_path):
    message = error(["plan", config(tmp_path, until="untill")])
    assert (
        "phases[0]: unknown key(s) ['untill'] (did you mean 'until' for 'untill'?)"
        in message
    )


def test_a_trainer_value_of_the_wrong_type_names_the_types_and_a_value_that_works(
    tmp_path, capsys
):
    message = error(["plan", config(tmp_path), "--trainer.max_epochs=abc"])
    assert message == (
        "lightning-sparse: --trainer.max_epochs=abc: trainer.max_epochs takes an integer or "
        "null, and 'abc' is neither: give it an integer, e.g. --trainer.max_epochs=10"
    )
    plans([config(tmp_path), "--trainer.max_epochs=10"], capsys)


def test_a_value_outside_a_choice_names_the_closest_choice(tmp_path, capsys):
    message = error(["plan", config(tmp_path), "--trainer.precision=bf16-mixd"])
    assert message.startswith(
        "lightning-sparse: --trainer.precision=bf16-mixd: trainer.precision takes one of "
    )
    assert "'bf16-mixd' is none of them" in message
    assert message.endswith(
        "did you mean bf16-mixed? Write --trainer.precision=bf16-mixed"
    )
    plans([config(tmp_path), "--trainer.precision=bf16-mixed"], capsys)


def test_an_unknown_option_names_the_closest_one_with_the_value_given(tmp_path, capsys):
    message = error(["plan", config(tmp_path), "--trainer.max_stepz=3"])
    assert message == (
        "lightning-sparse: unknown option --trainer.max_stepz (given as "
        "--trainer.max_stepz=3): did you mean --trainer.max_steps? Write "
        "--trainer.max_steps=3 (lightning-sparse plan --help lists the options)"
    )
    plans([config(tmp_path), "--trainer.max_steps=3"], capsys)


def test_a_stray_word_is_named(tmp_path):
    assert error(["plan", config(tmp_path), "stray"]) == (
        "lightning-sparse: unrecognized arguments: stray (lightning-sparse plan --help lists "
        "the options)"
    )


@pytest.mark.parametrize(
    ("typo", "fix"),
    [
        (
            "trainer:\n  max_stepz: 3\n",
            "Rename max_stepz: under trainer: to max_steps:",
        ),
        ("trainr:\n  max_steps: 3\n", "Rename trainr: to trainer:"),
    ],
)
def test_an_unknown_key_in_a_config_names_the_part_to_rename(
    tmp_path, capsys, typo, fix
):
    extra = tmp_path / "extra.yaml"
    extra.write_text(typo)
    message = error(["plan", config(tmp_path), f"--config={extra}"])
    key = typo.replace(":\n  ", ".").split(":")[0]
    assert message.startswith(
        f"lightning-sparse: a config sets {key}, which is not a key"
    )
    assert (
        f"did you mean trainer.max_steps? {fix} (lightning-sparse plan --help"
        in message
    )
    extra.write_text("trainer:\n  max_steps: 3\n")
    plans([config(tmp_path), f"--config={extra}"], capsys)


def test_a_class_that_does_not_exist_names_the_closest_one(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(
        BASE.format(key="params", until="until").replace(
            "SparsityCallback", "SparsityCalback"
        )
    )
    message = error(["plan", f"--config={path}"])
    assert message == (
        "lightning-sparse: trainer.callbacks[1]: there is no class "
        "lightning_sparse.SparsityCalback (lightning_sparse has no 'SparsityCalback'): did you "
        "mean lightning_sparse.SparsityCallback?"
    )


def test_a_callback_argument_of_the_wrong_type_names_it_and_a_value_that_works(
    tmp_path,
):
    path = tmp_path / "typed.yaml"
    path.write_text(
        BASE.format(key="params", until="until").replace('["layer.weight"]', "{a: 1}")
    )
    message = error(["plan", f"--config={path}"])
    assert message.startswith(
        "lightning-sparse: trainer.callbacks[1]: lightning_sparse.SparsityCallback's params: "
        "{'a': 1}: params takes a list, a string or null"
    )


def test_no_config_asks_for_a_recipe_and_an_overlay_alone_for_a_base(tmp_path):
    assert error(["plan"]) == (
        "lightning-sparse: no model or data given: plan runs a recipe, a YAML config naming the "
        "model, the data and the trainer (recipes/README.md lists them): lightning-sparse plan "
        "--config recipes/vit/cpu_demo.yaml"
    )
    overlay = (
        Path(__file__).resolve().parents[1] / "recipes/overlays/sparsity_24_70pct.yaml"
    )
    message = error(["fit", f"--config={overlay}"])
    assert "a sparsity overlay" in message and "give a base config first" in message
