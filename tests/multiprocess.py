"""Run a worker script (``tests/distributed_worker.py`` by default) as a 2-process job on the CPU (gloo), as torchrun would.

The processes are started here with ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, so
Lightning's ``LightningEnvironment`` treats them as externally launched and the worker can run
several ``fit`` calls (a full run, then a resume) in one job. Each rank writes a JSON report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(
    config: dict[str, Any],
    out: Path,
    nprocs: int = 2,
    timeout: float = 300,
    worker: Path = WORKER,
) -> list[dict[str, Any]]:
    """Run ``worker`` (a script in ``tests/``) on ``nprocs`` CPU processes; return each rank's
    report (rank order)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(out)}
    port = _free_port()
    procs = []
    for rank in range(nprocs):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nprocs),
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), str(WORKER.parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        log = (out / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), json.dumps(config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=out,
            )
        )
    failed = []
    for rank, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            code = "timeout"
        if code != 0:
            failed.append(rank)
    if failed:
        tails = {r: (out / f"rank{r}.log").read_text()[-3000:] for r in failed}
        raise AssertionError(f"worker rank(s) {failed} failed:\n{tails}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]
