"""The semi_structured backend: 2:4 matmuls on NVIDIA sparse tensor cores (Ampere and newer).

A selected ``nn.Linear`` gets a sparse forward by a class swap (the same module object and
Parameter objects, see :mod:`lightning_sparse.backends.masked`). At every forward the weight,
in the matmul dtype (float16/bfloat16, or the autocast dtype), is pruned and packed by
``torch._sparse_semi_structured_tile(W, algorithm="largest_abs_values_greedy")``: a transposable
2:4 mask (2 of 4 along the rows *and* the columns of every 4x4 tile) chosen greedily by
``|w|``, packed both as ``W`` and as ``W.T``. The forward ``x @ W.T`` and the input gradient
``grad @ W`` then run as sparse matmuls (cuSPARSELt, with the transpose fused, or CUTLASS on
sm8x); the weight gradient ``grad.T @ x`` is a dense matmul and reaches the dense weight
unchanged (straight-through), as in PyTorch's 2:4 training recipe.

Phases with a stored mask (``static``, ``magnitude``) multiply the weight by the mask first; a
transposable mask survives the tile op's greedy unchanged, so the same kernels run them.

Where a kernel cannot run (a CPU tensor, a float32 matmul), and with ``kernel="emulated"``,
the layer computes what the masked backend computes, with the same operations: the weight
times :func:`~lightning_sparse.masks.tiles.transposable_2to4_mask` (or times its stored mask).
That mask is the kernel's greedy choice, except where ``|w|`` ties within a tile: the kernel
compares the values in the matmul dtype (bfloat16 values tie often) and its sorting network
orders equal values its own way, while the emulation ranks the stored (e.g. float32) values
and breaks ties by position. Both are valid greedy choices; the GPU tests compare them on
weights without ties. The CPU tests run the whole control flow with the emulation.

Example (the emulation, on the CPU):
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.backends.masked import uninstall_forward
    >>> from lightning_sparse.masks.tiles import transposable_2to4_mask
    >>> layer = nn.Linear(8, 4)
    >>> install_semi_structured_forward(layer, "emulated")
    >>> x = torch.randn(3, 8)
    >>> w = layer.weight * transposable_2to4_mask(layer.weight)
    >>> torch.allclose(layer(x), x @ w.T + layer.bias)
    True
    >>> uninstall_forward(layer); type(layer).__name__
    'Linear'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.sparse import (
    SparseSemiStructuredTensorCUSPARSELT,
    SparseSemiStructuredTensorCUTLASS,
)

from lightning_sparse.backends.capability import HALF_DTYPES
from lightning_sparse.backends.masked import (
    SparseClasses,
    SparseForwardMixin,
    project_eagerly,
    straight_through_mask,
    swap_forward,
)
from lightning_sparse.core.layers import CONV1D, LINEAR
from lightning_sparse.masks.tiles import is_transposable_2to4, transposable_2to4_mask

GREEDY = "largest_abs_values_greedy"


def _pack_cusparselt(weight: Tensor) -> Tensor:
    packed, meta, packed_t, meta_t, bitmask = torch._sparse_semi_structured_tile(
        weight, algorithm=GREEDY, use_cutlass=False
    )
    rows, cols = weight.shape
    return SparseSemiStructuredTensorCUSPARSELT(
        weight.shape,
        packed=packed.view(rows, -1),  # as torch's prune_dense_static_sort: 2-D views
        meta=meta,
        packed_t=packed_t.view(cols, -1),
        meta_t=meta_t,
        compressed_swizzled_bitmask=bitmask,
        fuse_transpose_cusparselt=True,  # results come back as (tokens, out), not transposed
        requires_grad=False,
    )


def _pack_cutlass(weight: Tensor) -> Tensor:
    packed, meta, packed_t, meta_t, bitmask = torch._sparse_semi_structured_tile(
        weight, algorithm=GREEDY, use_cutlass=True
    )
    return SparseSemiStructuredTensorCUTLASS(
        weight.shape,
        packed=packed,
        meta=meta,
        packed_t=packed_t,
        meta_t=meta_t,
        compressed_swizzled_bitmask=bitmask,
        requires_grad=False,
    )


EMULATED = "emulated"
KERNELS: dict[str, Callable[[Tensor], Tensor]] = {
    "cusparselt": _pack_cusparselt,
    "cutlass": _pack_cutlass,
}


class _Sparsify24(torch.autograd.Function):
    """The 2:4-pruned (packed) weight; the gradient reaches the dense weight unmasked."""

    @staticmethod
    def forward(ctx, weight: Tensor, kernel: str) -> Tensor:  # type: ignore[override]
        return KERNELS[kernel](weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


@torch.compiler.allow_in_graph
def sparsify_24(weight: Tensor, kernel: str) -> Tensor:
    """``weight`` pruned to the greedy transposable 2:4 pattern and packed for ``kernel``
    (``"cusparselt"`` or ``"cutlass"``), with a straight-through gradient.

    ``torch.compile`` keeps the call as one node of its graph; AOTAutograd then traces the
    tile op (with fake tensors, through the CUDA kernel's fallback) and the tensor subclass's
    matmuls, as torch's own ``test_sp24_compile`` does.
    """
    return _Sparsify24.apply(weight, kernel)


def kernel_runs(weight: Tensor, dtype: torch.dtype) -> bool:
    """Whether a 2:4 kernel can run a matmul of ``weight`` in ``dtype`` (else: emulation)."""
    return weight.device.type == "cuda" and dtype in HALF_DTYPES


def matmul_dtype(input: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(input, weight)`` computes in here: autocast's, else the weight's."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def semi_structured_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kernel: str,
    mask: Tensor | None = None,
) -> Tensor:
    """``F.linear(input, W24, bias)`` where ``W24`` is the 2:4 projection of ``weight * mask``
    (of ``weight`` without a mask), run by ``kernel``, gradients straight through to ``weight``.

    ``kernel="emulated"``, and any matmul that would not run in float16/bfloat16 on a CUDA
    device, computes the same function as the masked backend, with the same operations.
    """
    dtype = matmul_dtype(input, weight)
    if kernel == EMULATED or not kernel_runs(weight, dtype):
        if mask is None:
            mask = project_eagerly(transposable_2to4_mask, weight)
        return F.linear(input, straight_through_mask(weight, mask), bias)
    w = weight.to(
        dtype
    ).contiguous()  # the tile op reads row-major (Conv1D's W.T is not)
    if mask is not None:
        w = straight_through_mask(w, mask)
    # The sparse matmuls take 2-D row-major inputs (a column-major input would make autograd
    # multiply with the packed weight on the left, which the fused transpose does not support).
    x = input.to(dtype).reshape(-1, input.shape[-1]).contiguous()
    b = None if bias is None else bias.to(dtype)
    linear = _linear_24 if kernel == "cusparselt" else _linear_24_eager
    out = linear(x, w, b, kernel)
    return out.view(*input.shape[:-1], out.shape[-1])


def _linear_24(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: str) -> Tensor:
    return F.linear(x, sparsify_24(weight, kernel), bias)


# The CUTLASS tensor made by the tile op carries 3-D metadata, which the meta function of
# ``aten._sparse_semi_structured_(add)mm`` (used when compiling) rejects in torch 2.15: under
# ``torch.compile`` CUTLASS layers run eagerly (a graph break), cuSPARSELt layers are traced.
_linear_24_eager = torch.compiler.disable(_linear_24)


class NotTransposableError(ValueError):
    """A stored mask that the 2:4 kernels cannot run (not transposable 2:4)."""


class SemiStructuredForward(SparseForwardMixin):
    """A matmul layer (``Linear``, ``Conv1D``) whose matmuls run 2:4-sparse (see the module
    docstring) on the weight as the ``(out, in)`` matrix it multiplies by."""

    _ls_kernel: str

    def forward(self, input: Tensor) -> Tensor:
        matrix = self._ls_layer.matrix
        mask = self._ls_mask
        return semi_structured_linear(
            input,
            matrix(self.weight),
            self.bias,
            self._ls_kernel,
            None if mask is None else matrix(mask).contiguous(),
        )


class SemiStructuredLinear(SemiStructuredForward, nn.Linear):
    """``nn.Linear`` whose matmuls run 2:4-sparse."""

    _ls_layer = LINEAR


class SemiStructuredConv1D(SemiStructuredForward):
    """Hugging Face's ``Conv1D`` whose matmuls run 2:4-sparse (on ``weight.T``)."""

    _ls_layer = CONV1D


_SEMI_STRUCTURED_CLASSES: SparseClasses = {
    LINEAR: {nn.Linear: SemiStructuredLinear},
    CONV1D: {None: SemiStructuredConv1D},
}


def install_semi_structured_forward(
    module: nn.Module, kernel: str, mask: Tensor | None = None
) -> None:
    """Make the ``nn.Linear`` (or ``Conv1D``) ``module`` run 2:4-sparse with ``kernel``; with
    ``mask`` (stored like the weight; transposable 2:4 as the ``(out, in)`` matrix), on
    ``weight * mask``, else on the matrix's own 2:4 projection."""
    if kernel not in (*KERNELS, EMULATED):
        raise ValueError(f"kernel={kernel!r}; use one of {[*KERNELS, EMULATED]}")
    # transposable 2:4 holds for the matrix iff it holds for its transpose
    if mask is not None and not is_transposable_2to4(mask):
        raise NotTransposableError(
            "the semi_structured backend runs stored masks that are transposable 2:4 (at most "
            "2 kept per row and per column of every 4x4 tile); this mask is not"
        )
    swap_forward(module, _SEMI_STRUCTURED_CLASSES, mask=mask)
    module._ls_kernel = kernel
