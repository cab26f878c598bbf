"""The kernel check: is a 2:4 kernel right on the GPU it runs on?

Packed 2:4 layouts change with torch and cuSPARSELt releases and GPU generations, and a
layout the library does not read gives wrong results without an error. So before a 2:4
kernel's first matmul in a process, :func:`check_kernel` runs a small 2:4 weight with known
values through exactly the code that training (or inference) uses, forward and input
gradient, and compares it with dense math on the same 2:4 weight. A kernel that fails is not
used: its layers run masked math, the fit-start table says why, and one warning names the
versions. Verdicts are cached per process, dtype and device. The check computes the same
whatever its caller's context (:func:`plain_autograd`: gradients on, no inference mode, no
autocast), and an out-of-memory or CUDA error during it is raised, not kept as a verdict: it
says nothing about the kernel.

Kernels register themselves (:func:`register_kernel`); every function that runs one calls
:func:`require_kernel` first, which runs the check once and raises :class:`KernelCheckError`
for a kernel that failed it, so nothing can run an unchecked kernel.

Example (a stand-in kernel, on the CPU):
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from lightning_sparse.backends.masked import straight_through_mask
    >>> from lightning_sparse.masks.tiles import transposable_2to4_mask
    >>> def dense_24(x, weight, bias):
    ...     mask = transposable_2to4_mask(weight.detach())
    ...     return F.linear(x, straight_through_mask(weight, mask), bias)
    >>> register_kernel("doc-right", dense_24, label="a dense stand-in")
    >>> check_kernel("doc-right", torch.float32, torch.device("cpu")).passed
    True
    >>> register_kernel("doc-wrong", lambda x, w, b: -dense_24(x, w, b), label="a wrong one")
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as warned:  # a failed check warns once
    ...     verdict = check_kernel("doc-wrong", torch.float32, torch.device("cpu"))
    >>> verdict.passed, verdict.error, len(warned)
    (False, 2.0, 1)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.backends import capability as capability_rules
from lightning_sparse.masks.tiles import transposable_2to4_mask

Linear24 = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""``(x (tokens, in), weight (out, in), bias) -> x @ W24.T + bias``, ``W24`` the greedy
transposable 2:4 projection of ``weight`` (a kernel registered with ``prunes=False`` is given
a weight that is already 2:4), differentiable in ``x`` and ``weight`` (straight-through)."""

TOLERANCE = 0.02
"""Largest relative error (``||out - ref|| / ||ref||``) a half-precision kernel may show;
rounding gives about 0.002, a wrong layout about 1."""
_ROWS, _COLS, _TOKENS = 128, 256, 60  # every 2:4 kernel takes the weight; 60 tokens pad


@dataclass(frozen=True)
class KernelVerdict:
    """The result of :func:`check_kernel`: passed or not, the largest relative error of the
    output and gradients (``None`` when the kernel raised), what was found, in one line
    (e.g. "cuSPARSELt on sm90 (torch 2.11.0, cuSPARSELt 0.8.0), bfloat16 gave wrong results
    in the kernel check (relative error 1.1)"), and for a kernel that passed, what its
    ``describe`` says of how it runs here (e.g. which packer)."""

    kernel: str
    passed: bool
    error: float | None
    reason: str
    note: str = ""


@dataclass(frozen=True)
class _Kernel:
    linears: tuple[Linear24, ...]
    label: str
    prunes: bool
    trains: bool
    describe: Callable[[torch.dtype, torch.device], str] | None


_KERNELS: dict[str, _Kernel] = {}
_VERDICTS: dict[tuple[str, torch.dtype, torch.device], KernelVerdict] = {}
_RUNNING: set[tuple[str, torch.dtype, torch.device]] = set()


class KernelCheckError(RuntimeError):
    """A 2:4 kernel that failed the kernel check was asked to run."""


def register_kernel(
    name: str,
    *linears: Linear24,
    label: str,
    prunes: bool = True,
    trains: bool = True,
    describe: Callable[[torch.dtype, torch.device], str] | None = None,
) -> None:
    """Make ``linears`` the kernel ``name`` that :func:`check_kernel` runs: each code path
    that runs it (e.g. a weight pruned at every forward, and one with a stored mask), all
    checked. ``label`` names it in messages (e.g. ``"cuSPARSELt"``); ``prunes=False``: it is
    given a 2:4 weight; ``trains=False``: only its forward is checked (inference);
    ``describe(dtype, device)`` says, after a passed check, how it runs there (the
    verdict's ``note``)."""
    if not linears:
        raise TypeError(f"register_kernel({name!r}) needs at least one linear")
    _KERNELS[name] = _Kernel(linears, label, prunes, trains, describe)
    for key in [key for key in _VERDICTS if key[0] == name]:
        del _VERDICTS[key]


