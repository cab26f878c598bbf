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

from lightning_sparse.masks import NM, Sparsity, mark_top_k, name_seed, random_score
from lightning_sparse.masks.random import random_subset
from lightning_sparse.masks.refill import refill_groups_, refill_tiles_

Select = Callable[[Tensor, Sparsity], Tensor]


class Regrowth:
    """Chooses regrown entries among those not in ``survivors`` (a bool tensor)."""

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        """A bool mask of ``k`` entries outside ``survivors`` (written into ``out`` if given)."""
        raise NotImplementedError

    def refill_(
        self,
        mask: Tensor,
        dropped: Tensor,
        target: NM,
        layout: str | None,
        select: Select | None = None,
    ) -> None:
        """Bring every group of ``target.m`` of ``mask`` (a valid N:M mask before the drop)
        that lost entries to ``dropped`` (a subset of it) back to ``target.n``, in place, in
        the algorithm's ``layout`` (:meth:`~lightning_sparse.algorithms.SparsityAlgorithm.nm_layout`):
        transposable 2:4 ``"tiles"`` (from a tile whose survivors fit no 2:4 pattern on, by
        groups), ``"groups"`` along the input dimension (see
        :mod:`~lightning_sparse.masks.refill`), or ``None``: a custom ``select`` chooses the
        whole mask from scores in which the survivors come first. ``dropped`` becomes the
        entries that changed."""
        keys, magnitude, seed = self._keys()
        done = 0  # leading rows refilled
        if layout == "tiles":
            done = 4 * refill_tiles_(mask, dropped, keys, magnitude, seed)
            layout = "groups"  # the rows the tiles left, if any
        if layout == "groups":
            if done < mask.shape[0]:
                rows = slice(done, None)
                row_keys = None if keys is None else keys[rows]
                refill_groups_(
                    mask[rows], dropped[rows], target, row_keys, magnitude, seed
                )
            return
        assert select is not None, "a custom layout needs the algorithm's select"
        survivors = mask & ~dropped
        scores = self._scores(mask)
        low, high = torch.aminmax(scores)
        bonus = 16 * (high - low) + 1
        grown = select(torch.where(survivors, bonus, scores - low), target) & ~survivors
        mask.copy_(survivors | grown)
        dropped ^= grown

    def _scores(self, like: Tensor) -> Tensor:
        """A score for every entry (a custom ``select`` ranks the whole tensor)."""
        raise NotImplementedError

    def _keys(self) -> tuple[Tensor | None, bool, int]:
        """The refills' ``(keys, magnitude, seed)``: keys laid out like the weight, or ``None``
        for random regrowth from the seed."""
        raise NotImplementedError


class ByScore(Regrowth):
    """The highest ``score`` wins (``magnitude=True``: the highest ``|score|``); ties go to the
    lower flat index."""

    def __init__(self, score: Tensor, magnitude: bool = False) -> None:
        self.score = score
        self.magnitude = magnitude

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        return mark_top_k(
            self.score, k, magnitude=self.magnitude, excluding=survivors, out=out
        )

    def _scores(self, like: Tensor) -> Tensor:
        scores = self.score.reshape(like.shape)
        return scores.abs() if self.magnitude else scores

    def _keys(self) -> tuple[Tensor | None, bool, int]:
        return self.score.detach(), self.magnitude, 0


class AtRandom(Regrowth):
    """Uniformly at random, reproducibly from ``(seed, parameter name, step)``."""

    def __init__(self, seed: int, name: str, step: int) -> None:
        self.seed = name_seed(seed, name, step)

    def pick(self, survivors: Tensor, k: int, out: Tensor | None = None) -> Tensor:
        return random_subset(k, survivors, self.seed, out=out)

    def _scores(self, like: Tensor) -> Tensor:
        return random_score(like, self.seed)

    def _keys(self) -> tuple[Tensor | None, bool, int]:
        # a hash of (seed, position in the rows refilled): however groups are split
        return None, False, self.seed
