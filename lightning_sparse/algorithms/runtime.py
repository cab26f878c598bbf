"""``runtime``: the PyTorch 2:4 training recipe: every forward projects the dense weight to N:M."""

from __future__ import annotations

from torch import Tensor

from lightning_sparse.algorithms.base import SparsityAlgorithm, register_algorithm
from lightning_sparse.masks import NM


@register_algorithm("runtime")
class Runtime(SparsityAlgorithm):
    """Straight-through N:M: the mask is re-derived from the dense weight at every forward
    (largest magnitudes in each group of M), and the dense weight learns from the dense
    gradient. The default for ``"N:M"`` phases.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
    """

    straight_through = True
    projects = True
    option_names = frozenset()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.phase.target, NM):
            raise TypeError(
                f"phases[{self.phase.index}]: algorithm 'runtime' projects to an N:M pattern, "
                f"but sparsity={self.phase.target}; use sparsity: '2:4', or algorithm "
                f"'magnitude' (update_every: 1) for unstructured straight-through sparsity"
            )
        self._target: NM = self.phase.target

    def project(self, weight: Tensor) -> Tensor:
        return self.select(weight.detach().abs(), self._target)