def check_kernel(name: str, dtype: torch.dtype, device: torch.device) -> KernelVerdict:
    """Run kernel ``name`` once on ``device`` in ``dtype`` and compare it with dense math
    (cached: later calls return the first verdict). A failure warns once."""
    key = (name, dtype, normalized_device(device))
    if key not in _VERDICTS:
        _RUNNING.add(key)
        try:
            verdict = _run_check(name, _KERNELS[name], dtype, key[2])
        finally:
            _RUNNING.discard(key)
        _VERDICTS[key] = verdict
        if not verdict.passed:
            warnings.warn(
                f"{verdict.reason}; it is not used in this process: layers run masked "
                f"dense math (the same function) instead, and exports stay dense",
                RuntimeWarning,
                stacklevel=2,
            )
    return _VERDICTS[key]


def require_kernel(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise :class:`KernelCheckError` unless kernel ``name`` passed the check on ``device``
    in ``dtype`` (running it first if needed). Called by the code that runs the kernel."""
    key = (name, dtype, normalized_device(device))
    if key in _RUNNING:  # the check itself is running the kernel
        return
    verdict = _VERDICTS.get(key)
    if verdict is None:
        if capturing(device):
            raise KernelCheckError(
                f"the 2:4 kernel {name!r} is captured into a CUDA graph before it was "
                f"checked; run one step eagerly first (as torch.compile's warm-up does)"
            )
        verdict = check_kernel(name, dtype, device)
    if not verdict.passed:
        raise KernelCheckError(verdict.reason)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s stream (nothing may then
    synchronize: no check, comparison or search can run)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def plain_autograd(device: torch.device) -> Iterator[None]:
    """Gradients on, inference mode and autocast off, on ``device`` and the CPU: what the
    kernel check and ``verify_speed`` run under, so that a caller's ``torch.no_grad()``,
    ``torch.inference_mode()`` or autocast region changes neither their verdict nor their
    dtype.

    Example:
        >>> with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     with plain_autograd(torch.device("cpu")):
        ...         x = torch.ones(2, 2, requires_grad=True)
        ...         (x @ x).dtype, (x @ x).requires_grad
        (torch.float32, True)
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device_type in {"cpu", device.type}:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def normalized_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` is ``cuda:N`` of the current device), so that
    caches keyed on a device hold one entry per GPU, however the device was written."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def known_values(rows: int, cols: int, seed: int = 0) -> Tensor:
    """A ``(rows, cols)`` weight whose ``|w|`` are distinct within every 4x4 tile (values
    ``(1 + k/16) / 16`` with random signs, exact in float16 and bfloat16), so every greedy
    2:4 choice is the same, however a kernel breaks ties.

    Example:
        >>> w = known_values(4, 8)
        >>> w.shape, len(set(w[:, :4].abs().flatten().tolist()))
        (torch.Size([4, 8]), 16)
    """
    gen = torch.Generator().manual_seed(seed)
    tiles = (rows // 4) * (cols // 4)
    ranks = torch.argsort(torch.rand(tiles, 16, generator=gen, device="cpu"), dim=1)
    signs = torch.randint(0, 2, (tiles, 16), generator=gen, device="cpu") * 2 - 1
    values = (1 + ranks / 16) / 16 * signs
    return (
        values.view(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)
    )


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``||out - reference|| / ||reference||``, in float32."""
    reference = reference.float()
    return float((out.float() - reference).norm() / reference.norm().clamp_min(1e-30))


def versions(device: torch.device) -> str:
    """``"sm90 (torch 2.11.0, cuSPARSELt 0.8.0)"``: what a verdict depends on."""
    capability = capability_rules.device_capability(device)
    arch = device.type if isinstance(capability, str) else "sm{}{}".format(*capability)
    parts = [f"torch {torch.__version__.split('+')[0]}"]
    version = torch.backends.cusparselt.version()
    if version:
        parts.append(
            f"cuSPARSELt {version // 1000}.{version % 1000 // 100}.{version % 100}"
        )
    return f"{arch} ({', '.join(parts)})"


def _run_check(
    name: str, kernel: _Kernel, dtype: torch.dtype, device: torch.device
) -> KernelVerdict:
    where = f"{kernel.label} on {versions(device)}, {str(dtype).removeprefix('torch.')}"
    with plain_autograd(device):
        try:
            got, reference = _outputs(kernel, dtype, device)
        except _INTERRUPTIONS as err:  # the GPU's state, not the kernel: no verdict
            raise _interrupted(err, where) from err
        except Exception as err:  # noqa: BLE001 (any failure of a kernel means: do not use it)
            return KernelVerdict(
                name,
                False,
                None,
                f"{where} raised {type(err).__name__} in the kernel check ({first_line(err)})",
            )
    error = max(
        relative_error(g.detach().cpu(), r)
        for outputs in got
        for g, r in zip(outputs, reference)
    )
    if error <= TOLERANCE:
        note = kernel.describe(dtype, device) if kernel.describe else ""
        return KernelVerdict(
            name, True, error, f"{where} passed the kernel check", note
        )
    return KernelVerdict(
        name,
        False,
        error,
        f"{where} gave wrong results in the kernel check (relative error {error:.2g})",
    )


_INTERRUPTIONS = (torch.OutOfMemoryError, torch.AcceleratorError)
"""Errors of the GPU's state (memory, a CUDA error that poisons the context), not of a kernel."""


def _interrupted(err: Exception, where: str) -> Exception:
    """``err`` again, its message saying that it interrupted the kernel check of ``where``."""
    fix = (
        "free GPU memory (a smaller batch, fewer processes on this GPU) and run again"
        if isinstance(err, torch.OutOfMemoryError)
        else "a CUDA error leaves the process unusable: restart it"
    )
    return type(err)(
        f"{type(err).__name__} in the kernel check of {where} ({first_line(err)}): this "
        f"says nothing about the kernel, so no verdict is kept; {fix}"
    )


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of ``err``'s message, at most ``limit`` characters, for one-line reasons."""
    return (str(err).strip().splitlines() or [""])[0][:limit]


def _outputs(
    kernel: _Kernel, dtype: torch.dtype, device: torch.device
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Each of ``kernel``'s code paths' outputs (and gradients, when it trains) on the
    check's weight, and the dense CPU reference for them."""
    gen = torch.Generator().manual_seed(1)
    weight = known_values(_ROWS, _COLS)
    w24 = weight * transposable_2to4_mask(weight)  # the CPU reference
    x = torch.randn(_TOKENS, _COLS, generator=gen, device="cpu")
    grad = torch.randn(_TOKENS, _ROWS, generator=gen, device="cpu")
    reference = [x @ w24.T]
    if kernel.trains:
        reference += [grad @ w24, grad.T @ x]
    given = weight if kernel.prunes else w24
    got = [
        _run(linear, x, given, grad, kernel.trains, dtype, device)
        for linear in kernel.linears
    ]
    return got, reference


def _run(
    linear: Linear24,
    x: Tensor,
    weight: Tensor,
    grad: Tensor,
    trains: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> list[Tensor]:
    """``linear``'s output and, when it trains, its input and weight gradients."""
    # copies: each path gets leaves of its own, so gradients do not accumulate across paths
    given = weight.to(device, dtype, copy=True).requires_grad_(trains)
    x_in = x.to(device, dtype, copy=True).requires_grad_(trains)
    out = linear(x_in, given, None)
    if not trains:
        return [out]
    out.backward(grad.to(device, dtype))
    return [out, x_in.grad, given.grad]


def verdicts() -> list[KernelVerdict]:
    """Every verdict this process has reached so far, in the order the checks ran (for
    reports: which kernels ran, and why others did not).

    Example:
        >>> import torch
        >>> import warnings
        >>> register_kernel("doc-unpruned", lambda x, w, b: x @ w.T, label="no pruning")
        >>> with warnings.catch_warnings(record=True):  # it fails the check: a warning
        ...     verdict = check_kernel("doc-unpruned", torch.float32, torch.device("cpu"))
        >>> verdict in verdicts(), verdict.passed
        (True, False)
    """
    return list(_VERDICTS.values())


def forget_verdicts() -> None:
    """Drop every cached verdict (as a new process would start)."""
    _VERDICTS.clear()
