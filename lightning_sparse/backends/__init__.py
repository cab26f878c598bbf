"""Backends decide how a masked weight is executed; they never decide which weights to drop.

``"masked"``: dense math on a masked weight, any device. ``"semi_structured"``: 2:4 sparse
tensor cores (:mod:`~lightning_sparse.backends.semi_structured`). ``"auto"``: per layer,
semi_structured where the hardware, dtype and shape allow it
(:mod:`~lightning_sparse.backends.capability`) and the kernel passed the kernel check on this
GPU (:mod:`~lightning_sparse.backends.kernel_check`), masked elsewhere; with
``verify_speed``, also masked where the sparse kernel is slower
(:mod:`~lightning_sparse.backends.speed`).

Example:
    >>> from torch import nn
    >>> from lightning_sparse.masks import NM
    >>> layer = nn.Linear(256, 256)
    >>> choose_backend("auto", 0.7, layer.weight, [("fc", layer, "weight")])
    BackendChoice(name='masked', reason='70% has no sparse kernel', kernel=None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_sparse.backends.capability import forward_dtype, semi_structured_kernel
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.backends.kernel_check import TOLERANCE, check_kernel
from lightning_sparse.backends.speed import TIMINGS, SpeedMeasurement
from lightning_sparse.masks import NM, Sparsity, describe

BACKEND_NAMES = ("auto", "masked", "semi_structured")

Speedup = Callable[[Tensor, str, torch.dtype], "SpeedMeasurement | None"]
"""``(weight, kernel, dtype) -> (dense time / sparse time, relative error)``, or ``None``
where it does not time that weight (see ``speed.SpeedCheck``)."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend one parameter runs on in one phase, why, and (semi_structured) the kernel."""

    name: str
    reason: str
    kernel: str | None = None


def validate_backend(
    name: object,
    verify_speed: bool | str | None = None,
    verify_speed_tokens: int | None = None,
) -> str:
    """``name`` if it is a backend and ``verify_speed`` (``None``: on where ``name`` is
    ``"auto"``) and ``verify_speed_tokens`` go with it; else an error that says the fix."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend={name!r}; use one of {list(BACKEND_NAMES)}")
    if not (
        verify_speed is None
        or isinstance(verify_speed, bool)
        or verify_speed in TIMINGS
    ):
        raise TypeError(
            f"verify_speed={verify_speed!r}; use True (time each layer as the model runs: "
            f"as CUDA graphs where it is compiled with them, else eagerly; the default with "
            f"backend='auto'), {' or '.join(map(repr, TIMINGS))} (time it that way), or False"
        )
    if verify_speed and name != "auto":
        raise ValueError(
            f"verify_speed={verify_speed!r} picks, per layer, between the sparse kernel and "
            f"dense math, which backend={name!r} does not do; use backend='auto'"
        )
    if verify_speed_tokens is None:
        return name  # type: ignore[return-value]
    if (
        isinstance(verify_speed_tokens, bool)
        or not isinstance(verify_speed_tokens, int)
        or verify_speed_tokens < 1
    ):
        raise ValueError(
            f"verify_speed_tokens={verify_speed_tokens!r}: give the rows of one layer's "
            f"matmul in a training step as a positive integer (batch x sequence length, e.g. "
            f"12 x 1024 = 12288 for GPT-2 at batch 12)"
        )
    if verify_speed is False or name != "auto":
        raise ValueError(
            f"verify_speed_tokens={verify_speed_tokens} sets how verify_speed times layers, "
            f"which is off here (backend={name!r}, verify_speed={verify_speed!r}); use "
            f"backend='auto' with verify_speed left on, or drop verify_speed_tokens"
        )
    return name  # type: ignore[return-value]


def choose_backend(
    requested: str,
    target: Sparsity,
    weight: Tensor,
    owners: Sequence[tuple[str, nn.Module, str]],
    compute_dtype: torch.dtype | None = None,
    speedup: Speedup | None = None,
    gpu: GpuTarget | None = None,
) -> BackendChoice:
    """The backend for ``weight`` (held by ``owners``) in a sparse phase with ``target``.

    ``compute_dtype`` is the autocast dtype (``None``: the weight's own, as its forward sees
    it: for FSDP2, the gathered weight's, see :mod:`~lightning_sparse.backends.fsdp`); the
    kernel check and ``speedup`` run in that dtype at the whole shape; ``speedup``, when
    given, measures sparse against dense and keeps slower layers on masked dense math;
    ``gpu`` predicts the choice on that GPU instead of the weight's own device.
    """
    if requested == "masked":
        return BackendChoice("masked", "requested")
    if target != NM(2, 4):
        return BackendChoice("masked", f"{describe(target)} has no sparse kernel")
    kernel, why = semi_structured_kernel(weight, owners, compute_dtype, gpu)
    if kernel is None:
        return BackendChoice("masked", why)
    if gpu is not None or weight.is_meta:  # a plan's prediction: nothing runs
        return BackendChoice("semi_structured", why, kernel)
    dtype = forward_dtype(weight, compute_dtype)  # FSDP2: the gathered weight's
    verdict = check_kernel(kernel, dtype, weight.device)
    if not verdict.passed:
        return BackendChoice("masked", f"{verdict.reason}: running masked math")
    if verdict.note:
        why = f"{why}, {verdict.note}"
    measured = None if speedup is None else speedup(weight, kernel, dtype)
    if measured is not None:
        if measured.error > TOLERANCE:
            rows, cols = weight.shape
            return BackendChoice(
                "masked",
                f"{why}: wrong results at shape {rows}x{cols} in verify_speed (relative "
                f"error {measured.error:.2g}), so kept dense",
            )
        ratio, details = measured.ratio, measured.details()
        if ratio < 1.0:
            return BackendChoice(
                "masked",
                f"{why}: sparse {ratio:.2f}x dense ({details}), so kept dense (verify_speed)",
            )
        why = f"{why}, {ratio:.2f}x dense ({details})"
    return BackendChoice("semi_structured", why, kernel)


def require_semi_structured(offending: Sequence[tuple[str, str]]) -> None:
    """Raise for ``backend='semi_structured'`` with each ``(where, why)`` it cannot run."""
    if not offending:
        return
    lines = "\n".join(f"  {where}: {why}" for where, why in offending)
    raise ValueError(
        f"backend='semi_structured' cannot run these layers on 2:4 sparse tensor cores:\n"
        f"{lines}\nUse backend='auto' to run them with masked dense math (the same function), "
        f"or exclude them from params"
    )
