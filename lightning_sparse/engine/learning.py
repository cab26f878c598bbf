"""What a learned phase reports: its cost when it starts, its layers' statistics when it ends
(how many N:M groups left the prior's pattern, how sure the logits are), and how those
statistics are kept in checkpoints for the end-of-fit summary.

Example:
    >>> report = {"fc.weight": (12, 48, 0.21)}
    >>> overall(report)
    (12, 48, 0.21)
    >>> summarize("sparsity", 0, report, 30)
    '[sparsity] step 30: phase 1 learned its masks: 25.0% of 48 groups changed from the prior, mean pattern entropy 0.21 nats'
    >>> layer_lines(report)
    ['fc.weight: 12 of 48 groups changed from the prior (25.0%), mean pattern entropy 0.21 nats']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_sparse.algorithms import Learned
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.masks.candidates import candidate_count
from lightning_sparse.masks.tile_candidates import TILE_CANDIDATES

LearnedReports = dict[int, dict[str, tuple[int, int, float]]]
"""Per learned phase index, per parameter: ``(groups changed from the prior, groups, mean
pattern entropy in nats)``, as :meth:`~lightning_sparse.algorithms.Learned.statistics` gives."""


def layer_statistics(algo: Learned) -> dict[str, tuple[int, int, float]]:
    """Per parameter ``algo`` learns masks for, in its order: its
    :meth:`~lightning_sparse.algorithms.Learned.statistics` now."""
    return {param: algo.statistics(param) for param in algo.logits}


def overall(report: Mapping[str, tuple[int, int, float]]) -> tuple[int, int, float]:
    """``(groups changed from the prior, groups, mean pattern entropy)`` over every
    parameter of ``report``, the entropy weighted by the groups."""
    changed = sum(c for c, _, _ in report.values())
    groups = sum(g for _, g, _ in report.values())
    return changed, groups, sum(g * e for _, g, e in report.values()) / max(groups, 1)


def logit_bytes(groups: int, candidates: int) -> int:
    """Bytes of fp32 state a learned phase holds for ``groups`` groups of ``candidates``
    patterns: the logits, their gradient and Adam's two moments."""
    return 4 * 4 * groups * candidates


def learned_units(
    algo: Learned, shapes: Iterable[torch.Size]
) -> tuple[dict[tuple[str, str, int], int], int]:
    """What ``algo`` keeps logits for over weights whose rows have ``shapes``: per kind of
    unit (``("group of 4", "groups of 4")`` or the same for ``"4x4 tile"``) and candidate
    count, how many units; and the
    bytes they hold with their gradient and Adam state."""
    units: dict[tuple[str, str, int], int] = {}
    for shape in shapes:
        count, candidates = algo.logit_count(shape)
        unit = (
            ("4x4 tile", "4x4 tiles")
            if algo.learns_tiles(shape)
            else (f"group of {algo.target.m}", f"groups of {algo.target.m}")
        )
        key = (*unit, candidates)
        units[key] = units.get(key, 0) + count
    return units, sum(logit_bytes(count, c) for (*_, c), count in units.items())


def handover_form(algo: Learned) -> str:
    """How ``algo``'s masks are handed over: ``""`` as learned, else the transposable form."""
    if not algo.transposable:
        return ""
    return f", transposable: {algo.transposable}"


def describe_start(name: str, algo: Learned, step: int, resumed: bool = False) -> str:
    """The log lines of a learned phase that starts (or, ``resumed``, goes on) at ``step``:
    what it learns, what it costs, and where each layer's logits stand."""
    candidates = candidate_count(algo.target)
    report = layer_statistics(algo)
    frozen = {False: "frozen", True: "training", "dense": "training, dense gradient"}[
        algo.train_weights
    ]
    how = "goes on learning" if resumed else "learns"
    units, held = learned_units(algo, algo.shapes.values())
    where = ""
    if algo.shards.splits:  # what this rank holds of them
        held = sum(logit_bytes(*value.shape) for value in algo.logits.values())
        where = " on this rank, its share of the ranks' split"
    parts = [f"{n} {many}, {c} logits each" for (_, many, c), n in units.items()]
    uniform = f"{math.log(candidates):.2f} nats"
    if algo.tiled:
        uniform += f" ({math.log(TILE_CANDIDATES) / 4:.2f} per group of a tile)"
    head = (
        f"[{name}] step {step}: phase {algo.phase.index + 1} {how} {algo.target} masks of "
        f"{len(algo.shapes)} parameters (weights {frozen}{handover_form(algo)}): "
        f"{', '.join(parts)} ({held / 2**20:.2f} MiB with their gradient and Adam "
        f"state{where}), prior init={algo.init!r} at strength {algo.prior_strength:g}; pattern "
        f"entropy of a uniform distribution: {uniform}"
    )
    return "\n".join([head] + [f"  {line}" for line in layer_lines(report)])


def describe_projection(algo: Learned) -> str:
    """How many groups the handover's projection onto transposable tiles changed (``""``
    where nothing was projected), to end the handover's log line."""
    if not algo.projected:
        return ""
    groups = sum(
        math.prod(algo.shapes[name]) // algo.target.m for name in algo.projected
    )
    changed = sum(algo.projected.values())
    return (
        f", projected onto transposable 2:4 tiles: the projection changed {changed} of "
        f"{groups} groups ({changed / max(groups, 1):.1%})"
    )


def summarize(
    name: str, index: int, report: Mapping[str, tuple[int, int, float]], step: int
) -> str:
    """The log line of learned phase ``index`` ending at ``step`` with ``report``."""
    changed, groups, entropy = overall(report)
    return (
        f"[{name}] step {step}: phase {index + 1} learned its masks: "
        f"{changed / max(groups, 1):.1%} of {groups} groups changed from the prior, mean "
        f"pattern entropy {entropy:.2f} nats"
    )


def layer_lines(report: Mapping[str, tuple[int, int, float]]) -> list[str]:
    """One line per parameter of ``report``, for the summary."""
    return [
        f"{param}: {changed} of {groups} groups changed from the prior "
        f"({changed / max(groups, 1):.1%}), mean pattern entropy {entropy:.2f} nats"
        for param, (changed, groups, entropy) in report.items()
    ]


def read_reports(
    name: str, value: Any, phases: Sequence[ResolvedPhase]
) -> LearnedReports:
    """The ``learned_reports`` of a saved state (``None``: none), checked; a ``ValueError``
    names what is wrong."""
    if value is None:
        return {}

    def is_stats(stats: Any) -> bool:
        return (
            isinstance(stats, (list, tuple))
            and len(stats) == 3
            and all(type(x) is int for x in stats[:2])
            and isinstance(stats[2], float)
        )

    if not (
        isinstance(value, Mapping)
        and all(
            type(index) is int
            and 0 <= index < len(phases)
            and isinstance(layers, Mapping)
            and all(isinstance(p, str) and is_stats(s) for p, s in layers.items())
            for index, layers in value.items()
        )
    ):
        raise ValueError(
            f"[{name}] the checkpoint's sparsity state has learned_reports "
            f"{str(value)[:80]}, not per phase and parameter (changed, groups, entropy); "
            f"the checkpoint is damaged or was not written by SparsityCallback"
        )
    return {
        index: {param: (s[0], s[1], s[2]) for param, s in layers.items()}
        for index, layers in value.items()
    }
