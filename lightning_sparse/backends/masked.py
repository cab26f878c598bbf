"""The masked backend: dense math on a masked weight, on any device.

Hard-mask phases need nothing here: the pruned weights are stored as zeros, so the unmodified
module already computes the sparse function. Straight-through phases swap the layer's class for a
subclass whose ``forward`` uses ``weight * mask`` (the mask is either stored on the module or
projected from the weight at every forward). The swap keeps the same module object and the same
Parameter objects, so optimizers, EMA copies and ``state_dict`` keys see no change; swapping back
restores the original class.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.backends.masked import install_masked_forward, uninstall_forward
    >>> layer = nn.Linear(4, 2)
    >>> mask = torch.tensor([[True, False, True, False], [False, True, False, True]])
    >>> install_masked_forward(layer, mask=mask)
    >>> torch.allclose(layer(torch.ones(1, 4)), torch.ones(1, 4) @ (layer.weight * mask).T + layer.bias)
    True
    >>> uninstall_forward(layer); type(layer).__name__
    'Linear'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _StraightThroughMask(torch.autograd.Function):
    """``weight * mask`` forward; the gradient passes to the dense weight unmasked."""

    @staticmethod
    def forward(ctx, weight: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        return weight * mask

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def straight_through_mask(weight: Tensor, mask: Tensor) -> Tensor:
    """``weight * mask`` whose gradient w.r.t. ``weight`` is the dense incoming gradient."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return _StraightThroughMask.apply(weight, mask)
    return weight * mask


class SparseForwardMixin:
    """Adds the masked effective weight to a Linear/Conv subclass."""

    _ls_mask: Tensor | None
    _ls_project: Callable[[Tensor], Tensor] | None
    _ls_original_class: type[nn.Module]

    def sparse_weight(self) -> Tensor:
        weight = self.weight  # type: ignore[attr-defined]
        mask = (
            self._ls_project(weight) if self._ls_project is not None else self._ls_mask
        )
        return straight_through_mask(weight, mask)


class MaskedLinear(SparseForwardMixin, nn.Linear):
    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.sparse_weight(), self.bias)


class _MaskedConv(SparseForwardMixin):
    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.sparse_weight(), self.bias)  # type: ignore[attr-defined]


class MaskedConv1d(_MaskedConv, nn.Conv1d):
    pass


class MaskedConv2d(_MaskedConv, nn.Conv2d):
    pass


class MaskedConv3d(_MaskedConv, nn.Conv3d):
    pass


_MASKED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: MaskedLinear,
    nn.Conv1d: MaskedConv1d,
    nn.Conv2d: MaskedConv2d,
    nn.Conv3d: MaskedConv3d,
}


def straight_through_unsupported(module: nn.Module, attr: str) -> str | None:
    """Why ``module.attr`` cannot run a straight-through forward, or ``None`` if it can."""
    if attr != "weight":
        return f"straight-through masking applies to layer weights, not {type(module).__name__}.{attr}"
    if isinstance(module, SparseForwardMixin):
        return None
    cls = type(module)
    for base in _MASKED_CLASSES:
        if isinstance(module, base):
            if cls.forward is not base.forward:
                return f"{cls.__name__} overrides forward(), so a masked forward would bypass it"
            return None
    return f"{cls.__name__} is not a Linear or Conv layer"


def install_masked_forward(
    module: nn.Module,
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """Make ``module`` compute with ``weight * mask`` (or ``weight * project(weight)``)."""
    if not isinstance(module, SparseForwardMixin):
        reason = straight_through_unsupported(module, "weight")
        if reason is not None:
            raise TypeError(reason)
        original = type(module)
        base = next(b for b in _MASKED_CLASSES if isinstance(module, b))
        module.__class__ = _swapped_class(original, _MASKED_CLASSES[base])
        module._ls_original_class = original
    module._ls_mask = mask
    module._ls_project = project


_SWAPPED: dict[tuple[type, type], type] = {}


def _swapped_class(
    original: type[nn.Module], masked: type[nn.Module]
) -> type[nn.Module]:
    """The masked class for ``original`` (a subclass of both, so isinstance checks still hold)."""
    if original in _MASKED_CLASSES:
        return masked
    key = (original, masked)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"Masked{original.__name__}", (masked, original), {})
    return _SWAPPED[key]


def uninstall_forward(module: nn.Module) -> None:
    """Restore the module's original class (and drop the mask reference)."""
    original = getattr(module, "_ls_original_class", None)
    if original is None:
        return
    module.__class__ = original
    for attr in ("_ls_mask", "_ls_project", "_ls_original_class"):
        module.__dict__.pop(attr, None)
