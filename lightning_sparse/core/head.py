"""Which layers are a model's output head, and the evidence for each.

The head is the layer that produces the model's output. A forward of the model is the best
evidence (:func:`record_calls`): the layers whose output the forward returns, as is or as a view,
or else the last layer to run. Names (``head``, ``lm_head``, ``classifier``...) and weights tied
to an embedding support it: a named layer among the last to run is a head too (timm's DeiT has
``head`` and ``head_dist``), one that runs before another layer is not. Without a forward, names
and ties decide; the generic name ``fc`` counts only for the last layer registered (a ResNet),
and a model with neither leaves its last registered layer dense as the head. Layers are those
of a known type (:mod:`~lightning_sparse.core.layers`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential()
    >>> net.add_module("out", nn.Linear(4, 2))  # registered first, runs last
    >>> net.add_module("mid", nn.Linear(3, 4))
    >>> net.forward = lambda x: net.out(net.mid(x))
    >>> find_heads(net)
    {'mid': 'the last layer registered (no forward seen: set example_input_array to find it by a forward)'}
    >>> find_heads(net, record_calls(net, lambda: net(torch.randn(1, 3)), "a test forward"))
    {'out': 'returned by a test forward'}
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_sparse.core.layers import STORED, layer_type

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
# ``head_dist``: the distillation head of timm's DeiT (and LeViT), beside ``head``
_HEAD_NAMES = {
    "head",
    "head_dist",
    "lm_head",
    "classifier",
    "output",
    "fc_out",
    "output_layer",
}
NO_FORWARD = "no forward seen: set example_input_array to find it by a forward"


@dataclass(frozen=True)
class Calls:
    """What one forward showed: the layers in the order they last returned, and those whose
    output the forward returned."""

    source: str  #: the forward, for reports (``"the forward of example_input_array"``)
    order: list[str]  #: layer module names, by the last time each returned
    returned: list[str]  #: layers whose output (or a view of it) the forward returned
    failed: str | None = None  #: the error that stopped the forward, if one did


def is_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer of a known type (Linear, ConvNd, Conv1D)."""
    return layer_type(module) is not STORED


def record_calls(model: nn.Module, forward: Callable[[], Any], source: str) -> Calls:
    """Run ``forward`` (a forward of ``model``) once, recording its layers' calls. A forward
    that raises is recorded as failed (the head is then found without it, and the report says
    why)."""
    names = {id(m): n for n, m in model.named_modules() if is_layer(m)}
    last: dict[str, int] = {}
    calls = itertools.count()
    outputs: list[tuple[weakref.ref[Tensor], str]] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        name = names[id(module)]
        last[name] = next(calls)  # a later call sorts later
        if isinstance(output, Tensor):  # a weak reference: no output is kept alive
            outputs.append((weakref.ref(output), name))

    handles = [m.register_forward_hook(hook) for m in model.modules() if id(m) in names]
    try:
        result = forward()
    except Exception as err:  # noqa: BLE001 (evidence missing, reported: not a failed run)
        first_line = f"{type(err).__name__}: {err}".splitlines()[0]
        return Calls(source, [], [], failed=first_line[:120])
    finally:
        for handle in handles:
            handle.remove()
    returned = []
    for tensor in _tensors(result):
        for ref, name in outputs:
            out = ref()
            if out is not None and (tensor is out or tensor._base is out):
                returned.append(name)
    order = sorted(last, key=last.__getitem__)
    return Calls(source, order, list(dict.fromkeys(returned)))


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a forward's result: nested tuples, lists and mappings (Hugging Face
    ``ModelOutput`` is one)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _named(module_name: str, at_end: bool) -> str | None:
    """Why a layer's name makes it a head, or ``None``; ``at_end``: whether the layer is where
    a generic ``fc`` must be to count (registered last without a forward; run with one)."""
    parts = module_name.split(".")
    if parts[-1] in _HEAD_NAMES:
        return f"named {parts[-1]!r}"
    if parts[-1] != "fc":
        return None
    # timm ConvNeXt and others: ``head.fc``; a ResNet: ``fc`` at the top, at the end
    if len(parts) > 1 and parts[-2] in _HEAD_NAMES:
        return f"named {'.'.join(parts[-2:])!r}"
    return "named 'fc'" if at_end else None


def find_heads(model: nn.Module, calls: Calls | None = None) -> dict[str, str]:
    """The output head modules' names, each with how it was found (see the module docstring)."""
    layers = [(n, m) for n, m in model.named_modules() if is_layer(m)]
    if not layers:
        return {}
    last_name = layers[-1][0]
    ran = set() if calls is None else set(calls.order)
    embedded = {
        id(p)
        for m in model.modules()
        if isinstance(m, EMBEDDING_TYPES)
        for p in m.parameters(recurse=False)
    }
    support: dict[str, list[str]] = {}
    for name, module in layers:
        named = _named(name, name in ran if calls is not None else name == last_name)
        tied = id(getattr(module, "weight", None)) in embedded
        why = [w for w in (named, "tied to an embedding" if tied else None) if w]
        if why:
            support[name] = why
    if calls is None or not calls.order:
        if calls is None:
            note = NO_FORWARD
        elif calls.failed is not None:
            note = f"{calls.source} failed: {calls.failed}"
        else:
            note = f"no layer ran in {calls.source}"
        if not support:
            return {last_name: f"the last layer registered ({note})"}
        return {n: f"{'; '.join(w)} ({note})" for n, w in support.items()}
    how = "returned by" if calls.returned else "the last layer to run in"
    heads = {n: [f"{how} {calls.source}"] for n in calls.returned or calls.order[-1:]}
    for name in reversed(calls.order):  # the last layers to run, while they are heads
        if name in heads:
            heads[name] += support.get(name, [])
        elif name in support:
            heads[name] = support[name] + [f"among the last to run in {calls.source}"]
        else:
            break
    for name, why in support.items():
        if name not in ran:  # no position to contradict the name
            heads[name] = why + [f"did not run in {calls.source}"]
    return {n: "; ".join(w) for n, w in heads.items()}
