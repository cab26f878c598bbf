"""A Linear layer's masked forward that keeps its weight and mask for the backward, not their
product.

``F.linear(x, weight * mask)`` under autograd keeps the product (in the matmul dtype) from the
forward to the backward, for the input's gradient: a weight-sized tensor of its own per layer,
which FSDP2 cannot free as it frees its gathered weight. :func:`masked_linear` keeps what
exists anyway (the weight as given, which under FSDP2 is its gathered parameter, and the mask:
the engine's stored one, a projected one, a learned sample) and multiplies them again in the
backward, with the same values. A compiled graph is left to the compiler, which recomputes
such a product where that saves memory.

Example:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> x = torch.randn(3, 8, requires_grad=True)
    >>> w = torch.randn(4, 8, requires_grad=True)
    >>> mask = torch.rand(4, 8) > 0.5
    >>> y = masked_linear(x, w, mask, None, torch.float32, dense_gradient=True)
    >>> torch.equal(y, torch.nn.functional.linear(x, w * mask))
    True
    >>> y.sum().backward()
    >>> torch.allclose(x.grad, torch.ones(3, 4) @ (w * mask)), torch.equal(w.grad, torch.ones(4, 3) @ x)
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def masked_linear(
    input: Tensor,
    weight: Tensor,
    mask: Tensor,
    bias: Tensor | None,
    dtype: torch.dtype,
    dense_gradient: bool,
) -> Tensor:
    """``F.linear(input, weight * mask, bias)`` computed in ``dtype`` (as autocast or the
    weights' dtype says), the product not kept for the backward. The weight's gradient is
    the product's (``dense_gradient``: unmasked, straight-through); a mask that requires a
    gradient (a learned sample) gets ``grad * weight``."""
    return _MaskedLinear.apply(input, weight, mask, bias, dtype, dense_gradient)


def _product(weight: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    return weight.to(dtype) * mask  # a bool mask multiplies without a float copy


class _MaskedLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        mask: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
        dense_gradient: bool,
    ) -> Tensor:
        x = input.to(dtype)  # what autocast hands F.linear
        with torch.autocast(input.device.type, enabled=False):
            product = _product(weight, mask, dtype)
            out = F.linear(x, product, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x, weight, mask)
        ctx.dtype, ctx.dense_gradient = dtype, dense_gradient
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_input = grad_weight = grad_mask = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
        if needs[0]:
            grad_input = grad @ _product(weight, mask, ctx.dtype)
        if needs[1] or needs[2]:
            grad_product = rows.T @ x.reshape(-1, x.shape[-1])  # (out, in)
            if needs[1]:
                # straight-through: the product's gradient as it is
                dense = ctx.dense_gradient
                grad_weight = grad_product if dense else grad_product * mask
            if needs[2]:
                grad_mask = grad_product * weight.to(ctx.dtype)
        if needs[3]:
            grad_bias = rows.sum(0)
        return grad_input, grad_weight, grad_mask, grad_bias, None, None
