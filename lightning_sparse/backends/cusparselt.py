"""The cuSPARSELt 2:4 linear as custom ops: prune, then ``x @ W24.T`` and its input gradient.

- ``lightning_sparse::prune_24(weight)``: ``weight`` times its greedy transposable 2:4 mask
  (:func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`: torch's tile kernel on CUDA), with
  a straight-through gradient.
- ``lightning_sparse::linear_24(x, w24, bias)``: packs ``w24`` (:func:`pack`) and runs
  ``torch._cslt_sparse_mm`` with the algorithm searched for its shape
  (:mod:`~lightning_sparse.backends.cusparselt_algorithms`); its backward packs ``w24.T`` for
  the input gradient ``grad @ W24`` (``lightning_sparse::linear_24_input_grad``) and computes
  the weight gradient ``grad.T @ x`` densely (straight-through to the weight).

- ``lightning_sparse::linear_24_stored(x, weight, bias, mask, ...)``: the same product for a
  stored mask, with what the mask fixes of the packed format (its :class:`MaskPacking`, made
  at each mask update by :func:`mask_packing`), so that each step only gathers the values.

Packing uses our packer (:mod:`~lightning_sparse.backends.cusparselt_packer`, at memory speed)
where its bytes equal those of cuSPARSELt's own ``torch._cslt_compress`` on the running GPU and
``torch._cslt_sparse_mm`` computes the same product from both (compared once per process, dtype
and device, on weights with padded groups and negative zeros), and ``torch._cslt_compress``
everywhere else; a difference warns once. ``torch._cslt_compress`` is only ever given positive
zeros: ``weight * mask`` leaves ``-0.0`` at pruned negative weights, which a compressor may
count as kept values (CUTLASS's sm90 compressor did).

Being custom ops with fake implementations, they are single nodes that ``torch.compile``
traces (and CUDA graphs capture) without looking inside. Each run first asks
:func:`~lightning_sparse.backends.kernel_check.require_kernel`, before any cuSPARSELt work, so
they refuse to run where the kernel check failed.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.backends.cusparselt_algorithms import ALGORITHMS, sparse_mm
from lightning_sparse.backends.cusparselt_packer import (
    DTYPES,
    Packing,
    canonical_words,
    compress,
    packing,
    positive_zeros,
    supports,
)
from lightning_sparse.backends.kernel_check import (
    capturing,
    known_values,
    normalized_device,
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
    return torch._cslt_compress(positive_zeros(w24))


_PACKER_MATCHES: dict[tuple[torch.dtype, torch.device], bool] = {}


def packer_matches(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether our packer writes the bytes of ``torch._cslt_compress`` on ``device`` in
    ``dtype`` (compared once; while a CUDA graph is captured, unknown counts as no)."""
    key = (dtype, normalized_device(device))
    if key not in _PACKER_MATCHES:
        if capturing(device):
            return False
        _PACKER_MATCHES[key] = _compare_packers(*key)
    return _PACKER_MATCHES[key]


def packer_note(dtype: torch.dtype, device: torch.device) -> str:
    """Which packer this process uses, for the fit-start table (nothing off a GPU)."""
    if device.type != "cuda":
        return ""
    if packer_matches(dtype, device):
        return "packed by lightning_sparse"
    return "packed by torch._cslt_compress"


