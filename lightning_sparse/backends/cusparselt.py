"""The cuSPARSELt 2:4 linear as custom ops: ``x @ W24.T`` and its input gradient.

- ``lightning_sparse::linear_24_projected(x, weight, bias)``: ``W24`` is the greedy
  transposable 2:4 projection of ``weight``, packed in cuSPARSELt's format; runs
  ``torch._cslt_sparse_mm`` with the algorithm searched for its shape
  (:mod:`~lightning_sparse.backends.cusparselt_algorithms`). Its backward projects ``weight``
  again and multiplies ``grad`` by ``W24.T`` packed
  (``lightning_sparse::linear_24_projected_input_grad``), and computes the weight gradient
  ``grad.T @ x`` densely (straight-through to the weight). Where the Triton kernels pack
  (:mod:`~lightning_sparse.backends.triton_sparse24`), one pass over the weight chooses the
  mask (:func:`~lightning_sparse.masks.tiles.transposable_2to4_mask`'s choice, ties included)
  and writes the packing; else torch's tile kernel chooses it
  (:func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`) and :func:`pack` packs.
- ``lightning_sparse::linear_24(x, weight, bias, mask)``: the same for ``weight * mask`` (a
  stored mask at a shape our packers do not know), or a 2:4 weight as it is; its backward
  packs ``W24.T`` (``lightning_sparse::linear_24_input_grad``).
- ``lightning_sparse::linear_24_stored(x, weight, bias, mask, ...)``: the same product for a
  stored mask, with what the mask fixes of the packed format (its :class:`MaskPacking`, made
  at each mask update by :func:`mask_packing`), so that each step only gathers the values (or
  the Triton kernels pack the weight at the mask in one pass).

Every op takes the weight as stored and casts it to the matmul dtype (``x``'s) inside, so what
it saves for the backward is the weight itself and the stored mask's tensors, never a pruned
or cast copy: under FSDP2 that weight is its unsharded parameter, whose storage FSDP2 frees
after the forward and gathers again for the backward, so no layer holds a weight-sized tensor
from its forward to its backward. The backward makes ``W24.T`` again from it (for a projected
mask, the same mask: it depends on the values only), one more pass over the weight, instead of
keeping ``W24.T`` packed (9/16 of the weight's bytes a layer).

The packer (:func:`packer`) is chosen once per process, dtype and device, at the first packing:
the Triton kernels where they write the bytes of cuSPARSELt's own ``torch._cslt_compress`` on
the running GPU and ``torch._cslt_sparse_mm`` computes the same products from both, else our
torch-ops packer (:mod:`~lightning_sparse.backends.cusparselt_packer`) where it does, else
``torch._cslt_compress``; each comparison runs on weights with padded groups and negative
zeros, and a difference warns once. ``torch._cslt_compress`` is only ever given positive
zeros: ``weight * mask`` leaves ``-0.0`` at pruned negative weights, which a compressor may
count as kept values (CUTLASS's sm90 compressor did).

Being custom ops with fake implementations, they are single nodes that ``torch.compile``
traces (and CUDA graphs capture) without looking inside; which packer runs is decided inside
them, as they run. Each run first asks
:func:`~lightning_sparse.backends.kernel_check.require_kernel`, before any cuSPARSELt work, so
they refuse to run where the kernel check failed.

Example (shapes only, on fake CUDA tensors):
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     x = torch.empty(300, 256, device="cuda", dtype=torch.bfloat16)
    ...     w = torch.empty(128, 256, device="cuda", dtype=torch.bfloat16)
    ...     linear_24_projected(x, w, None).shape
    torch.Size([300, 128])
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
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
    first_line,
    known_values,
    normalized_device,
    require_kernel,
    versions,
)
from lightning_sparse.masks.tiles import greedy_2to4_mask, transposable_2to4_mask

try:
    from lightning_sparse.backends import triton_sparse24
except ModuleNotFoundError as missing:  # the CPU torch build has no Triton
    if missing.name != "triton":
        raise
    triton_sparse24 = None

KERNEL = "cusparselt"


def pack(w24: Tensor) -> Tensor:
    """``w24`` (row-major, 2:4 along rows) in cuSPARSELt's compressed layout."""
    if supports(w24.shape, w24.dtype) and packer_matches(w24.dtype, w24.device):
        return compress(w24)
    return torch._cslt_compress(positive_zeros(w24))


