"""The cuSPARSELt packer on the running GPU: the bytes of ``torch._cslt_compress`` and the
products of ``torch._cslt_sparse_mm``. Skipped without a CUDA GPU of capability 8.0+ and a torch
with cuSPARSELt. The layout was measured on sm90 with cuSPARSELt 0.8: a failure elsewhere means
it differs there, and the packer must not be used on that GPU or library version."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_packs_as, bits

from lightning_sparse.backends.capability import cusparselt_available
from lightning_sparse.backends.cusparselt import _compare_packers
from lightning_sparse.backends.cusparselt_packer import (
    canonical_words,
    compress,
    packing,
    positive_zeros,
)
from lightning_sparse.masks.tiles import transposable_2to4_mask

SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (SM80 and cusparselt_available()),
        reason="needs a CUDA GPU with compute capability 8.0+ and cuSPARSELt",
    ),
]
DTYPES = [torch.bfloat16, torch.float16]


def greedy_2to4(shape, dtype, seed=0) -> torch.Tensor:
    """A random weight pruned to the greedy transposable 2:4 mask the training path uses."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, device="cuda", generator=gen)
    return (w * transposable_2to4_mask(w)).to(dtype)


def sparse_groups(shape, dtype, seed=0) -> torch.Tensor:
    """Random weights keeping 0, 1 or 2 values in each group of 4 (padding on every path)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = shape[0] * shape[1] // 4
    counts = torch.randint(3, (groups, 1), device="cuda", generator=gen)
    keep = torch.rand(groups, 4, device="cuda", generator=gen).argsort(dim=1) < counts
    w = torch.randn(groups, 4, device="cuda", generator=gen) * keep
    return w.to(dtype).view(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 128), (256, 640), (4096, 1024)])
def test_compress_writes_the_bytes_of_cslt_compress(shape, dtype):
    w24 = greedy_2to4(shape, dtype)
    for w in (w24, w24.t().contiguous(), sparse_groups(shape, dtype)):
        assert_packs_as(w, torch._cslt_compress(positive_zeros(w)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zeros_pack_and_multiply_as_cslt_compress_packs_them(dtype):
    """``weight * mask`` leaves ``-0.0`` where a negative weight was pruned: our bytes are
    cuSPARSELt's for the same weight with positive zeros, stored zeros compared by value, and
    cuSPARSELt's matmul computes the same product from both."""
    w = torch.randn(256, 256, device="cuda").to(dtype)
    masked = w * (sparse_groups((256, 256), dtype) != 0)
    assert bits(masked).eq(-0x8000).any()
    ours, theirs = compress(masked), torch._cslt_compress(positive_zeros(masked))
    assert torch.equal(canonical_words(ours), canonical_words(theirs))
    x = torch.randn(256, 64, device="cuda").to(dtype)
    assert torch.equal(torch._cslt_sparse_mm(ours, x), torch._cslt_sparse_mm(theirs, x))


def test_the_packer_comparison_passes_on_this_gpu():
    """What the training path decides: our packer matches cuSPARSELt here (else every packing
    runs ``torch._cslt_compress``, and the packing targets cannot hold)."""
    for dtype in DTYPES:
        assert _compare_packers(dtype, torch.device("cuda")), dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packing_on_the_gpu_writes_the_bytes_of_cslt_compress(dtype):
    weight = torch.randn(512, 256, device="cuda").to(dtype)
    weight[weight == 0] = (
        1  # the mask keeps no exact zeros: same bytes, padding included
    )
    keep = sparse_groups((512, 256), dtype) != 0
    got = packing(keep).compress(weight)
    expected = torch._cslt_compress(positive_zeros(weight * keep))
    assert torch.equal(canonical_words(got), canonical_words(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cslt_sparse_mm_with_our_bytes_computes_the_dense_product(dtype):
    w24 = greedy_2to4((1024, 512), dtype, seed=1)
    x = torch.randn(512, 256, device="cuda").to(dtype)
    ours = torch._cslt_sparse_mm(compress(w24), x)
    theirs = torch._cslt_sparse_mm(torch._cslt_compress(positive_zeros(w24)), x)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(
        ours.float(), w24.float() @ x.float(), rtol=2e-2, atol=2e-2
    )