def _compare_packers(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether our packer writes the bytes of ``torch._cslt_compress`` (given positive zeros;
    stored zeros compared by value, :func:`canonical_words`) for weights holding ``-0.0`` where
    pruned, and ``torch._cslt_sparse_mm`` computes the same product from both, for ``W`` and
    ``W.T``."""
    weight = known_values(128, 256)
    w24 = weight * transposable_2to4_mask(
        weight
    )  # -0.0 at every pruned negative weight
    w24[:8, :8] = -0.0  # groups keeping 1 or none: padded; a kept weight that is -0.0
    same = True
    for w in (w24, w24.t().contiguous()):
        w = w.to(device, dtype)
        ours, theirs = compress(w), torch._cslt_compress(positive_zeros(w))
        x = torch.randn(w.shape[1], 64, generator=torch.Generator().manual_seed(0))
        x = x.to(device, dtype)
        same = same and (
            ours.shape == theirs.shape
            and torch.equal(canonical_words(ours), canonical_words(theirs))
            and torch.equal(
                torch._cslt_sparse_mm(ours, x), torch._cslt_sparse_mm(theirs, x)
            )
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


# cuSPARSELt's 16-bit dense operands: rows padded to a multiple of this, as torch pads them
_TOKENS_MULTIPLE = 8


def _sparse_mm(
    packed: Tensor, out_features: int, dense: Tensor, bias: Tensor | None
) -> Tensor:
    """``dense @ W24.T + bias`` for a row-major ``dense`` of shape ``(tokens, in)``, where
    ``packed`` is the ``(out_features, in)`` weight ``W24`` in cuSPARSELt's format."""
    tokens = dense.shape[0]
    padding = -tokens % _TOKENS_MULTIPLE
    if padding:
        dense = F.pad(dense, (0, 0, 0, padding))
    dense_t = dense.t()
    algorithm = ALGORITHMS.choose(packed, dense_t, bias, out_features=out_features)
    out = sparse_mm(packed, dense_t, bias, True, algorithm)
    return out[:tokens] if padding else out


@torch.library.custom_op("lightning_sparse::linear_24", mutates_args=())
def linear_24(x: Tensor, w24: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ w24.T + bias`` on cuSPARSELt: ``x`` (tokens, in) row-major, ``w24`` (out, in)."""
    require_kernel(KERNEL, w24.dtype, w24.device)
    return _sparse_mm(pack(w24), w24.shape[0], x, bias)


@linear_24.register_fake
def _(x: Tensor, w24: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], w24.shape[0]))


@torch.library.custom_op("lightning_sparse::linear_24_input_grad", mutates_args=())
def linear_24_input_grad(grad: Tensor, w24: Tensor) -> Tensor:
    """``grad @ w24`` on cuSPARSELt (``w24.T`` packed): the input gradient of ``linear_24``."""
    require_kernel(KERNEL, w24.dtype, w24.device)
    return _sparse_mm(pack(w24.t().contiguous()), w24.shape[1], grad, None)


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


@dataclass(frozen=True, eq=False)
class MaskPacking:
    """What a stored transposable 2:4 mask fixes of the packed ``W`` and ``W.T``: each group's
    stored positions and the metadata bytes (:class:`~lightning_sparse.backends.cusparselt_packer.Packing`).

    Made by :func:`mask_packing` when the mask is installed and at each mask update (the engine
    reinstalls the forward then), and refreshed in place, so a compiled graph or CUDA graph that
    holds these tensors reads the current mask's packing. ``version`` is the stored mask's
    version counter when it was made: an eager forward that finds the mask changed since then
    packs it again.
    """

    mask: Tensor
    """The ``(out, in)`` bool mask matrix (a copy where the stored mask is laid out otherwise)."""
    rows: Packing
    """The packing of ``W`` (the forward's weight)."""
    columns: Packing
    """The packing of ``W.T`` (the input gradient's weight)."""
    version: int

    def op_arguments(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(mask, keys, metadata, keys_t, metadata_t)``: what the stored-mask ops take."""
        rows, columns = self.rows, self.columns
        return self.mask, rows.keys, rows.metadata, columns.keys, columns.metadata


def packs_stored_masks(shape: tuple[int, ...]) -> bool:
    """Whether :func:`mask_packing` packs a stored mask of this ``(out, in)`` shape (one our
    packer knows the layout of, in both orientations)."""
    return supports(shape, DTYPES[0])


def mask_packing(
    matrix: Tensor, stored: Tensor, previous: MaskPacking | None = None
) -> MaskPacking:
    """The :class:`MaskPacking` of the bool ``(out, in)`` mask ``matrix`` (``stored``: the
    mask as the engine keeps it, whose version counter is recorded), written into
    ``previous``'s tensors when they have its shape and device. The shape must
    :func:`packs_stored_masks`.

    Example:
        >>> import torch
        >>> mask = torch.zeros(128, 256, dtype=torch.bool)
        >>> mask[:, 0::4] = mask[:, 1::4] = True
        >>> first = mask_packing(mask, mask)
        >>> _ = mask.copy_(mask.roll(2, dims=1))  # an update in place, then a reinstall
        >>> again = mask_packing(mask, mask, previous=first)
        >>> again.rows.keys is first.rows.keys, torch.equal(again.rows.metadata, packing(mask).metadata)
        (True, True)
    """
    rows, columns = packing(matrix), packing(matrix.t().contiguous())
    version = stored._version
    fresh = previous is None or (previous.rows.shape, previous.mask.device) != (
        rows.shape,
        matrix.device,
    )
    if fresh:
        return MaskPacking(matrix.clone(), rows, columns, version)
    previous.mask.copy_(matrix)
    for old, new in ((previous.rows, rows), (previous.columns, columns)):
        old.keys.copy_(new.keys)
        old.metadata.copy_(new.metadata)
    return MaskPacking(previous.mask, previous.rows, previous.columns, version)


def _pack_stored(
    weight: Tensor, mask: Tensor, keys: Tensor, metadata: Tensor
) -> Tensor:
    """``weight * mask`` in cuSPARSELt's format: gathered at the stored positions by our
    packer where it matches ``torch._cslt_compress``, else by ``torch._cslt_compress``."""
    if packer_matches(weight.dtype, weight.device):
        return Packing(tuple(weight.shape), keys, metadata).compress(weight)
    return torch._cslt_compress(positive_zeros(weight * mask))


@torch.library.custom_op("lightning_sparse::linear_24_stored", mutates_args=())
def linear_24_stored(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mask: Tensor,
    keys: Tensor,
    metadata: Tensor,
    keys_t: Tensor,
    metadata_t: Tensor,
) -> Tensor:
    """``x @ (weight * mask).T + bias`` on cuSPARSELt, the weight packed at the stored mask's
    positions (``keys``/``metadata``: its packing; ``keys_t``/``metadata_t``: its transpose's)."""
    require_kernel(KERNEL, weight.dtype, weight.device)
    return _sparse_mm(
        _pack_stored(weight, mask, keys, metadata), weight.shape[0], x, bias
    )


@linear_24_stored.register_fake
def _(x, weight, bias, mask, keys, metadata, keys_t, metadata_t):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op(
    "lightning_sparse::linear_24_stored_input_grad", mutates_args=()
)
def linear_24_stored_input_grad(
    grad: Tensor,
    weight: Tensor,
    mask: Tensor,
    keys: Tensor,
    metadata: Tensor,
    keys_t: Tensor,
    metadata_t: Tensor,
) -> Tensor:
    """``grad @ (weight * mask)`` on cuSPARSELt: the input gradient of ``linear_24_stored``."""
    require_kernel(KERNEL, weight.dtype, weight.device)
    packed = _pack_stored(
        weight.t().contiguous(), mask.t().contiguous(), keys_t, metadata_t
    )
    return _sparse_mm(packed, weight.shape[1], grad, None)


@linear_24_stored_input_grad.register_fake
def _(grad, weight, mask, keys, metadata, keys_t, metadata_t):  # type: ignore[no-untyped-def]
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _setup_stored(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, *packing_ = inputs
    ctx.save_for_backward(x, weight, *packing_)
    ctx.has_bias = bias is not None


def _backward_stored(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    x, weight, *packing_ = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = (
        linear_24_stored_input_grad(grad, weight, *packing_)
        if ctx.needs_input_grad[0]
        else None
    )
    grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None  # straight-through
    grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None, None, None, None, None


linear_24_stored.register_autograd(_backward_stored, setup_context=_setup_stored)


def _setup_stored_input_grad(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _backward_stored_input_grad(ctx, grad_out: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    grad, weight, *packing_ = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_grad = (
        linear_24_stored(grad_out, weight, None, *packing_)
        if ctx.needs_input_grad[0]
        else None
    )
    grad_w = grad.t() @ grad_out if ctx.needs_input_grad[1] else None
    return grad_grad, grad_w, None, None, None, None, None


linear_24_stored_input_grad.register_autograd(
    _backward_stored_input_grad, setup_context=_setup_stored_input_grad
)


def cusparselt_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    packing: MaskPacking | None = None,
) -> Tensor:
    """``x @ W24.T + bias``: ``W24`` is ``weight * mask`` (a transposable 2:4 mask; with its
    ``packing``, packed at its stored positions), or the greedy 2:4 projection of ``weight``;
    gradients straight through to ``weight``."""
    if packing is not None:
        return linear_24_stored(x, weight, bias, *packing.op_arguments())
    w24 = prune_24(weight) if mask is None else straight_through_mask(weight, mask)
    return linear_24(x, w24, bias)