TRITON, TORCH_OPS, CSLT = "triton", "torch", "cslt"


@dataclass(frozen=True)
class Packer:
    """The packer of cuSPARSELt's format for one dtype and device in this process: ``name``
    is ``"triton"`` (the Triton kernels, and our torch-ops packer where they do not apply),
    ``"torch"`` (our torch-ops packer) or ``"cslt"`` (``torch._cslt_compress``); ``why``: why
    not the Triton kernels."""

    name: str
    why: str = ""

    def note(self) -> str:
        """What the fit-start table says of it."""
        if self.name == TRITON:
            return "packed by lightning_sparse's Triton kernels"
        packer = (
            "lightning_sparse" if self.name == TORCH_OPS else "torch._cslt_compress"
        )
        return f"packed by {packer} ({self.why})"


_PACKERS: dict[tuple[torch.dtype, torch.device], Packer] = {}
_FUSED = True  # see fused_kernels


def packer(dtype: torch.dtype, device: torch.device) -> Packer:
    """The packer for ``dtype`` on ``device``, chosen at the first call (comparing with
    ``torch._cslt_compress``; while a CUDA graph is captured, an unknown one counts as
    ``torch._cslt_compress``)."""
    key = (dtype, normalized_device(device))
    if key not in _PACKERS:
        if capturing(device):
            return Packer(CSLT, "not compared yet: a CUDA graph was being captured")
        _PACKERS[key] = _choose_packer(*key)
    return _PACKERS[key]


