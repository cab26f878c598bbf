"""``static``: the mask is chosen once at phase start (by magnitude or seeded random) and kept."""

from __future__ import annotations

from lightning_sparse.algorithms.base import SparsityAlgorithm, register_algorithm


@register_algorithm("static")
class Static(SparsityAlgorithm):
    """Hard mask fixed for the whole phase; the default for a float sparsity.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[{"sparsity": 0.7, "algorithm": "static", "init": "random"}])
    """
