"""Export: a plain state dict with the masks folded in.

The result loads into the unmodified model with ``strict=True``: same keys, dense tensors with
zeros where weights were pruned. Works on a live trainer (after or during ``fit``), on the
LightningModule it trained, or on a checkpoint (a path or a loaded dict) written with
:class:`~lightning_sparse.SparsityCallback`.

A checkpoint file is read with ``torch.load(weights_only=True)``: tensors, containers and plain
values only, never code (``trusted=True`` opts out, for files you trust). The sparsity state in it
is checked before any mask is folded in: a malformed state raises a ``ValueError`` naming the
group, the mask and what is wrong (see ``docs/safe-loading.md``).

Example:
    >>> import torch
    >>> ckpt = {"state_dict": {"w": torch.ones(2, 2)},
    ...         "callbacks": {"SparsityCallback{'name': 'sparsity'}": {
    ...             "masks": {"w_mask": torch.tensor([[True, False], [False, True]])}}}}
    >>> export_state_dict(ckpt)["w"].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from lightning_sparse.engine.resume import STATE_VERSION
from lightning_sparse.engine.sharding import gather_full
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.formats.fold import fold_masks
from lightning_sparse.masks.patterns import not_a_mask

SAFE_LOAD_TORCH = (2, 10)
"""The first torch whose ``weights_only=True`` loader has no published way around it:
CVE-2025-32434 (fixed in 2.6) and CVE-2026-24747 (fixed in 2.10) ran code from crafted files."""
_STATE_KEY = "SparsityCallback"  # every SparsityCallback's state_key starts so


def _checkpoint_masks(checkpoint: Mapping[str, Any], where: str) -> dict[str, Tensor]:
    """Every group's masks, checked: bool tensors, each parameter in one group."""
    callbacks = checkpoint.get("callbacks", {})
    if not isinstance(callbacks, Mapping):
        raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
            f"{where}: 'callbacks' is a {type(callbacks).__name__}, not a dict of callback "
            f"states; the checkpoint is damaged or was not written by Lightning"
        )
    masks: dict[str, Tensor] = {}
    owners: dict[str, str] = {}
    for key, state in callbacks.items():
        if not (isinstance(key, str) and key.startswith(_STATE_KEY)):
            continue
        for name, mask in _group_masks(state, f"{where}: {key}").items():
            if name in owners:
                raise ValueError(
                    f"{where}: {owners[name]} and {key} both hold mask {name!r}: a parameter "
                    f"belongs to one group, so the checkpoint is damaged"
                )
            masks[name], owners[name] = mask, key
    return masks


def _group_masks(state: Any, where: str) -> dict[str, Tensor]:
    """One group's masks from its checkpoint state, or a ``ValueError`` naming what is wrong."""

    def bad(what: str) -> ValueError:
        return ValueError(
            f"{where}: {what}; the checkpoint is damaged or was not written by SparsityCallback"
        )

    if not isinstance(state, Mapping):
        raise bad(f"the state is a {type(state).__name__}, not a dict")
    if not state:  # saved before the callback started: no masks yet
        return {}
    version = state.get("version", STATE_VERSION)
    if type(version) is not int or not 1 <= version <= STATE_VERSION:
        if type(version) is int and version > STATE_VERSION:
            raise ValueError(
                f"{where}: state version {version}, but this lightning_sparse reads versions 1 "
                f"to {STATE_VERSION}: upgrade lightning_sparse to read it"
            )
        raise bad(f"state version {version!r}, not 1 to {STATE_VERSION}")
    masks = state.get("masks")
    if not isinstance(masks, Mapping):
        raise bad(
            f"'masks' is {'missing' if masks is None else type(masks).__name__}, not a dict of "
            f"'<param>_mask' bool tensors"
        )
    for name, mask in masks.items():
        problem = not_a_mask(mask)
        if problem is not None:
            raise bad(f"mask {name!r} is {problem}")
    return dict(masks)


def _trainer_of(model: pl.LightningModule) -> pl.Trainer:
    """The trainer ``model`` is attached to, whose callbacks hold its masks."""
    try:
        trainer = model.trainer
    except RuntimeError:  # Lightning's way of saying "not attached"
        trainer = None
    called = f"export_state_dict({type(model).__name__})"
    if trainer is None:
        raise ValueError(
            f"{called}: the model is not attached to the Trainer that fit it, and the masks "
            f"live in that trainer's SparsityCallback: pass the trainer "
            f"(export_state_dict(trainer)) or a checkpoint it wrote"
        )
    if trainer.lightning_module is not model:
        # the trainer went on to fit another model: its weights and masks are that model's
        raise ValueError(
            f"{called}: the model is no longer attached to the Trainer that fit it, which has "
            f"since fit another model ({type(trainer.lightning_module).__name__}) and holds "
            f"that model's weights and masks: export each model right after its fit "
            f"(export_state_dict(model)), or pass a checkpoint written during its fit "
            f"(export_state_dict('path/to.ckpt'))"
        )
    return trainer


def _check_fitted_here(trainer: pl.Trainer, called: str) -> None:
    """Raise if a sparsity callback of ``trainer`` has since been fit on another model: its
    masks are that model's now (a callback holds the engine of its latest fit). ``called``
    names the call in the message."""
    for cb in trainer.callbacks:
        sparsifier = getattr(cb, "sparsifier", None)
        if not isinstance(sparsifier, Sparsifier) or not sparsifier.targets:
            continue
        if not sparsifier.belongs_to(trainer.lightning_module):
            raise ValueError(
                f"{called}: {cb.state_key} of the trainer has since been fit on another "
                f"model, so the masks it holds are that model's: export each model right "
                f"after its fit, or give each model its own SparsityCallback"
            )


