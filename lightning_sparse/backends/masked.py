"""The masked backend: dense math on a masked weight, on any device.

Hard-mask phases need nothing here: the pruned weights are stored as zeros, so the unmodified
module already computes the sparse function. Straight-through phases swap the layer's class for a
subclass whose ``forward`` uses ``weight * mask`` (the mask is either stored on the module or
projected from the weight at every forward); learned phases the same, with a mask sampled at
every forward that is differentiable in the algorithm's own parameters (``sample``). The swap
keeps the same module object and the same
Parameter objects, so optimizers, EMA copies and ``state_dict`` keys see no change; swapping back
restores the original class. A weight that other code reads directly (``nn.MultiheadAttention``'s
``in_proj_weight`` and ``out_proj.weight``) gets, the same way, a class whose attribute of that
name returns the masked weight (:func:`install_sparse_attribute`).

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
from typing import ClassVar

import torch
from torch import Tensor, nn

from lightning_sparse.backends.masked_linear import masked_linear
from lightning_sparse.core.layers import CONV, CONV1D, LINEAR, LayerType
from lightning_sparse.masks.tiles import TILE_KERNEL_DTYPES


class _StraightThroughMask(torch.autograd.Function):
    """``weight * mask`` forward; the gradient passes to the dense weight unmasked (and to a
    mask that requires one, a learned mask, as the product gives it: ``grad * weight``)."""

    @staticmethod
    def forward(ctx, weight: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(weight)
        return weight * mask

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None]:  # type: ignore[override]
        mask_grad = grad * ctx.saved_tensors[0] if ctx.needs_input_grad[1] else None
        return grad, mask_grad


def straight_through_mask(weight: Tensor, mask: Tensor) -> Tensor:
    """``weight * mask`` whose gradient w.r.t. ``weight`` is the dense incoming gradient."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return _StraightThroughMask.apply(weight, mask)
    return weight * mask


class SparseForwardMixin:
    """Adds the masked effective weight to a layer subclass."""

    _ls_mask: Tensor | None
    _ls_project: Callable[[Tensor], Tensor] | None
    _ls_sample: Callable[[bool, torch.dtype], Tensor] | None
    _ls_original_class: type[nn.Module]
    _ls_layer: ClassVar[LayerType]

    def sparse_mask(self, dtype: torch.dtype) -> tuple[Tensor, bool]:
        """:func:`layer_mask` of this layer's weight, for a matmul in ``dtype``."""
        return layer_mask(self, self.weight, dtype)  # type: ignore[attr-defined]

    def sparse_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight times its mask, for a matmul in ``dtype`` (:func:`masked_weight`)."""
        return masked_weight(self, self.weight, dtype)  # type: ignore[attr-defined]


def layer_mask(
    module: nn.Module, weight: Tensor, dtype: torch.dtype
) -> tuple[Tensor, bool]:
    """The mask ``module`` multiplies ``weight`` by for a matmul in ``dtype`` (a learned
    sample, ``sample(module.training, dtype)``; a projected mask; or the stored one), and
    whether the weight's gradient passes it unmasked (straight-through: always, except for a
    sample without a true ``dense_gradient`` attribute)."""
    if module._ls_sample is not None:
        mask = module._ls_sample(module.training, dtype)
        return mask, bool(getattr(module._ls_sample, "dense_gradient", False))
    if module._ls_project is not None:
        return project_mask(module._ls_project, weight, dtype), True
    assert module._ls_mask is not None
    return module._ls_mask, True


def masked_weight(module: nn.Module, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` times :func:`layer_mask`: its gradient reaches a sampled mask, hence the
    parameters it was drawn from, and the weight, times the mask (the product's own
    gradient) or unmasked (straight-through, as :func:`straight_through_mask`). A sample is
    multiplied in ``dtype``, so that a float32 weight under autocast and the 16-bit weight
    FSDP2 gathers give the same product."""
    mask, dense_gradient = layer_mask(module, weight, dtype)
    if module._ls_sample is not None:
        weight = weight.to(dtype)
    return straight_through_mask(weight, mask) if dense_gradient else weight * mask


