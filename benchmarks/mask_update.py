"""Cost of one mask update per algorithm vs one AdamW step over the same GPT-2-small weights (CPU).

Each algorithm runs on both mask paths (``--paths``): the torch operations alone, and with the
compiled loops of the ``[cpu]`` extra (skipped, with a note, where Numba is not installed).

The weights are the 124.3 M parameters of GPT-2 small's weight matrices: 12 blocks of
``attn.c_attn`` 2304x768, ``attn.c_proj`` 768x768, ``mlp.c_fc`` 3072x768 and ``mlp.c_proj``
768x3072 (84.9 M), plus ``wte`` 50257x768 and ``wpe`` 1024x768. All 50 are sparsified, so the
mask update and the AdamW step (torch's default AdamW, state already allocated) touch the same
tensors. Everything runs in this process, interleaved, with the same number of threads, and
every figure is the CPU time of the process (all its threads): on a busy machine other jobs
barely count, where wall time can triple.

For each algorithm, ``Sparsifier.before_optimizer_step`` is timed at ``--updates`` update steps
(default 4) and as many plain steps, each followed by an optimizer step (timed apart), with
different gradients at consecutive updates, as in training. A plain step only masks the
gradients (every hard-mask step pays that); an update step also checks finiteness, chooses the
new masks, zeroes the weights and optimizer state whose mask changed, and then masks the
gradients. The first update of a phase also pays one-time costs (the 2:4 tile tables, built
once per process; buffers touched for the first time), about 0.1 s, which the medians of 4
leave out as the outlier they are (``--updates 1`` shows them). "Mask update" is the difference
of the medians; "update / AdamW step" is the median, over the repeats, of each run's update
cost divided by the AdamW step timed just before that run (with the lowest and highest in
brackets: memory speed drifts between minutes, and pairing each run with its own AdamW step
cancels most of it). That step, and every algorithm, starts from the
same dense weights and AdamW state (the first step from that state runs cold, about 3x slower,
once: it is not timed). "Phase start" is choosing the first masks when the phase begins; "AdamW
step in the phase" is the optimizer step after each timed step (the masked gradients leave
exact zeros in AdamW's ``exp_avg_sq``, and torch's default CPU AdamW computes ``sqrt`` of zeros
slowly).

    python benchmarks/mask_update.py                  # ~15 minutes, ~6 GB, 1 thread
    python benchmarks/mask_update.py --threads 2 --repeats 1 --algorithms "set 90%" "rigl 2:4"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from common import markdown_table, median
from torch import nn

from lightning_sparse import kernels
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

UPDATE = {"update_every": 2, "update_stop": 10_000}
DST = {**UPDATE, "drop_fraction": 0.3, "drop_fraction_decay": "constant"}
ALGORITHMS: dict[str, dict[str, Any]] = {
    "static 90%": {"sparsity": 0.9},
    "gmp 90%": {"sparsity": 0.9, "algorithm": "gmp", **UPDATE},
    "set 90%": {"sparsity": 0.9, "algorithm": "set", **DST},
    "rigl 90%": {"sparsity": 0.9, "algorithm": "rigl", **DST},
    "rigl 90% erk": {
        "sparsity": 0.9,
        "algorithm": "rigl",
        "distribution": "erk",
        **DST,
    },
    "rigl 90% global": {
        "sparsity": 0.9,
        "algorithm": "rigl",
        "distribution": "global",
        **DST,
    },
    "set 2:4": {"sparsity": "2:4", "algorithm": "set", **DST},
    "rigl 2:4": {"sparsity": "2:4", "algorithm": "rigl", **DST},
}


class GPT2SmallWeights(nn.Module):
    """Only the weight matrices of GPT-2 small (no biases, norms or attention math)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50257, 768)
        self.wpe = nn.Embedding(1024, 768)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {
                    "c_attn": nn.Linear(768, 2304, bias=False),
                    "attn_c_proj": nn.Linear(768, 768, bias=False),
                    "c_fc": nn.Linear(768, 3072, bias=False),
                    "mlp_c_proj": nn.Linear(3072, 768, bias=False),
                }
            )
            for _ in range(12)
        )