def packer_matches(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether our packers write the bytes of ``torch._cslt_compress`` on ``device`` in
    ``dtype`` (see :func:`packer`)."""
    return packer(dtype, device).name != CSLT


def packer_note(dtype: torch.dtype, device: torch.device) -> str:
    """Which packer this process uses, for the fit-start table (nothing off a GPU)."""
    if device.type != "cuda":
        return ""
    return packer(dtype, device).note()


@contextlib.contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Inside the block, the cuSPARSELt ops use the Triton kernels where they were chosen
    (``True``, as outside) or our torch-ops packer instead (``False``: to time the difference).

    Example:
        >>> with fused_kernels(False):
        ...     _fused(torch.zeros(128, 128, dtype=torch.bfloat16))
        False
    """
    global _FUSED
    before, _FUSED = _FUSED, enabled
    try:
        yield
    finally:
        _FUSED = before


def _fused(weight: Tensor) -> bool:
    """Whether the Triton kernels pack ``weight`` (they passed their comparison for its dtype
    and device, and take its shape)."""
    return (
        _FUSED
        and supports(weight.shape, weight.dtype)
        and packer(weight.dtype, weight.device).name == TRITON
    )


def _choose_packer(dtype: torch.dtype, device: torch.device) -> Packer:
    if not _compare_packers(dtype, device):
        return Packer(CSLT, "lightning_sparse's packers write other bytes here")
    why = _triton_differs(dtype, device)
    return Packer(TORCH_OPS, why) if why else Packer(TRITON)


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
        same = same and _writes_cslt_bytes(compress(w), w)
    if not same:
        warnings.warn(
            f"lightning_sparse's cuSPARSELt packer does not write the bytes of "
            f"torch._cslt_compress on {versions(device)}: 2:4 weights are packed by "
            f"torch._cslt_compress (correct, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
    return same


def _triton_differs(dtype: torch.dtype, device: torch.device) -> str:
    """Why the Triton kernels are not used on ``device`` in ``dtype``: empty where both write
    the bytes of ``torch._cslt_compress`` and ``torch._cslt_sparse_mm`` computes the same
    products from them, for ``W`` and ``W.T`` of a weight with zeros, negative zeros and groups
    keeping fewer than 2 (the mask chosen by the kernel, and a stored mask)."""
    if triton_sparse24 is None:
        return "Triton is not installed"
    if not triton_sparse24.runs_on(device):
        return f"the Triton kernels do not run on {device.type} tensors here"
    weight = known_values(128, 256)
    weight[:8, :8] = -0.0  # tiles of zeros: groups keeping none ...
    weight[0, 1], weight[5, 6] = 0.75, -0.75  # ... and groups keeping one
    w24 = weight * transposable_2to4_mask(weight)
    expected = [w.to(device, dtype) for w in (w24, w24.t().contiguous())]
    w = weight.to(device, dtype)
    try:
        fused = triton_sparse24.mask_and_pack(w)
        stored = triton_sparse24.pack(w, (w24 != 0).to(device))
    except (torch.OutOfMemoryError, torch.AcceleratorError):
        raise  # the GPU's state, not the kernels': no choice is kept
    except Exception as err:  # noqa: BLE001 (a kernel that fails here is not used)
        why = f"the Triton kernels raised {type(err).__name__} ({first_line(err)})"
    else:
        packings = zip((*fused, *stored), expected * 2)
        if all(_writes_cslt_bytes(ours, w24) for ours, w24 in packings):
            return ""
        why = "the Triton kernels write other bytes than torch._cslt_compress"
    warnings.warn(
        f"{why} on {versions(device)}: 2:4 weights are packed by lightning_sparse's torch-ops "
        f"packer (correct, slower)",
        RuntimeWarning,
        stacklevel=4,
    )
    return why


def _writes_cslt_bytes(ours: Tensor, w24: Tensor) -> bool:
    """Whether ``ours`` holds the bytes ``torch._cslt_compress`` writes for the 2:4 ``w24``
    (stored zeros by value) and ``torch._cslt_sparse_mm`` computes the same product from it."""
    theirs = torch._cslt_compress(positive_zeros(w24))
    x = torch.randn(w24.shape[1], 64, generator=torch.Generator().manual_seed(0))
    x = x.to(w24.device, w24.dtype)
    return (
        ours.shape == theirs.shape
        and torch.equal(canonical_words(ours), canonical_words(theirs))
        and torch.equal(
            torch._cslt_sparse_mm(ours, x), torch._cslt_sparse_mm(theirs, x)
        )
    )


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


def _in_dtype(weight: Tensor, dtype: torch.dtype, mask: Tensor | None = None) -> Tensor:
    """``weight`` in the matmul ``dtype`` (a copy only where it is stored in another), times
    ``mask`` where given. The ops take the weight as stored and cast it here, in the forward
    and again in the backward, so that what they save for the backward is the weight itself
    (under FSDP2 its own unsharded parameter, whose storage FSDP2 frees after the forward and
    gathers again for the backward), never a private copy of it."""
    w = weight.to(dtype)
    return w if mask is None else w * mask


def _straight_through(grad_w: Tensor, weight: Tensor) -> Tensor:
    """The dense weight gradient in the weight's stored dtype, as autograd's cast would give it."""
    return grad_w.to(weight.dtype)


@torch.library.custom_op("lightning_sparse::linear_24", mutates_args=())
def linear_24(
    x: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None = None
) -> Tensor:
    """``x @ W24.T + bias`` on cuSPARSELt, in ``x``'s dtype: ``x`` (tokens, in) row-major,
    ``W24`` (out, in) is ``weight * mask`` (a 2:4 ``mask``), or ``weight`` itself where it is
    2:4 already (no ``mask``); gradients straight through to ``weight``."""
    require_kernel(KERNEL, x.dtype, weight.device)
    return _sparse_mm(pack(_in_dtype(weight, x.dtype, mask)), weight.shape[0], x, bias)


@linear_24.register_fake
def _(
    x: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None = None
) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("lightning_sparse::linear_24_input_grad", mutates_args=())
def linear_24_input_grad(
    grad: Tensor, weight: Tensor, mask: Tensor | None = None
) -> Tensor:
    """``grad @ W24`` on cuSPARSELt (``W24.T`` packed), in ``grad``'s dtype: the input
    gradient of ``linear_24``."""
    require_kernel(KERNEL, grad.dtype, weight.device)
    w24_t = _in_dtype(weight, grad.dtype, mask).t().contiguous()
    return _sparse_mm(pack(w24_t), weight.shape[1], grad, None)


@linear_24_input_grad.register_fake
def _(grad: Tensor, weight: Tensor, mask: Tensor | None = None) -> Tensor:
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _setup(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, mask = inputs
    ctx.save_for_backward(x, weight, mask)  # W24 is made again in the backward
    ctx.has_bias = bias is not None


def _backward(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    x, weight, mask = ctx.saved_tensors
    grad = grad.contiguous()
    needs = ctx.needs_input_grad
    grad_x = linear_24_input_grad(grad, weight, mask) if needs[0] else None
    grad_w = _straight_through(grad.t() @ x, weight) if needs[1] else None
    grad_b = grad.sum(0) if ctx.has_bias and needs[2] else None
    return grad_x, grad_w, grad_b, None


linear_24.register_autograd(_backward, setup_context=_setup)


def _setup_input_grad(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _backward_input_grad(ctx, grad_out: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    grad, weight, mask = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    needs = ctx.needs_input_grad
    grad_grad = linear_24(grad_out, weight, None, mask) if needs[0] else None
    grad_w = _straight_through(grad.t() @ grad_out, weight) if needs[1] else None
    return grad_grad, grad_w, None


linear_24_input_grad.register_autograd(
    _backward_input_grad, setup_context=_setup_input_grad
)


def _project_and_pack(weight: Tensor, transposed: bool) -> Tensor:
    """``W24``, the greedy transposable 2:4 projection of ``weight``, packed (``transposed``:
    ``W24.T`` packed): by the Triton kernels in one pass, or with torch's tile kernel's mask by
    :func:`pack`. The mask depends on the values only, so the forward's ``W24`` and the
    backward's ``W24.T`` are made from the same mask."""
    if _fused(weight):
        packed, packed_t = triton_sparse24.mask_and_pack(
            weight, rows=not transposed, columns=transposed
        )
        return packed_t if transposed else packed
    w24 = weight * greedy_2to4_mask(weight)
    return pack(w24.t().contiguous() if transposed else w24)


@torch.library.custom_op("lightning_sparse::linear_24_projected", mutates_args=())
def linear_24_projected(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W24.T + bias`` on cuSPARSELt, in ``x``'s dtype (float16 or bfloat16), for the
    greedy transposable 2:4 projection ``W24`` of ``weight`` in that dtype; gradients straight
    through to ``weight``. Its backward saves ``weight`` as given and projects it again for the
    input gradient (``linear_24_projected_input_grad``)."""
    require_kernel(KERNEL, x.dtype, weight.device)
    packed = _project_and_pack(_in_dtype(weight, x.dtype), False)
    return _sparse_mm(packed, weight.shape[0], x, bias)


@linear_24_projected.register_fake
def _(x, weight, bias):  # type: ignore[no-untyped-def]
    torch._check(x.dtype in DTYPES, lambda: f"x has dtype {x.dtype}")
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op(
    "lightning_sparse::linear_24_projected_input_grad", mutates_args=()
)
def linear_24_projected_input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    """``grad @ W24`` on cuSPARSELt, ``W24`` projected from ``weight`` again (``W24.T``
    packed): the input gradient of ``linear_24_projected`` (not differentiable again)."""
    require_kernel(KERNEL, grad.dtype, weight.device)
    packed_t = _project_and_pack(_in_dtype(weight, grad.dtype), True)
    return _sparse_mm(packed_t, weight.shape[1], grad, None)


@linear_24_projected_input_grad.register_fake
def _(grad: Tensor, weight: Tensor) -> Tensor:
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _no_second_order(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    raise RuntimeError(
        "a second-order gradient through a runtime 2:4 layer on cuSPARSELt: its backward "
        "projects the weight inside one op, which cannot be differentiated again; run that "
        "layer with backend='masked' (the same function, in dense math)"
    )


linear_24_projected_input_grad.register_autograd(_no_second_order)


def _setup_projected(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)  # no packing: W24.T is made again in the backward
    ctx.has_bias = bias is not None


def _backward_projected(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    x, weight = ctx.saved_tensors
    grad = grad.contiguous()
    needs = ctx.needs_input_grad
    grad_x = linear_24_projected_input_grad(grad, weight) if needs[0] else None
    grad_w = _straight_through(grad.t() @ x, weight) if needs[1] else None
    grad_b = grad.sum(0) if ctx.has_bias and needs[2] else None
    return grad_x, grad_w, grad_b


linear_24_projected.register_autograd(
    _backward_projected, setup_context=_setup_projected
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
    weight: Tensor, mask: Tensor, keys: Tensor, metadata: Tensor, transposed: bool
) -> Tensor:
    """``weight * mask`` (``transposed``: its transpose; ``keys``/``metadata``: that one's
    packing) in cuSPARSELt's format, by the packer in use: the Triton kernels (reading
    ``weight`` and ``mask`` as they are), our packer gathering at the stored positions, or
    ``torch._cslt_compress``."""
    if _fused(weight):
        packed, packed_t = triton_sparse24.pack(
            weight, mask, rows=not transposed, columns=transposed
        )
        return packed_t if transposed else packed
    if transposed:
        weight, mask = weight.t().contiguous(), mask.t().contiguous()
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
    """``x @ (weight * mask).T + bias`` on cuSPARSELt, in ``x``'s dtype, the weight packed at
    the stored mask's positions (``keys``/``metadata``: its packing; ``keys_t``/``metadata_t``:
    its transpose's)."""
    require_kernel(KERNEL, x.dtype, weight.device)
    w = _in_dtype(weight, x.dtype)
    return _sparse_mm(_pack_stored(w, mask, keys, metadata, False), w.shape[0], x, bias)


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
    """``grad @ (weight * mask)`` on cuSPARSELt, in ``grad``'s dtype: the input gradient of
    ``linear_24_stored``."""
    require_kernel(KERNEL, grad.dtype, weight.device)
    packed = _pack_stored(_in_dtype(weight, grad.dtype), mask, keys_t, metadata_t, True)
    return _sparse_mm(packed, weight.shape[1], grad, None)


@linear_24_stored_input_grad.register_fake
def _(grad, weight, mask, keys, metadata, keys_t, metadata_t):  # type: ignore[no-untyped-def]
    return grad.new_empty((grad.shape[0], weight.shape[1]))


def _setup_stored(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, *packing_ = inputs
    ctx.save_for_backward(
        x, weight, *packing_
    )  # the weight as given, the mask's packing
    ctx.has_bias = bias is not None


def _backward_stored(ctx, grad: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    x, weight, *packing_ = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = (
        linear_24_stored_input_grad(grad, weight, *packing_)
        if ctx.needs_input_grad[0]
        else None
    )
    grad_w = (
        _straight_through(grad.t() @ x, weight) if ctx.needs_input_grad[1] else None
    )
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
    grad_w = (
        _straight_through(grad.t() @ grad_out, weight)
        if ctx.needs_input_grad[1]
        else None
    )
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
    """``x @ W24.T + bias`` in ``x``'s dtype: ``W24`` is ``weight * mask`` (a transposable 2:4
    mask; with its ``packing``, packed at its stored positions), or the greedy 2:4 projection
    of ``weight``; gradients straight through to ``weight`` (any float dtype: each op casts it
    inside, so what it saves for the backward is ``weight`` itself, never a pruned copy)."""
    if packing is not None:
        return linear_24_stored(x, weight, bias, *packing.op_arguments())
    if mask is None:
        return linear_24_projected(x, weight, bias)
    return linear_24(x, weight, bias, mask)
