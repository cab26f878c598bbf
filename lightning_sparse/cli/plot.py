"""A PNG of a sparsity schedule: each group's target sparsity against the optimizer step.

Needs matplotlib (``pip install 'lightning-sparse[plot]'``); :func:`plot_schedule` raises
``ModuleNotFoundError`` with that hint without it.

Example:
    >>> import os, tempfile
    >>> import lightning as L
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_sparse import SparsityCallback
    >>> from lightning_sparse.cli.plan import plan_schedule
    >>> cb = SparsityCallback(phases=[{"sparsity": 0.9, "algorithm": "gmp", "until": 0.8},
    ...                               {"sparsity": 0.0}], params=["layer.weight"])
    >>> trainer = L.Trainer(max_steps=100, callbacks=[cb], logger=False, accelerator="cpu")
    >>> path = os.path.join(tempfile.mkdtemp(), "plan.png")
    >>> plot_schedule(plan_schedule(trainer, BoringModel()), path)
    >>> os.path.getsize(path) > 0
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_sparse.cli.plan import SchedulePlan
from lightning_sparse.core.schedule import phase_at
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import sparsity_fraction

PLOT_HINT = "the schedule plot needs matplotlib: pip install 'lightning-sparse[plot]'"
_POINTS = 1000  # steps sampled along the run (plus every phase boundary)


def target_curve(
    sparsifier: Sparsifier, total_steps: int
) -> tuple[list[int], list[float]]:
    """``(steps, target sparsity)`` of one group over a run, sampled densely enough to draw
    (every phase boundary included); dense phases and the time after the last one are 0.

    Example:
        >>> from lightning_sparse.core.schedule import Phase, resolve_phases
        >>> phases = resolve_phases([Phase(sparsity="2:4", until=0.5), Phase()], total_steps=4)
        >>> target_curve(Sparsifier("g", [], phases), 4)
        ([0, 1, 2, 3, 4], [0.5, 0.5, 0.0, 0.0, 0.0])
    """
    steps = {round(total_steps * i / _POINTS) for i in range(_POINTS + 1)}
    for phase in sparsifier.phases:
        steps |= {phase.start, max(phase.start, (phase.end or total_steps) - 1)}
        if phase.end is not None:
            steps.add(phase.end)
    ordered = sorted(s for s in steps if 0 <= s <= total_steps)
    values = []
    for step in ordered:
        phase = phase_at(sparsifier.phases, step)
        algo = None if phase is None else sparsifier.algorithms.get(phase.index)
        values.append(0.0 if algo is None else sparsity_fraction(algo.target_at(step)))
    return ordered, values


def plot_schedule(plan: SchedulePlan, path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``plan``: one line per group (target sparsity against optimizer step),
    phase boundaries as dashed vertical lines labelled with the phase that starts there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(PLOT_HINT) from err
    total = int(plan.run.total_steps)
    figure, axes = plt.subplots(figsize=(8, 3.5))
    for index, group in enumerate(plan.groups):
        color = f"C{index}"
        steps, values = target_curve(group.sparsifier, total)
        axes.plot(steps, values, drawstyle="steps-post", color=color, label=group.name)
        for phase in group.sparsifier.phases:
            axes.axvline(phase.start, color=color, linestyle="--", linewidth=0.8)
            axes.annotate(
                f" {phase.index + 1}: {phase.spec.describe()}",
                (phase.start, 1.0),
                xycoords=("data", "axes fraction"),
                va="top",
                fontsize=8,
                color=color,
                rotation=90 if len(group.sparsifier.phases) > 4 else 0,
            )
    axes.set_xlim(0, total)
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("target sparsity")
    axes.set_title(f"Sparsity schedule ({plan.run_description.split(':')[0]})")
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(
        parents=True, exist_ok=True
    )  # the run's directory, before the run
    figure.savefig(path, dpi=120)
    plt.close(figure)
