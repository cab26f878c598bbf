"""Can a layer run on 2:4 sparse tensor cores? The rules, read from the installed torch.

``torch.backends.cusparselt.is_available()`` only says that the build ships cuSPARSELt; it is
``True`` on a machine without a GPU. So every rule here looks at the parameter's own device:

- a CUDA device (not ROCm) of compute capability 8.0 (Ampere) or newer;
- a plain ``nn.Linear`` or Hugging Face ``Conv1D`` weight (2-D, not shared by several modules),
  stored as a plain tensor or sharded by FSDP2, whose forward multiplies the gathered whole
  tensor (:mod:`~lightning_sparse.backends.fsdp`); not a DTensor that reaches the forward
  (tensor parallelism);
- a float16 or bfloat16 matmul: the weight's dtype (for FSDP2, the gathered weight's:
  ``MixedPrecisionPolicy(param_dtype=...)``), or the autocast dtype of
  ``precision="16-mixed"`` / ``"bf16-mixed"``; without autocast the bias has the weight's dtype;
- a shape the kernels take. ``torch._sparse_semi_structured_tile`` (the runtime 2:4 projection
  that packs ``W`` and ``W.T``) needs both dimensions to be multiples of 128 in cuSPARSELt
  format; its CUTLASS format (sm8x only: torch's CUTLASS 2:4 kernels are built for Ampere)
  needs multiples of 32 rows and 64 columns for ``W`` and for ``W.T``, so 64 for both.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.backends.capability import semi_structured_kernel
    >>> fc = nn.Linear(256, 128)
    >>> kernel, why = semi_structured_kernel(fc.weight, [("fc", fc, "weight")], torch.bfloat16)
    >>> kernel is None and why in ("no CUDA GPU", "parameter on cpu, not on a CUDA GPU")
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_sparse.backends.fsdp import GatheredWeight, gathered_weight
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.backends.masked import forward_unsupported
from lightning_sparse.core.layers import CONV1D, LINEAR

AMPERE = (8, 0)
HALF_DTYPES = (torch.float16, torch.bfloat16)
CUSPARSELT_MULTIPLE = 128  # both dimensions, for the tile op's cuSPARSELt metadata
CUTLASS_MULTIPLE = 64  # both dimensions: W is 32x64-aligned, and so is W.T
_AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# the matmul layers (forward_unsupported only asks whether a layer type is listed)
_MATMUL_LAYERS = {LINEAR: {None: nn.Module}, CONV1D: {None: nn.Module}}


def autocast_dtype(precision: str | None) -> torch.dtype | None:
    """The dtype a Lightning ``precision`` setting runs matmuls in under autocast, or ``None``
    when it does not autocast (the weights' own dtype is used).

    Example:
        >>> autocast_dtype("bf16-mixed"), autocast_dtype("bf16-true"), autocast_dtype(None)
        (torch.bfloat16, None, None)
    """
    return _AUTOCAST_DTYPES.get(str(precision)) if precision is not None else None


def device_capability(device: torch.device) -> tuple[int, int] | str:
    """The CUDA compute capability of ``device``, or why it has none."""
    if torch.version.hip is not None:
        return "ROCm build: the 2:4 kernels used here are NVIDIA-only"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if device.type != "cuda":
        return f"parameter on {device}, not on a CUDA GPU"
    return torch.cuda.get_device_capability(device)


def cusparselt_available() -> bool:
    """Whether this torch build ships cuSPARSELt (says nothing about the GPU)."""
    return torch.backends.cusparselt.is_available()


TORCH_FEATURES = {
    "torch._sparse_semi_structured_tile": lambda: hasattr(
        torch, "_sparse_semi_structured_tile"
    ),
    "torch.sparse.SparseSemiStructuredTensorCUSPARSELT": lambda: hasattr(
        torch.sparse, "SparseSemiStructuredTensorCUSPARSELT"
    ),
    "torch.sparse.SparseSemiStructuredTensorCUTLASS": lambda: hasattr(
        torch.sparse, "SparseSemiStructuredTensorCUTLASS"
    ),
}
"""What the 2:4 path needs from torch, by name, and how to tell that it is there."""


def missing_torch_features() -> list[str]:
    """The parts of :data:`TORCH_FEATURES` this torch lacks (none on a supported release)."""
    return [name for name, present in TORCH_FEATURES.items() if not present()]


def semi_structured_kernel(
    weight: Tensor,
    owners: Sequence[tuple[str, nn.Module, str]],
    compute_dtype: torch.dtype | None = None,
    target: GpuTarget | None = None,
) -> tuple[str | None, str]:
    """``(kernel, reason)``: the 2:4 tensor format that can run this weight's matmuls
    (``"cusparselt"`` or ``"cutlass"``) and a short description, or ``(None, why not)``.

    Args:
        weight: the parameter.
        owners: ``(module name, module, attribute)`` for each module holding it.
        compute_dtype: the autocast dtype, or ``None`` for the weight's own dtype.
        target: predict for this GPU (``lightning-sparse plan --gpu``) instead of the
            weight's own device: the weight is taken to be there, and torch to be a CUDA
            build with cuSPARSELt, as PyPI's are.
    """
    missing = missing_torch_features()
    if missing:
        return None, (
            f"this torch ({torch.__version__}) lacks {', '.join(missing)}: the 2:4 kernels "
            f"need a torch release that has them"
        )
    if len(owners) != 1:
        return None, "shared by several modules (tied weights)"
    _, module, attr = owners[0]
    reason = forward_unsupported(module, attr, _MATMUL_LAYERS)
    if reason is not None:
        return None, reason
    seen = gathered_weight(weight)
    if isinstance(seen, str):
        return None, seen
    capability = target.capability if target else device_capability(weight.device)
    if isinstance(capability, str):
        return None, capability
    if capability < AMPERE:
        return None, (
            f"compute capability {capability[0]}.{capability[1]}: 2:4 sparse tensor cores "
            f"need 8.0 (Ampere) or newer"
        )
    dtype = compute_dtype or seen.dtype
    if dtype not in HALF_DTYPES:
        return None, (
            f"matmuls in {_name(dtype)}: the 2:4 kernels need float16 or bfloat16 weights "
            f"or autocast (precision='bf16-mixed')"
            + (
                ", or FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
                if seen.shards
                else ""
            )
        )
    bias = getattr(module, "bias", None)
    if compute_dtype is None and bias is not None:
        bias_dtype = forward_dtype(bias, None)
        if bias_dtype != dtype:
            return None, f"bias is {_name(bias_dtype)} but the weight is {_name(dtype)}"
    arch = f"sm{capability[0]}{capability[1]}, {_name(dtype)}"
    gathered = f", {seen.describe()}" if seen.shards else ""
    has_cusparselt = target is not None or cusparselt_available()
    if has_cusparselt and _multiples(seen, CUSPARSELT_MULTIPLE):
        return "cusparselt", f"cuSPARSELt, {arch}{gathered}"
    sm8x = capability[0] == 8
    if sm8x and _multiples(seen, CUTLASS_MULTIPLE):
        return "cutlass", f"CUTLASS, {arch}{gathered}"
    cusparselt = (
        f"cuSPARSELt needs both dimensions multiples of {CUSPARSELT_MULTIPLE}"
        if has_cusparselt
        else "this torch build has no cuSPARSELt"
    )
    cutlass = (
        f"CUTLASS needs multiples of {CUTLASS_MULTIPLE}"
        if sm8x
        else "CUTLASS 2:4 kernels are sm8x only"
    )
    rows, cols = weight.shape
    return None, f"no 2:4 kernel for shape {rows}x{cols}: {cusparselt}; {cutlass}"


def forward_dtype(weight: Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``weight``'s matmuls run in: ``compute_dtype`` (autocast's) where given,
    else the weight's own as its forward sees it (for FSDP2, the gathered weight's).

    Example:
        >>> w = torch.ones(2, 2)
        >>> forward_dtype(w, torch.bfloat16), forward_dtype(w, None)
        (torch.bfloat16, torch.float32)
    """
    if compute_dtype is not None:
        return compute_dtype
    seen = gathered_weight(weight)
    return weight.dtype if isinstance(seen, str) else seen.dtype


def _multiples(weight: GatheredWeight, multiple: int) -> bool:
    return all(size % multiple == 0 for size in weight.shape)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
