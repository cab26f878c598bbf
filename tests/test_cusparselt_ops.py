"""The cuSPARSELt custom ops on the CPU: their registration (opcheck, with a dense stand-in for
cuSPARSELt's matmul), the searched algorithm in every sparse matmul, and the choice of packer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import bits, dense_cusparselt, emulated_cusparselt, pretend_gpu
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sparse.backends import (
    BackendChoice,
    choose_backend,
    cusparselt,
    cusparselt_packer,
)
from lightning_sparse.backends import cusparselt_algorithms as algorithms
from lightning_sparse.backends.cusparselt_algorithms import Algorithm, AlgorithmCache
from lightning_sparse.backends.semi_structured import stored_mask_packing
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
    half = [t.detach().bfloat16().requires_grad_() for t in (x, weight, bias)]
    torch.library.opcheck(cusparselt.linear_24_projected, tuple(half))
    # a float32 weight multiplied in bfloat16 (autocast's case): the op casts it
    torch.library.opcheck(cusparselt.linear_24_projected, (half[0], weight, half[2]))
    grad = torch.randn(12, 128, dtype=torch.bfloat16)
    args = (grad, half[1].detach())  # not differentiable again
    torch.library.opcheck(cusparselt.linear_24_projected_input_grad, args)
    mask = transposable_2to4_mask(weight.detach())
    torch.library.opcheck(cusparselt.linear_24, (x, w24, bias))
    torch.library.opcheck(cusparselt.linear_24, (x, w24, None))
    torch.library.opcheck(cusparselt.linear_24, (x, weight, bias, mask))
    torch.library.opcheck(cusparselt.linear_24_input_grad, (torch.randn(12, 128), w24))
    args = (torch.randn(12, 128), weight, mask)
    torch.library.opcheck(cusparselt.linear_24_input_grad, args)


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


def test_a_second_order_gradient_through_the_runtime_op_names_the_fix(dense_stand_in):
    torch.manual_seed(0)
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    out = cusparselt.cusparselt_linear(x, weight, None, None)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order.*backend='masked'"):
        grad_x.sum().backward()


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
    chosen = {"transpose_result": True, "alg_id": 17, "split_k": 2, "split_k_mode": 1}
    default = {"transpose_result": True, "alg_id": 0, "split_k": 1, "split_k_mode": -1}
    checked = [chosen, default]  # each search's choice, run once against algorithm 0
    assert ran == [*checked, chosen, *checked, chosen, chosen, chosen]


def wrong_split_k(packed, dense, bias=None, alg_id=0, **options):
    """cuSPARSELt's matmul as dense math, where algorithm 5 sums wrongly (a split-k that
    drops a partial sum)."""
    out = F.linear(dense.t(), packed, bias)
    return out * 0.5 if alg_id == 5 else out


def test_a_searched_configuration_that_disagrees_with_algorithm_0_is_not_used(
    monkeypatch,
):
    monkeypatch.setattr(torch, "_cslt_sparse_mm", wrong_split_k)
    cache = AlgorithmCache(lambda *args: Algorithm(5, split_k=2, split_k_mode=1))
    packed, dense = torch.randn(128, 256), torch.randn(256, 64)
    with pytest.warns(RuntimeWarning, match=r"alg 5, split-k 2 \(split-k mode 1\)"):
        assert cache.choose(packed, dense, None, out_features=128) == algorithms.DEFAULT
    assert cache.describe(128, 256) == "alg 0 (the searched alg 5, split-k 2 disagreed)"
    bigger = torch.randn(512, 256)
    with warnings.catch_warnings():  # one warning per process
        warnings.simplefilter("error")
        assert cache.choose(bigger, dense, None, 512) == algorithms.DEFAULT


def test_a_search_that_raises_leaves_algorithm_0_and_a_cuda_error_is_raised():
    def search(packed, dense, bias, transposed):
        if packed.shape[0] == 64:
            raise torch.AcceleratorError("CUDA error: an illegal memory access")
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 8.00 GiB\nmore"
        )

    cache = AlgorithmCache(search, run=lambda *args: pytest.fail("nothing runs"))
    packed, dense = torch.randn(128, 256), torch.randn(256, 64)
    with pytest.warns(RuntimeWarning) as warned:
        assert cache.choose(packed, dense, None, out_features=128) == algorithms.DEFAULT
    assert str(warned[0].message) == (
        "cuSPARSELt's search raised OutOfMemoryError for a 128x256 float32 weight at up to "
        "64 tokens (CUDA out of memory. Tried to allocate 8.00 GiB); such shapes run "
        "algorithm 0 (correct, maybe slower), and the fit-start table names them"
    )
    assert cache.describe(128, 256) == "alg 0 (the search raised)"
    with warnings.catch_warnings():  # one warning per process, one search per shape
        warnings.simplefilter("error")
        assert (
            cache.choose(torch.randn(512, 256), dense, None, 512) == algorithms.DEFAULT
        )
        assert cache.choose(packed, dense, None, out_features=128) == algorithms.DEFAULT
    with pytest.raises(torch.AcceleratorError):  # the process is unusable: no fallback
        cache.choose(torch.randn(64, 256), dense, None, out_features=64)


def test_a_searched_configuration_that_agrees_is_kept_and_bias_is_part_of_the_shape(
    monkeypatch,
):
    monkeypatch.setattr(torch, "_cslt_sparse_mm", wrong_split_k)
    searched = []
    cache = AlgorithmCache(lambda *args: searched.append(args[2]) or Algorithm(7))
    packed, dense = torch.randn(128, 256), torch.randn(256, 64)
    for bias in (None, torch.randn(128), None, torch.randn(128)):
        assert cache.choose(packed, dense, bias, out_features=128) == Algorithm(7)
    assert [b is None for b in searched] == [
        True,
        False,
    ]  # one search with, one without
    assert cache.describe(128, 256) == "alg 7"


def test_the_cache_searches_once_per_shape_bucket_and_not_while_capturing(monkeypatch):
    calls = []
    cache = AlgorithmCache(
        lambda *args: calls.append(args) or Algorithm(5),
        run=lambda *args: torch.ones(1),  # every configuration agrees
    )
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

    cache = AlgorithmCache(search, run=lambda *args: torch.ones(1))  # all agree
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
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    monkeypatch.setattr(cusparselt, "_compare_packers", lambda dtype, device: matches)
    monkeypatch.setattr(torch, "_cslt_compress", lambda w: "theirs")
    monkeypatch.setattr(cusparselt, "compress", lambda w: "ours")
    w24 = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert cusparselt.pack(w24) == ("ours" if matches else "theirs")
    assert cusparselt.pack(w24.float()) == "theirs"  # a dtype the packer does not know
    assert cusparselt.pack(w24[:, :100]) == "theirs"  # a shape it does not know


def test_a_packer_that_differs_warns_and_the_table_names_the_packer(monkeypatch):
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    monkeypatch.setattr(
        torch, "_cslt_compress", lambda w: w.reshape(w.shape[0], -1) * 0
    )
    with pytest.warns(RuntimeWarning, match="packed by torch._cslt_compress"):
        assert not cusparselt.packer_matches(torch.bfloat16, torch.device("cpu"))
    assert cusparselt.packer(torch.bfloat16, torch.device("cpu")).note() == (
        "packed by torch._cslt_compress (lightning_sparse's packers write other bytes here)"
    )
    cuda = torch.device("cuda", 0)
    cusparselt._PACKERS[torch.bfloat16, cuda] = cusparselt.Packer("torch", "no Triton")
    note = cusparselt.packer_note(torch.bfloat16, cuda)
    assert note == "packed by lightning_sparse (no Triton)"


CPU = torch.device("cpu")


def test_the_packer_comparison_runs_once_per_gpu_however_the_device_is_written(
    monkeypatch,
):
    compared = []
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    monkeypatch.setattr(
        cusparselt, "_compare_packers", lambda *key: compared.append(key) or True
    )
    monkeypatch.setattr(cusparselt, "_triton_differs", lambda *key: "no Triton here")
    monkeypatch.setattr(cusparselt, "capturing", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for device in ("cuda", "cuda:1", "cuda", "cuda:0"):
        assert cusparselt.packer_matches(torch.bfloat16, torch.device(device))
    cuda = torch.device("cuda", 1)
    assert compared == [
        (torch.bfloat16, cuda),
        (torch.bfloat16, torch.device("cuda", 0)),
    ]
    assert cusparselt.packer_note(torch.bfloat16, torch.device("cuda")) == (
        "packed by lightning_sparse (no Triton here)"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compressor_that_writes_negative_zeros_into_padding_leaves_our_packer_on(
    monkeypatch, dtype
):
    """``weight * mask`` leaves ``-0.0`` at pruned negative weights; a compressor that copies
    them into padding writes other bytes for the same weight, which must not turn the
    packer off (it did: every packing then ran ``torch._cslt_compress``)."""
    emulated_cusparselt(monkeypatch, raw_padding=True)
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "packed by torch._cslt_compress" warning
        assert cusparselt.packer_matches(dtype, CPU)


def test_a_packing_the_matmul_reads_otherwise_turns_our_packer_off(monkeypatch):
    """The comparison multiplies too: equal bytes are not enough where the library's matmul
    computes another product from our packing than from its own."""
    emulated_cusparselt(monkeypatch)
    mm = torch._cslt_sparse_mm
    ours = set()

    def tagged(w24):
        packed = cusparselt_packer.compress(w24)
        ours.add(packed.data_ptr())
        return packed

    def reads_ours_otherwise(packed, dense, *args, **kwargs):
        out = mm(packed, dense, *args, **kwargs)
        return out + 1 if packed.data_ptr() in ours else out

    monkeypatch.setattr(cusparselt, "compress", tagged)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", reads_ours_otherwise)
    monkeypatch.setattr(cusparselt, "_PACKERS", {})
    with pytest.warns(RuntimeWarning, match="packed by torch._cslt_compress"):
        assert not cusparselt.packer_matches(torch.bfloat16, CPU)


def test_cslt_compress_is_given_positive_zeros_only(monkeypatch):
    """Where our packer is off, every path hands ``torch._cslt_compress`` a weight without
    ``-0.0`` (a compressor may count one as a kept value)."""
    dense_cusparselt(monkeypatch, packer_matches=False)
    given = []
    monkeypatch.setattr(
        torch, "_cslt_compress", lambda w: given.append(bits(w)) or w.clone()
    )
    torch.manual_seed(0)
    x = torch.randn(16, 256, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    mask = transposable_2to4_mask(weight.detach())
    assert bits(weight.detach() * mask).eq(-0x8000).any()
    packing = stored_mask_packing("cusparselt", mask, mask)
    for stored in (None, packing):
        out = cusparselt.cusparselt_linear(x, weight, None, mask, stored)
        out.sum().backward()
    assert len(given) == 4  # W and W.T, projected and stored
    assert not any(words.eq(-0x8000).any() for words in given)


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
        "cuSPARSELt, sm90, bfloat16, 1.30x dense (alg 17, as CUDA graphs, 8192 tokens)",
        "cusparselt",
    )


def test_a_second_order_gradient_through_the_stored_mask_op_with_a_frozen_weight(
    dense_stand_in,
):
    """A gradient penalty through a frozen 2:4 weight (``create_graph``): the input gradient
    is differentiated again through the upstream gradient, as dense math with the pruned
    weight gives it."""
    torch.manual_seed(0)
    x = torch.randn(8, 256, requires_grad=True)
    weight = torch.randn(128, 256)  # frozen
    mask = transposable_2to4_mask(weight)
    out = cusparselt.linear_24(x, weight, None, mask)
    (grad_x,) = torch.autograd.grad((out**2).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad_x.sum(), x)
    x_ref = x.detach().requires_grad_()
    out_ref = x_ref @ (weight * mask).T
    (grad_ref,) = torch.autograd.grad((out_ref**2).sum(), x_ref, create_graph=True)
    (second_ref,) = torch.autograd.grad(grad_ref.sum(), x_ref)
    torch.testing.assert_close(grad_x, grad_ref)
    torch.testing.assert_close(second, second_ref)
