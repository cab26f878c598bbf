"""The cuSPARSELt algorithm for each matmul shape, searched once per process.

cuSPARSELt's default algorithm (0) can be much slower than the best one for a shape, and the
best one depends on the shape, the dtype and the GPU. So the first sparse matmul of each
(tokens bucket, out, in, dtype, transposed result) asks cuSPARSELt's own search
(``torch._C._cusparselt.mm_search``, which times its candidates on the real operands) and every
later matmul of that shape uses its choice. Token counts are bucketed to the next power of two,
so that varying sequence lengths search a few times, not at every new length.

The search may return a split-k configuration, which changes how the products are summed. So
each searched configuration runs once against algorithm 0 on the same operands before it is
kept; one that disagrees beyond the kernel check's tolerance is replaced by algorithm 0 for
that shape, with one warning per process.

Example (an injected search and matmul, on the CPU):
    >>> import torch
    >>> def matmul(packed, dense, bias, transposed, algorithm):  # a stand-in for cuSPARSELt's
    ...     return torch.ones(2, 2)
    >>> cache = AlgorithmCache(
    ...     search=lambda packed, dense, bias, transposed: Algorithm(17), run=matmul
    ... )
    >>> packed, dense = torch.empty(128, 144, dtype=torch.bfloat16), torch.empty(256, 300)
    >>> cache.choose(packed, dense, None, out_features=128)
    Algorithm(alg_id=17, split_k=1, split_k_mode=-1)
    >>> cache.describe(128, 256)
    'alg 17'
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.backends.kernel_check import (
    TOLERANCE,
    capturing,
    first_line,
    relative_error,
)


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
Run = Callable[[Tensor, Tensor, "Tensor | None", bool, Algorithm], Tensor]
"""``(packed, dense, bias, transpose_result, algorithm) -> product``: one sparse matmul."""

_MM_ARGUMENTS = {
    arg.name for arg in torch.ops.aten._cslt_sparse_mm.default._schema.arguments
}


def sparse_mm(
    packed: Tensor,
    dense: Tensor,
    bias: Tensor | None,
    transpose_result: bool,
    algorithm: Algorithm,
) -> Tensor:
    """``torch._cslt_sparse_mm`` with ``algorithm`` (as far as this torch's op takes it)."""
    options = {
        "alg_id": algorithm.alg_id,
        "split_k": algorithm.split_k,
        "split_k_mode": algorithm.split_k_mode,
    }
    return torch._cslt_sparse_mm(
        packed,
        dense,
        bias,
        transpose_result=transpose_result,
        **{name: value for name, value in options.items() if name in _MM_ARGUMENTS},
    )


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

    def __init__(
        self, search: Search = search_cusparselt, run: Run = sparse_mm
    ) -> None:
        self.search = search
        self.run = run
        self.chosen: dict[tuple, Algorithm] = {}
        self.rejected: dict[tuple, tuple[Algorithm, float]] = {}
        """The searched configurations that disagreed with algorithm 0, and by how much."""
        self.failed: dict[tuple, str] = {}
        """The shapes whose search raised, and the error's first line."""

    def choose(
        self,
        packed: Tensor,
        dense: Tensor,
        bias: Tensor | None,
        out_features: int,
        transpose_result: bool = True,
    ) -> Algorithm:
        """The algorithm for ``packed @ dense`` (``dense`` is ``(in, tokens)``), searched on
        these operands the first time its shape comes, and checked against algorithm 0. While
        a CUDA graph is being captured neither can run: an unsearched shape then uses the
        default algorithm."""
        in_features, tokens = dense.shape
        key = (
            tokens_bucket(tokens),
            out_features,
            in_features,
            packed.dtype,
            transpose_result,
            bias is not None,
        )
        if key not in self.chosen:
            if capturing(packed.device):
                return DEFAULT
            self.chosen[key] = self._searched(key, packed, dense, bias)
        return self.chosen[key]

    def _searched(
        self, key: tuple, packed: Tensor, dense: Tensor, bias: Tensor | None
    ) -> Algorithm:
        """The searched algorithm, checked; algorithm 0 where the search itself raised (it
        times many candidates, with workspaces of their own), with one warning per process.
        A CUDA error is raised: it leaves the process unusable."""
        try:
            found = self.search(packed, dense, bias, key[4])
        except torch.AcceleratorError:
            raise
        except RuntimeError as err:
            if not self.failed:
                tokens, out_features, in_features, dtype = key[:4]
                warnings.warn(
                    f"cuSPARSELt's search raised {type(err).__name__} for a "
                    f"{out_features}x{in_features} {str(dtype).removeprefix('torch.')} weight "
                    f"at up to {tokens} tokens ({first_line(err)}); such shapes run "
                    f"algorithm 0 (correct, maybe slower), and the fit-start table names them",
                    RuntimeWarning,
                    stacklevel=5,
                )
            self.failed[key] = first_line(err)
            return DEFAULT
        return self._checked(found, key, packed, dense, bias)

    def _checked(
        self,
        found: Algorithm,
        key: tuple,
        packed: Tensor,
        dense: Tensor,
        bias: Tensor | None,
    ) -> Algorithm:
        """``found``, or algorithm 0 where ``found`` computes another product."""
        if found == DEFAULT:
            return found
        transposed = key[4]
        error = relative_error(
            self.run(packed, dense, bias, transposed, found),
            self.run(packed, dense, bias, transposed, DEFAULT),
        )
        if error <= TOLERANCE:
            return found
        if not self.rejected:
            tokens, out_features, in_features, dtype = key[:4]
            warnings.warn(
                f"cuSPARSELt's search chose {found} (split-k mode {found.split_k_mode}) for "
                f"a {out_features}x{in_features} {str(dtype).removeprefix('torch.')} weight "
                f"at up to {tokens} tokens, which disagrees with algorithm 0 on the same "
                f"operands (relative error {error:.2g}); such shapes run algorithm 0 "
                f"(correct, maybe slower), and the fit-start table names them",
                RuntimeWarning,
                stacklevel=4,
            )
        self.rejected[key] = (found, error)
        return DEFAULT

    def describe(self, out_features: int, in_features: int) -> str:
        """The algorithms chosen so far for a layer shape, e.g. ``"alg 17"``,
        ``"alg 0 (the searched alg 5, split-k 2 disagreed)"`` or ``"alg 0 (the search
        raised)"``."""
        found = set()
        for key, algorithm in self.chosen.items():
            if key[1:3] != (out_features, in_features):
                continue
            rejected = self.rejected.get(key)
            if rejected:
                found.add(f"{algorithm} (the searched {rejected[0]} disagreed)")
            elif key in self.failed:
                found.add(f"{algorithm} (the search raised)")
            else:
                found.add(str(algorithm))
        return ", ".join(sorted(found))


ALGORITHMS = AlgorithmCache()
"""The process's cache, used by every cuSPARSELt matmul."""
