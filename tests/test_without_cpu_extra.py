"""Without the ``[cpu]`` extra (no Numba), the package imports, trains and gives the same masks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import dst_updates

from lightning_sparse import kernels

CHILD = """
import sys
sys.modules["numba"] = None  # as if the [cpu] extra were not installed
sys.path.insert(0, {tests!r})
import torch
from helpers import dst_updates
from lightning_sparse import kernels
assert not kernels.installed()
torch.save({{f"{{a}} {{s}}": dst_updates(a, s) for a, s in {runs!r}}}, {out!r})
assert "lightning_sparse.kernels.loops" not in sys.modules
"""
RUNS = [("set", "2:4"), ("rigl", 0.9), ("rigl", "1:4")]


def test_masks_without_numba_are_the_masks_with_it(tmp_path):
    """A process that cannot import Numba runs the torch operations only; its masks and
    weights equal those of this process, where the compiled loops run if installed."""
    out = tmp_path / "masks.pt"
    tests = str(Path(__file__).parent)
    script = CHILD.format(tests=tests, runs=RUNS, out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    without = torch.load(out)
    with kernels.compiled(True):
        for algorithm, sparsity in RUNS:
            for a, b in zip(
                without[f"{algorithm} {sparsity}"], dst_updates(algorithm, sparsity)
            ):
                assert torch.equal(a, b)


def test_importing_the_package_does_not_import_numba():
    code = "import sys, lightning_sparse; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_compiled_loops_can_be_turned_off_for_a_block():
    values = torch.zeros(4)
    with kernels.compiled(False):
        assert not kernels.accepts(values)
    assert kernels.accepts(values) == kernels.installed()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(4, dtype=torch.bfloat16),
        torch.zeros(4, 4).t(),
        torch.zeros(4, dtype=torch.int64),
    ],
    ids=["bfloat16", "strided", "int64"],
)
def test_the_compiled_loops_take_only_contiguous_float32_or_float64(tensor):
    assert not kernels.accepts(tensor)
