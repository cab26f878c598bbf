"""Elementwise work over mask-sized tensors, run by NumPy on the CPU and by torch elsewhere.

A few operations that mask updates lean on have slow CPU kernels in torch:
``nonzero`` and comparisons into bool tensors run element by element, and any op that mixes a
float and a bool tensor (``grad * mask``) casts element by element (about 3x slower than the
same work through NumPy's vectorized loops on the same memory). These functions run NumPy on a
zero-copy view of CPU tensors whose dtype NumPy has (float16/32/64, bool, integers), and the
equivalent torch ops on other devices and dtypes (bfloat16); the results are identical bit for
bit either way. NumPy's loops are single-threaded: large masks are worked through in chunks that
stay in the CPU cache, and no OpenMP region (which waits for every thread, badly so on an
oversubscribed machine) is entered.

Example:
    >>> import torch
    >>> grad = torch.tensor([1.5, -2.0, 3.0])
    >>> multiply_by_mask_(grad, torch.tensor([True, False, True]))
    >>> grad.tolist(), flat_nonzero(torch.tensor([[False, True], [True, True]])).tolist()
    ([1.5, -0.0, 3.0], [1, 2, 3])
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from lightning_sparse.kernels import loops as cpu_kernels

CHUNK = 1 << 18
"""Elements per chunk on the CPU: 1 MiB of float32, which stays in the L2 cache with the bool
temporaries of a chunk."""

_SCRATCH: dict[tuple[torch.device, int, int], Tensor] = {}  # (device, slot, thread)

_NUMPY_DTYPES = {
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
}
_SAME_SIZE_INT = {2: np.int16, 4: np.int32, 8: np.int64}
_ALL_BUT_SIGN = {kind: kind(np.iinfo(kind).max) for kind in _SAME_SIZE_INT.values()}


def numpy_view(tensor: Tensor) -> np.ndarray | None:
    """A NumPy view of ``tensor`` (no copy), or ``None`` if NumPy cannot work on it in place
    (another device, a dtype NumPy lacks such as bfloat16, a tensor subclass, a strided view)."""
    if type(tensor) not in (Tensor, torch.nn.Parameter):
        return None  # a tensor subclass (DTensor, ...): leave it to torch
    if tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_DTYPES:
        return None
    if not tensor.is_contiguous():
        return None
    return tensor.detach().numpy()


def backend(*tensors: Tensor) -> tuple[ModuleType, list]:
    """``(np, arrays)`` when NumPy can work on every tensor (flat views of the same memory),
    else ``(torch, tensors)`` flattened (copies if not contiguous: read them, do not write them).
    The ufunc names used in this package exist in both modules."""
    views = [numpy_view(t) for t in tensors]
    if all(v is not None for v in views):
        return np, [v.reshape(-1) for v in views]
    return torch, [t.reshape(-1) for t in tensors]


def chunks(n: int, device: torch.device) -> Iterator[slice]:
    """Slices covering ``range(n)``: cache-sized on the CPU, one slice elsewhere."""
    step = CHUNK if device.type == "cpu" else max(n, 1)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def nonzero_of(xp: ModuleType, flags):
    """Ascending indices of the true entries of a flat bool array (NumPy or torch)."""
    if xp is np:
        return np.flatnonzero(flags)
    return flags.nonzero().squeeze(1)


def scratch(xp: ModuleType, like, size: int, boolean: bool = False):
    """An uninitialized flat array of ``size`` entries with ``like``'s dtype (or bool), on its
    device: a reusable chunk buffer."""
    if xp is np:
        return np.empty(size, dtype=bool if boolean else like.dtype)
    return torch.empty(
        size, dtype=torch.bool if boolean else like.dtype, device=like.device
    )


def fill(xp: ModuleType, array, value: bool) -> None:
    """Set every entry of ``array`` (NumPy or torch) to ``value``."""
    if xp is np:
        array.fill(value)
    else:
        array.fill_(value)


def abs_into(xp: ModuleType, array, out):
    """``|array|`` written into ``out`` (same dtype and length; NumPy or torch) and returned.
    On NumPy arrays by clearing the sign bit through integer views: the bits ``np.abs``
    writes (NaN stays NaN), at half its cost."""
    if xp is not np:
        return torch.abs(array, out=out)
    kind = _SAME_SIZE_INT[array.itemsize]
    np.bitwise_and(array.view(kind), _ALL_BUT_SIGN[kind], out=out.view(kind))
    return out


def as_tensor(array, device: torch.device) -> Tensor:
    """A NumPy result as a tensor on ``device`` (no copy on the CPU); tensors pass through."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array).to(device)
    return array


