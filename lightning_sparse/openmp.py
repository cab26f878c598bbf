"""How torch's OpenMP threads wait on a machine that other processes keep busy.

torch's CPU kernels run on OpenMP threads (GNU libgomp in PyPI's Linux wheels), one per core,
and between parallel regions an idle thread spins before it sleeps. Beside busy processes, a
thread that lost its core holds up the others, which spin on the cores the other processes
need; threads that sleep instead (``OMP_WAIT_POLICY=PASSIVE``) run the same kernels in the same
order, so every result stays the same bit for bit. libgomp reads the policy once, when torch
loads it, so it must be chosen before ``import torch``: the ``lightning-sparse`` command does
that (:func:`choose_wait_policy`), a script can call the same function first, and a fit on the
CPU whose process chose nothing on a busy machine says so once (:func:`busy_machine_notice`).

This module imports nothing but the standard library, so a script can call it before torch.

Example:
    >>> wait_policy(load=2.6, environ={})
    'PASSIVE'
    >>> wait_policy(load=0.2, environ={}) is None
    True
    >>> wait_policy(load=2.6, environ={"OMP_WAIT_POLICY": "ACTIVE"}) is None
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

_notice_given = False  # busy_machine_notice speaks once per process


def wait_policy(load: float | None, environ: Mapping[str, str]) -> str | None:
    """The ``OMP_WAIT_POLICY`` to set: ``"PASSIVE"`` when other processes keep at least one
    core busy (a 1-minute ``load`` average of 1 or more; ``None``: not known) and ``environ``
    chooses no wait policy (``OMP_WAIT_POLICY``, or libgomp's ``GOMP_SPINCOUNT``), else
    ``None`` (OpenMP's default: spin). torch runs a thread on every core, so one busy core is
    enough for the others to wait on a thread that lost its core; on an idle machine spinning
    threads are faster."""
    chosen = "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ
    if chosen or load is None or load < 1.0:
        return None
    return "PASSIVE"


def load_and_cores() -> tuple[float | None, int]:
    """The 1-minute load average (``None`` where the system has none) and the cores this
    process may run on."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1
    )
    return load, cores


def choose_wait_policy(who: str = "lightning-sparse") -> str | None:
    """Set ``OMP_WAIT_POLICY`` as :func:`wait_policy` chooses for this machine now, and say so
    on stderr (``who``: the program that chose); the policy set, or ``None``. Call it before
    torch is imported: libgomp reads the variable only when torch loads it."""
    load, cores = load_and_cores()
    policy = wait_policy(load, os.environ)
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
        print(
            f"{who}: the load average ({load:.1f} on {cores} cores) says other processes "
            f"keep cores busy, so OpenMP threads will sleep instead of spinning while they "
            f"wait (OMP_WAIT_POLICY={policy}: same thread count, same results); set "
            f"OMP_WAIT_POLICY=ACTIVE to keep them spinning",
            file=sys.stderr,
        )
    return policy


def busy_machine_notice(threads: int) -> str | None:
    """What to tell a CPU fit that runs ``threads`` OpenMP threads on a busy machine in a
    process that chose no wait policy (see :func:`wait_policy`): how to make its threads
    sleep. ``None`` when there is nothing to tell, or it was told once in this process."""
    global _notice_given
    load, cores = load_and_cores()
    if _notice_given or threads < 2 or wait_policy(load, os.environ) is None:
        return None
    _notice_given = True
    script = (
        os.path.basename(sys.argv[0]) if sys.argv[0].endswith(".py") else "script.py"
    )
    return (
        f"The load average ({load:.1f} on {cores} cores) says other processes keep cores busy, "
        f"and torch's {threads} OpenMP threads spin while they wait for each other, on the "
        f"cores those processes need: beside busy jobs that runs a CPU fit several times "
        f"slower (docs/cli.md, 'Shared machines and CI'). Let them sleep instead, as the "
        f"lightning-sparse command does: start the script with OMP_WAIT_POLICY=PASSIVE "
        f"python {script}, or call lightning_sparse.openmp.choose_wait_policy() before "
        f"importing torch (same thread count, same results). This process keeps its policy: "
        f"libgomp read it when torch loaded"
    )
