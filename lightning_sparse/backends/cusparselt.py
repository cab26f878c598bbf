"""The cuSPARSELt 2:4 linear as custom ops: prune, then ``x @ W24.T`` and its input gradient.

- ``lightning_sparse::prune_24(weight)``: ``weight`` times its greedy transposable 2:4 mask
  (:func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`: torch's tile kernel on CUDA), with
  a straight-through gradient.
- ``lightning_sparse::linear_24(x, w24, bias)``: packs ``w24`` with ``torch._cslt_compress``
  (the layout cuSPARSELt itself writes) and runs ``torch._cslt_sparse_mm``; its backward packs
  ``w24.T`` for the input gradient ``grad @ W24`` (``lightning_sparse::linear_24_input_grad``)
  and computes the weight gradient ``grad.T @ x`` densely (straight-through to the weight).

Being custom ops with fake implementations, they are single nodes that ``torch.compile``
traces (and CUDA graphs capture) without looking inside. Each run first asks
:func:`~lightning_sparse.backends.kernel_check.require_kernel`, so they refuse to run where
the kernel check failed.

Example (shapes only, on fake CUDA tensors):
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     x = torch.empty(300, 256, device="cuda", dtype=torch.bfloat16)
    ...     w = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    ...     linear_24(x, prune_24(w), None).shape
    torch.Size([300, 128])
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.backends.kernel_check import require_kernel
from lightning_sparse.backends.masked import straight_through_mask
from lightning_sparse.masks.tiles import greedy_2to4_mask

KERNEL = "cusparselt"


@torch.library.custom_op("lightning_sparse::prune_24", mutates_args=())
def prune_24(weight: Tensor) -> Tensor:
    """``weight`` pruned to its greedy transposable 2:4 pattern (straight-through)."""
    return weight * greedy_2to4_mask(weight)


@prune_24.register_fake
def _(weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


def _straight_through(ctx: object, grad: Tensor) -> Tensor:
    return grad


prune_24.register_autograd(_straight_through)


def pack(w24: Tensor) -> Tensor:
    """``w24`` (row-major, 2:4 along rows) in cuSPARSELt's compressed layout."""
    return torch._cslt_compress(w24)


def _sparse_mm(w24: Tensor, dense: Tensor, bias: Tensor | None) -> Tensor:
    """``dense @ w24.T + bias`` for a row-major ``dense`` of shape ``(tokens, in)``."""
    require_kernel(KERNEL, w24.dtype, w24.device)
    return torch._cslt_sparse_mm(pack(w24), dense.t(), bias, transpose_result=True)


@torch.library.custom_op("lightning_sparse::linear_24", mutates_args=())
def linear_24(x: Tensor, w24: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ w24.T + bias`` on cuSPARSELt: ``x`` (tokens, in) row-major, ``w24`` (out, in)."""
    return _sparse_mm(w24, x, bias)


@linear_24.register_fake
def _(x: Tensor, w24: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], w24.shape[0]))


@torch.library.custom_op("lightning_sparse::linear_24_input_grad", mutates_args=())
def linear_24_input_grad(grad: Tensor, w24: Tensor) -> Tensor:
    """``grad @ w24`` on cuSPARSELt (``w24.T`` packed): the input gradient of ``linear_24``."""
    return _sparse_mm(w24.t().contiguous(), grad, None)


@linear_24_input_grad.register_fake
def _(grad: Tensor, w24: Tensor) -> Tensor:
    return grad.new_empty((grad.shape[0], w24.shape[1]))


def _setup(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    x, w24, bias = inputs
    ctx.save_for_backward(x, w24)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    x, w24 = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = linear_24_input_grad(grad, w24) if ctx.needs_input_grad[0] else None
    grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
    grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


linear_24.register_autograd(_backward, setup_context=_setup)


def cusparselt_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None
) -> Tensor:
    """``x @ W24.T + bias``: ``W24`` is ``weight * mask`` (a transposable 2:4 mask), or the
    greedy 2:4 projection of ``weight``; gradients straight through to ``weight``."""
    w24 = prune_24(weight) if mask is None else straight_through_mask(weight, mask)
    return linear_24(x, w24, bias)
