"""``verify_speed``: time a Linear's sparse and dense forward+backward once per distinct shape.

Real 2:4 GEMM gains range from below 1x to about 1.4x depending on the shape, so with
``SparsityCallback(backend="auto", verify_speed=True)`` a layer whose sparse kernel is slower
than its dense matmul keeps running dense math (masked, the same function).

The measurement is a training step's worth of one layer: ``tokens`` rows of random input in the
matmul dtype (``verify_speed_tokens``: the rows of one matmul in a training step, e.g. batch x
sequence length; :data:`VERIFY_TOKENS` where not given), forward then backward (input and
weight gradients), the runtime 2:4 projection included, the best of a few rounds after a
warm-up. The ratio depends on the token count, most where 2:4 gains or loses least. It is
timed the way the model runs (:func:`timing_for`): eagerly, or captured and replayed as a CUDA
graph for a model compiled with CUDA graphs (``torch.compile(mode="reduce-overhead")``), where
the cuSPARSELt calls' CPU cost, larger than the matmul at ViT and GPT-2 sizes, is not paid. The
weight has known values (distinct magnitudes in every 4x4 tile), so the sparse output is also compared with dense math on the
same 2:4 weight: a kernel that goes wrong only at some shapes is caught at those shapes.

Example (``measure_speedup`` on the CPU times the emulation; it is meaningful on a GPU only):
    >>> import torch
    >>> m = measure_speedup((64, 64), torch.float32, "emulated", torch.device("cpu"), tokens=32)
    >>> m.ratio > 0, m.error < 1e-6
    (True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse.backends.cuda_graphs import (
    compiled_with_cuda_graphs,
    cuda_graphed,
)
from lightning_sparse.backends.cusparselt_algorithms import ALGORITHMS
from lightning_sparse.backends.kernel_check import (
    first_line,
    known_values,
    plain_autograd,
    relative_error,
)
from lightning_sparse.backends.semi_structured import (
    semi_structured_linear,
    stored_mask_packing,
)
from lightning_sparse.masks.tiles import transposable_2to4_mask

VERIFY_TOKENS = 8192
"""The token count ``verify_speed`` times where ``verify_speed_tokens`` is not given."""
_ROUNDS, _CALLS, _WARMUP = 3, 5, 3
EAGER, CUDA_GRAPHS = "eager", "cuda_graphs"
TIMINGS = (EAGER, CUDA_GRAPHS)
"""How ``verify_speed`` times a layer; ``verify_speed=True`` picks one by :func:`timing_for`."""


def timing_for(verify_speed: bool | str | None, model: nn.Module) -> str | None:
    """How ``verify_speed`` times ``model``'s layers: ``None`` (not at all), ``"eager"``, or
    ``"cuda_graphs"``; ``True`` (and ``None``, the default) means as the model runs:
    ``"cuda_graphs"`` where it is compiled with CUDA graphs
    (:func:`~lightning_sparse.backends.cuda_graphs.compiled_with_cuda_graphs`), else
    ``"eager"``.

    Example:
        >>> net = nn.Linear(8, 8)
        >>> timing_for(True, net), timing_for("cuda_graphs", net), timing_for(False, net)
        ('eager', 'cuda_graphs', None)
    """
    if verify_speed is False:
        return None
    if verify_speed is True or verify_speed is None:
        return CUDA_GRAPHS if compiled_with_cuda_graphs(model) else EAGER
    if verify_speed not in TIMINGS:
        raise ValueError(
            f"verify_speed={verify_speed!r}; use True, False or one of {TIMINGS}"
        )
    return verify_speed


@dataclass(frozen=True)
class SpeedMeasurement:
    """Dense time / sparse time of one layer shape, the sparse output's relative error
    against dense math on the same 2:4 weight, the cuSPARSELt algorithms it ran and how it
    was timed (``"eager"``, ``"as CUDA graphs"``, or why capture failed and it ran eagerly)."""

    ratio: float
    error: float
    algorithm: str = ""
    timing: str = EAGER
    stored: bool = False
    """Timed with a stored mask (packed ahead of the steps), not one projected per forward."""
    tokens: int = VERIFY_TOKENS

    def details(self) -> str:
        """The algorithm, a stored mask, the timing and the token count, for a reason in the
        fit-start table."""
        parts = (
            self.algorithm,
            "stored mask" if self.stored else "",
            self.timing,
            f"{self.tokens} tokens",
        )
        return ", ".join(part for part in parts if part)


def measure_speedup(
    shape: tuple[int, int],
    dtype: torch.dtype,
    kernel: str,
    device: torch.device,
    tokens: int = VERIFY_TOKENS,
    timing: str = EAGER,
    stored: bool = False,
) -> SpeedMeasurement:
    """Time forward+backward of a Linear weight of ``shape``, sparse against dense (eagerly,
    or with ``timing="cuda_graphs"`` on a GPU, each replayed as a CUDA graph), and compare
    the sparse output with dense math. ``stored``: with a stored mask, as ``static`` and
    ``magnitude`` phases run (packed ahead of the steps), else projected at every forward."""
    with plain_autograd(device):  # a caller's no_grad or autocast changes nothing here
        return _measure(shape, dtype, kernel, device, tokens, timing, stored)


def _measure(
    shape: tuple[int, int],
    dtype: torch.dtype,
    kernel: str,
    device: torch.device,
    tokens: int,
    timing: str,
    stored: bool,
) -> SpeedMeasurement:
    out_features, in_features = shape
    gen = {"device": device, "dtype": dtype}
    x = torch.randn(tokens, in_features, **gen, requires_grad=True)
    weight = known_values(out_features, in_features).to(**gen).requires_grad_()
    grad = torch.randn(tokens, out_features, **gen)

    def dense() -> None:
        F.linear(x, weight).backward(grad)

    mask = transposable_2to4_mask(weight.detach()) if stored else None
    packing = None if mask is None else stored_mask_packing(kernel, mask, mask)

    def sparse() -> None:
        semi_structured_linear(x, weight, None, kernel, mask, packing).backward(grad)

    with torch.no_grad():
        out = semi_structured_linear(x, weight, None, kernel, mask, packing)
        w24 = weight * transposable_2to4_mask(weight)
        error = relative_error(out, F.linear(x, w24))
    dense, sparse, how = _as_timed(dense, sparse, device, timing)
    ratio = _seconds(dense, device) / _seconds(sparse, device)
    algorithm = (
        ALGORITHMS.describe(out_features, in_features) if kernel == "cusparselt" else ""
    )
    return SpeedMeasurement(ratio, error, algorithm, how, stored, tokens)


def _as_timed(
    dense: Callable[[], None],
    sparse: Callable[[], None],
    device: torch.device,
    timing: str,
) -> tuple[Callable[[], object], Callable[[], object], str]:
    """The two steps as they are timed, and how: replayed as CUDA graphs for
    ``timing="cuda_graphs"`` on a GPU, else (or where capture fails, saying why) eagerly."""
    if timing != CUDA_GRAPHS or device.type != "cuda":
        return dense, sparse, EAGER
    try:
        return cuda_graphed(dense), cuda_graphed(sparse), "as CUDA graphs"
    except RuntimeError as err:
        return (
            dense,
            sparse,
            f"eager: CUDA graph capture failed ({first_line(err, 120)})",
        )


def _seconds(step: Callable[[], object], device: torch.device) -> float:
    for _ in range(_WARMUP):
        step()
    best = float("inf")
    for _ in range(_ROUNDS):
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(_CALLS):
            step()
        _synchronize(device)
        best = min(best, (time.perf_counter() - start) / _CALLS)
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeedCheck:
    """Sparse-vs-dense measurements, once per (shape, dtype, kernel, device), timed by
    ``timing`` (see :data:`TIMINGS`) at ``tokens`` rows (``None``: :data:`VERIFY_TOKENS`);
    ``gpu_only``: weights off a CUDA device are not timed (``None``: no measurement), as
    ``verify_speed``'s default has it, since a kernel runs on a GPU only.

    Example:
        >>> check = SpeedCheck(tokens=32)
        >>> w = torch.zeros(64, 64)
        >>> check(w, "emulated", torch.float32) == check(w, "emulated", torch.float32)
        True
        >>> len(check.results), check.describe()
        (1, 'each layer shape on a 2:4 kernel timed at fit start, eagerly, at 32 tokens')
    """

    def __init__(
        self, tokens: int | None = None, timing: str = EAGER, gpu_only: bool = False
    ) -> None:
        self.tokens = VERIFY_TOKENS if tokens is None else tokens
        self.tokens_given = tokens is not None
        self.timing = timing
        self.gpu_only = gpu_only
        self.results: dict[tuple, SpeedMeasurement] = {}

    def __call__(
        self, weight: Tensor, kernel: str, dtype: torch.dtype, stored: bool = False
    ) -> SpeedMeasurement | None:
        """The measurement for ``weight``'s shape (``stored``: with a stored mask)."""
        if self.gpu_only and weight.device.type != "cuda":
            return None
        key = (tuple(weight.shape), dtype, kernel, weight.device, stored)
        if key not in self.results:
            self.results[key] = measure_speedup(
                key[0], dtype, kernel, weight.device, self.tokens, self.timing, stored
            )
        return self.results[key]

    def describe(self) -> str:
        """How layers are timed, in a clause for the fit-start table and the plan."""
        how = "as CUDA graphs" if self.timing == CUDA_GRAPHS else "eagerly"
        count = f"at {self.tokens} tokens" + (
            ""
            if self.tokens_given
            else " (the default: set verify_speed_tokens to the rows of one matmul in a "
            "training step, batch x sequence length)"
        )
        return f"each layer shape on a 2:4 kernel timed at fit start, {how}, {count}"
