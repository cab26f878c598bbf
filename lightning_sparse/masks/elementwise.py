"""Elementwise work over mask-sized tensors: counting, listing, masking weights and state.

Each function is defined by its torch operations and runs on any device; on plain CPU
float32/float64 tensors the compiled twin of :mod:`lightning_sparse.kernels` runs instead when
it is installed, with the same bits.

Example:
    >>> import torch
    >>> grad = torch.tensor([1.5, -2.0, 3.0])
    >>> multiply_by_mask_(grad, torch.tensor([True, False, True]))
    >>> grad.tolist(), flat_nonzero(torch.tensor([[False, True], [True, True]])).tolist()
    ([1.5, -0.0, 3.0], [1, 2, 3])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sparse import kernels

_SCRATCH: dict[tuple[torch.device, int, int], Tensor] = {}  # (device, slot, thread)


def flat_nonzero(mask: Tensor) -> Tensor:
    """Ascending flat indices (int64) of the ``True`` entries of ``mask``."""
    if kernels.accepts(mask):
        return kernels.flat_nonzero(mask)
    return mask.reshape(-1).nonzero().squeeze(1)


def count_true(mask: Tensor) -> int:
    """How many entries of a bool tensor are ``True``.

    >>> count_true(torch.tensor([[True, False], [True, True]]))
    3
    """
    if kernels.accepts(mask):
        return kernels.count_true(mask)
    return int(torch.count_nonzero(mask))


def set_at_(target: Tensor, index: Tensor, values: Tensor | bool) -> None:
    """``target.view(-1)[index] = values`` for a contiguous ``target``.

    >>> chosen = torch.zeros(4, dtype=torch.bool)
    >>> set_at_(chosen, torch.tensor([1, 3]), True)
    >>> chosen.tolist()
    [False, True, False, True]
    """
    with_values = () if isinstance(values, bool) else (values,)
    if kernels.accepts(target, *with_values):
        kernels.set_at_(target, index, values)
    else:
        target.view(-1)[index] = values


def pick_output(
    k: int, n_eligible: int, n: int, device: torch.device, out: Tensor | None
) -> Tensor:
    """The flat bool tensor of ``n`` entries a pick of ``k`` of ``n_eligible`` entries is
    written to: ``out`` viewed flat, or a new one. Raises ``ValueError`` if ``k`` is negative
    or more than ``n_eligible``."""
    if not 0 <= k <= n_eligible:
        raise ValueError(f"cannot pick {k} of {n_eligible} eligible entries")
    if out is None:
        return torch.empty(n, dtype=torch.bool, device=device)
    return out.view(-1)


def as_multiplier(mask: Tensor) -> Tensor:
    """A bool ``mask`` as a factor for ``tensor * factor``: its bytes as ``uint8`` (a view) for
    a plain tensor, a DTensor as it is. torch casts a bool factor element by element; the
    products by ``uint8`` are the same bits."""
    return mask.view(torch.uint8) if type(mask) is torch.Tensor else mask


def runs_compiled(*tensors: Tensor) -> bool:
    """Whether the functions here run a compiled loop on these tensors (CPU float32/float64
    with the ``[cpu]`` extra installed; see :mod:`lightning_sparse.kernels`)."""
    return kernels.accepts(*tensors)


def multiply_by_mask_(tensor: Tensor, mask: Tensor) -> None:
    """``tensor *= mask`` for a bool ``mask`` shaped like ``tensor``: pruned entries become zeros
    carrying the sign of what they held (``-0.0`` for a negative value), as ``mul_`` writes."""
    if kernels.accepts(tensor, mask):
        kernels.multiply_(tensor, mask)
    else:
        tensor.mul_(as_multiplier(mask))


def zero_where_(tensor: Tensor, where: Tensor) -> None:
    """Set ``tensor`` to ``+0.0`` where the bool ``where`` is set (``masked_fill_(where, 0)``).

    >>> state = torch.tensor([-1.5, 2.0, -3.0])
    >>> zero_where_(state, torch.tensor([True, False, True]))
    >>> state.tolist()
    [0.0, 2.0, 0.0]
    """
    if kernels.accepts(tensor, where) and tensor.is_floating_point():
        kernels.zero_where_(tensor, where)
    else:
        tensor.masked_fill_(where, 0)


def apply_mask_change_(
    weight: Tensor, mask: Tensor, changed: Tensor, states: Sequence[Tensor]
) -> None:
    """Make an updated bool ``mask`` take effect where ``changed`` (bool) says it changed: there
    ``weight *= mask`` (a dropped weight becomes a zero of its sign) and every tensor in
    ``states`` (optimizer state shaped like ``weight``) becomes ``+0.0``. Where few entries
    changed (under 1 in 64), by index; the bits are those of :func:`multiply_by_mask_` and
    :func:`zero_where_` either way.

    >>> weight, momentum = torch.tensor([1.5, -2.0, 3.0]), torch.tensor([0.5, 0.25, 0.75])
    >>> apply_mask_change_(weight, torch.tensor([True, False, True]),
    ...                    torch.tensor([True, True, False]), [momentum])
    >>> weight.tolist(), momentum.tolist()
    ([1.5, -0.0, 3.0], [0.0, 0.0, 0.75])
    """
    if 64 * count_true(changed) < changed.numel() and weight.is_contiguous():
        index = flat_nonzero(changed)
        values = weight.view(-1)
        kept = mask.reshape(-1).index_select(0, index)
        values.index_copy_(0, index, values.index_select(0, index) * kept)
        for state in states:
            state.view(-1).index_fill_(0, index, 0)
        return
    if kernels.accepts(weight, mask, changed):
        kernels.multiply_where_(weight, mask, changed)
    else:
        multiply_by_mask_(weight, mask)
    for state in states:
        zero_where_(state, changed)


def scratch_mask(numel: int, device: torch.device, slot: int = 0) -> Tensor:
    """A flat bool tensor of ``numel`` entries with undefined contents, for mask-sized work.

    On the CPU it is a view of a buffer kept between calls (one per ``slot`` and thread, grown
    to the largest request), since a fresh buffer costs a page fault per 4 KiB when first
    written. It stays valid until the next call with the same slot on the same thread;
    :func:`free_scratch` releases the buffers. Other devices get a fresh tensor (their caching
    allocators reuse memory already).

    >>> a = scratch_mask(8, torch.device("cpu"), slot=3)
    >>> scratch_mask(4, torch.device("cpu"), slot=3).data_ptr() == a.data_ptr()
    True
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.bool, device=device)
    key = device, slot, threading.get_ident()
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=torch.bool, device=device)
    return buffer[:numel]


def free_scratch() -> None:
    """Release the buffers :func:`scratch_mask` keeps."""
    _SCRATCH.clear()