def flat_nonzero(mask: Tensor) -> Tensor:
    """Ascending flat indices (int64) of the ``True`` entries of ``mask``."""
    xp, (flags,) = backend(mask)
    return as_tensor(nonzero_of(xp, flags), mask.device).to(torch.int64)


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


def count_true(mask: Tensor) -> int:
    """How many entries of a bool tensor are ``True``.

    >>> count_true(torch.tensor([[True, False], [True, True]]))
    3
    """
    xp, (flags,) = backend(mask)
    return int(xp.count_nonzero(flags))


def as_multiplier(mask: Tensor) -> Tensor:
    """A bool ``mask`` as a factor for ``tensor * factor``: its bytes as ``uint8`` (a view, no
    copy) for a plain tensor, a DTensor as it is. Multiplying by a bool tensor casts it element
    by element (about 5x slower on the CPU); by ``uint8`` the products are the same bit for bit.
    """
    return mask.view(torch.uint8) if type(mask) is torch.Tensor else mask


def multiply_by_mask_(tensor: Tensor, mask: Tensor) -> None:
    """``tensor *= mask`` for a bool ``mask`` shaped like ``tensor``: pruned entries become zeros
    carrying the sign of what they held (``-0.0`` for a negative value), as ``mul_`` writes.
    On the CPU in one compiled loop (float32/64) or a NumPy one; elsewhere by ``mul_``."""
    values, flags = numpy_view(tensor), numpy_view(mask)
    if values is None or flags is None:
        tensor.mul_(as_multiplier(mask))
    elif cpu_kernels.accepts(values):
        cpu_kernels.multiply(values.reshape(-1), flags.reshape(-1).view(np.uint8))
    else:
        np.multiply(values, flags, out=values)


def zero_where_(tensor: Tensor, where: Tensor) -> None:
    """Set ``tensor`` to ``+0.0`` where the bool ``where`` is set, as ``masked_fill_(where, 0)``
    does (bit for bit); on the CPU in one compiled loop (float32/64) or by clearing the bits
    of those entries.

    >>> state = torch.tensor([-1.5, 2.0, -3.0])
    >>> zero_where_(state, torch.tensor([True, False, True]))
    >>> state.tolist()
    [0.0, 2.0, 0.0]
    """
    values, flags = numpy_view(tensor), numpy_view(where)
    if values is None or flags is None or not tensor.is_floating_point():
        tensor.masked_fill_(where, 0)
        return
    if cpu_kernels.accepts(values):
        cpu_kernels.zero_where(values.reshape(-1), flags.reshape(-1).view(np.uint8))
        return
    bits = values.reshape(-1).view(_SAME_SIZE_INT[values.itemsize])
    flags = flags.reshape(-1)
    keep = np.empty(
        min(CHUNK, flags.size), dtype=np.int8
    )  # -1 (all bits) keeps, 0 clears
    for part in chunks(flags.size, tensor.device):
        k = keep[: part.stop - part.start]
        np.subtract(flags[part].view(np.int8), 1, out=k)
        np.bitwise_and(bits[part], k, out=bits[part])


