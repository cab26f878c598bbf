"""``runtime``: the PyTorch 2:4 training recipe: every forward projects the dense weight to N:M."""

from __future__ import annotations

from torch import Tensor

from lightning_sparse.algorithms.base import SparsityAlgorithm, register_algorithm
from lightning_sparse.core.schedule import Phase
from lightning_sparse.masks import NM
from lightning_sparse.masks.tiles import (
    greedy_2to4_mask,
    has_4x4_tiles,
    tile_kernel_takes,
)


@register_algorithm("runtime")
class Runtime(SparsityAlgorithm):
    """Straight-through N:M: the mask is re-derived from the dense weight at every forward,
    and the dense weight learns from the dense gradient. The default for ``"N:M"`` phases.

    ``2:4`` on a 2-D weight whose dimensions are multiples of 4 uses the transposable greedy
    mask of :func:`~lightning_sparse.masks.tiles.transposable_2to4_mask` (at most 2 per row and
    per column of every 4x4 tile, by decreasing ``|w|``): the choice the CUDA kernel
    ``torch._sparse_semi_structured_tile(W, "largest_abs_values_greedy")`` makes, so the
    ``semi_structured`` and ``masked`` backends compute the same function. It keeps ~49% of the
    weights (a tile keeps 7 instead of 8 when the greedy paints itself into a corner). Other
    targets and shapes: the N largest ``|w|`` of every M along the input dimension.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
    """

    straight_through = True
    projects = True
    option_names = frozenset()

    @classmethod
    def validate(cls, spec: Phase, where: str) -> None:
        super().validate(spec, where)
        cls.require_nm(
            spec,
            where,
            "projects to an N:M pattern",
            "use sparsity: '2:4', or algorithm 'magnitude' (update_every: 1) for "
            "unstructured straight-through sparsity",
        )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.phase.target, NM)
        self._target: NM = self.phase.target
        self._tiles = self._target == NM(2, 4)  # transposable 4x4 tiles where they fit

    def project(self, weight: Tensor) -> Tensor:
        if self._tiles and has_4x4_tiles(weight):
            return greedy_2to4_mask(weight)
        return self.select(weight.detach().abs(), self._target)

    def traceable(self, weight: Tensor) -> bool:
        """2:4 on a weight torch's tile kernel takes: one custom op chooses the mask.

        Example:
            >>> import torch
            >>> from torch._subclasses.fake_tensor import FakeTensorMode
            >>> from lightning_sparse.algorithms import build_algorithm
            >>> from lightning_sparse.core.schedule import Phase, resolve_phases
            >>> algo = build_algorithm(resolve_phases([Phase(sparsity="2:4")], total_steps=1)[0])
            >>> algo.traceable(torch.zeros(128, 256, dtype=torch.bfloat16))  # on the CPU
            False
            >>> with FakeTensorMode():  # a CUDA weight, shapes only
            ...     algo.traceable(torch.empty(128, 256, device="cuda", dtype=torch.bfloat16))
            True
        """
        return self._tiles and tile_kernel_takes(weight)
