"""The examples in the demo docstrings run and give the printed results."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "lightning_sparse.demo._checks",
    "lightning_sparse.demo.compiling",
    "lightning_sparse.demo.optim",
    "lightning_sparse.demo.multicrop",
    "lightning_sparse.demo.images",
    "lightning_sparse.demo.text",
    "lightning_sparse.demo.probes",
    "lightning_sparse.demo.vit",
    "lightning_sparse.demo.dino",
    "lightning_sparse.demo.gpt",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(
        importlib.import_module(name), optionflags=doctest.ELLIPSIS
    )
    assert result.attempted > 0 and result.failed == 0


def test_public_api_is_documented():
    from lightning_sparse import demo

    for name in demo.__all__:
        obj = getattr(demo, name)
        if isinstance(obj, type):
            assert obj.__doc__ and "Example" in obj.__doc__, (
                f"{name} needs a docstring with an example"
            )
