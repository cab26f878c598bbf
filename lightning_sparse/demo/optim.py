"""AdamW with decoupled weight decay groups and a linear-warmup + cosine learning-rate schedule.

Shared by the demo LightningModules; everything here is plain PyTorch.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    >>> groups = param_groups_weight_decay(model, 0.1, no_decay_modules=(torch.nn.Embedding,))
    >>> [len(g["params"]) for g in groups], [g["weight_decay"] for g in groups]
    ([1, 2], [0.1, 0.0])
    >>> opt = torch.optim.AdamW(groups, lr=1.0)
    >>> sched = warmup_cosine_schedule(opt, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    >>> lrs = []
    >>> for _ in range(10):
    ...     lrs.append(round(opt.param_groups[0]["lr"], 3))
    ...     opt.step()
    ...     sched.step()
    >>> lrs
    [0.5, 1.0, 0.966, 0.868, 0.722, 0.55, 0.378, 0.232, 0.134, 0.1]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_sparse.demo._checks import (
    check_non_negative_float,
    check_positive_float,
    resolve_steps,
)


def param_groups_weight_decay(
    module: nn.Module,
    weight_decay: float,
    *,
    no_decay_names: Iterable[str] = (),
    no_decay_modules: tuple[type[nn.Module], ...] = (),
) -> list[dict]:
    """Split the trainable parameters of ``module`` into a decayed and a non-decayed group.

    Not decayed: parameters with fewer than two dimensions (biases, norm scales), parameters whose
    name ends with one of ``no_decay_names`` (e.g. timm's ``pos_embed``, ``cls_token``), and the
    parameters of modules of the types in ``no_decay_modules`` (e.g. embeddings). Frozen
    parameters (``requires_grad=False``) are left out of both groups, and a parameter shared by
    two modules (weight tying) appears once.
    """
    skip_names = tuple(no_decay_names)
    skip_ids: set[int] = set()
    for sub in module.modules():
        if no_decay_modules and isinstance(sub, no_decay_modules):
            skip_ids.update(id(p) for p in sub.parameters(recurse=False))
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if (
            param.ndim < 2
            or id(param) in skip_ids
            or (skip_names and name.endswith(skip_names))
        ):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine_factor(
    step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> float:
    """The learning-rate multiplier at optimizer step ``step`` (0-based).

    Linear warmup from ``1 / warmup_steps`` to 1 over the first ``warmup_steps`` steps, then a
    half cosine that reaches ``min_lr_ratio`` at the last step, ``total_steps - 1``; constant
    afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps + 1) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (
        1.0 + math.cos(math.pi * progress)
    )


def check_adamw_warmup_cosine(
    lr: float, weight_decay: float, warmup_steps: float, min_lr_ratio: float
) -> None:
    """Eager checks of the arguments the demo modules pass to AdamW and
    :func:`warmup_cosine_schedule`: a ValueError names the bad one.

    >>> check_adamw_warmup_cosine(1e-3, 0.05, 0.1, 1.5)
    Traceback (most recent call last):
    ...
    ValueError: min_lr_ratio=1.5 is invalid: it must be in [0, 1]
    """
    check_positive_float("lr", lr)
    check_non_negative_float("weight_decay", weight_decay)
    resolve_steps("warmup_steps", warmup_steps, 1)
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(
            f"min_lr_ratio={min_lr_ratio!r} is invalid: it must be in [0, 1]"
        )


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: float,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepping :func:`warmup_cosine_factor`; ``warmup_steps`` may be a fraction."""
    warmup = min(resolve_steps("warmup_steps", warmup_steps, total_steps), total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine_factor(step, total_steps, warmup, min_lr_ratio),
    )


def adamw_warmup_cosine(
    groups: list[dict[str, Any]], hparams: Any, total_steps: int
) -> dict[str, Any]:
    """AdamW over ``groups`` with its per-step warmup + cosine schedule, from a demo module's
    ``lr``, ``betas``, ``warmup_steps`` and ``min_lr_ratio``, as ``configure_optimizers``
    returns them to Lightning."""
    optimizer = torch.optim.AdamW(groups, lr=hparams.lr, betas=tuple(hparams.betas))
    scheduler = warmup_cosine_schedule(
        optimizer, total_steps, hparams.warmup_steps, hparams.min_lr_ratio
    )
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
    }


def cosine_ramp(step: int, total_steps: int, start: float, end: float) -> float:
    """Cosine interpolation from ``start`` (at step 0) to ``end`` (at ``total_steps``), clamped.

    >>> [round(cosine_ramp(s, 4, 0.996, 1.0), 4) for s in range(6)]
    [0.996, 0.9966, 0.998, 0.9994, 1.0, 1.0]
    """
    progress = min(1.0, max(0.0, step / max(1, total_steps)))
    return end - (end - start) * 0.5 * (1.0 + math.cos(math.pi * progress))


def linear_ramp(step: int, ramp_steps: int, start: float, end: float) -> float:
    """Linear interpolation from ``start`` to ``end`` over ``ramp_steps`` steps, then ``end``.

    >>> [linear_ramp(s, 3, 0.04, 0.07) for s in (0, 3, 10)]
    [0.04, 0.07, 0.07]
    """
    if step >= ramp_steps:
        return end
    return start + (end - start) * step / ramp_steps


def total_training_steps(trainer: object) -> int:
    """``trainer.estimated_stepping_batches`` as an int, with an error that says how to fix it."""
    total = getattr(trainer, "estimated_stepping_batches", None)
    if total is None or not math.isfinite(total) or total < 1:
        raise ValueError(
            f"The learning-rate schedule needs the run length, but the trainer estimates "
            f"{total!r} optimizer steps: set Trainer(max_steps=...) or Trainer(max_epochs=...)"
        )
    return int(total)
