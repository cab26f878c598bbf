"""Export: a plain state dict with the masks folded into the weights.

The result loads into the unmodified model with ``strict=True``: same keys, dense tensors with
zeros where weights were pruned. Works on a live trainer (after or during ``fit``) or on a
checkpoint (a path or a loaded dict) written with :class:`~lightning_sparse.SparsityCallback`.

Example:
    >>> import torch
    >>> ckpt = {"state_dict": {"w": torch.ones(2, 2)},
    ...         "callbacks": {"SparsityCallback{'name': 'sparsity'}": {
    ...             "masks": {"w_mask": torch.tensor([[True, False], [False, True]])}}}}
    >>> export_state_dict(ckpt)["w"].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_sparse.engine.sharding import gather_full


def fold_masks(
    state_dict: Mapping[str, Tensor], masks: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Multiply each ``<param>`` by its ``<param>_mask``; errors name a mask without a weight."""
    result = dict(state_dict)
    for key, mask in masks.items():
        name = key.removesuffix("_mask")
        if name not in result:
            raise KeyError(f"mask {key!r} has no weight {name!r} in the state dict")
        weight = result[name]
        result[name] = weight * mask.to(device=weight.device, dtype=weight.dtype)
    return result


def _checkpoint_masks(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    masks: dict[str, Tensor] = {}
    for key, state in checkpoint.get("callbacks", {}).items():
        if key.startswith("SparsityCallback") and isinstance(state, Mapping):
            masks.update(state.get("masks", {}))
    return masks


def export_state_dict(
    source: pl.Trainer | Mapping[str, Any] | str | Path,
) -> dict[str, Tensor]:
    """The model's state dict with every sparsity group's masks folded in.

    Args:
        source: a :class:`~lightning.pytorch.Trainer` that ran ``fit`` with sparsity callbacks
            (with sharded parameters, e.g. FSDP2, call it on every rank: weights are gathered),
            a checkpoint dict, or a path to a checkpoint file.
    """
    if isinstance(source, pl.Trainer):
        # found by state key, as in a checkpoint: export sits below the callback
        states = {cb.state_key: cb.state_dict() for cb in source.callbacks}
        masks = _checkpoint_masks({"callbacks": states})
        module_state = source.lightning_module.state_dict()
        # sharded (FSDP2) weights are gathered: a collective, so call this on every rank
        state = {k: gather_full(v.detach()) for k, v in module_state.items()}
        return fold_masks(state, masks)
    if isinstance(source, (str, Path)):
        source = torch.load(source, map_location="cpu", weights_only=False)
    if "state_dict" not in source:
        raise KeyError(
            "export_state_dict needs a Lightning checkpoint (a dict with 'state_dict'), a path "
            f"to one, or a Trainer; got a mapping with keys {sorted(source)[:5]}"
        )
    return fold_masks(source["state_dict"], _checkpoint_masks(source))
