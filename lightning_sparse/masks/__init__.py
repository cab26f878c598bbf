"""Mask math in torch ops, on any device: targets, top-k choices, random subsets, N:M groups,
transposable 2:4 tiles, refills after a drop, and applying a mask to weights and state.

The modules below import each other directly; this package re-exports what the layers above
use most.
"""

from lightning_sparse.masks.choose import (
    from_zeros_mask,
    prune_smallest_,
    row_target_mask,
    smallest_kept,
    target_mask,
)
from lightning_sparse.masks.patterns import (
    NM,
    Sparsity,
    describe,
    is_nm,
    nm_groups,
    num_kept,
    sparsity_fraction,
)
from lightning_sparse.masks.random import name_seed, random_score, random_subset
from lightning_sparse.masks.top_k import mark_top_k

__all__ = [
    "NM",
    "Sparsity",
    "describe",
    "from_zeros_mask",
    "is_nm",
    "mark_top_k",
    "name_seed",
    "nm_groups",
    "num_kept",
    "prune_smallest_",
    "random_score",
    "random_subset",
    "row_target_mask",
    "smallest_kept",
    "sparsity_fraction",
    "target_mask",
]
