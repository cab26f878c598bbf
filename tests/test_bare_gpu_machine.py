"""On a GPU machine with only torch, Lightning, timm and pytest (no jsonargparse, no
hypothesis), as the acceptance's is: the GPU tests collect, and the command line says what
it needs instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BARE = ROOT / "tests" / "bare_gpu_machine"


def run_bare(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout, as on that machine (``bare_gpu_machine``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(BARE), str(ROOT)]),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # hypothesis's plugin is not installed there
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_gpu_tests_collect_without_jsonargparse_and_hypothesis():
    # the documented command: every test module and every doctest module
    found = run_bare(
        "-m", "pytest", "-m", "gpu", "--collect-only", "-p", "no:cacheprovider"
    )
    out = found.stdout + found.stderr
    assert found.returncode == 0, out[-3000:]
    assert " error" not in out.splitlines()[-1], out[-3000:]
    assert "<Function test_kernel_matches_emulation_outputs_and_gradients" in out
    (header,) = [line for line in out.splitlines() if line.startswith("not installed:")]
    assert header.startswith("not installed: hypothesis; not collected: ")
    assert "tests/test_top_k.py" in header and "_gpu.py" not in header


def test_the_command_line_says_it_needs_jsonargparse():
    run = run_bare("-m", "lightning_sparse.cli.entry", "plan", "--config", "x.yaml")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "lightning-sparse's command line needs jsonargparse, which is not installed: pip "
        "install 'jsonargparse[signatures]>=4.27' (SparsityCallback in your own script "
        "does not need it)"
    )
