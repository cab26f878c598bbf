"""How a group's target sparsity spreads over its layers: ``uniform``, ``erk`` or ``global``.

- ``uniform``: every layer gets the target.
- ``erk`` (Erdos-Renyi-Kernel, Evci et al. 2020, "Rigging the Lottery"): layer ``l`` keeps a
  fraction ``eps * sum(shape_l) / prod(shape_l)`` of its weights (for a Linear layer
  ``(n_in + n_out) / (n_in * n_out)``, for a convolution the kernel sizes join the sum and the
  product), with ``eps`` chosen so the group as a whole keeps ``1 - target`` of its weights. A
  layer whose density would exceed 1 stays dense and ``eps`` is solved again for the others.
- ``global``: one threshold over the scores of all the group's weights (magnitudes, or the
  algorithm's own score): the ``round((1 - target) * total)`` highest-scoring weights of the
  group survive, wherever they are (ties at the threshold are broken deterministically).

Each distribution returns one target per layer as a float sparsity that encodes an exact count
of kept weights (:func:`~lightning_sparse.masks.num_kept` of it gives the count back). N:M
targets are per-layer by nature: only ``uniform`` accepts them.

Example:
    >>> import torch
    >>> shapes = {"a": torch.Size([4, 4]), "b": torch.Size([16, 4])}
    >>> {name: round(d, 3) for name, d in erk_densities(0.5, shapes).items()}
    {'a': 0.714, 'b': 0.446}
    >>> spread("erk", 0.5, shapes, score=None)  # exact counts: 11 of 16 and 29 of 64 kept
    {'a': 0.3125, 'b': 0.546875}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_sparse.masks import NM, Sparsity, mark_top_k, num_kept

Shapes = Mapping[str, torch.Size]
Score = Callable[[str], Tensor]


def uniform(target: float, shapes: Shapes, score: Score | None) -> dict[str, float]:
    """Every layer gets ``target``."""
    return dict.fromkeys(shapes, target)


def erk_densities(target: float, shapes: Shapes) -> dict[str, float]:
    """ERK densities (fractions kept) per layer; see the module docstring."""
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    raw = {name: sum(shape) / numel[name] for name, shape in shapes.items()}
    dense: set[str] = set()
    while True:
        sparse = [name for name in shapes if name not in dense]
        budget = (1.0 - target) * sum(numel.values()) - sum(numel[n] for n in dense)
        divisor = sum(raw[n] * numel[n] for n in sparse)
        if not sparse or divisor == 0:
            return {name: 1.0 for name in shapes}
        eps = budget / divisor
        highest = max(raw[n] for n in sparse)
        if eps * highest <= 1.0:
            break
        dense |= {n for n in sparse if raw[n] == highest}
    return {name: 1.0 if name in dense else eps * raw[name] for name in shapes}


def erk(target: float, shapes: Shapes, score: Score | None) -> dict[str, float]:
    """Erdos-Renyi-Kernel targets (see the module docstring)."""
    return {
        name: _exact(shapes[name], 1.0 - density)
        for name, density in erk_densities(target, shapes).items()
    }


@torch.no_grad()
def global_threshold(
    target: float, shapes: Shapes, score: Score | None
) -> dict[str, float]:
    """One threshold over all scores of the group (see the module docstring)."""
    if score is None:
        raise ValueError("the 'global' distribution needs the layers' scores")
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    keep = num_kept(sum(numel.values()), target)
    scores = {name: score(name).detach().reshape(-1).float() for name in shapes}
    if keep in (0, sum(numel.values())):
        return dict.fromkeys(shapes, target)
    device = next(iter(scores.values())).device
    chosen = mark_top_k(torch.cat([s.to(device) for s in scores.values()]), keep)
    kept, offset = {}, 0
    for name in shapes:
        kept[name] = int(torch.count_nonzero(chosen[offset : offset + numel[name]]))
        offset += numel[name]
    return {name: (numel[name] - kept[name]) / numel[name] for name in shapes}


def _exact(shape: torch.Size, sparsity: float) -> float:
    numel = math.prod(shape)
    return (numel - num_kept(numel, sparsity)) / numel


DISTRIBUTIONS: dict[str, Callable[[float, Shapes, Score | None], dict[str, float]]] = {
    "uniform": uniform,
    "erk": erk,
    "global": global_threshold,
}


def check_distribution(name: object, target: Sparsity, where: str) -> str:
    """Validate a phase's ``distribution`` (``None`` means ``uniform``)."""
    name = "uniform" if name is None else name
    if not isinstance(name, str) or name not in DISTRIBUTIONS:
        raise ValueError(
            f"{where}: distribution={name!r} is not available; use one of {sorted(DISTRIBUTIONS)}"
        )
    if name != "uniform" and isinstance(target, NM):
        raise ValueError(
            f"{where}: distribution={name!r} spreads a fraction over layers, but "
            f"sparsity='{target}' already fixes {target.n} of every {target.m} weights in each "
            f"layer; leave distribution out (or use 'uniform')"
        )
    return str(name)


def spread(
    name: str, target: Sparsity, shapes: Shapes, score: Score | None
) -> dict[str, Sparsity]:
    """One target per layer: ``target`` spread over ``shapes`` by distribution ``name``.
    ``score(layer)`` gives the scores the algorithm ranks by (only ``global`` calls it)."""
    if isinstance(target, NM):
        return dict.fromkeys(shapes, target)
    return dict(DISTRIBUTIONS[name](float(target), shapes, score))
