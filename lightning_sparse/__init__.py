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
from lightning_sparse.compressed import (
    load_compressed,
    save_compressed,
    to_semi_structured,
)
from lightning_sparse.export import export_state_dict, fold_masks
from lightning_sparse.masks import NM
from lightning_sparse.schedule import Phase
from lightning_sparse.selection import select_parameters
from lightning_sparse.sparsifier import Sparsifier

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
