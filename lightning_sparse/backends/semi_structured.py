"""The semi_structured backend: 2:4 matmuls on NVIDIA sparse tensor cores (Ampere and newer).

A selected ``nn.Linear`` gets a sparse forward by a class swap (the same module object and
Parameter objects, see :mod:`lightning_sparse.backends.masked`). At every forward the weight,
in the matmul dtype (float16/bfloat16, or the autocast dtype), is pruned to a transposable
2:4 pattern (2 of 4 along the rows *and* the columns of every 4x4 tile) chosen greedily by
``|w|`` (torch's tile kernel), so that the forward ``x @ W.T`` and the input gradient
``grad @ W`` both run as sparse matmuls; the weight gradient ``grad.T @ x`` is a dense matmul
and reaches the dense weight unchanged (straight-through), as in PyTorch's 2:4 training recipe.
Two kernels run them:

- ``"cusparselt"``: :mod:`~lightning_sparse.backends.cusparselt`, packed by cuSPARSELt's own
  ``torch._cslt_compress``, or by our packers (Triton kernels, torch ops) where their bytes
  match that on the running GPU;
- ``"cutlass"`` (sm8x): :mod:`~lightning_sparse.backends.cutlass`.

Before a kernel's first matmul in a process, the kernel check
(:mod:`~lightning_sparse.backends.kernel_check`) runs this module's code on a small weight and
compares it with dense math; a kernel that fails it is never run.

Phases with a stored mask (``static``, ``magnitude``) multiply the weight by the mask instead;
the mask must be transposable 2:4. On cuSPARSELt, what the mask fixes of the packed format is
computed when the mask is installed and at each mask update (:func:`~lightning_sparse.backends.cusparselt.mask_packing`),
so each step only gathers the weight's values.

Where a kernel cannot run (a CPU tensor, a float32 matmul), and with ``kernel="emulated"``,
the layer computes what the masked backend computes, with the same operations: the weight
times its greedy transposable 2:4 mask (or times its stored mask). On the CPU that mask is
:func:`~lightning_sparse.masks.tiles.transposable_2to4_mask`; on a GPU the kernel's own
choice, :func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`, which can differ from it only
where ``|w|`` ties within a tile (the GPU tests compare them on weights without ties).

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
from torch.sparse import to_sparse_semi_structured

from lightning_sparse.backends.capability import HALF_DTYPES
from lightning_sparse.backends.cusparselt import (
    MaskPacking,
    cusparselt_linear,
    mask_packing,
    packer_note,
    packs_stored_masks,
)
from lightning_sparse.backends.cutlass import cutlass_linear
from lightning_sparse.backends.kernel_check import register_kernel, require_kernel
from lightning_sparse.backends.masked import (
    SparseClasses,
    SparseForwardMixin,
    matmul_dtype,
    project_eagerly,
    straight_through_mask,
    swap_forward,
)
from lightning_sparse.core.layers import CONV1D, LINEAR
from lightning_sparse.masks.tiles import (
    greedy_2to4_mask,
    is_transposable_2to4,
    transposable_2to4_mask,
)

EMULATED = "emulated"
KernelLinear = Callable[
    [Tensor, Tensor, "Tensor | None", "Tensor | None", "MaskPacking | None"], Tensor
]
"""``(x, weight, bias, mask, packing) -> x @ W24.T + bias`` in ``x``'s dtype (the matmul
dtype) for a row-major 2-D ``x`` and a row-major ``weight`` as stored; ``W24`` is ``weight * mask``, or without a mask the
greedy transposable 2:4 projection of ``weight``; gradients straight through to ``weight``.
``packing`` is cuSPARSELt's packing of the stored mask where it has one (see
:func:`install_semi_structured_forward`); other kernels are given ``None``."""
KERNELS: dict[str, KernelLinear] = {
    "cusparselt": cusparselt_linear,
    "cutlass": cutlass_linear,
}
LABELS = {"cusparselt": "cuSPARSELt", "cutlass": "CUTLASS"}


def kernel_runs(weight: Tensor, dtype: torch.dtype) -> bool:
    """Whether a 2:4 kernel can run a matmul of ``weight`` in ``dtype`` (else: emulation)."""
    return weight.device.type == "cuda" and dtype in HALF_DTYPES


def semi_structured_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kernel: str,
    mask: Tensor | None = None,
    packing: MaskPacking | None = None,
) -> Tensor:
    """``F.linear(input, W24, bias)`` where ``W24`` is the 2:4 projection of ``weight * mask``
    (of ``weight`` without a mask), run by ``kernel``, gradients straight through to ``weight``.
    ``packing``: the mask's packing for cuSPARSELt (:func:`~lightning_sparse.backends.cusparselt.mask_packing`).

    ``kernel="emulated"``, and any matmul that would not run in float16/bfloat16 on a CUDA
    device, computes the same function as the masked backend, with the same operations.

    Raises:
        KernelCheckError: ``kernel`` failed the kernel check on this device and dtype.
    """
    dtype = matmul_dtype(input, weight)
    if kernel == EMULATED or not kernel_runs(weight, dtype):
        if mask is None:
            mask = project_eagerly(greedy_2to4_mask, weight, dtype)
        return F.linear(input, straight_through_mask(weight, mask), bias)
    if (
        not torch.compiler.is_compiling()
    ):  # compiled graphs run the ops, which check too
        require_kernel(kernel, dtype, weight.device)
    # The kernels read row-major (Conv1D's W.T is not) and cast the weight to x's dtype
    # themselves, so that they can save it as it is; the matmuls take 2-D row-major inputs.
    w = weight.contiguous()
    x = input.to(dtype).reshape(-1, input.shape[-1]).contiguous()
    b = None if bias is None else bias.to(dtype)
    out = KERNELS[kernel](x, w, b, mask, packing)
    return out.view(*input.shape[:-1], out.shape[-1])


def _checked_linears(
    kernel: str,
) -> list[Callable[[Tensor, Tensor, Tensor | None], Tensor]]:
    """The code paths the kernel check runs ``kernel`` through: the weight projected at every
    forward (``runtime``), and a stored mask (its greedy transposable 2:4 mask), as
    :func:`install_semi_structured_forward` packs it."""

    def projected(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return semi_structured_linear(x, weight, bias, kernel)

    def stored(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        mask = transposable_2to4_mask(weight.detach())
        packing = stored_mask_packing(kernel, mask, mask)
        return semi_structured_linear(x, weight, bias, kernel, mask, packing)

    return [projected, stored]


register_kernel(
    "cusparselt",
    *_checked_linears("cusparselt"),
    label=LABELS["cusparselt"],
    describe=packer_note,
)
register_kernel("cutlass", *_checked_linears("cutlass"), label=LABELS["cutlass"])

INFERENCE = "semi_structured_tensor"
"""The kernel check's name for torch's ``to_sparse_semi_structured`` tensors (inference)."""


def pack_for_inference(w24: Tensor) -> Tensor:
    """A 2:4 weight as torch's ``SparseSemiStructuredTensor`` (``to_sparse_semi_structured``:
    cuSPARSELt's own packing where torch has it), for inference ``F.linear`` calls.

    Raises:
        KernelCheckError: those tensors failed the kernel check on this device and dtype.
    """
    require_kernel(INFERENCE, w24.dtype, w24.device)
    return to_sparse_semi_structured(w24)


register_kernel(
    INFERENCE,
    lambda x, w24, bias: F.linear(x, pack_for_inference(w24), bias),
    label="torch's SparseSemiStructuredTensor",
    prunes=False,
    trains=False,
)


class NotTransposableError(ValueError):
    """A stored mask that the 2:4 kernels cannot run (not transposable 2:4)."""


class SemiStructuredForward(SparseForwardMixin):
    """A matmul layer (``Linear``, ``Conv1D``) whose matmuls run 2:4-sparse (see the module
    docstring) on the weight as the ``(out, in)`` matrix it multiplies by."""

    _ls_kernel: str

    _ls_packing: MaskPacking | None

    def forward(self, input: Tensor) -> Tensor:
        matrix = self._ls_layer.matrix
        mask = self._ls_mask
        packing = self._ls_packing
        if (
            packing is not None
            and not torch.compiler.is_compiling()
            and mask._version != packing.version  # changed in place since installed
        ):
            packing = self._ls_packing = stored_mask_packing(
                self._ls_kernel, matrix(mask).contiguous(), mask, packing
            )
        if packing is not None:  # it holds the mask's (out, in) matrix already
            mask_matrix = packing.mask
        else:
            mask_matrix = None if mask is None else matrix(mask).contiguous()
        return semi_structured_linear(
            input, matrix(self.weight), self.bias, self._ls_kernel, mask_matrix, packing
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
    ``weight * mask``, else on the matrix's own 2:4 projection.

    Call it again after the mask changes: for cuSPARSELt it packs the mask's positions anew
    (into the same tensors, which compiled graphs hold)."""
    if kernel not in (*KERNELS, EMULATED):
        raise ValueError(f"kernel={kernel!r}; use one of {[*KERNELS, EMULATED]}")
    # transposable 2:4 holds for the matrix iff it holds for its transpose
    if mask is not None and not is_transposable_2to4(mask):
        raise NotTransposableError(
            "the semi_structured backend runs stored masks that are transposable 2:4 (at most "
            "2 kept per row and per column of every 4x4 tile); this mask is not"
        )
    previous = module.__dict__.get("_ls_packing")
    swap_forward(module, _SEMI_STRUCTURED_CLASSES, mask=mask)
    module._ls_kernel = kernel
    module._ls_packing = (
        None
        if mask is None
        else stored_mask_packing(
            kernel, module._ls_layer.matrix(mask).contiguous(), mask, previous
        )
    )


def stored_mask_packing(
    kernel: str, matrix: Tensor, stored: Tensor, previous: MaskPacking | None = None
) -> MaskPacking | None:
    """What ``kernel`` packs of a stored mask ahead of the steps: for cuSPARSELt, the
    :func:`~lightning_sparse.backends.cusparselt.mask_packing` of the ``(out, in)`` bool
    ``matrix`` (``stored``: the mask as kept, whose version is recorded; ``previous``: the
    packing to write into), where our packer knows the shape; else ``None``."""
    if kernel != "cusparselt" or not packs_stored_masks(tuple(matrix.shape)):
        return None
    return mask_packing(matrix, stored, previous)
