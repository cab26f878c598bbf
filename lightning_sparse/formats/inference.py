"""2:4-sparse weights as PyTorch's ``SparseSemiStructuredTensor``, for GPU inference.

Example:
    >>> from torch import nn
    >>> report = to_semi_structured(nn.Sequential(nn.Linear(8, 8)))  # on the CPU: none converts
    >>> report["0.weight"] in ("no CUDA GPU", "parameter on cpu, not on a CUDA GPU")
    True
"""

from __future__ import annotations

from torch import nn

from lightning_sparse.backends import capability as capability_rules
from lightning_sparse.backends import semi_structured
from lightning_sparse.backends.kernel_check import check_kernel
from lightning_sparse.core.layers import layer_type
from lightning_sparse.formats.compressed_layout import nm_pattern


def to_semi_structured(model: nn.Module) -> dict[str, str]:
    """Swap every 2:4-sparse ``nn.Linear`` and Hugging Face ``Conv1D`` weight for a
    ``SparseSemiStructuredTensor`` (inference).

    A weight is converted when the ``(out, in)`` matrix its layer multiplies by (``W.T`` for a
    ``Conv1D``) is 2:4 along the input dimension (at most 2 non-zeros in every group of 4, e.g.
    after :func:`~lightning_sparse.export_state_dict`) and PyTorch's
    ``to_sparse_semi_structured`` accepts it (a CUDA GPU with sparse tensor cores, fp16/bf16
    or int8, supported shapes) and those tensors passed the kernel check on this GPU and dtype
    (:mod:`~lightning_sparse.backends.kernel_check`; a failed check leaves every weight dense
    and says why). A ``Conv1D`` keeps the transpose of the sparse matrix, which its ``addmm``
    runs on the same kernel as ``F.linear``. Returns, for every such weight, ``"converted"``
    or why not.
    """
    report: dict[str, str] = {}
    for module_name, module in model.named_modules():
        matrix = layer_type(module).matrix
        if matrix is None:
            continue
        name = f"{module_name}.weight" if module_name else "weight"
        weight = module.weight.detach()
        capability = capability_rules.device_capability(weight.device)
        if isinstance(capability, str):
            report[name] = capability
            continue
        if nm_pattern(matrix(weight) != 0) is None:
            report[name] = "not 2:4 sparse"
            continue
        verdict = check_kernel(semi_structured.INFERENCE, weight.dtype, weight.device)
        if not verdict.passed:
            report[name] = f"{verdict.reason}: left dense"
            continue
        try:
            sparse = semi_structured.pack_for_inference(matrix(weight).contiguous())
        except (RuntimeError, ValueError, NotImplementedError) as err:
            report[name] = f"to_sparse_semi_structured refused it: {err}"
            continue
        stored = sparse if matrix(weight) is weight else sparse.t()  # Conv1D: (in, out)
        module.weight = nn.Parameter(stored, requires_grad=False)
        report[name] = "converted"
    return report
