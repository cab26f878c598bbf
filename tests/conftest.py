"""Puts ``tests/`` on ``sys.path`` (pytest does so for a conftest's folder) so that test modules
in sub-folders can import the shared ``helpers`` module, and holds the shared fixtures."""

import logging

import pytest

from lightning_sparse import kernels
from lightning_sparse.backends.kernel_check import forget_verdicts


@pytest.fixture(autouse=True)
def fresh_kernel_checks():
    """Every test starts as a new process would: no 2:4 kernel checked yet."""
    forget_verdicts()
    yield
    forget_verdicts()


@pytest.fixture
def lightning_log(caplog):
    """What Lightning's rank-zero logger prints (the callback's tables and summaries)."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    return caplog


@pytest.fixture(params=["torch", "compiled"])
def mask_path(request):
    """Runs the test on the torch operations (the reference) and again on the compiled CPU
    loops of the ``[cpu]`` extra (skipped where Numba is not installed)."""
    if request.param == "compiled" and not kernels.installed():
        pytest.skip("the compiled loops need the [cpu] extra (numba)")
    with kernels.compiled(request.param == "compiled"):
        yield request.param
