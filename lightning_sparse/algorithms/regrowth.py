"""Where a drop-and-grow update regrows: where a score is highest, or uniformly at random.

A :class:`Regrowth` answers two questions about the entries that are not active after the
drop: which ``k`` of them regrow (an unstructured target), and which of them refill every N:M
group to ``N`` (an N:M target). :class:`ByScore` takes the highest scores (``rigl``: the
gradient's magnitude, or a custom :meth:`~lightning_sparse.algorithms.DropAndGrow.grow_score`);
:class:`AtRandom` draws them uniformly (``set``).

Example:
    >>> import torch
    >>> survivors = torch.tensor([True, False, False, False])
    >>> ByScore(torch.tensor([9.0, -3.0, 1.0, 2.0]), magnitude=True).pick(survivors, 2).tolist()
    [False, True, False, True]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_sparse.masks import NM, Sparsity, name_seed, random_score, topk_mask
from lightning_sparse.masks.elementwise import Ops, ops_for
from lightning_sparse.masks.random_subset import random_subset
from lightning_sparse.masks.refill import (
    GroupKeys,
    Keys,
    TileKeys,
    refill_groups_,
    refill_tiles_,
)
from lightning_sparse.masks.tiles import has_4x4_tiles
from lightning_sparse.masks.top_k import top_k_mask

Select = Callable[[Tensor, Sparsity], Tensor]


class Regrowth:
    """Chooses regrown entries among those not in ``survivors`` (a bool tensor)."""

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        """A bool mask of ``k`` entries outside ``survivors`` (written into ``out`` if given)."""
        raise NotImplementedError

    def refill_(
        self, mask: Tensor, dropped: Tensor, target: NM, select: Select
    ) -> None:
        """Bring every group of ``target.m`` of ``mask`` (a valid N:M mask before the drop)
        that lost entries to ``dropped`` (a subset of it) back to ``target.n``, in place, the
        way ``select`` lays masks out: transposable 2:4 tiles where the built-in ``select``
        makes them, else groups along the input dimension (see
        :mod:`~lightning_sparse.masks.refill`); from a tile whose survivors fit no 2:4
        pattern on, by groups. ``dropped`` becomes the entries that changed. A custom
        ``select`` chooses the whole mask from scores in which the survivors come first."""
        layout = _layout(select, mask, target)
        ops = ops_for(mask, *self._values())
        done = 0  # leading rows refilled
        if layout == "tiles":
            keys, seed = self._tile_keys(ops)
            done = 4 * refill_tiles_(ops, mask, dropped, keys, seed)
            layout = "groups"  # the rows the tiles left, if any
        if layout == "groups":
            if done < mask.shape[0]:
                rows = slice(done, None)
                keys, seed = self._group_keys(ops, target, rows)
                refill_groups_(ops, mask[rows], dropped[rows], target, keys, seed)
            return
        survivors = mask & ~dropped
        scores = self._scores(mask)
        low, high = torch.aminmax(scores)
        bonus = 16 * (high - low) + 1
        grown = select(torch.where(survivors, bonus, scores - low), target) & ~survivors
        mask.copy_(survivors | grown)
        dropped ^= grown

    def _values(self) -> tuple[Tensor, ...]:
        """The tensors the keys come from (they decide between NumPy and torch)."""
        return ()

    def _scores(self, like: Tensor) -> Tensor:
        """A score for every entry (a custom ``select`` ranks the whole tensor)."""
        raise NotImplementedError

    def _group_keys(self, ops: Ops, target: NM, rows: slice) -> tuple[Keys | None, int]:
        """The keys of :func:`refill_groups_` for these ``rows`` of the weight (``None``:
        random) and its seed."""
        raise NotImplementedError

    def _tile_keys(self, ops: Ops) -> tuple[Keys | None, int]:
        """The keys of :func:`refill_tiles_` (``None``: random) and its seed."""
        raise NotImplementedError


class ByScore(Regrowth):
    """The highest ``score`` wins (``magnitude=True``: the highest ``|score|``); ties go to the
    lower flat index."""

    def __init__(self, score: Tensor, magnitude: bool = False) -> None:
        self.score = score
        self.magnitude = magnitude

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        return top_k_mask(
            self.score, k, magnitude=self.magnitude, excluding=survivors, out=out
        )

    def _values(self) -> tuple[Tensor, ...]:
        return (self.score,)

    def _scores(self, like: Tensor) -> Tensor:
        scores = self.score.reshape(like.shape)
        return scores.abs() if self.magnitude else scores

    def _group_keys(self, ops: Ops, target: NM, rows: slice) -> tuple[Keys | None, int]:
        values = ops.array(self.score.detach())[rows]
        return GroupKeys(ops, values, target.m, self.magnitude), 0

    def _tile_keys(self, ops: Ops) -> tuple[Keys | None, int]:
        return TileKeys(ops, ops.array(self.score.detach()), self.magnitude), 0


class AtRandom(Regrowth):
    """Uniformly at random, reproducibly from ``(seed, parameter name, step)``."""

    def __init__(self, seed: int, name: str, step: int) -> None:
        self.seed = name_seed(seed, name, step)

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        return random_subset(k, survivors, self.seed, out=out)

    def _scores(self, like: Tensor) -> Tensor:
        return random_score(like, self.seed)

    def _group_keys(self, ops: Ops, target: NM, rows: slice) -> tuple[Keys | None, int]:
        # a hash of (seed, position in the rows): however groups are split
        return None, self.seed

    def _tile_keys(self, ops: Ops) -> tuple[Keys | None, int]:
        return None, self.seed


def _layout(select: Select, survivors: Tensor, target: NM) -> str | None:
    """How the algorithm's ``select`` lays out ``target``: ``"tiles"`` (transposable 2:4),
    ``"groups"`` (N of every M along the input dimension) or ``None`` (a custom select)."""
    from lightning_sparse.algorithms.base import SparsityAlgorithm

    if select is topk_mask:
        return "groups"
    if getattr(select, "__func__", None) is not SparsityAlgorithm.select:
        return None
    if target == NM(2, 4) and has_4x4_tiles(survivors):
        return "tiles"
    return "groups"
