"""OpenMP's wait policy outside the command line: a CPU fit on a busy machine, in a process that
chose no policy, is told once how to let its threads sleep, and the quickstart chooses the
policy itself before torch loads, as the ``lightning-sparse`` command does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TinyModule, fast_trainer, random_loader

from lightning_sparse import SparsityCallback, openmp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def busy(monkeypatch):
    """A machine whose load average says other processes keep its cores busy, and a process
    that chose no wait policy and has not been told yet."""
    monkeypatch.setattr(openmp, "load_and_cores", lambda: (3.2, 2))
    monkeypatch.setattr(openmp, "_notice_given", False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def fit() -> None:
    cb = SparsityCallback(sparsity=0.5, params=["net.fc1.weight"])
    fast_trainer(max_steps=2, callbacks=[cb]).fit(TinyModule(), random_loader())


def test_a_cpu_fit_on_a_busy_machine_is_told_once_how_to_let_threads_sleep(
    busy, lightning_log
):
    fit()
    fit()  # a second fit in the same process is not told again
    told = [m for m in lightning_log.messages if "OpenMP threads" in m]
    assert len(told) == 1
    assert told[0].startswith(
        "The load average (3.2 on 2 cores) says other processes keep"
    )
    assert "torch's 2 OpenMP threads spin while they wait" in told[0]
    assert "OMP_WAIT_POLICY=PASSIVE python " in told[0]
    assert (
        "call lightning_sparse.openmp.choose_wait_policy() before importing torch"
        in told[0]
    )


@pytest.mark.parametrize(
    ("load", "environ", "threads"),
    [
        (0.4, {}, 2),  # an idle machine: spinning threads are faster
        (3.2, {"OMP_WAIT_POLICY": "ACTIVE"}, 2),  # the process chose
        (3.2, {"GOMP_SPINCOUNT": "0"}, 2),
        (3.2, {}, 1),  # one thread waits on nobody
    ],
)
def test_nothing_is_told_where_nothing_spins_or_the_process_chose(
    monkeypatch, load, environ, threads
):
    monkeypatch.setattr(openmp, "load_and_cores", lambda: (load, 2))
    monkeypatch.setattr(openmp, "_notice_given", False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert openmp.busy_machine_notice(threads) is None


def test_the_quickstart_chooses_the_wait_policy_before_torch_loads():
    code = (
        "import os, sys, runpy\n"
        "os.getloadavg = lambda: (3.0, 3.0, 3.0)\n"
        "from lightning_sparse import openmp\n"
        "seen, choose = [], openmp.choose_wait_policy\n"
        "openmp.choose_wait_policy = lambda who: seen.append('torch' in sys.modules) or choose(who)\n"
        "runpy.run_path('examples/quickstart.py', run_name='quickstart')\n"
        "print(seen, os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
    )
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[False]", "PASSIVE", "True"]
    assert done.stderr.startswith("quickstart: the load average (3.0 on ")
