"""Sparse training on a schedule for PyTorch Lightning, Fabric and your own loop.

>>> from lightning_sparse import SparsityCallback
>>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])

:class:`SparsityCallback` serves ``Trainer``; :class:`SparseTraining` the same engine in a loop
you write (Fabric or plain PyTorch).

The public names load on first use, so that ``import lightning_sparse`` (and the command
line's ``--help``) imports neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOMES = {  # public name -> the module that defines it
    "NM": "lightning_sparse.masks",
    "DropAndGrow": "lightning_sparse.algorithms",
    "MaskContext": "lightning_sparse.algorithms",
    "Phase": "lightning_sparse.core.schedule",
    "Sparsifier": "lightning_sparse.engine.sparsifier",
    "SparsityAlgorithm": "lightning_sparse.algorithms",
    "SparseTraining": "lightning_sparse.loop",
    "SparsityCallback": "lightning_sparse.callback",
    "export_state_dict": "lightning_sparse.formats.export",
    "fold_masks": "lightning_sparse.formats.fold",
    "load_compressed": "lightning_sparse.formats.compressed",
    "register_algorithm": "lightning_sparse.algorithms",
    "save_compressed": "lightning_sparse.formats.compressed",
    "select_parameters": "lightning_sparse.core.selection",
    "to_semi_structured": "lightning_sparse.formats.inference",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is used."""
    if name not in _HOMES:
        raise AttributeError(f"module 'lightning_sparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if (
    TYPE_CHECKING
):  # the names as type checkers and the API docs see them (ruff: F401 off)
    from lightning_sparse.algorithms import (
        DropAndGrow,
        MaskContext,
        SparsityAlgorithm,
        register_algorithm,
    )
    from lightning_sparse.callback import SparsityCallback
    from lightning_sparse.core.schedule import Phase
    from lightning_sparse.core.selection import select_parameters
    from lightning_sparse.engine.sparsifier import Sparsifier
    from lightning_sparse.formats.compressed import load_compressed, save_compressed
    from lightning_sparse.formats.export import export_state_dict
    from lightning_sparse.formats.fold import fold_masks
    from lightning_sparse.formats.inference import to_semi_structured
    from lightning_sparse.loop import SparseTraining
    from lightning_sparse.masks import NM
