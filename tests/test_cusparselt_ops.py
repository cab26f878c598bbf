"""The cuSPARSELt custom ops on the CPU: their registration (opcheck, with a dense stand-in for
cuSPARSELt's matmul), the searched algorithm in every sparse matmul, and the choice of packer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import dense_cusparselt, pretend_gpu
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sparse.backends import BackendChoice, choose_backend, cusparselt
from lightning_sparse.backends import cusparselt_algorithms as algorithms
from lightning_sparse.backends.cusparselt_algorithms import Algorithm, AlgorithmCache
from lightning_sparse.backends.speed import SpeedMeasurement
from lightning_sparse.masks import NM
from lightning_sparse.masks.tiles import transposable_2to4_mask


@pytest.fixture
def dense_stand_in(monkeypatch):
    """cuSPARSELt's matmul replaced by dense math, so the ops run on the CPU."""
    return dense_cusparselt(monkeypatch)


def test_the_ops_pass_opcheck(dense_stand_in):
    torch.manual_seed(0)
    x = torch.randn(12, 256, requires_grad=True)
    weight = torch.randn(128, 256, requires_grad=True)
    bias = torch.randn(128, requires_grad=True)
    w24 = (weight * transposable_2to4_mask(weight)).detach().requires_grad_()
    torch.library.opcheck(cusparselt.prune_24, (weight,))
    torch.library.opcheck(cusparselt.linear_24, (x, w24, bias))
    torch.library.opcheck(cusparselt.linear_24, (x, w24, None))
    torch.library.opcheck(cusparselt.linear_24_input_grad, (torch.randn(12, 128), w24))


def test_the_ops_compute_the_2to4_linear_with_straight_through_gradients(
    dense_stand_in,
):
    torch.manual_seed(0)
    x = torch.randn(12, 256, requires_grad=True)
    weight = torch.randn(128, 256, requires_grad=True)
    out = cusparselt.cusparselt_linear(x, weight, None, None)
    w24 = weight.detach() * transposable_2to4_mask(weight.detach())
    torch.testing.assert_close(out, x.detach() @ w24.T)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ w24)
    torch.testing.assert_close(weight.grad, grad.T @ x.detach())  # dense


def test_every_sparse_matmul_uses_the_searched_algorithm(monkeypatch):
    searched, ran = [], []

    def search(packed, dense, bias, transposed):
        searched.append(tuple(dense.shape))
        return Algorithm(17, split_k=2, split_k_mode=1)

    def sparse_mm(packed, dense, bias=None, **options):
        ran.append(options)
        return F.linear(dense.t(), packed, bias)

    monkeypatch.setattr(cusparselt, "ALGORITHMS", AlgorithmCache(search))
    monkeypatch.setattr(cusparselt, "require_kernel", lambda *args: None)
    monkeypatch.setattr(cusparselt, "pack", lambda w24: w24)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm)
    x = torch.randn(300, 256, requires_grad=True)
    w24 = torch.randn(128, 256, requires_grad=True)
    for _ in range(2):
        cusparselt.linear_24(x, w24, None).sum().backward()
    # forward, input gradient, once each; 300 tokens padded to 304 as torch pads them
    assert searched == [(256, 304), (128, 304)]
    chosen = {"alg_id": 17, "split_k": 2, "split_k_mode": 1}
    assert ran == [{"transpose_result": True, **chosen}] * 4


def test_the_cache_searches_once_per_shape_bucket_and_not_while_capturing(monkeypatch):
    calls = []
    cache = AlgorithmCache(lambda *args: calls.append(args) or Algorithm(5))
    packed = torch.empty(128, 144, dtype=torch.bfloat16)
    for tokens in (300, 400, 512, 513):
        cache.choose(packed, torch.empty(256, tokens), None, out_features=128)
    assert len(calls) == 2 and cache.describe(128, 256) == "alg 5"  # buckets 512, 1024
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with FakeTensorMode():
        on_gpu = torch.empty(128, 144, dtype=torch.bfloat16, device="cuda")
        dense = torch.empty(256, 64, dtype=torch.bfloat16, device="cuda")
    assert cache.choose(on_gpu, dense, None, 128) == algorithms.DEFAULT
    assert len(calls) == 2


def test_the_cache_searches_each_dtype_of_a_shape_on_its_own():
    searched = []

    def search(packed, dense, bias, transposed):
        searched.append(packed.dtype)
        return Algorithm(17 if packed.dtype == torch.bfloat16 else 5)

    cache = AlgorithmCache(search)
    dtypes = [torch.bfloat16, torch.float16] * 2
    chosen = [
        cache.choose(
            torch.empty(128, 144, dtype=dtype),
            torch.empty(256, 300, dtype=dtype),
            None,
            out_features=128,
        ).alg_id
        for dtype in dtypes
    ]
    assert chosen == [17, 5, 17, 5] and searched == dtypes[:2]


@pytest.mark.parametrize("matches", [True, False])
def test_our_packer_is_used_only_where_its_bytes_match(monkeypatch, matches):
    monkeypatch.setattr(cusparselt, "_PACKER_MATCHES", {})
    monkeypatch.setattr(cusparselt, "_compare_packers", lambda dtype, device: matches)
    monkeypatch.setattr(torch, "_cslt_compress", lambda w: "theirs")
    monkeypatch.setattr(cusparselt, "compress", lambda w: "ours")
    w24 = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert cusparselt.pack(w24) == ("ours" if matches else "theirs")
    assert cusparselt.pack(w24.float()) == "theirs"  # a dtype the packer does not know
    assert cusparselt.pack(w24[:, :100]) == "theirs"  # a shape it does not know


def test_a_packer_that_differs_warns_and_the_table_names_the_packer(monkeypatch):
    monkeypatch.setattr(cusparselt, "_PACKER_MATCHES", {})
    monkeypatch.setattr(
        torch, "_cslt_compress", lambda w: w.reshape(w.shape[0], -1) * 0
    )
    with pytest.warns(RuntimeWarning, match="packed by torch._cslt_compress"):
        assert not cusparselt.packer_matches(torch.bfloat16, torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    cusparselt._PACKER_MATCHES[torch.bfloat16, cuda] = True
    assert cusparselt.packer_note(torch.bfloat16, cuda) == "packed by lightning_sparse"


def test_verify_speed_names_the_searched_algorithm(monkeypatch):
    pretend_gpu(monkeypatch, (9, 0))
    layer = nn.Linear(1024, 4096)
    owners = [("fc", layer, "weight")]
    fast = lambda weight, kernel, dtype: SpeedMeasurement(
        1.3, 0.001, "alg 17", "as CUDA graphs"
    )
    choice = choose_backend(
        "auto", NM(2, 4), layer.weight, owners, torch.bfloat16, fast
    )
    assert choice == BackendChoice(
        "semi_structured",
        "cuSPARSELt, sm90, bfloat16, 1.30x dense (alg 17, as CUDA graphs)",
        "cusparselt",
    )