def apply_mask_change_(
    weight: Tensor, mask: Tensor, changed: Tensor, states: Sequence[Tensor]
) -> None:
    """Make an updated bool ``mask`` take effect where ``changed`` (bool) says it changed: there
    ``weight *= mask`` (a dropped weight becomes a zero of its sign) and every tensor in
    ``states`` (optimizer state shaped like ``weight``) becomes ``+0.0``. Bit for bit what
    :func:`multiply_by_mask_` and :func:`zero_where_` write: by index where few entries
    changed (under 1 in 64), else on the CPU in compiled loops
    (:mod:`~lightning_sparse.kernels.loops`).

    >>> weight, momentum = torch.tensor([1.5, -2.0, 3.0]), torch.tensor([0.5, 0.25, 0.75])
    >>> apply_mask_change_(weight, torch.tensor([True, False, True]),
    ...                    torch.tensor([True, True, False]), [momentum])
    >>> weight.tolist(), momentum.tolist()
    ([1.5, -0.0, 3.0], [0.0, 0.0, 0.75])
    """
    if 64 * count_true(changed) < changed.numel() and weight.is_contiguous():
        index = flat_nonzero(changed)  # a few entries: by index
        values = weight.view(-1)
        kept = mask.reshape(-1).index_select(0, index)
        values.index_copy_(0, index, values.index_select(0, index) * kept)
        for state in states:
            state.view(-1).index_fill_(0, index, 0)
        return
    arrays = [numpy_view(t) for t in (weight, mask, changed)]
    if any(a is None for a in arrays) or not cpu_kernels.accepts(arrays[0]):
        multiply_by_mask_(weight, mask)
    else:
        values, *flags = (a.reshape(-1) for a in arrays)
        cpu_kernels.multiply_where(values, *(f.view(np.uint8) for f in flags))
    for state in states:
        zero_where_(state, changed)


def scratch_mask(numel: int, device: torch.device, slot: int = 0) -> Tensor:
    """A flat bool tensor of ``numel`` entries with undefined contents, for mask-sized work.

    On the CPU it is a view of a buffer kept between calls (one per ``slot`` and thread, grown
    to the largest request): a freshly allocated buffer costs a page fault per 4 KiB when first
    written, about as much as a pass over it. It stays valid until the next call with the same
    slot on the same thread; :func:`free_scratch` releases the buffers. Other devices get a
    fresh tensor (their caching allocators reuse memory already).

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


class Ops:
    """The few array operations NumPy and torch spell differently, for code written once for
    both: NumPy on the CPU, torch elsewhere (see :func:`ops_for`).

    >>> ops = ops_for(torch.zeros(3))
    >>> ops.xp.__name__, ops.nonzero(ops.array(torch.tensor([0, 5, 7])) > 1).tolist()
    ('numpy', [1, 2])
    """

    def __init__(self, xp: ModuleType, device: torch.device) -> None:
        self.xp = xp
        self.device = device

    def array(self, tensor: Tensor):
        """``tensor`` in this namespace (a NumPy view on the CPU)."""
        if self.xp is np:
            view = numpy_view(tensor.contiguous())
            assert view is not None
            return view
        return tensor

    def arange(self, n: int):
        return np.arange(n) if self.xp is np else torch.arange(n, device=self.device)

    def nonzero(self, flags):
        return nonzero_of(self.xp, flags)

    def take(self, array, index):
        """``array.reshape(-1)[index]`` (NumPy: without bounds checks, which cost 5x the
        gather: give valid indices)."""
        if self.xp is np:
            return np.take(array, index, mode="clip")
        return torch.take(array, index)

    def take_rows(self, array, index):
        """``array[index]`` along the first axis (valid indices, as for :meth:`take`)."""
        if self.xp is np:
            return np.take(array, index, axis=0, mode="clip")
        return array[index]

    def argmax_rows(self, array):
        return np.argmax(array, axis=1) if self.xp is np else array.argmax(1)

    def to_int64(self, array):
        return array.astype(np.int64) if self.xp is np else array.to(torch.int64)

    def to_float64(self, array):
        return array.astype(np.float64) if self.xp is np else array.to(torch.float64)


def ops_for(*tensors: Tensor) -> Ops:
    """NumPy when it can work on every tensor (CPU, a NumPy dtype), else torch."""
    device = tensors[0].device
    if all(numpy_view(t.contiguous()) is not None for t in tensors):
        return Ops(np, device)
    return Ops(torch, device)
