"""GPUs a plan can target: compute capability and peak dense vs 2:4 tensor-core rates.

``lightning-sparse plan --gpu h100`` asks, for each selected layer, which kernel
``backend="auto"`` would choose on that GPU, by the same rules fit start applies to the GPU it
runs on (:func:`~lightning_sparse.backends.capability.semi_structured_kernel`). The rates are
the vendors' peak bf16/fp16 tensor-core figures (dense, and with 2:4 sparsity: twice that), for
the FLOP estimate; they are not measured speeds.

Example:
    >>> gpu = parse_gpu("H100")
    >>> gpu.name, gpu.capability, round(gpu.sparse_tflops / gpu.dense_tflops, 1)
    ('H100 SXM', (9, 0), 2.0)
    >>> parse_gpu("sm80").capability, parse_gpu("8.6").name
    ((8, 0), 'sm86')
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuTarget:
    """A GPU to plan for: its name, compute capability, peak bf16 tensor-core rates and
    memory in GiB (``None`` when the plan was given a bare capability)."""

    name: str
    capability: tuple[int, int]
    dense_tflops: float | None = None
    sparse_tflops: float | None = None
    memory_gib: float | None = None

    @property
    def arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


GPUS: dict[str, GpuTarget] = {
    "a100": GpuTarget("A100", (8, 0), 312.0, 624.0, 80.0),
    "a10": GpuTarget("A10", (8, 6), 125.0, 250.0, 24.0),
    "a6000": GpuTarget("RTX A6000", (8, 6), 155.0, 310.0, 48.0),
    "l4": GpuTarget("L4", (8, 9), 121.0, 242.0, 24.0),
    "l40s": GpuTarget("L40S", (8, 9), 362.0, 733.0, 48.0),
    "rtx4090": GpuTarget("RTX 4090", (8, 9), 165.0, 330.0, 24.0),
    "h100": GpuTarget("H100 SXM", (9, 0), 989.0, 1979.0, 80.0),
    "h100-pcie": GpuTarget("H100 PCIe", (9, 0), 756.0, 1513.0, 80.0),
    "h200": GpuTarget("H200", (9, 0), 989.0, 1979.0, 141.0),
    "b200": GpuTarget("B200", (10, 0), 2250.0, 4500.0, 180.0),
    "t4": GpuTarget("T4", (7, 5), 65.0, None, 16.0),
    "v100": GpuTarget("V100", (7, 0), 125.0, None, 32.0),
}
"""Known GPUs by lower-case name (peak dense / 2:4 bf16 tensor TFLOP/s, T4 and V100: fp16,
no sparse tensor cores; memory as sold, the A100's and V100's larger model)."""

_CAPABILITY = re.compile(r"^(?:sm_?|compute_?)?(\d{1,2})\.?(\d)$")


def parse_gpu(value: str) -> GpuTarget:
    """A :class:`GpuTarget` from a name (``"h100"``, ``"A100"``, ``"l4"``) or a compute
    capability (``"sm80"``, ``"sm_90"``, ``"8.6"``).

    Raises:
        ValueError: neither a known name nor a capability; the message lists the names.
    """
    key = str(value).strip().lower().replace(" ", "").replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    match = _CAPABILITY.match(key.replace("-", "_"))
    if match:
        major, minor = int(match.group(1)), int(match.group(2))
        return GpuTarget(f"sm{major}{minor}", (major, minor))
    raise ValueError(
        f"--gpu={value!r} is neither a GPU this plan knows nor a compute capability: use one "
        f"of {sorted(GPUS)} or a capability such as 'sm80' or '9.0'"
    )