def _load_checkpoint(path: str | Path, trusted: bool) -> Any:
    """``torch.load`` on the CPU: in full if ``trusted``, else tensors and plain values only."""
    if not trusted and TorchVersion(torch.__version__) < SAFE_LOAD_TORCH:
        raise ValueError(
            f"export_state_dict({str(path)!r}) reads checkpoint files with torch.load("
            f"weights_only=True), which torch {torch.__version__} cannot be relied on to keep "
            f"safe (crafted files ran code through it before torch "
            f"{'.'.join(map(str, SAFE_LOAD_TORCH))}: CVE-2025-32434, CVE-2026-24747). Upgrade "
            f"torch to read files from elsewhere, or, if you trust whoever wrote this file, pass "
            f"trusted=True, which unpickles it in full and runs any code it holds"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as err:
        if trusted:
            raise ValueError(_unreadable(path, err)) from err
        raise ValueError(
            f"export_state_dict({str(path)!r}): the file holds more than tensors, containers "
            f"and plain values, so it was not loaded (torch.load(weights_only=True): "
            f"{_refusal(err)}). Unpickling a checkpoint in full runs any code the file names, "
            f"so only those types are read by default; a checkpoint written by Trainer.fit with "
            f"SparsityCallback needs no more. If the class it names is harmless, allow just that "
            f"one with torch.serialization.add_safe_globals([...]) and call again; if you trust "
            f"whoever wrote the file, pass trusted=True, which unpickles it in full and runs any "
            f"code it holds"
        ) from err
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    # torch reports a damaged file by whatever its reader tripped on
    except (RuntimeError, OSError, EOFError, LookupError, TypeError, ValueError) as err:
        raise ValueError(_unreadable(path, err)) from err


def _refusal(err: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message (worded per release)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        lines = text.partition("WeightsUnpickler error:")[2].splitlines()
    else:
        lines = [line for line in text.splitlines() if "GLOBAL" in line]
    reason = next((line.strip() for line in lines if line.strip()), "")
    return reason.partition(". Please use")[0][:200] or "no reason given"


def _unreadable(path: str | Path, err: Exception) -> str:
    return (
        f"export_state_dict({str(path)!r}): not a readable PyTorch checkpoint "
        f"({type(err).__name__}: {str(err)[:200]}); the file is damaged or is no torch.save file"
    )


def export_state_dict(
    source: pl.Trainer | pl.LightningModule | Mapping[str, Any] | str | Path,
    trusted: bool = False,
) -> dict[str, Tensor]:
    """The model's state dict with every sparsity group's masks folded in.

    Args:
        source: a :class:`~lightning.pytorch.Trainer` that ran ``fit`` with sparsity callbacks
            (with sharded parameters, e.g. FSDP2, or inside a distributed learned phase,
            call it on every rank: weights or the learned masks are gathered),
            the :class:`~lightning.pytorch.LightningModule` it trained (still attached to that
            trainer, as after ``fit``; once the trainer or its callback has fit another model,
            the module is refused, never exported with that model's weights or masks), a
            checkpoint dict, or a path to a checkpoint file.
        trusted: for a path only: unpickle the file in full (``torch.load(weights_only=False)``).
            A pickle can run any code when it is loaded, so by default only tensors, containers
            and plain values are read, which is all a checkpoint of ``Trainer.fit`` with
            :class:`~lightning_sparse.SparsityCallback` holds. Pass ``True`` only for files whose
            writer you trust (e.g. a checkpoint whose ``hyper_parameters`` hold your own classes).
    """
    if not isinstance(trusted, bool):
        raise TypeError(f"export_state_dict(trusted={trusted!r}): use True or False")
    called = "export_state_dict(trainer)"
    if isinstance(source, pl.LightningModule):
        called = f"export_state_dict({type(source).__name__})"
        source = _trainer_of(source)
    if isinstance(source, pl.Trainer):
        if source.lightning_module is None:
            raise ValueError(
                f"{called}: the trainer holds no model yet, so there are no weights or masks "
                f"to export: call it after trainer.fit(model, ...), or pass a checkpoint that "
                f"a fit with SparsityCallback wrote (export_state_dict('path/to.ckpt'))"
            )
        _check_fitted_here(source, called)
        # found by state key, as in a checkpoint: export sits below the callback
        states = {cb.state_key: cb.state_dict() for cb in source.callbacks}
        masks = _checkpoint_masks({"callbacks": states}, "the trainer's callbacks")
        module_state = source.lightning_module.state_dict()
        # sharded (FSDP2) weights are gathered: a collective, so call this on every rank
        state = {k: gather_full(v.detach()) for k, v in module_state.items()}
        return fold_masks(state, masks)
    if not isinstance(source, (Mapping, str, Path)):
        raise TypeError(
            f"export_state_dict(source=...) takes a Trainer that ran fit, the LightningModule "
            f"it trained, a checkpoint dict or the path of a checkpoint file; got a "
            f"{type(source).__name__}"
        )
    where = "the checkpoint"
    if isinstance(source, (str, Path)):
        where = str(source)
        source = _load_checkpoint(source, trusted)
    if not isinstance(source, Mapping) or "state_dict" not in source:
        keys = sorted(map(str, source))[:5] if isinstance(source, Mapping) else None
        raise KeyError(
            "export_state_dict needs a Lightning checkpoint (a dict with 'state_dict'), a path "
            "to one, or a Trainer; got "
            + (
                f"a mapping with keys {keys}"
                if keys is not None
                else f"a {type(source).__name__}"
            )
        )
    if not isinstance(source["state_dict"], Mapping):
        raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
            f"{where}: 'state_dict' is a {type(source['state_dict']).__name__}, not a dict of "
            f"tensors; the checkpoint is damaged"
        )
    return fold_masks(source["state_dict"], _checkpoint_masks(source, where))
