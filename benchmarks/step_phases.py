"""Where a step's time goes: dense vs static 70% vs ``torch.nn.utils.prune`` (ModelPruning), per phase.

The companion of ``step_time.py`` for the question it cannot settle on a loaded machine: the
same ViT and AdamW, without Lightning, each variant its own model stepping round-robin with
the others in one process (order reversed every other round), so load changes hit all variants
alike. Each phase (forward, backward, the sparsity hooks, ``optimizer.step``, ``zero_grad``) is
timed with per-thread CPU time on 1 torch thread (default), which other processes' load barely
moves; ``--threads 2 --wall`` times wall clock on 2 threads instead. "static 70%" drives this
project's :class:`~lightning_sparse.engine.sparsifier.Sparsifier` as the callback does;
"prune l1 70%" is what ``ModelPruning`` installs (``prune.global_unstructured``).

    python benchmarks/step_phases.py                      # batch 64, 30 rounds: ~3 min idle
    python benchmarks/step_phases.py --batch-size 4 --rounds 60
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from common import markdown_table, median
from step_time import ViTModule, block_linears
from torch import nn
from torch.nn.utils import prune

from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

PHASES = ("forward", "backward", "hooks", "optimizer", "zero_grad", "total")


class Variant:
    """One model, optimizer and (for static) sparsifier; :meth:`step` times each phase."""

    def __init__(self, name: str, fused: bool, clock: Callable[[], float]) -> None:
        self.name = name
        self.clock = clock
        torch.manual_seed(0)
        self.model = ViTModule().model
        if name.startswith("prune"):
            prune.global_unstructured(
                block_linears(self.model),
                pruning_method=prune.L1Unstructured,
                amount=0.7,
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, weight_decay=0.05, fused=fused
        )
        self.sparsifier = None
        if name.startswith("static"):
            targets = select_parameters(self.model).targets
            phases = resolve_phases([Phase(sparsity=0.7)], total_steps=10**6)
            self.sparsifier = Sparsifier("static", targets, phases)
        self.step_count = 0
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        clock, sp, opt = self.clock, self.sparsifier, [self.optimizer]
        t0 = clock()
        if sp is not None:
            sp.on_step_start(self.step_count, opt)
        t1 = clock()
        loss = nn.functional.cross_entropy(self.model(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        if sp is not None:
            sp.before_optimizer_step(self.step_count, self.optimizer, opt)
        t4 = clock()
        self.optimizer.step()
        t5 = clock()
        self.optimizer.zero_grad()
        t6 = clock()
        self.step_count += 1
        if record:
            for phase, t in zip(
                PHASES,
                (t2 - t1, t3 - t2, (t1 - t0) + (t4 - t3), t5 - t4, t6 - t5, t6 - t0),
            ):
                self.times[phase].append(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=30, help="timed steps per variant"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--wall", action="store_true", help="wall clock, not thread CPU time"
    )
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.thread_time
    torch.manual_seed(1)
    x = torch.randn(args.batch_size, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch_size,))
    names = ["dense", "dense (again)", "static 70%", "prune l1 70%"]
    variants = [Variant(name, args.fused, clock) for name in names]
    for i in range(args.warmup + args.rounds):
        for v in variants if i % 2 == 0 else variants[::-1]:
            v.step(x, y, record=i >= args.warmup)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch_size}, "
        f"{'AdamW(fused=True)' if args.fused else 'AdamW'}, "
        f"{'wall' if args.wall else 'thread CPU'} ms, median [min-max] of {args.rounds} "
        f"steps, load average " + ", ".join(f"{v:.1f}" for v in os.getloadavg())
    )
    header = ["variant", *PHASES, "vs dense (paired)"]
    dense = variants[0].times["total"]
    rows = []
    for v in variants:
        ratios = [a / b for a, b in zip(v.times["total"], dense)]
        rows.append(
            [v.name]
            + [
                f"{median(t) * 1e3:.2f} [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]"
                for t in v.times.values()
            ]
            + [f"{median(ratios):.3f}x"]
        )
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
