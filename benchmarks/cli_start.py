"""How fast the command line answers, and what ``plan`` costs: whole processes, timed from
outside.

Each command runs ``--runs`` times after one warm-up run, the commands in turn (A B C ... A B C)
so that a drift in the machine's speed spreads over all of them. Reported per command: the
minimum and median wall time from start to exit, the median CPU time (user + system) and the
largest peak resident memory of a run (``os.wait4``'s ``ru_maxrss``). The ratio column divides
each median by the median of ``python -m lightning_sparse.cli.main --help``: LightningCLI's own
help, after torch and Lightning are imported, which is what ``lightning-sparse --help`` printed
before the command had an entry module of its own. The load average before and after is
printed: on a shared machine read it first.

    PYTHONPATH=. python benchmarks/cli_start.py            # 20 runs of the quick commands, 3 of each plan
    PYTHONPATH=. python benchmarks/cli_start.py --runs 5 --plan-runs 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lightning_sparse.cli.entry"]
QUICK = {
    "lightning-sparse --help": [*CLI, "--help"],
    "lightning-sparse --version": [*CLI, "--version"],
    "python -m lightning_sparse.cli.main --help": [
        sys.executable,
        "-m",
        "lightning_sparse.cli.main",
        "--help",
    ],
    "lightning-sparse plan --help": [*CLI, "plan", "--help"],
}
PLANS = {
    "plan dinov2/vitl14_24_70pct.yaml": [
        *CLI,
        "plan",
        "--config=recipes/dinov2/vitl14_24_70pct.yaml",
        "--plot=false",
    ],
    "plan hf/llama7b_24_plan.yaml --gpu h100": [
        *CLI,
        "plan",
        "--config=recipes/hf/llama7b_24_plan.yaml",
        "--gpu=h100",
        "--plot=false",
    ],
}
BASELINE = "python -m lightning_sparse.cli.main --help"


def run_once(command: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak resident MiB of one run of ``command``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def measure(commands: dict[str, list[str]], runs: int) -> dict[str, list[tuple]]:
    """``runs`` timed runs of each command, in turn, after one warm-up run each."""
    for command in commands.values():
        run_once(command)
    results: dict[str, list[tuple]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            results[name].append(run_once(command))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=20, help="runs of the quick commands"
    )
    parser.add_argument("--plan-runs", type=int, default=3, help="runs of each plan")
    args = parser.parse_args()
    load = os.getloadavg()
    results = {**measure(QUICK, args.runs), **measure(PLANS, args.plan_runs)}
    baseline = statistics.median(wall for wall, _, _ in results[BASELINE])
    print(
        f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"{len(os.sched_getaffinity(0))} cores; Python {sys.version.split()[0]}\n"
    )
    print(
        "| command | runs | wall min | wall median | CPU median | peak memory | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        walls = [wall for wall, _, _ in runs]
        cpu = statistics.median(c for _, c, _ in runs)
        peak = max(p for _, _, p in runs)
        print(
            f"| `{name}` | {len(runs)} | {min(walls):.2f} s | {statistics.median(walls):.2f} s "
            f"| {cpu:.2f} s | {peak:.0f} MiB | {statistics.median(walls) / baseline:.3f}x |"
        )


if __name__ == "__main__":
    main()
