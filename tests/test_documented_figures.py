"""The measured figures of each recipe agree wherever they are stated: the README's table, the
recipes' README (the full record, with the command and the machine) and the recipe's own
``Expect:`` comment. A figure is a decimal (``0.967``, ``1.451 ± 0.009``), a time (``116 s``,
``35-39 s``) or a memory size (``981 MiB``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
FIGURE = re.compile(
    r"(?<![\w.])\d+\.\d+(?![\w.])|(?<![\w.])\d+(?:-\d+)? (?:s|min|MiB|GiB|GB)\b"
)
ALL = sorted(str(p.relative_to(RECIPES)) for p in RECIPES.rglob("*.yaml"))


def figures(text: str) -> set[str]:
    return set(FIGURE.findall(text))


def rows(markdown: str) -> list[list[str]]:
    """The cells of each table row that names a recipe in its first cell."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("| `")
    ]


def recipe_names(cell: str) -> list[str]:
    """The recipes a first cell names (``dinov2/a.yaml``, ``b.yaml``: b in dinov2/ too)."""
    names, folder = [], ""
    for name in re.findall(r"`([\w/.]+\.yaml)`", cell):
        folder = name.rpartition("/")[0] or folder
        names.append(name if "/" in name else f"{folder}/{name}")
    return names


def expect(recipe: str) -> str:
    """A recipe's ``# Expect:`` comment, with its continuation lines."""
    lines = (RECIPES / recipe).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Expect:"))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        block.append(line)
    return " ".join(line.removeprefix("#").strip() for line in block)


RECORD = {  # recipes/README.md: recipe -> (command cell, result cell)
    name: (row[2], row[-1])
    for row in rows((RECIPES / "README.md").read_text())
    for name in recipe_names(row[0])
}
README = [
    (recipe_names(row[0]), row[-1])
    for row in rows((ROOT / "README.md").read_text().split("## Recipes")[1])
]


def test_every_recipe_is_in_both_tables():
    assert sorted(RECORD) == ALL
    assert sorted(n for names, _ in README for n in names) == ALL


@pytest.mark.parametrize(("names", "result"), README, ids=lambda v: str(v)[:40])
def test_the_readme_states_the_figures_of_the_record_and_the_recipe(names, result):
    stated = figures(result)
    assert stated <= set().union(*(figures(RECORD[n][1]) for n in names)), (
        "a README figure the recipes' README does not state"
    )
    assert stated <= set().union(*(figures(expect(n)) for n in names)), (
        "a README figure the recipe's own Expect comment does not state"
    )


@pytest.mark.parametrize("recipe", ALL)
def test_a_recipe_states_the_figures_of_its_record_which_names_command_and_machine(
    recipe,
):
    command, result = RECORD[recipe]
    own = expect(recipe)
    if "not yet measured on a GPU" in result:
        assert "not yet measured on a GPU" in own
        return  # the figures beside it are references (a paper's, a blog's)
    assert figures(own) <= figures(result), (
        "an Expect figure the recipes' README does not state"
    )
    if figures(result):
        assert "lightning-sparse" in command or "python benchmarks/" in result
        machine = r"2 (CPU )?cores|2-core"
        assert re.search(machine, result), "the machine it was measured on"
        assert re.search(machine, own)


def test_the_demo_sentences_state_the_vit_recipes_figures():
    vit = figures(expect("vit/cpu_demo.yaml"))
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = page.read_text().split("\n\n")
        (sentence,) = [p for p in text if "val/acc" in p and not p.startswith("|")]
        assert figures(sentence) and figures(sentence) <= vit, page.name


def test_the_front_pages_say_the_current_gpu_path_is_not_yet_measured_on_a_gpu():
    for page in ("README.md", "docs/index.md", "docs/limitations.md", "docs/hopper.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert re.search(r"not yet (measured|run) on a GPU", text), page
