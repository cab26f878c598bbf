"""The cuSPARSELt packer on the CPU: byte for byte against ``torch._cslt_compress`` output
captured on an H100 (cuSPARSELt 0.8.0, torch 2.11; ``fixtures/cusparselt_h100.safetensors``,
whose metadata says what each tensor is), against a loop-per-group reference of the measured
layout, round trips, the stored-mask split and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_packs_as, bits
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sparse.backends.cusparselt_packer import (
    canonical_words,
    compress,
    packing,
    supports,
    unpack,
)
from lightning_sparse.masks.tiles import transposable_2to4_mask

FIXTURES = load_file(Path(__file__).parent / "fixtures" / "cusparselt_h100.safetensors")
PROBE_GROUPS = sorted(
    {key.split("/")[1] for key in FIXTURES if key.startswith("probes/group")}
)
RANDOM_SHAPES = sorted(
    {key.split("/")[1] for key in FIXTURES if key.startswith("random/")}
)


def probe_base() -> torch.Tensor:
    """The 128x128 probe weight: ones at positions 0 and 1 of every group of 4."""
    w = torch.zeros(128 * 32, 4, dtype=torch.bfloat16)
    w[:, :2] = 1
    return w


def patched(base: torch.Tensor, changes: torch.Tensor) -> torch.Tensor:
    """``base`` with the ``(word index, word)`` rows of ``changes`` written in."""
    expected = base.clone()
    expected[changes[:, 0].long()] = changes[:, 1].to(torch.int16)
    return expected


def random_2to4(shape, dtype, seed, kept=(0, 1, 2)) -> torch.Tensor:
    """Gaussian weights keeping a random choice of ``kept`` values in each group of 4."""
    gen = torch.Generator().manual_seed(seed)
    n, k = shape
    groups = n * k // 4
    counts = torch.tensor(kept)[torch.randint(len(kept), (groups,), generator=gen)]
    order = torch.rand(groups, 4, generator=gen).argsort(dim=1)
    keep = order < counts.view(-1, 1)
    return (torch.randn(groups, 4, generator=gen) * keep).to(dtype).view(n, k)


def reference(w: torch.Tensor) -> torch.Tensor:
    """The compressed words of ``w`` written group by group from the measured layout."""
    n, k = w.shape
    raw = bits(w).tolist()
    values, words = [], [0] * (n * k // 16)
    for r in range(n):
        for q in range(k // 4):
            first = r * k + 4 * q
            kept = [i for i in range(4) if raw[first + i] & 0x7FFF][:2]
            padding = [p for p in (3, 2) if p not in kept][: 2 - len(kept)]
            stored = sorted(kept + padding)
            values += [0 if p in padding else raw[first + p] for p in stored]
            row_block, a, b, c = r // 64, r // 16 % 4, r // 8 % 2, r % 8
            col_block, d, e = q // 8, q // 4 % 2, q % 4
            nibble = (
                512 * (row_block * (k // 32) + col_block)
                + 128 * a
                + 16 * c
                + 4 * e
                + 2 * d
                + b
            )
            words[nibble // 4] |= (stored[0] | stored[1] << 2) << 4 * (nibble % 4)
    words = [word - 0x10000 if word >= 0x8000 else word for word in words]
    return torch.tensor(values + words, dtype=torch.int16)


@pytest.mark.parametrize("transpose", [False, True], ids=["W", "W.T"])
@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_compress_writes_the_captured_bytes_of_random_weights(shape, transpose):
    w24 = FIXTURES[f"random/{shape}/w24"]
    w = w24.t().contiguous() if transpose else w24
    assert_packs_as(
        w, FIXTURES[f"random/{shape}/compressed{'_t' if transpose else ''}"]
    )


@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_negative_zeros_pack_to_the_captured_bytes(shape):
    """``weight * mask`` leaves ``-0.0`` at pruned negative weights (and a kept weight may be
    ``-0.0``): the bytes are those captured for the same weight with positive zeros."""
    w24 = FIXTURES[f"random/{shape}/w24"]
    signed = torch.where(w24 == 0, torch.tensor(-0.0, dtype=w24.dtype), w24)
    assert bits(signed).eq(-0x8000).any()
    for w, suffix in ((signed, ""), (signed.t().contiguous(), "_t")):
        expected = FIXTURES[f"random/{shape}/compressed{suffix}"]
        assert torch.equal(bits(compress(w)), bits(expected))


@pytest.mark.parametrize("group", PROBE_GROUPS)
def test_groups_keeping_fewer_than_two_are_padded_as_captured(group):
    base = FIXTURES["probes/base"]
    assert torch.equal(bits(compress(probe_base().view(128, 128))), base)
    g = int(group.removeprefix("group"))
    cases = {f"pattern{a}{b}": (a, b) for a in range(4) for b in range(a + 1, 4)}
    cases.update({f"single{a}": (a,) for a in range(4)}, empty=())
    for case, positions in cases.items():
        w = probe_base()
        w[g] = 0
        w[g, list(positions)] = 1
        got = compress(w.view(128, 128))
        expected = patched(base, FIXTURES[f"probes/{group}/{case}"])
        assert torch.equal(bits(got), expected), case
        assert torch.equal(unpack(got, (128, 128)), w.view(128, 128)), case
        signed = torch.where(w == 0, torch.tensor(-0.0, dtype=w.dtype), w)
        assert torch.equal(bits(compress(signed.view(128, 128))), expected), case


def test_every_groups_metadata_nibble_sits_where_captured():
    base, flips = FIXTURES["probes/base"], FIXTURES["probes/flip_to_23"]
    for g in range(128 * 32):
        w = probe_base()
        w[g] = torch.tensor([0, 0, 1, 1])
        assert torch.equal(
            bits(compress(w.view(128, 128))), patched(base, flips[g : g + 1])
        )


@settings(max_examples=12, deadline=None)
@given(
    shape=st.sampled_from([(128, 128), (128, 256), (256, 128)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_compress_matches_the_layout_written_group_by_group(shape, dtype, seed):
    w = random_2to4(shape, dtype, seed)
    assert torch.equal(bits(compress(w)), reference(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (256, 640)])
def test_unpack_gives_the_weight_back(shape, dtype):
    w = random_2to4(shape, dtype, seed=sum(shape))
    assert torch.equal(unpack(compress(w), shape), w)
    greedy = torch.randn(shape)
    w24 = (greedy * transposable_2to4_mask(greedy)).to(dtype)
    for w in (w24, w24.t()):
        assert torch.equal(unpack(compress(w), w.shape), w)


def test_negative_zeros_count_as_zeros_and_padding_is_positive_zero():
    w = random_2to4((128, 128), torch.bfloat16, seed=1, kept=(0, 1))
    signed = torch.where(w == 0, torch.tensor(-0.0, dtype=w.dtype), w)
    assert torch.equal(bits(compress(signed)), bits(compress(w)))


def test_the_canonical_form_ignores_only_the_sign_of_zero():
    """What the packer comparison reads: two packings of one weight agree whichever zero
    fills their padding; another pattern of the same stored values (only the metadata
    differs), a value of the other sign or another value does not."""
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    values = torch.arange(1, 33, dtype=torch.bfloat16) / 8  # exact in bfloat16
    w[:, 0::4] = values
    w[:, 1::4] = -values
    moved = w.roll(2, dims=1)  # the same values kept at positions 2 and 3 of each group
    ours, other_pattern = compress(w), compress(moved)
    stored = w.numel() // 2
    assert torch.equal(bits(ours)[:stored], bits(other_pattern)[:stored])
    padded = compress(torch.where(torch.arange(128) % 4 == 1, 0.0, w).bfloat16())
    signed = padded.clone()
    signed.view(-1)[1::2][: stored // 2] = -0.0  # every group's padding written as -0.0
    assert not torch.equal(bits(signed), bits(padded))
    assert torch.equal(canonical_words(signed), canonical_words(padded))
    other_values = compress(torch.where(w < 0, 2 * w, w))  # other negative values
    for unlike in (other_pattern, compress(-w), other_values):
        assert not torch.equal(canonical_words(unlike), canonical_words(ours))


def test_a_packing_equals_compress_of_the_masked_weight():
    weight = torch.randn(256, 384).bfloat16()
    keep = random_2to4((256, 384), torch.float32, seed=2) != 0
    masked = weight * keep
    plan = packing(keep)
    assert torch.equal(bits(plan.compress(weight)), bits(compress(masked)))
    assert torch.equal(
        bits(packing(masked != 0).compress(masked)), bits(compress(masked))
    )


def test_a_packing_keeping_exact_zeros_unpacks_to_the_masked_weight():
    weight = torch.randn(128, 256).bfloat16()
    keep = random_2to4((128, 256), torch.float32, seed=3, kept=(2,)) != 0
    weight[keep & (torch.rand(128, 256) < 0.3)] = 0
    packed = packing(keep).compress(weight)
    assert not torch.equal(bits(packed), bits(compress(weight * keep)))  # padding moved
    assert torch.equal(unpack(packed, weight.shape), weight * keep)


def test_the_packer_traces_on_fake_cuda_tensors():
    with FakeTensorMode():
        w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
        packed = compress(w)
        assert (packed.shape, packed.device.type) == ((256, 72), "cuda")
        assert packing(w != 0).compress(w).shape == (256, 72)
        assert unpack(packed, (256, 128)).shape == (256, 128)


def test_compress_compiles_into_one_graph():
    w = random_2to4((256, 128), torch.bfloat16, seed=4)
    compiled = torch.compile(compress, backend="aot_eager", fullgraph=True)
    assert torch.equal(bits(compiled(w)), bits(compress(w)))


def test_supports_16_bit_weights_in_multiples_of_128():
    assert supports((128, 256), torch.float16) and supports(
        (4096, 1024), torch.bfloat16
    )
    for shape in [(64, 128), (128, 96), (128,), (128, 128, 4), (0, 128)]:
        assert not supports(shape, torch.bfloat16), shape
    for dtype in [torch.float32, torch.int8, torch.float8_e4m3fn]:
        assert not supports((128, 128), dtype), dtype


@pytest.mark.parametrize(
    "w, message",
    [
        (torch.zeros(64, 128, dtype=torch.bfloat16), "multiples of 128"),
        (torch.zeros(128, 128, 4, dtype=torch.bfloat16), "multiples of 128"),
        (torch.zeros(128, 128), "float16 and bfloat16 only"),
        (torch.zeros(128, 128, dtype=torch.int8), "float16 and bfloat16 only"),
    ],
)
def test_compress_refuses_layouts_it_does_not_know(w, message):
    with pytest.raises(ValueError, match=message) as error:
        compress(w)
    assert "torch._cslt_compress" in str(error.value)


def test_the_split_refuses_mismatched_inputs():
    with pytest.raises(TypeError, match="bool mask"):
        packing(torch.ones(128, 128))
    plan = packing(torch.ones(128, 128, dtype=torch.bool))
    with pytest.raises(ValueError, match="packing of shape"):
        plan.compress(torch.zeros(256, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="compresses to 9216"):
        unpack(torch.zeros(128, 64, dtype=torch.bfloat16), (128, 128))
