"""The CUTLASS 2:4 linear (sm8x): torch's tile kernel packs ``W`` and ``W.T`` for torch's
``SparseSemiStructuredTensorCUTLASS``, whose matmuls run the forward and the input gradient.

The CUTLASS tensor made by the tile op carries 3-D metadata, which the meta function of
``aten._sparse_semi_structured_(add)mm`` (used when compiling) rejects in newer torch
releases, so under ``torch.compile`` this linear runs eagerly (a graph break). Packing first
asks :func:`~lightning_sparse.backends.kernel_check.require_kernel`, so it refuses to run
where the kernel check failed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.sparse import SparseSemiStructuredTensorCUTLASS

from lightning_sparse.backends.kernel_check import require_kernel
from lightning_sparse.backends.masked import straight_through_mask

KERNEL = "cutlass"


def pack_cutlass(weight: Tensor) -> Tensor:
    """``weight`` pruned to its greedy transposable 2:4 pattern and packed for CUTLASS."""
    require_kernel(KERNEL, weight.dtype, weight.device)
    packed, meta, packed_t, meta_t, bitmask = torch._sparse_semi_structured_tile(
        weight, algorithm="largest_abs_values_greedy", use_cutlass=True
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


class _PackCutlass(torch.autograd.Function):
    """The packed 2:4 weight; the gradient reaches the dense weight unmasked."""

    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:  # type: ignore[override]
        return pack_cutlass(weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


@torch.compiler.disable
def cutlass_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    packing: object = None,
) -> Tensor:
    """``x @ W24.T + bias``: ``W24`` is the greedy 2:4 projection of ``weight * mask`` (a
    transposable mask survives it unchanged) or of ``weight``; straight-through gradients.
    (``packing`` is cuSPARSELt's packing of a stored mask: CUTLASS packs its own.)"""
    weight = weight.to(x.dtype)
    if mask is not None:
        weight = straight_through_mask(weight, mask)
    return F.linear(x, _PackCutlass.apply(weight), bias)
