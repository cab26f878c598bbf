"""Whether a sparse phase can run on a group's parameters, checked when the group is built.

Three questions, each answered per parameter before any mask exists: does the phase's N:M
pattern fit the layer (groups of ``M`` along its inputs), can a straight-through algorithm give
the layer a masked forward (a weight read outside its layer, or tied to several layers, cannot),
and can ``init: wanda`` see the inputs each weight multiplies.
A ``ValueError`` names the parameter and a pattern that excludes it alone.

Example:
    >>> from torch import nn
    >>> from lightning_sparse.algorithms import build_algorithm
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.core.selection import select_parameters
    >>> net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> phase = resolve_phases([Phase(sparsity="2:4")], total_steps=10)[0]
    >>> check_phase(phase, build_algorithm(phase), select_parameters(net).targets)
    Traceback (most recent call last):
    ...
    ValueError: phases[0]: sparsity '2:4' is impossible for parameter '0.weight': ...
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning_sparse.algorithms import SparsityAlgorithm
from lightning_sparse.backends.masked import straight_through_unsupported
from lightning_sparse.core.layers import nm_unsupported
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.core.selection import ParamTarget, read_elsewhere
from lightning_sparse.engine.input_norms import input_norms_unsupported
from lightning_sparse.masks import NM


def check_phase(
    phase: ResolvedPhase, algorithm: SparsityAlgorithm, targets: Sequence[ParamTarget]
) -> None:
    """Raise if sparse ``phase`` (run by ``algorithm``) cannot run on one of ``targets``."""
    where = f"phases[{phase.index}]"
    for t in targets:
        reason = input_norms_unsupported(t) if algorithm.calibrates else None
        if reason is not None:
            raise ValueError(
                f"{where}: init='wanda' scores each weight by the norm of the input it "
                f"multiplies, but parameter {t.name!r} cannot have one: {reason}; exclude it "
                f"(exclude=[{_pattern(t, targets)!r}]) or use init: topk"
            )
        if isinstance(phase.target, NM):
            reason = nm_unsupported(t.layer, t.param.shape, phase.target.m)
            if reason is not None:
                raise ValueError(
                    f"{where}: sparsity '{phase.target}' is impossible for parameter {t.name!r}: "
                    f"{reason}; exclude it (exclude=[{_pattern(t, targets)!r}]) or use a float "
                    f"sparsity"
                )
        if algorithm.straight_through:
            for module_name, module, attr in t.owners:
                if t.sparse_reads:  # every read of module.attr will be sparse
                    continue
                reason = read_elsewhere(t.readers) or straight_through_unsupported(
                    module, attr
                )
                if reason is None and len(t.owners) > 1:
                    reason = "it is shared by several modules (tied weights)"
                if reason is not None:
                    raise ValueError(
                        f"{where}: algorithm {algorithm.name!r} masks the forward of each "
                        f"layer, but parameter {t.name!r} ({module_name or 'model'}) cannot: "
                        f"{reason}; use a hard-mask algorithm ({_hard_mask_for(phase)}) "
                        f"or exclude it (exclude=[{_pattern(t, targets)!r}])"
                    )


def _pattern(t: ParamTarget, targets: Sequence[ParamTarget]) -> str:
    """A pattern that names ``t`` alone among ``targets`` (a glob matches dotted suffixes:
    ``conv1.weight`` would also take ``layer1.0.conv1.weight``)."""
    if any(o.name.endswith("." + t.name) for o in targets):
        return f"re:^{re.escape(t.name)}$"
    return t.name


def _hard_mask_for(phase: ResolvedPhase) -> str:
    """The built-in hard-mask algorithms that accept ``phase``'s target, for messages."""
    return "'static'" if isinstance(phase.target, NM) else "'static', 'gmp'"
