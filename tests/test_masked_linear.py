"""The masked Linear forward keeps the weight and its mask for the backward, not their
product, and gives the gradients plain autograd gives ``F.linear(x, weight * mask)``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse.backends.masked import install_masked_forward
from lightning_sparse.backends.masked_linear import masked_linear


def _inputs(dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=gen, dtype=dtype).requires_grad_(True)
    weight = torch.randn(4, 8, generator=gen, dtype=dtype).requires_grad_(True)
    bias = torch.randn(4, generator=gen, dtype=dtype).requires_grad_(True)
    return gen, x, weight, bias


@pytest.mark.parametrize("dense_gradient", [True, False])
def test_gradients_are_those_of_the_product(dense_gradient):
    """A soft mask that learns (as a learned phase samples): the input, weight, mask and bias
    gradients of ``F.linear(x, weight * mask, bias)`` on a (batch, tokens, features) input;
    with ``dense_gradient`` the weight's is the product's, unmasked."""
    gen, x, weight, bias = _inputs()
    mask = torch.rand(4, 8, generator=gen).requires_grad_(True)
    out = masked_linear(x, weight, mask, bias, torch.float32, dense_gradient)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (x, weight, mask, bias), grad)
    product = weight.detach() * mask.detach()
    ref_x, ref_p, ref_b = (
        t.detach().clone().requires_grad_(True) for t in (x, product, bias)
    )
    expected_out = F.linear(ref_x, ref_p, ref_b)
    gx, gp, gb = torch.autograd.grad(expected_out, (ref_x, ref_p, ref_b), grad)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    expected_weight = gp if dense_gradient else gp * mask.detach()
    for value, reference in zip(
        got, (gx, expected_weight, gp * weight.detach(), gb), strict=True
    ):
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6)


def test_under_autocast_it_multiplies_in_bf16_and_keeps_no_product():
    """A float32 Linear with a stored bool mask under bf16 autocast: the output of the bf16
    matmul of the bf16 input, weight and bias; the backward keeps the bf16 input, the weight
    and the mask, nothing weight-sized of its own; the weight's gradient is float32."""
    _, x, weight, bias = _inputs()
    layer = nn.Linear(8, 4)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    mask = torch.tensor([[True, False] * 4] * 4)
    install_masked_forward(layer, mask=mask)
    saved: list[torch.Tensor] = []
    with (
        torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t
        ),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        out = layer(x)
    expected = F.linear(
        x.detach().bfloat16(),
        (weight.detach() * mask).bfloat16(),
        bias.detach().bfloat16(),
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    kept = {t.untyped_storage().data_ptr() for t in saved}
    assert layer.weight.untyped_storage().data_ptr() in kept
    assert mask.untyped_storage().data_ptr() in kept
    weight_sized = [t for t in saved if t.numel() == 32 and t.dtype != torch.bool]
    assert [t.untyped_storage().data_ptr() for t in weight_sized] == [
        layer.weight.untyped_storage().data_ptr()
    ]
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(  # straight-through: the unmasked gradient of the product
        layer.weight.grad,
        (torch.ones(6, 4).bfloat16().T @ x.detach().reshape(6, 8).bfloat16()).float(),
    )


def test_a_sample_without_dense_gradient_masks_the_weight_gradient():
    """A layer given a plain sampling function (no ``dense_gradient`` attribute): the weight's
    gradient is the product's times the mask, and the mask's is the product's times the
    weight."""
    gen, x, weight, _ = _inputs()
    layer = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    soft = torch.rand(4, 8, generator=gen).requires_grad_(True)
    install_masked_forward(layer, sample=lambda training, dtype: soft.to(dtype))
    layer(x).sum().backward()
    grad_product = torch.ones(6, 4).T @ x.detach().reshape(6, 8)
    torch.testing.assert_close(layer.weight.grad, grad_product * soft.detach())
    torch.testing.assert_close(soft.grad, grad_product * weight.detach())
