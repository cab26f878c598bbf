"""What the engine does to gradients before an optimizer step: the finiteness check that gates
a mask update, masking the gradients of pruned weights (hard masks), masked decay
(straight-through masks), and averaging a learned mask's gradients over the ranks.

Example:
    >>> import torch
    >>> weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    >>> weight.grad = torch.tensor([0.5, 0.5, 0.5])
    >>> mask_gradients([weight], [torch.tensor([True, False, True])])
    >>> weight.grad.tolist()
    [0.5, 0.0, 0.5]
    >>> all_finite([weight, weight.grad])
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_sparse.core.selection import ParamTarget
from lightning_sparse.engine.layer_threads import for_each_layer, update_threads
from lightning_sparse.engine.ranks import sum_over_ranks, world_size
from lightning_sparse.masks.elementwise import (
    as_multiplier,
    multiply_by_mask_,
    runs_compiled,
)

COMPILED_GRADIENT_MASKING = 1 << 24
"""Gradient entries (all of a group's together) from which :func:`mask_gradients` runs the
compiled loops on torch's threads instead of torch's fused multiply. Below, a backward's
gradients are still in the CPU cache, where torch's multiply is as fast; beyond, it runs well
below memory speed (it casts the ``uint8`` masks element by element) and the compiled loops do
not (``benchmarks/mask_update.py`` measures both)."""


def owned_by(
    targets: Sequence[ParamTarget], optimizer: torch.optim.Optimizer
) -> list[ParamTarget]:
    """The ``targets`` whose parameters ``optimizer`` updates."""
    in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [t for t in targets if id(t.param) in in_opt]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (no NaN, no infinity)."""
    return all(_finite(t.detach()) for t in tensors)


def _finite(x: Tensor) -> bool:
    if type(x) is not torch.Tensor or x.numel() == 0:  # sharded (DTensor) or empty
        return bool(torch.isfinite(x).all())
    # a NaN or infinite entry makes the sum NaN or infinite (one reduction, cheaper than
    # aminmax); a sum that overflowed is settled by the exact check
    total = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    if bool(total.isfinite()):
        return True
    low, high = torch.aminmax(x)  # NaN if any entry is NaN, +-inf if any is
    return bool(low.isfinite() & high.isfinite())


def mask_gradients(params: Sequence[Tensor], masks: Sequence[Tensor]) -> None:
    """Zero the gradients of pruned weights (``grad *= mask`` for each parameter with a
    gradient): one fused ``torch._foreach_mul_`` per dtype and device, by the masks' bytes
    (:func:`~lightning_sparse.masks.elementwise.as_multiplier`); or, from
    :data:`COMPILED_GRADIENT_MASKING` entries on where the compiled loops take every gradient,
    one loop per gradient on as many threads as torch uses."""
    pairs = [(p.grad, m) for p, m in zip(params, masks) if p.grad is not None]
    if not pairs:
        return
    grads = [grad for grad, _ in pairs]
    sizes = [grad.numel() for grad in grads]
    compiled = sum(sizes) >= COMPILED_GRADIENT_MASKING and all(
        runs_compiled(grad, mask) for grad, mask in pairs
    )
    if not compiled:
        torch._foreach_mul_(grads, [as_multiplier(m) for _, m in pairs])
        return
    workers = update_threads(True, grads)
    for_each_layer(lambda pair: multiply_by_mask_(*pair), pairs, sizes, workers)


@torch.no_grad()
def decay_gradients(
    targets: Sequence[ParamTarget],
    mask_of: Callable[[ParamTarget], Tensor],
    decay: float,
) -> None:
    """Masked decay (SR-STE, Zhou et al. 2021): the gradient of every pruned entry gains
    ``decay * weight``, so the optimizer pulls the weights the forward leaves out toward zero
    and the mask settles. ``mask_of`` gives each target's keep-mask as its forward used it.
    Sharded parameters decay their local shards."""
    for t in targets:
        grad = t.param.grad
        if grad is not None:
            weight = t.param.detach()
            grad.add_(weight.masked_fill(mask_of(t), 0), alpha=decay)


@torch.no_grad()
def average_over_ranks(params: Sequence[Tensor]) -> None:
    """Make each gradient of ``params`` its mean over the ranks of a distributed run (a rank
    without one counts zeros), in one all-reduce of them all: for parameters that no
    data-parallel wrapper averages, such as a learned mask's logits. Every rank must call it
    with the same parameters (a collective); nothing happens in a single process."""
    ranks = world_size()
    if ranks == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
    for grad, total in zip(grads, sum_over_ranks(grads)):
        grad.copy_(total / ranks)
