"""Mask math in torch ops, on any device: targets, top-k choices, random subsets, N:M groups,
transposable 2:4 tiles, refills after a drop, and applying a mask to weights and state."""

from lightning_sparse.masks.patterns import (
    NM,
    Sparsity,
    describe,
    is_nm,
    nm_groups,
    num_kept,
    sparsity_fraction,
)
from lightning_sparse.masks.select import (
    drop_smallest,
    drop_smallest_,
    from_zeros_mask,
    keep_top,
    name_seed,
    random_score,
    smallest_active,
    top_indices,
    topk_mask,
)

__all__ = [
    "NM",
    "Sparsity",
    "describe",
    "drop_smallest",
    "drop_smallest_",
    "from_zeros_mask",
    "is_nm",
    "keep_top",
    "name_seed",
    "nm_groups",
    "num_kept",
    "random_score",
    "smallest_active",
    "sparsity_fraction",
    "top_indices",
    "topk_mask",
]
