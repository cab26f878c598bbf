"""CUDA graphs: capture a step to replay it, and tell whether a model is compiled to run as them.

A 2:4 layer's speed depends on how it runs: each cuSPARSELt call costs about 0.6 ms of CPU in
eager mode, which a CUDA graph replay does not pay. So ``verify_speed`` times a layer the way
the model will run it: as a CUDA graph (:func:`cuda_graphed`) where the model is compiled with
CUDA graphs (:func:`compiled_with_cuda_graphs`: ``torch.compile``'s ``mode="reduce-overhead"``
or ``"max-autotune"``), else eagerly.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(8, 8))
    >>> compiled_with_cuda_graphs(net)
    False
    >>> net[0].compile(mode="reduce-overhead")  # compiles lazily, at the first call
    >>> compiled_with_cuda_graphs(net)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

_CUDAGRAPHS = "triton.cudagraphs"  # inductor's option, which its modes set


def cuda_graphed(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured once as a CUDA graph (after three warm-up runs on a side stream, as
    capture needs): the graph's replay.

    Raises:
        RuntimeError: ``step`` cannot be captured (e.g. it synchronizes with the CPU).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def compiled_with_cuda_graphs(model: nn.Module) -> bool:
    """Whether ``model``, or a module in it, is compiled by ``torch.compile`` with CUDA
    graphs: ``module.compile(mode=...)``, a ``torch.compile``'d module, or a LightningModule
    that Lightning unwrapped from one, with the mode ``"reduce-overhead"`` or
    ``"max-autotune"`` (or inductor's ``triton.cudagraphs`` option).

    It reads the compiler options torch keeps on a compiled callable
    (``get_compiler_config()``, ``compiler_config``); where there are none (another backend
    than inductor), the answer is ``False``."""
    return any(
        bool((options or {}).get(_CUDAGRAPHS)) for options in _compiler_options(model)
    )


def _compiler_options(model: nn.Module) -> Iterator[dict | None]:
    for module in model.modules():
        state = module.__dict__
        compiled = state.get("_compiled_call_impl")  # module.compile(...)
        if compiled is not None:
            get = getattr(compiled, "get_compiler_config", None)
            yield get() if callable(get) else None
        context = state.get("dynamo_ctx")  # torch.compile(module): an OptimizedModule
        unwrapped = state.get("_compiler_ctx")  # Lightning's record of an unwrapped one
        if isinstance(unwrapped, dict):
            context = unwrapped.get("dynamo_ctx")
        if context is not None:
            yield getattr(context, "compiler_config", None)
