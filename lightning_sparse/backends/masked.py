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

from collections.abc import Callable, Mapping

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
            project_eagerly(self._ls_project, weight)
            if self._ls_project is not None
            else self._ls_mask
        )
        return straight_through_mask(weight, mask)


@torch.compiler.disable
def project_eagerly(project: Callable[[Tensor], Tensor], weight: Tensor) -> Tensor:
    """``project(weight)`` outside any compiled graph.

    A projection is a pure function of the weight's values (sorting networks, table lookups)
    that ``torch.compile`` would retrace and split at every step; run eagerly, only the
    masked matmul is compiled.
    """
    return project(weight.detach())


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
    return forward_unsupported(module, attr, _MASKED_CLASSES)


def forward_unsupported(
    module: nn.Module, attr: str, classes: Mapping[type[nn.Module], type[nn.Module]]
) -> str | None:
    """Why ``module.attr`` cannot get one of the sparse forwards in ``classes`` (a map from a
    base layer class to its sparse subclass), or ``None`` if it can."""
    if attr != "weight":
        return f"a sparse forward applies to layer weights, not {type(module).__name__}.{attr}"
    cls = original_class(module)
    for base in classes:
        if issubclass(cls, base):
            if cls.forward is not base.forward:
                return f"{cls.__name__} overrides forward(), so a sparse forward would bypass it"
            return None
    names = " or ".join(base.__name__ for base in classes)
    return f"{cls.__name__} is not a {names} layer"


def install_masked_forward(
    module: nn.Module,
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """Make ``module`` compute with ``weight * mask`` (or ``weight * project(weight)``)."""
    swap_forward(module, _MASKED_CLASSES, mask=mask, project=project)


def swap_forward(
    module: nn.Module,
    classes: Mapping[type[nn.Module], type[nn.Module]],
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """Give ``module`` the sparse forward that ``classes`` maps its base class to.

    Only ``module.__class__`` changes (to a subclass of both the original class and the
    sparse one), so the module object, its Parameters and its ``state_dict`` keys stay the
    same. A module that already has a sparse forward is re-swapped if ``classes`` differ.
    """
    original = original_class(module)
    reason = forward_unsupported(module, "weight", classes)
    if reason is not None:
        raise TypeError(reason)
    base = next(b for b in classes if issubclass(original, b))
    module.__class__ = _swapped_class(original, base, classes[base])
    module._ls_original_class = original
    module._ls_mask = mask
    module._ls_project = project


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before any sparse forward was installed."""
    return module.__dict__.get("_ls_original_class", type(module))


_SWAPPED: dict[tuple[type, type], type] = {}


def _swapped_class(
    original: type[nn.Module], base: type[nn.Module], sparse: type[nn.Module]
) -> type[nn.Module]:
    """The sparse class for ``original`` (a subclass of both, so isinstance checks still hold).

    For a subclass ``MyLinear`` of ``nn.Linear`` and ``sparse=MaskedLinear`` it is
    ``MaskedMyLinear(MaskedLinear, MyLinear)``, created once and reused.
    """
    if original is base:
        return sparse
    key = (original, sparse)
    if key not in _SWAPPED:
        name = sparse.__name__.replace(base.__name__, original.__name__)
        _SWAPPED[key] = type(name, (sparse, original), {})
    return _SWAPPED[key]


def uninstall_forward(module: nn.Module) -> None:
    """Restore the module's original class (and drop the mask and other ``_ls_`` state)."""
    original = module.__dict__.get("_ls_original_class")
    if original is None:
        return
    module.__class__ = original
    for attr in [name for name in module.__dict__ if name.startswith("_ls_")]:
        del module.__dict__[attr]
