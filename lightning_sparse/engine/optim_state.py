"""Masking optimizer state: keeps momentum/moments of pruned weights at exactly zero.

Works for any ``torch.optim`` optimizer: every per-parameter state tensor with the parameter's
shape (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``,
RMSprop, Adagrad, ...) is zeroed where asked; scalars such as ``step`` are left alone.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2, 2))
    >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    >>> p.grad = torch.ones(2, 2); opt.step()
    >>> zero_optimizer_state([opt], p, torch.tensor([[True, False], [False, False]]))
    >>> opt.state[p]["momentum_buffer"].tolist()
    [[0.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_sparse.masks.elementwise import zero_where_


def state_tensors(
    optimizers: Iterable[torch.optim.Optimizer], param: Tensor
) -> list[Tensor]:
    """Every floating-point state tensor shaped like ``param`` in ``optimizers`` (momentum,
    moments, ...; not scalars such as ``step``)."""
    found = []
    for optimizer in optimizers:
        for value in optimizer.state.get(param, {}).values():
            if (
                isinstance(value, Tensor)
                and value.shape == param.shape
                and value.is_floating_point()
            ):
                found.append(value)
    return found


@torch.no_grad()
def zero_optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer], param: Tensor, where: Tensor
) -> None:
    """Set every state tensor of ``param`` (see :func:`state_tensors`) to zero at the ``True``
    entries of ``where``, a bool mask shaped like ``param``."""
    for value in state_tensors(optimizers, param):
        zero_where_(value, where)
