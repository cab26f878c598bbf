"""The cuSPARSELt algorithm for each matmul shape, searched once per process.

cuSPARSELt's default algorithm (0) can be much slower than the best one for a shape, and the
best one depends on the shape, the dtype and the GPU. So the first sparse matmul of each
(tokens bucket, out, in, dtype, transposed result) asks cuSPARSELt's own search
(``torch._C._cusparselt.mm_search``, which times its candidates on the real operands) and every
later matmul of that shape uses its choice. Token counts are bucketed to the next power of two,
so that varying sequence lengths search a few times, not at every new length.

Example (an injected search, on the CPU):
    >>> import torch
    >>> cache = AlgorithmCache(search=lambda packed, dense, bias, transposed: Algorithm(17))
    >>> packed, dense = torch.empty(128, 144, dtype=torch.bfloat16), torch.empty(256, 300)
    >>> cache.choose(packed, dense, None, out_features=128)
    Algorithm(alg_id=17, split_k=1, split_k_mode=-1)
    >>> list(cache.chosen)
    [(512, 128, 256, torch.bfloat16, True)]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.backends.kernel_check import capturing


@dataclass(frozen=True)
class Algorithm:
    """A cuSPARSELt algorithm and its split-k setting (``split_k_mode=-1``: the default)."""

    alg_id: int
    split_k: int = 1
    split_k_mode: int = -1

    def __str__(self) -> str:
        split = f", split-k {self.split_k}" if self.split_k != 1 else ""
        return f"alg {self.alg_id}{split}"


DEFAULT = Algorithm(0)
Search = Callable[[Tensor, Tensor, "Tensor | None", bool], Algorithm]
"""``(packed, dense, bias, transpose_result) -> Algorithm``: cuSPARSELt's search."""


def search_cusparselt(
    packed: Tensor, dense: Tensor, bias: Tensor | None, transpose_result: bool
) -> Algorithm:
    """cuSPARSELt's own search on these operands (the best algorithm by its timings)."""
    found = torch._C._cusparselt.mm_search(
        packed, dense, bias, None, None, transpose_result
    )
    if isinstance(found, int):  # releases that return only the algorithm
        return Algorithm(found)
    alg_id, split_k, split_k_mode = found[:3]
    return Algorithm(int(alg_id), int(split_k), int(split_k_mode))


def tokens_bucket(tokens: int) -> int:
    """The next power of two at or above ``tokens``.

    Example:
        >>> tokens_bucket(300), tokens_bucket(512), tokens_bucket(1)
        (512, 512, 1)
    """
    return 1 << max(tokens - 1, 0).bit_length()


class AlgorithmCache:
    """The chosen algorithm per matmul shape (see the module docstring)."""

    def __init__(self, search: Search = search_cusparselt) -> None:
        self.search = search
        self.chosen: dict[tuple, Algorithm] = {}

    def choose(
        self,
        packed: Tensor,
        dense: Tensor,
        bias: Tensor | None,
        out_features: int,
        transpose_result: bool = True,
    ) -> Algorithm:
        """The algorithm for ``packed @ dense`` (``dense`` is ``(in, tokens)``), searched on
        these operands the first time its shape comes. While a CUDA graph is being captured
        a search cannot run: an unsearched shape then uses the default algorithm."""
        in_features, tokens = dense.shape
        key = (
            tokens_bucket(tokens),
            out_features,
            in_features,
            packed.dtype,
            transpose_result,
        )
        if key not in self.chosen:
            if capturing(packed.device):
                return DEFAULT
            self.chosen[key] = self.search(packed, dense, bias, transpose_result)
        return self.chosen[key]

    def describe(self, out_features: int, in_features: int) -> str:
        """The algorithms chosen so far for a layer shape, e.g. ``"alg 17"``."""
        found = sorted(
            {
                str(a)
                for key, a in self.chosen.items()
                if key[1:3] == (out_features, in_features)
            }
        )
        return ", ".join(found)


ALGORITHMS = AlgorithmCache()
"""The process's cache, used by every cuSPARSELt matmul."""
