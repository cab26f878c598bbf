"""Puts ``tests/`` on ``sys.path`` (pytest does so for a conftest's folder) so that test modules
in sub-folders can import the shared ``helpers`` module, and holds the shared fixtures."""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from lightning_sparse import kernels
from lightning_sparse.backends.kernel_check import forget_verdicts


@pytest.fixture(autouse=True)
def fresh_kernel_checks():
    """Every test starts as a new process would: no 2:4 kernel checked yet."""
    forget_verdicts()
    yield
    forget_verdicts()


@contextmanager
def torch_flags_restored() -> Iterator[None]:
    """torch's process-wide flags and the environment variables as they were, whatever the
    block set (float32 matmul precision covers TF32 matmuls: torch refuses its legacy flag
    beside it). ``Trainer(deterministic=True)`` turns deterministic algorithms on (and with
    them NaN-filled ``torch.empty``) and never off, and a one-process Fabric or Trainer run
    under DDP leaves ``WORLD_SIZE`` set, which sends a later script to a ``torchrun``
    start."""
    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.get_float32_matmul_precision(),
        (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
        dict(os.environ),
    )
    try:
        yield
    finally:
        deterministic, warn_only, fill, precision, cudnn_flags, environ = saved
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.set_float32_matmul_precision(precision)
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = (
            cudnn_flags
        )
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)


@pytest.fixture(autouse=True)
def fresh_torch_flags():
    """Every test starts with the flags the one before it found (see
    :func:`torch_flags_restored`)."""
    with torch_flags_restored():
        yield


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
