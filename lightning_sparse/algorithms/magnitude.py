"""``magnitude``: straight-through; the mask is re-chosen from the dense weights periodically."""

from __future__ import annotations

from torch import Tensor

from lightning_sparse.algorithms.base import (
    MaskContext,
    SparsityAlgorithm,
    register_algorithm,
)
from lightning_sparse.masks import Sparsity


@register_algorithm("magnitude")
class Magnitude(SparsityAlgorithm):
    """Stored weights stay dense and learn from the dense gradient; the forward uses the
    largest-magnitude weights, re-chosen every ``update_every`` steps (default 100).

    Re-choosing among hard-masked weights would change nothing (pruned weights are zero), which
    is why this algorithm is straight-through.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": 0.7, "algorithm": "magnitude", "update_every": 50}])
    """

    layers_in_parallel = True
    straight_through = True
    dynamic = True

    def selection_score(
        self, weight: Tensor, mask: Tensor | None, ctx: MaskContext
    ) -> Tensor:
        # Stored weights are dense, so an update ranks all of them by magnitude.
        if mask is None:
            return super().selection_score(weight, mask, ctx)
        return weight.detach().abs()

    def update_mask(
        self, weight: Tensor, mask: Tensor, target: Sparsity, ctx: MaskContext
    ) -> Tensor:
        return self.select(self.selection_score(weight, mask, ctx), target)