def seconds(fn: Callable[[], Any]) -> float:
    """The CPU time of this process (all its threads) that ``fn()`` takes: unlike wall time, it
    barely counts other jobs on a busy machine, and every figure here is a CPU-bound pass."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--updates", type=int, default=4, help="update steps timed per run"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 gives stable numbers on a busy machine)",
    )
    parser.add_argument(
        "--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS)
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["torch", "compiled"],
        choices=["torch", "compiled"],
        help="torch operations only, and/or with the compiled loops of the [cpu] extra",
    )
    args = parser.parse_args()
    if "compiled" in args.paths and not kernels.installed():
        print("the [cpu] extra (numba) is not installed: timing the torch path only")
        args.paths = [p for p in args.paths if p != "compiled"] or ["torch"]
    for option in ("repeats", "updates", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option}={getattr(args, option)}: use 1 or more")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2SmallWeights()
    params = list(model.parameters())
    # two sets of gradients: consecutive updates see different ones, as in training (with the
    # same gradient twice, RigL would regrow the very weights it just dropped and change nothing)
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def fresh_gradients(step: int = 0) -> None:
        for p, g in zip(params, grads[step // 2 % 2]):
            p.grad = g.clone() if p.grad is None else p.grad.copy_(g)

    fresh_gradients()
    optimizer.step()  # allocate the state
    # every AdamW step timed and every algorithm starts from these weights and AdamW state (not
    # those an earlier algorithm pruned: zeros change how fast AdamW runs)
    dense = [p.detach().clone() for p in params]
    dense_state = [
        {k: v.clone() for k, v in optimizer.state[p].items()} for p in params
    ]

    @torch.no_grad()
    def restore_dense() -> None:
        for p, w, state in zip(params, dense, dense_state):
            p.copy_(w)
            for key, value in state.items():
                optimizer.state[p][key].copy_(value)

    restore_dense()
    optimizer.step()  # the first step from the snapshot runs cold (3x slower here): not timed

    numel = sum(p.numel() for p in params)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"{numel / 1e6:.1f} M weights in {len(params)} tensors"
    )
    targets = select_parameters(model, params=["*"]).targets
    adamw: list[float] = []
    runs = [(name, path) for name in args.algorithms for path in args.paths]
    times = {
        run: {"start": [], "update": [], "plain": [], "ratio": [], "adamw": []}
        for run in runs
    }
    for repeat in range(args.repeats):
        for name, path in runs:
            with kernels.compiled(path == "compiled"):
                restore_dense()
                fresh_gradients()
                adamw.append(seconds(optimizer.step))
                restore_dense()
                phases = resolve_phases([Phase.from_any(ALGORITHMS[name])], 100_000)
                sparsifier = Sparsifier(name, targets, phases)
                record = times[name, path]
                record["start"].append(
                    seconds(lambda s=sparsifier: s.on_step_start(0, [optimizer]))
                )
                if sparsifier.algorithm is not None and sparsifier.algorithm.dynamic:
                    run: dict[str, list[float]] = {"update": [], "plain": []}
                    for step in range(1, 2 * args.updates + 1):
                        fresh_gradients(step)
                        kind = (
                            "update"
                            if sparsifier.algorithm.is_update_step(step)
                            else "plain"
                        )
                        run[kind].append(
                            seconds(
                                lambda s=sparsifier, t=step: s.before_optimizer_step(
                                    t, optimizer, [optimizer]
                                )
                            )
                        )
                        # as in training: regrown weights move off zero (and the masked
                        # gradients leave zeros in exp_avg_sq, which torch's sqrt is slow on)
                        record["adamw"].append(seconds(optimizer.step))
                    # this run's update cost against the AdamW step timed just before it
                    cost = median(run["update"]) - median(run["plain"])
                    record["ratio"].append(cost / adamw[-1])
                    record["update"] += run["update"]
                    record["plain"] += run["plain"]
                sparsifier.close()
            print(
                f"  repeat {repeat + 1}: {name:<16} {path:<8} phase start {record['start'][-1]:6.2f} s"
                + (
                    f", update step {record['update'][-1]:6.2f} s, plain step "
                    f"{record['plain'][-1]:5.2f} s"
                    if record["update"]
                    else ""
                )
                + f", AdamW {adamw[-1]:5.2f} s",
                flush=True,
            )
    base = median(adamw)
    rows = [
        ["AdamW step (torch default)", "-", "-", f"{base * 1e3:.0f}", "1.00x", "-", "-"]
    ]
    for name, path in runs:
        record = times[name, path]
        start = f"{median(record['start']) * 1e3:.0f}"
        if not record["update"]:
            rows.append([name, path, "-", "-", "-", start, "-"])
            continue
        plain = median(record["plain"])
        cost = median(record["update"]) - plain
        ratios = sorted(record["ratio"])
        rows.append(
            [
                name,
                path,
                f"{plain * 1e3:.0f}",
                f"{cost * 1e3:.0f}",
                f"{median(ratios):.2f}x ({ratios[0]:.2f} to {ratios[-1]:.2f})",
                start,
                f"{median(record['adamw']) * 1e3:.0f}",
            ]
        )
    print()
    print(
        markdown_table(
            [
                "algorithm",
                "path",
                "gradient masking, every step (ms)",
                "mask update (ms)",
                "update / AdamW step",
                "phase start (ms)",
                "AdamW step in the phase (ms)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
