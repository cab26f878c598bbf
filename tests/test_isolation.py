"""A test that sets torch's process-wide flags or an environment variable leaves none of them
set for the next test (``tests/conftest.py``): Lightning's ``deterministic=True`` never turns
them off itself, and with them on every ``torch.empty`` is NaN-filled. The two tests run in
this order."""

from __future__ import annotations

import os

import lightning as L
import torch

FLAGS_AT_IMPORT = None


def flags() -> tuple:
    cudnn = torch.backends.cudnn
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.get_float32_matmul_precision(),
        cudnn.enabled,
        cudnn.benchmark,
        cudnn.deterministic,
        cudnn.allow_tf32,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


def test_a_test_sets_every_flag():
    global FLAGS_AT_IMPORT
    FLAGS_AT_IMPORT = flags()
    L.Trainer(deterministic=True, logger=False, enable_progress_bar=False)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.set_float32_matmul_precision("medium")
    cudnn = torch.backends.cudnn
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = (
        False,
        True,
        True,
        False,
    )
    os.environ["WORLD_SIZE"] = "2"  # as a one-process DDP run leaves it
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    changed = [old != new for old, new in zip(FLAGS_AT_IMPORT, flags())]
    assert changed == [True, False, True, True, True, True, True, True, True]


def test_the_next_test_finds_them_as_they_were():
    assert FLAGS_AT_IMPORT is not None, (
        "run the whole file: the test above sets the flags"
    )
    assert flags() == FLAGS_AT_IMPORT
    assert not torch.are_deterministic_algorithms_enabled()
    assert "WORLD_SIZE" not in os.environ