def matmul_dtype(input: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(input, weight)`` computes in here: autocast's, else the weight's."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def project_mask(
    project: Callable[[Tensor], Tensor], weight: Tensor, dtype: torch.dtype
) -> Tensor:
    """``project(weight)`` for a matmul in ``dtype``: traced into the graph being compiled
    where ``project`` has a ``traceable(weight) -> bool`` method that says yes for the weight
    it sees (torch's tile kernel, one custom op, choosing a 2:4 mask), else eagerly
    (:func:`project_eagerly`). Outside ``torch.compile`` both compute the same mask.

    Example:
        >>> import torch
        >>> from lightning_sparse.masks.tiles import transposable_2to4_mask
        >>> w = torch.randn(8, 16)
        >>> torch.equal(project_mask(transposable_2to4_mask, w, w.dtype), transposable_2to4_mask(w))
        True
    """
    if torch.compiler.is_compiling():
        traceable = getattr(project, "traceable", None)
        if traceable is not None:
            seen = _projected_weight(weight, dtype)
            if traceable(seen):
                return project(seen)
    return project_eagerly(project, weight, dtype)


@torch.compiler.disable
def project_eagerly(
    project: Callable[[Tensor], Tensor], weight: Tensor, dtype: torch.dtype
) -> Tensor:
    """``project(weight)`` outside any compiled graph, for a matmul in ``dtype``.

    A projection is a pure function of the weight's values (sorting networks, table lookups)
    that ``torch.compile`` would retrace and split at every step; run eagerly, only the
    masked matmul is compiled.
    """
    return project(_projected_weight(weight, dtype))


def _projected_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight a projection sees for a matmul in ``dtype``: on a GPU, in a 16-bit matmul
    dtype, the values the matmul multiplies, so that torch's tile kernel can choose a 2:4 mask
    (:func:`~lightning_sparse.masks.tiles.greedy_2to4_mask`); on the CPU, the stored weight."""
    weight = weight.detach()
    if weight.device.type == "cuda" and dtype in TILE_KERNEL_DTYPES:
        return weight.to(dtype)
    return weight


class MaskedForward(SparseForwardMixin):
    """The layer type's own computation, with the masked weight; an eager Linear keeps its
    weight and mask for the backward, not their product (:func:`masked_linear`)."""

    def forward(self, input: Tensor) -> Tensor:
        dtype = matmul_dtype(input, self.weight)
        if self._ls_layer is LINEAR and not torch.compiler.is_compiling():
            mask, dense_gradient = self.sparse_mask(dtype)
            return masked_linear(
                input, self.weight, mask, self.bias, dtype, dense_gradient
            )
        return self._ls_layer.compute(self, input, self.sparse_weight(dtype))


class MaskedLinear(MaskedForward, nn.Linear):
    _ls_layer = LINEAR


class MaskedConv1d(MaskedForward, nn.Conv1d):
    _ls_layer = CONV


class MaskedConv2d(MaskedForward, nn.Conv2d):
    _ls_layer = CONV


class MaskedConv3d(MaskedForward, nn.Conv3d):
    _ls_layer = CONV


class MaskedConv1D(MaskedForward):
    """Hugging Face's ``Conv1D`` (combined with its class at the swap, see :func:`swap_forward`)."""

    _ls_layer = CONV1D


SparseClasses = Mapping[LayerType, Mapping[type[nn.Module] | None, type[nn.Module]]]
"""Per layer type, the sparse class for each base class (``None``: for any base class, a
mixin combined with the module's class at the swap)."""

_MASKED_CLASSES: SparseClasses = {
    LINEAR: {nn.Linear: MaskedLinear},
    CONV: {nn.Conv1d: MaskedConv1d, nn.Conv2d: MaskedConv2d, nn.Conv3d: MaskedConv3d},
    CONV1D: {None: MaskedConv1D},
}


def straight_through_unsupported(module: nn.Module, attr: str) -> str | None:
    """Why ``module.attr`` cannot run a straight-through forward, or ``None`` if it can."""
    return forward_unsupported(module, attr, _MASKED_CLASSES)


def forward_unsupported(
    module: nn.Module, attr: str, classes: SparseClasses
) -> str | None:
    """Why ``module.attr`` cannot get one of the sparse forwards in ``classes`` (see
    :data:`SparseClasses`), or ``None`` if it can."""
    if attr != "weight":
        return f"a sparse forward applies to layer weights, not {type(module).__name__}.{attr}"
    cls = original_class(module)
    found = _sparse_class(cls, classes)
    if found is None:
        names = " or ".join(layer.name for layer in classes)
        return f"{cls.__name__} is not a {names} layer"
    base, _ = found
    if cls.forward is not base.forward:
        return (
            f"{cls.__name__} overrides forward(), so a sparse forward would bypass it"
        )
    return None


