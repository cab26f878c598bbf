"""Masks folded into a state dict: each weight times its mask, the keys unchanged. No Lightning
here, so that a loop without Lightning exports too.

Example:
    >>> import torch
    >>> fold_masks({"w": torch.ones(2, 2)}, {"w_mask": torch.tensor([[True, False], [False, True]])})["w"].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def fold_masks(
    state_dict: Mapping[str, Tensor], masks: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Multiply each ``<param>`` by its ``<param>_mask``; a ``ValueError`` names a mask without a
    weight or of another shape than its weight."""
    result = dict(state_dict)
    for key, mask in masks.items():
        name = key.removesuffix("_mask") if isinstance(key, str) else key
        weight = result.get(name)
        if not isinstance(weight, Tensor):
            raise ValueError(  # noqa: TRY004 (a missing weight, not a wrong argument type)
                f"mask {key!r} has no weight {name!r} in the state dict (it has "
                f"{sorted(map(str, result))[:5]}...): fold the masks of the model they were "
                f"trained with"
            )
        if not isinstance(mask, Tensor):
            raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
                f"mask {key!r} is a {type(mask).__name__}, not a tensor"
            )
        if mask.shape != weight.shape:
            raise ValueError(
                f"mask {key!r} has shape {tuple(mask.shape)}, but weight {name!r} has shape "
                f"{tuple(weight.shape)}: a mask must match its weight exactly"
            )
        result[name] = weight * mask.to(device=weight.device, dtype=weight.dtype)
    return result
