"""The accounting of live tensor bytes that the memory tests and the benchmark measure with:
counted by storage, against sizes computed by hand."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sparse.engine.memory_census import PeakBytes, storage_bytes


def test_storage_bytes_counts_each_storage_once_and_a_freed_one_as_zero():
    w = torch.zeros(64, 32)  # 8192 bytes
    mask = torch.ones(64, 32, dtype=torch.bool)  # 2048 bytes
    assert storage_bytes([w, w.t(), w[3:5], None, mask, mask.view(-1)]) == 8192 + 2048
    gathered = torch.zeros(128, dtype=torch.bfloat16)
    gathered.untyped_storage().resize_(0)  # as FSDP2 frees its gathered parameter
    assert storage_bytes([gathered, w]) == 8192


def test_peak_bytes_follows_what_is_made_and_freed_inside_the_block():
    before = torch.ones(1000)  # made before the block: never counted
    with PeakBytes() as peak:
        a = torch.ones(1000)  # 4000
        before.mul_(2)  # in place, on a tensor from before: nothing new
        view = before[:10]  # a view of it: nothing new
        b = a.to(torch.float64)  # 8000 more: 12000 held
        del a  # 8000
        c = torch.ones(500, dtype=torch.bool)  # 500 more: 8500
        del b  # 500
    assert peak.peak == 12000
    assert peak.held == 500
    assert view.shape == (10,) and c.shape == (500,)


def test_peak_bytes_sees_a_backward():
    layer = nn.Linear(100, 50, bias=False)
    x = torch.randn(8, 100)
    with PeakBytes() as peak:
        out = layer(x)
        out.sum().backward()
    # the output (8x50) and the weight gradient (50x100), float32, and the loss and the
    # gradient that seeds the backward (4 bytes each)
    assert peak.peak == (8 * 50 + 50 * 100) * 4 + 8
    assert peak.held == (8 * 50 + 50 * 100) * 4  # the output and the gradient stay
