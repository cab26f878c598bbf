"""Human-readable reports: the fit-start plan table and the fit-end summary."""

from __future__ import annotations

from lightning_sparse.algorithms import Learned
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.core.selection import Selection
from lightning_sparse.engine.flips import FlipRate
from lightning_sparse.engine.learning import (
    handover_form,
    layer_lines,
    layer_statistics,
    learned_units,
)
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import describe


def text_table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned text lines, a rule under the first (header) row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def plan_table(sparsifier: Sparsifier, selection: Selection) -> str:
    """Each selected parameter, its shape, sparsity per phase, backend and why; then exclusions
    and how the output head was found."""
    sp = sparsifier
    lines = [
        f"SparsityCallback '{sp.name}': {len(sp.targets)} parameters, {len(sp.phases)} phase(s)"
    ]
    for phase in sp.phases:
        lines.append(
            f"  phase {phase.index + 1}: {phase.span():<18} {phase.spec.describe()}"
        )
        if isinstance(sp.algorithms.get(phase.index), Learned):
            lines.append("    " + _learned_cost(sp, phase))
    header = (
        ["parameter", "shape"]
        + [f"phase {p.index + 1}" for p in sp.phases]
        + ["backend", "why"]
    )
    rows = [header]
    for t in sp.targets:
        cells = [t.name, "x".join(map(str, t.param.shape))]
        choices = []
        for phase in sp.phases:
            if phase.spec.is_dense:
                cells.append("dense")
                continue
            cells.append(f"{describe(phase.target)} {phase.spec.algorithm}")
            choices.append(sp.backends[phase.index, t.name])
        names = sorted({c.name for c in choices}) or ["-"]
        reasons = sorted({c.reason for c in choices}) or ["dense in every phase"]
        rows.append(cells + ["/".join(names), "; ".join(reasons)])
    lines += ["  " + line for line in text_table(rows)]
    speed = sp.forwards.speed_check
    if speed is not None and speed.results:
        lines.append(f"  verify_speed: {speed.describe()}")
    if selection.excluded:
        by_reason: dict[str, list[str]] = {}
        for name, reason in selection.excluded.items():
            by_reason.setdefault(reason, []).append(name)
        lines.append("  left dense:")
        for reason, names in by_reason.items():
            shown = ", ".join(names[:4]) + (
                f" (+{len(names) - 4} more)" if len(names) > 4 else ""
            )
            lines.append(f"    {reason}: {shown}")
    for head, how in selection.heads.items():
        lines.append(f"  output head {head or 'model'}: {how}")
    return "\n".join(lines)


def summary(
    sparsifier: Sparsifier, final_step: int, flips: FlipRate | None = None
) -> str:
    """Phases that ran with their step ranges, the final sparsity of the group (the sparsity the
    forward sees; under a straight-through algorithm the stored weights stay dense, and the line
    after it says so) and, if any were measured, its first, last and peak flip rates."""
    sp = sparsifier
    lines = [f"SparsityCallback '{sp.name}' summary"]
    entries = [(step, index) for step, index in sp.history]
    if entries and entries[0][0] > 0:  # resumed into this schedule (on_schedule_change)
        lines.append(
            f"  steps 0-{entries[0][0] - 1}: another schedule (this one from step "
            f"{entries[0][0]})"
        )
    for i, (step, index) in enumerate(entries):
        end = entries[i + 1][0] if i + 1 < len(entries) else final_step
        if end <= step and i + 1 < len(entries):
            continue
        label = (
            "dense"
            if index is None
            else f"phase {index + 1}: {sp.phases[index].spec.describe()}"
        )
        lines.append(f"  steps {step}-{max(step, end - 1)}: {label}")
    lines.append(
        f"  final sparsity: {sp.actual_sparsity():.1%} over {len(sp.targets)} parameters "
        f"(target now {sp.target_sparsity(final_step):.1%})"
    )
    if sp.algorithm is not None and sp.algorithm.straight_through:
        lines.append(
            f"  {sp.algorithm.name}: applied in the forward; stored weights stay dense; "
            f"export_state_dict folds the masks in"
        )
    measured = None if flips is None else flips.describe()
    if measured is not None:
        lines.append(f"  flip rate: {measured}")
    reports = dict(sp.learned_reports)
    if isinstance(sp.algorithm, Learned):  # still learning: where it stands now
        reports[sp.algorithm.phase.index] = layer_statistics(sp.algorithm)
    for index, report in sorted(reports.items()):
        lines.append(f"  phase {index + 1} learned masks:")
        lines += [f"    {line}" for line in layer_lines(report)]
    return "\n".join(lines)


def _learned_cost(sp: Sparsifier, phase: ResolvedPhase) -> str:
    """What learned ``phase`` holds and runs, for the plan table."""
    algo = sp.algorithms[phase.index]
    assert isinstance(algo, Learned)
    units, held = learned_units(algo, [t.rows_shape for t in sp.targets])
    parts = [
        f"{c} fp32 logits per {one} ({n} {many.split(' ')[0]}"
        for (one, many, c), n in units.items()
    ]
    return (
        f"learns {phase.target} masks{handover_form(algo)}: {'), '.join(parts)}; "
        f"{held / 2**20:.2f} MiB with their gradient and Adam state); training forwards "
        f"draw a Gumbel sample on masked math, evaluation forwards use the most likely "
        f"pattern"
    )
