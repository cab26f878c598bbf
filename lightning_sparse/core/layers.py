"""Layer types: how a parameter's owner computes with it, and so where its input dimension is.

Every mask rule works on *rows*: the weight as its layer computes with it, with the
computation's input dimension last, so that N:M groups (and the columns of transposable 2:4
tiles) run along the inputs. A layer type maps the stored weight to rows and back, says how
many inputs an output reads, computes the layer's forward with a given weight, and sums the
squares of the input features each weight entry multiplies (Wanda's input norms):

==========  =====================  ==========================  ==================
layer type  stored weight          rows (N:M along the last)   2:4 matmul kernels
==========  =====================  ==========================  ==================
Linear      ``(out, in)``          ``(out, in)``               yes
Conv1D      ``(in, out)``          ``(out, in)``: transposed   yes (on ``W.T``)
ConvNd      ``(out, in, *kernel)`` ``(out, *kernel, in)``      no
==========  =====================  ==========================  ==================

``Conv1D`` is Hugging Face's (``transformers.pytorch_utils.Conv1D``, in GPT-2 and GPT), found
by its class name and module without importing ``transformers``. Convolutions group along
input channels as NVIDIA's ASP and TensorRT do (the weight viewed as ``(K, R, S, C)``). A
weight of any other owner keeps its stored layout (:data:`STORED`: groups along the last axis
of ``(shape[0], -1)``). A new layer type is one entry of :data:`LAYER_TYPES`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> conv = nn.Conv2d(8, 4, 3)
    >>> layer = layer_type(conv)
    >>> layer.name, tuple(layer.to_rows(conv.weight).shape), layer.inputs(conv.weight.shape)
    ('ConvNd', (4, 3, 3, 8), 8)
    >>> torch.equal(layer.from_rows(layer.to_rows(conv.weight)), conv.weight)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerType:
    """How one kind of layer computes with its ``weight``."""

    name: str  #: shown in reports and messages (for convolutions: the class's name)
    stored: str  #: the stored layout, e.g. ``"(in, out)"``
    rows: str  #: the layout mask rules see, input dimension last
    is_class: Callable[
        [type], bool
    ]  #: whether a class (of an MRO) is this layer's class
    to_rows: Callable[[Tensor], Tensor]  #: stored weight -> rows (a view)
    from_rows: Callable[[Tensor], Tensor]  #: rows -> stored layout (a view)
    input_dim: int  #: the stored dimension that holds the inputs (channels for a conv)
    #: ``(module, input, weight) -> output``: the layer's forward with ``weight`` for its own
    compute: Callable[[nn.Module, Tensor, Tensor], Tensor] | None = None
    #: the weight as the ``(out, in)`` matrix of ``input @ matrix.T`` (2:4 kernels), if any
    matrix: Callable[[Tensor], Tensor] | None = None
    #: ``(module, input) -> (sums, count)``: over the ``count`` input vectors in ``input``, the
    #: sum of the square of the feature each weight entry multiplies, shaped to broadcast
    #: against the rows (``None``: a hook cannot see the inputs)
    input_squares: Callable[[nn.Module, Tensor], tuple[Tensor, int]] | None = None

    def base(self, cls: type) -> type | None:
        """The class in ``cls``'s MRO that is this layer type's class, or ``None``."""
        return next((c for c in cls.__mro__ if self.is_class(c)), None)

    def inputs(self, shape: torch.Size | tuple[int, ...]) -> int:
        """How many inputs (features or channels) each N:M group runs along."""
        return shape[self.input_dim] if len(shape) > self.input_dim else 1


def _same(weight: Tensor) -> Tensor:
    return weight


def _transposed(weight: Tensor) -> Tensor:
    return weight.transpose(0, 1)


def _is_hf_conv1d(cls: type) -> bool:
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _linear(module: nn.Module, input: Tensor, weight: Tensor) -> Tensor:
    return F.linear(input, weight, module.bias)


def _conv(module: nn.Module, input: Tensor, weight: Tensor) -> Tensor:
    return module._conv_forward(input, weight, module.bias)  # type: ignore[operator]


def _conv1d(module: nn.Module, input: Tensor, weight: Tensor) -> Tensor:
    # Hugging Face's Conv1D.forward with ``weight`` (in, out) for ``module.weight``
    size_out = input.size()[:-1] + (weight.shape[1],)
    out = torch.addmm(module.bias, input.view(-1, input.size(-1)), weight)
    return out.view(size_out)


def _feature_squares(module: nn.Module, input: Tensor) -> tuple[Tensor, int]:
    # Linear and Conv1D read the last axis of ``input`` as the features: (..., in) -> (1, in)
    x = input.detach().reshape(-1, input.shape[-1])
    sums = torch.linalg.vector_norm(x, dim=0, dtype=torch.float32).square()
    return sums.unsqueeze(0), x.shape[0]


def _patch_squares(module: nn.Module, input: Tensor) -> tuple[Tensor, int]:
    """A convolution's inputs are its unfolded patches: feature (channel, kernel offset) of
    every output position, after the layer's own padding. Sums come back as rows
    ``(1, *kernel, in)``, or ``(out, *kernel, in / groups)`` for a grouped convolution (each
    output row reads its own group's channels)."""
    conv: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
    spatial = len(conv.kernel_size)
    x = input.detach()
    x = x.unsqueeze(0) if x.dim() == spatial + 1 else x  # unbatched
    x = (
        x.float().square()
    )  # padding copies or zeros values, so it commutes with squaring
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    for d, (k, stride, dilation) in enumerate(
        zip(conv.kernel_size, conv.stride, conv.dilation)
    ):
        x = x.unfold(
            2 + d, dilation * (k - 1) + 1, stride
        )  # a view: (..., L_d, ..., span_d)
    x = x[(..., *(slice(None, None, dilation) for dilation in conv.dilation))]
    positions = tuple(range(2, 2 + spatial))
    sums = x.sum((0, *positions))  # (in, *kernel)
    count = x.shape[0] * math.prod(x.shape[i] for i in positions)
    groups = conv.groups
    rows = sums.view(groups, -1, *conv.kernel_size).movedim(
        1, -1
    )  # (g, *kernel, in / g)
    if groups > 1:
        rows = rows.repeat_interleave(conv.out_channels // groups, dim=0)
    return rows, count


LINEAR = LayerType(
    "Linear",
    "(out, in)",
    "(out, in)",
    lambda cls: cls is nn.Linear,
    _same,
    _same,
    1,
    _linear,
    _same,
    _feature_squares,
)
CONV1D = LayerType(
    "Conv1D",
    "(in, out)",
    "(out, in)",
    _is_hf_conv1d,
    _transposed,
    _transposed,
    0,
    _conv1d,
    _transposed,
    _feature_squares,
)
CONV = LayerType(
    "ConvNd",
    "(out, in, *kernel)",
    "(out, *kernel, in)",
    lambda cls: cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d),
    lambda weight: weight.movedim(1, -1),
    lambda rows: rows.movedim(-1, 1),
    1,
    _conv,
    None,
    _patch_squares,
)
STORED = LayerType(
    "parameter", "(d0, d1, ...)", "(d0, d1, ...)", lambda cls: False, _same, _same, 1
)
"""Any other owner (e.g. ``nn.MultiheadAttention.in_proj_weight``): the stored layout, groups
along the last axis of ``(shape[0], -1)``."""

LAYER_TYPES = (LINEAR, CONV1D, CONV)
"""The layers whose ``weight`` the default selection takes and the straight-through and 2:4
forwards know, in the order they are looked up."""


def layer_type(module: nn.Module, attr: str = "weight") -> LayerType:
    """The layer type of ``module.attr`` (:data:`STORED` for a weight of no known layer).

    The module's class before any sparse forward was installed decides
    (``_ls_original_class``), so the answer does not change during a phase.
    """
    if attr != "weight":
        return STORED
    cls = module.__dict__.get("_ls_original_class", type(module))
    return next((t for t in LAYER_TYPES if t.base(cls) is not None), STORED)


def layer_types(model: nn.Module) -> dict[str, LayerType]:
    """Parameter name -> layer type, for every ``weight`` of a known layer in ``model``, under
    each name the model's ``state_dict`` gives it (a shared module under all of them).

    >>> sorted((k, v.name) for k, v in layer_types(nn.Sequential(nn.Linear(2, 2), nn.ReLU(),
    ...                                                             nn.Conv2d(1, 1, 1))).items())
    [('0.weight', 'Linear'), ('2.weight', 'ConvNd')]
    """
    found = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        layer = layer_type(module)
        if layer is not STORED and module._parameters.get("weight") is not None:
            found[f"{module_name}.weight" if module_name else "weight"] = layer
    return found


def nm_misfit(layer: LayerType, shape: torch.Size, m: int) -> str | None:
    """Why N:M groups of ``m`` do not fit the inputs of a ``layer`` weight of ``shape``, in a
    few words (``"3 input channels, not a multiple of M=4"``), or ``None`` if they fit."""
    inputs = layer.inputs(shape)
    if inputs % m == 0:
        return None
    what = "input channels" if layer is CONV else "inputs per output"
    return f"{inputs} {what}, not a multiple of M={m}"


def nm_unsupported(layer: LayerType, shape: torch.Size, m: int) -> str | None:
    """Why N:M groups of ``m`` cannot run along the inputs of a ``layer`` weight of ``shape``,
    or ``None`` if they can."""
    misfit = nm_misfit(layer, shape, m)
    if misfit is None:
        return None
    return (
        f"its {layer.name} weight of shape {tuple(shape)} (stored {layer.stored}) has "
        f"{misfit}"
    )