def _sparse_class(
    cls: type[nn.Module], classes: SparseClasses
) -> tuple[type[nn.Module], type[nn.Module]] | None:
    """``(base class, sparse class)`` for a module of class ``cls``, or ``None``."""
    for layer, by_base in classes.items():
        base = layer.base(cls)
        if base is not None:
            sparse = by_base.get(base, by_base.get(None))
            if sparse is not None:
                return base, sparse
    return None


def install_masked_forward(
    module: nn.Module,
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
    sample: Callable[[bool, torch.dtype], Tensor] | None = None,
) -> None:
    """Make ``module`` compute with ``weight * mask`` (or ``weight * project(weight)``, both
    straight-through, or ``weight * sample(module.training)``, see :func:`masked_weight`)."""
    swap_forward(module, _MASKED_CLASSES, mask=mask, project=project, sample=sample)


def swap_forward(
    module: nn.Module,
    classes: SparseClasses,
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
    sample: Callable[[bool, torch.dtype], Tensor] | None = None,
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
    base, sparse = _sparse_class(original, classes)  # type: ignore[misc]
    module.__class__ = _swapped_class(original, base, sparse)
    module._ls_original_class = original
    module._ls_mask = mask
    module._ls_project = project
    module._ls_sample = sample
    module._ls_ran = False
    if "_ls_hook" not in module.__dict__:
        module._ls_hook = module.register_forward_pre_hook(_ran)


def _ran(module: nn.Module, args: object) -> None:
    """Marks that the sparse forward ran (the engine checks it in the first sparse step).

    Being a hook also turns off the inference fast paths that read a layer's weight without
    calling it: ``nn.TransformerEncoderLayer`` hands ``linear1.weight`` and ``linear2.weight``
    to one fused kernel unless a module in it has hooks."""
    module._ls_ran = True


def install_sparse_attribute(
    module: nn.Module,
    attr: str,
    mask: Tensor | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
    sample: Callable[[bool, torch.dtype], Tensor] | None = None,
) -> None:
    """Make every read of ``module.<attr>`` return ``weight * mask`` (or ``weight *
    project(weight)``), straight-through, or ``weight * sample(module.training)``
    (:func:`masked_weight`), for a weight that other code reads directly instead
    of calling ``module`` (``nn.MultiheadAttention`` hands ``in_proj_weight`` and
    ``out_proj.weight`` to ``F.multi_head_attention_forward``).

    Like :func:`swap_forward`, only the class changes (to a subclass with a property named
    ``attr``): the Parameter stays in ``module._parameters``, so ``state_dict`` keys,
    ``parameters()`` and optimizers see no change.
    """
    original = original_class(module)
    key = (original, attr)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(
            f"Sparse{original.__name__}", (original,), {attr: property(_sparse_read)}
        )
    module.__class__ = _SWAPPED[key]
    module._ls_original_class = original
    module._ls_attr = attr
    module._ls_mask = mask
    module._ls_project = project
    module._ls_sample = sample
    module._ls_ran = False


def _sparse_read(module: nn.Module) -> Tensor:
    weight = module._parameters[module._ls_attr]
    module._ls_ran = True  # the engine's check that the sparse weight is read
    return masked_weight(module, weight, matmul_dtype(weight, weight))


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before any sparse forward was installed."""
    return module.__dict__.get("_ls_original_class", type(module))


_SWAPPED: dict[tuple[type, object], type] = {}


def _swapped_class(
    original: type[nn.Module], base: type[nn.Module], sparse: type[nn.Module]
) -> type[nn.Module]:
    """The sparse class for ``original`` (a subclass of both, so isinstance checks still hold).

    For a subclass ``MyLinear`` of ``nn.Linear`` and ``sparse=MaskedLinear`` it is
    ``MaskedMyLinear(MaskedLinear, MyLinear)``, created once and reused; a mixin ``sparse``
    (not a subclass of ``base``) is always combined with ``original``.
    """
    if original is base and issubclass(sparse, base):
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
    hook = module.__dict__.get("_ls_hook")
    if hook is not None:
        hook.remove()
    for attr in [name for name in module.__dict__ if name.startswith("_ls_")]:
        del module.__dict__[attr]
