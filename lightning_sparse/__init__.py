"""Sparse training on a schedule for PyTorch Lightning.

>>> from lightning_sparse import SparsityCallback
>>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
"""

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
from lightning_sparse.formats.export import export_state_dict, fold_masks
from lightning_sparse.formats.inference import to_semi_structured
from lightning_sparse.masks import NM

__all__ = [
    "NM",
    "DropAndGrow",
    "MaskContext",
    "Phase",
    "Sparsifier",
    "SparsityAlgorithm",
    "SparsityCallback",
    "export_state_dict",
    "fold_masks",
    "load_compressed",
    "register_algorithm",
    "save_compressed",
    "select_parameters",
    "to_semi_structured",
]
