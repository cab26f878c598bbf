"""Shared helpers for the benchmarks: medians, live-tensor memory, Markdown tables."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Sequence

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
