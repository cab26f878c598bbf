"""Shared helpers for the benchmarks: medians, live-tensor memory, Markdown tables, a quiet
CPU trainer."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python (params, grads, optimizer
    state, masks, buffers, cached tensors), after a full garbage collection. Differences between
    variants measured at the same point of the same loop are the variants' extra memory."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if (
            isinstance(obj, torch.Tensor)
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
        ):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def quiet_cpu_trainer(**kwargs: Any) -> L.Trainer:
    """A CPU ``Trainer`` without loggers, checkpoints, progress bar, model summary or sanity
    check; ``kwargs`` add to or override these."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})
