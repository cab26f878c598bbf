"""Measured 2:4 speed per matmul shape, which ``lightning-sparse plan --gpu`` predicts from.

Each :class:`ShapeRatio` is one measured speed (dense time / sparse time) of a matmul with a
2:4 weight at one shape, under the conditions of its :class:`Setup` (GPU, versions, dtype,
what ran). They are the forward table of ``docs/hopper.md`` (its "searched, graphed" column),
and a test keeps the two equal. The matmul is the call the 2:4 training path makes (cuSPARSELt,
the only 2:4 kernel on sm90, with the searched algorithm), so a layer's input-gradient matmul,
an ``out -> in`` matmul of the same tokens, reads the ratio measured at that shape.

:func:`setup_for` picks the measurements that speak for a GPU, and :func:`step_estimates`
turns them into a layer's training-step speed at each measured token count: three matmuls of
equal dense time (the sparse forward and input gradient, a dense weight gradient), without the
packing of ``W`` and ``W.T``, so an upper estimate.

Example:
    >>> from lightning_sparse.backends.gpus import parse_gpu
    >>> setup = setup_for(parse_gpu("h200"), torch.bfloat16)  # measured on an H100 SXM
    >>> [f"{s.tokens}: {s.training:.2f}x" for s in step_estimates(1024, 4096, setup)]
    ['12336: 1.16x', '32896: 1.22x']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_sparse.backends.gpus import GPUS, GpuTarget


@dataclass(frozen=True)
class Setup:
    """Where and how a set of ratios was measured.

    Example:
        >>> H100_FORWARD.gpu.arch, H100_FORWARD.versions
        ('sm90', 'torch 2.11.0+cu130, cuSPARSELt 0.8.0, bfloat16')
    """

    gpu: GpuTarget  #: the ``--gpu`` target of the GPU measured on (its capability)
    device: str  #: the GPU as measured (model, memory, form factor)
    torch: str
    cusparselt: str
    dtype: torch.dtype
    measured: str  #: what ran, in one phrase
    documented: str  #: the page holding the table

    @property
    def versions(self) -> str:
        """The software and dtype, for a line that quotes a ratio."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"torch {self.torch}, cuSPARSELt {self.cusparselt}, {dtype}"


@dataclass(frozen=True)
class ShapeRatio:
    """Dense time / sparse time of ``tokens x in_features -> out_features`` under ``setup``.

    Example:
        >>> r = RATIOS[0]  # ViT-L fc1 at batch 48
        >>> r.tokens, r.in_features, r.out_features, r.ratio
        (12336, 1024, 4096, 1.19)
    """

    setup: Setup
    tokens: int
    in_features: int
    out_features: int
    ratio: float


@dataclass(frozen=True)
class StepEstimate:
    """A 2:4 layer's training step at one token count, from its two sparse matmuls' ratios;
    ``assumed`` names the one not measured at this count and taken equal to the other.

    Example:
        >>> round(StepEstimate(12336, 1.19, 1.34, None).training, 3)
        1.16
    """

    tokens: int
    forward: float
    input_grad: float
    assumed: str | None

    @property
    def training(self) -> float:
        """Dense step time / sparse step time (see :func:`step_speed`)."""
        return step_speed(self.forward, self.input_grad)


def step_speed(forward: float, input_grad: float) -> float:
    """A 2:4 layer's training step, dense time / sparse time, from the speeds of its sparse
    forward and input-gradient matmuls: three matmuls of equal dense time, the weight gradient
    dense, packing not counted.

    Example:
        >>> step_speed(2.0, 2.0)  # the 2:4 hardware limit bounds a step at 1.5x
        1.5
    """
    return 3.0 / (1.0 / forward + 1.0 / input_grad + 1.0)


H100_FORWARD = Setup(
    gpu=GPUS["h100"],
    device="H100 80GB HBM3 SXM",
    torch="2.11.0+cu130",
    cusparselt="0.8.0",
    dtype=torch.bfloat16,
    measured=(
        "the forward x @ W.T with W packed once, cuSPARSELt's searched algorithm, replayed "
        "as a CUDA graph"
    ),
    documented="docs/hopper.md",
)

RATIOS: tuple[ShapeRatio, ...] = (
    ShapeRatio(H100_FORWARD, 12336, 1024, 4096, 1.19),
    ShapeRatio(H100_FORWARD, 12336, 4096, 1024, 1.34),
    ShapeRatio(H100_FORWARD, 32896, 1024, 4096, 1.37),
    ShapeRatio(H100_FORWARD, 8192, 768, 3072, 1.17),
    ShapeRatio(H100_FORWARD, 16384, 4096, 11008, 1.79),
    ShapeRatio(H100_FORWARD, 16384, 11008, 4096, 1.44),
    ShapeRatio(H100_FORWARD, 65536, 4096, 16384, 1.49),
    ShapeRatio(H100_FORWARD, 65536, 8192, 28672, 1.54),
    ShapeRatio(H100_FORWARD, 2048, 8192, 28672, 1.68),
    ShapeRatio(H100_FORWARD, 64, 8192, 28672, 1.05),
)
"""Every measured ratio, in the order of the table in ``docs/hopper.md``."""


def setup_for(gpu: GpuTarget, dtype: torch.dtype) -> Setup | None:
    """The measurements that speak for ``gpu`` at ``dtype``: those made on it, else those made
    on another GPU of its compute capability, else ``None``.

    Example:
        >>> from lightning_sparse.backends.gpus import parse_gpu
        >>> setup_for(parse_gpu("h200"), torch.bfloat16).device  # another sm90 GPU
        'H100 80GB HBM3 SXM'
        >>> setup_for(parse_gpu("a100"), torch.bfloat16)  # sm80: not measured
        >>> setup_for(parse_gpu("h100"), torch.float16)  # measured in bfloat16 only
    """
    setups = [
        s
        for s in dict.fromkeys(r.setup for r in RATIOS)
        if s.gpu.capability == gpu.capability and s.dtype == dtype
    ]
    setups.sort(key=lambda s: s.gpu != gpu)  # stable: the GPU's own measurements first
    return setups[0] if setups else None


def step_estimates(
    in_features: int, out_features: int, setup: Setup
) -> list[StepEstimate]:
    """At each token count where ``setup`` measured the layer's forward (``in -> out``) or its
    input gradient (``out -> in``), the layer's :class:`StepEstimate`; empty when neither.

    Example:
        >>> fc2 = step_estimates(4096, 1024, H100_FORWARD)  # its input gradient: 1024 -> 4096
        >>> [(s.tokens, s.input_grad, s.assumed) for s in fc2]
        [(12336, 1.19, None), (32896, 1.37, 'forward')]
        >>> step_estimates(384, 1536, H100_FORWARD)
        []
    """
    forward: dict[int, float] = {}
    input_grad: dict[int, float] = {}
    for r in RATIOS:
        if r.setup != setup:
            continue
        if (r.in_features, r.out_features) == (in_features, out_features):
            forward[r.tokens] = r.ratio
        if (r.in_features, r.out_features) == (out_features, in_features):
            input_grad[r.tokens] = r.ratio
    steps = []
    for tokens in sorted(forward.keys() | input_grad.keys()):
        f = forward.get(tokens) or input_grad[tokens]
        g = input_grad.get(tokens) or forward[tokens]
        assumed = (
            "forward"
            if tokens not in forward
            else "input gradient"
            if tokens not in input_grad
            else None
        )
        steps.append(StepEstimate(tokens, f, g, assumed))
    return steps
