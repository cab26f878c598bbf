"""Recipes that start from a trained model's weights (``init_from``) name the command that
writes them (``init_from_command``, also their first Launch line): a missing file's error gives
that command, and on the CPU the command, run as written (shrunk), writes exactly that file,
from which the recipe then runs as listed."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
import yaml
from test_prune_finetune import TINY

from lightning_sparse.cli.main import SparseCLI

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STARTING = sorted(
    p for p in RECIPES.rglob("*.yaml") if "init_from" in yaml.safe_load(p.read_text())
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _in_an_empty_directory(monkeypatch, tmp_path):
    """The recipes' relative paths (``runs/...``, ``--config recipes/...``) as from a checkout."""
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    (tmp_path / "recipes").symlink_to(RECIPES)
    monkeypatch.chdir(tmp_path)


def start(recipe: Path) -> tuple[str, list[str]]:
    """A recipe's ``init_from`` and its ``init_from_command`` split into arguments."""
    config = yaml.safe_load(recipe.read_text())
    return config["init_from"], shlex.split(config["init_from_command"])


def test_the_recipes_that_start_from_weights_are_found():
    names = {p.name for p in STARTING}
    assert {"prune_finetune_cpu.yaml", "learn_masks_cpu.yaml"} <= names and len(
        names
    ) >= 4


@pytest.mark.parametrize("recipe", STARTING, ids=lambda p: p.name)
def test_a_recipe_names_the_command_that_writes_its_start(recipe):
    path, command = start(recipe)
    assert command[:3] == ["lightning-sparse", "fit", "--config"]
    assert f"--export_to={path}" in command  # it writes the very file
    # the Launch lines run that command first, then this recipe
    launch = recipe.read_text().split("# Launch:\n")[1].split("\n# Expect")[0]
    first, second = (line.removeprefix("#").strip() for line in launch.splitlines()[:2])
    assert shlex.split(first) == command
    assert f"--config recipes/{recipe.parent.name}/{recipe.name}" in second
    # and it trains the model class (and size) this recipe loads
    own = yaml.safe_load(recipe.read_text())["model"]
    base = yaml.safe_load((RECIPES.parent / command[3]).read_text())["model"]
    assert own["class_path"] == base["class_path"]
    assert own["init_args"]["preset"] == base["init_args"]["preset"]


@pytest.mark.parametrize("recipe", STARTING, ids=lambda p: p.name)
def test_a_missing_start_says_which_command_writes_it(recipe):
    path, command = start(recipe)
    with pytest.raises(SystemExit) as exit_info:
        SparseCLI(args=["fit", f"--config=recipes/{recipe.parent.name}/{recipe.name}"])
    assert str(exit_info.value) == (
        f"lightning-sparse fit: init_from={path!r}: no such file yet. The config names the "
        f"command that writes it (init_from_command); run it first, from this directory: "
        f"{' '.join(command)}"
    )


def test_the_cpu_recipes_run_as_listed_after_their_first_command(caplog, capsys):
    cpu = [p for p in STARTING if p.name.endswith("_cpu.yaml")]
    (path, command), *others = [start(p) for p in cpu]
    assert all(other == (path, command) for other in others)  # one step 1 for both
    SparseCLI(args=[*command[1:], "--trainer.max_steps=4", *TINY])
    assert Path(path).is_file()
    prune = RECIPES / "gpt" / "prune_finetune_cpu.yaml"
    SparseCLI(args=["fit", f"--config={prune}", "--trainer.max_steps=2", *TINY])
    assert (
        f"Loaded the model's weights from {path} (init_from" in capsys.readouterr().out
    )
    assert Path("runs/gpt_prune_finetune_cpu/model.safetensors").is_file()
