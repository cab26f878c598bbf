"""The names closest to a mistyped one, for errors that say what was probably meant.

Example:
    >>> closest("parms", ["phases", "params", "exclude", "backend"])
    ['params']
    >>> closest("blocks.*.mlp.fc1.weigth", ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight",
    ...                                     "blocks.0.mlp.fc2.weight", "head.weight"], count=2)
    ['blocks.0.mlp.fc1.weight', 'blocks.0.mlp.fc2.weight']
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(
    word: str, names: Iterable[str], count: int = 1, cutoff: float = 0.6
) -> list[str]:
    """Up to ``count`` of ``names`` most like ``word``, best first (``difflib``'s similarity,
    at least ``cutoff``: 0 lists the nearest whatever they are); ``[]`` when none is close."""
    return difflib.get_close_matches(
        word, list(dict.fromkeys(names)), n=count, cutoff=cutoff
    )
