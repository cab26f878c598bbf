"""The cuSPARSELt 2:4 linear as custom ops: prune, then ``x @ W24.T`` and its input gradient.

- ``lightning_sparse::prune_24(weight)``: ``weight`` times its greedy transposable 2:4 mask
  (:func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`: torch's tile kernel on CUDA), with
  a straight-through gradient.
- ``lightning_sparse::linear_24(x, w24, bias)``: packs ``w24`` (:func:`pack`) and runs
  ``torch._cslt_sparse_mm`` with the algorithm searched for its shape
  (:mod:`~lightning_sparse.backends.cusparselt_algorithms`); its backward packs ``w24.T`` for
  the input gradient ``grad @ W24`` (``lightning_sparse::linear_24_input_grad``) and computes
  the weight gradient ``grad.T @ x`` densely (straight-through to the weight).

Packing uses our packer (:mod:`~lightning_sparse.backends.cusparselt_packer`, at memory speed)
where its bytes equal those of cuSPARSELt's own ``torch._cslt_compress`` on the running GPU
(compared once per process, dtype and device, on weights with padded groups and negative
zeros), and ``torch._cslt_compress`` everywhere else; a difference warns once.

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

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.backends.cusparselt_algorithms import ALGORITHMS
from lightning_sparse.backends.cusparselt_packer import compress, supports
from lightning_sparse.backends.kernel_check import (
    capturing,
    known_values,
    require_kernel,
    versions,
)
from lightning_sparse.backends.masked import straight_through_mask
from lightning_sparse.masks.tiles import greedy_2to4_mask, transposable_2to4_mask

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
    if supports(w24.shape, w24.dtype) and packer_matches(w24.dtype, w24.device):
        return compress(w24)
    return torch._cslt_compress(w24)


_PACKER_MATCHES: dict[tuple[torch.dtype, torch.device], bool] = {}


def packer_matches(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether our packer writes the bytes of ``torch._cslt_compress`` on ``device`` in
    ``dtype`` (compared once; while a CUDA graph is captured, unknown counts as no)."""
    key = (dtype, device)
    if key not in _PACKER_MATCHES:
        if capturing(device):
            return False
        _PACKER_MATCHES[key] = _compare_packers(dtype, device)
    return _PACKER_MATCHES[key]


def packer_note(dtype: torch.dtype, device: torch.device) -> str:
    """Which packer this process uses, for the fit-start table (nothing off a GPU)."""
    if device.type != "cuda":
        return ""
    if packer_matches(dtype, device):
        return "packed by lightning_sparse"
    return "packed by torch._cslt_compress"


def _compare_packers(dtype: torch.dtype, device: torch.device) -> bool:
    weight = known_values(128, 256)
    w24 = weight * transposable_2to4_mask(weight)
    w24[:8, :8] = 0.0  # groups keeping 1 or none: padded
    w24[8, 1] = -0.0  # a pruned negative weight, as weight * mask leaves it
    both = [w24.to(device, dtype), w24.t().contiguous().to(device, dtype)]
    ours = [compress(w) for w in both]
    theirs = [torch._cslt_compress(w) for w in both]
    same = all(
        a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(ours, theirs)
    )
    if not same:
        warnings.warn(
            f"lightning_sparse's cuSPARSELt packer does not write the bytes of "
            f"torch._cslt_compress on {versions(device)}: 2:4 weights are packed by "
            f"torch._cslt_compress (correct, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return same


_MM_ARGUMENTS = {
    arg.name for arg in torch.ops.aten._cslt_sparse_mm.default._schema.arguments
}


# cuSPARSELt's 16-bit dense operands: rows padded to a multiple of this, as torch pads them
_TOKENS_MULTIPLE = 8


def _sparse_mm(w24: Tensor, dense: Tensor, bias: Tensor | None) -> Tensor:
    """``dense @ w24.T + bias`` for a row-major ``dense`` of shape ``(tokens, in)``."""
    require_kernel(KERNEL, w24.dtype, w24.device)
    tokens = dense.shape[0]
    padding = -tokens % _TOKENS_MULTIPLE
    if padding:
        dense = F.pad(dense, (0, 0, 0, padding))
    packed, dense_t = pack(w24), dense.t()
    algorithm = ALGORITHMS.choose(packed, dense_t, bias, out_features=w24.shape[0])
    options = {
        "alg_id": algorithm.alg_id,
        "split_k": algorithm.split_k,
        "split_k_mode": algorithm.split_k_mode,
    }
    out = torch._cslt_sparse_mm(
        packed,
        dense_t,
        bias,
        transpose_result=True,
        **{name: value for name, value in options.items() if name in _MM_ARGUMENTS},
    )
    return out[:tokens] if padding else out


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


def _setup_input_grad(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    grad, w24 = inputs
    ctx.save_for_backward(grad, w24)


def _backward_input_grad(ctx, grad_out: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    grad, w24 = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_grad = linear_24(grad_out, w24, None) if ctx.needs_input_grad[0] else None
    grad_w = grad.t() @ grad_out if ctx.needs_input_grad[1] else None
    return grad_grad, grad_w


linear_24_input_grad.register_autograd(
    _backward_input_grad, setup_context=_setup_input_grad
)


def cusparselt_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None
) -> Tensor:
    """``x @ W24.T + bias``: ``W24`` is ``weight * mask`` (a transposable 2:4 mask), or the
    greedy 2:4 projection of ``weight``; gradients straight through to ``weight``."""
    w24 = prune_24(weight) if mask is None else straight_through_mask(weight, mask)
    return linear_24(x, w24, bias)
