"""mark_top_k and the elementwise operations: exact choices, ties by position, and the torch
operations and the compiled CPU loops (float32/64) giving identical bits."""

import numpy as np
import pytest
import torch
from helpers import on_both_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sparse.masks.elementwise import (
    apply_mask_change_,
    count_true,
    flat_nonzero,
    free_scratch,
    multiply_by_mask_,
    scratch_mask,
    zero_where_,
)
from lightning_sparse.masks.top_k import LARGE, _Choice, _thresholds, mark_top_k

# Above LARGE entries the sampled-threshold path runs; below, a stable sort.
SIZES = [(7, 13), (300, 400), (1, LARGE + 5)]


def values_of(kind, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    if kind == "ties":  # few distinct values: thresholds fall inside large tie blocks
        return torch.randint(-3, 4, shape, generator=gen).float()
    if kind == "sorted":  # adversarial for a strided sample
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float).reshape(shape)
    return torch.zeros(shape)


def by_sorting(values, k, largest, magnitude, eligible):
    """The documented rule, spelled out: eligible entries ordered by value (or magnitude),
    equal values by position; the first k."""
    flat = values.reshape(-1)
    index = eligible.reshape(-1).nonzero().squeeze(1)
    scores = flat[index].abs() if magnitude else flat[index]
    order = torch.sort(scores, descending=largest, stable=True).indices[:k]
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[index[order]] = True
    return chosen.view(values.shape)


def kernel_loops():
    """The compiled loops themselves (skips the test without the [cpu] extra)."""
    return pytest.importorskip("lightning_sparse.kernels.loops", exc_type=ImportError)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    shape=st.sampled_from(SIZES),
    kind=st.sampled_from(["gaussian", "ties", "sorted", "zeros"]),
    fraction=st.floats(0.0, 1.0),
    largest=st.booleans(),
    magnitude=st.booleans(),
    restrict=st.sampled_from([None, "among", "excluding"]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
def test_top_k_is_the_stable_sort_choice(
    mask_path, shape, kind, fraction, largest, magnitude, restrict, seed, dtype
):
    """On the compiled path float32/64 run the compiled pass, float16 the torch one."""
    values = values_of(kind, shape, seed).to(dtype)
    flags = torch.rand(shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.4
    eligible = {None: torch.ones_like(flags), "among": flags, "excluding": ~flags}
    eligible = eligible[restrict]
    k = round(fraction * int(eligible.sum()))
    restriction = {"among": flags} if restrict == "among" else {}
    if restrict == "excluding":
        restriction = {"excluding": flags}
    chosen = mark_top_k(values, k, largest=largest, magnitude=magnitude, **restriction)
    assert chosen.dtype == torch.bool and chosen.shape == values.shape
    assert torch.equal(chosen, by_sorting(values, k, largest, magnitude, eligible))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["gaussian", "ties", "sorted", "nan"])
def test_compiled_and_torch_passes_agree(kind, dtype):
    """The compiled CPU pass (float32/64) marks exactly what the chunked torch pass marks, with
    every restriction and direction, NaN included."""
    values = values_of("gaussian" if kind == "nan" else kind, (3, 40_000), 7).to(dtype)
    if kind == "nan":
        values.view(-1)[::997] = float("nan")
    flags = torch.rand(3, 40_000, generator=torch.Generator().manual_seed(8)) < 0.3
    requests = [
        {"k": 5000, "magnitude": True, "among": flags},
        {"k": 30_000, "largest": False, "excluding": flags},
        {"k": 60_000, "largest": False, "magnitude": True},
        {"k": 1000},
    ]
    runs = on_both_paths(
        lambda: [mark_top_k(values, **request) for request in requests]
    )
    for torch_run, compiled_run in zip(*runs):
        assert torch.equal(torch_run, compiled_run)


@pytest.mark.parametrize("kind", ["gaussian", "ties", "nan"])
def test_sampled_thresholds_agree_on_both_paths(kind):
    """The strided sample and its order statistics (NumPy with the [cpu] extra, torch
    without) place the same thresholds, NaN sorted last on both."""
    values = values_of("gaussian" if kind == "nan" else kind, (5, 40_000), 3)
    if kind == "nan":
        values.view(-1)[::31] = float("nan")
    flags = torch.rand(values.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    choices = [
        _Choice(
            values.view(-1), 9000, largest, magnitude, flags.view(-1), keep_set, 100_000
        )
        for largest in (True, False)
        for magnitude in (True, False)
        for keep_set in (True, False)
    ]
    runs = on_both_paths(lambda: [_thresholds(c) for c in choices])
    assert str(runs[0]) == str(runs[1])  # as text: NaN == NaN


def test_threshold_pass_stops_where_the_band_outgrows_its_buffer():
    cpu_kernels = kernel_loops()
    x = np.repeat(
        np.arange(100, dtype=np.float32), 100
    )  # v fills x[100 v : 100 v + 100]
    sure = np.empty(10_000, np.uint8)
    args = (x, None, 1, False, True, 90.0, 80.0, True, sure)  # band: 80 <= x <= 90
    block = cpu_kernels.BLOCK
    short = np.empty(50, np.int64), np.empty(50, np.float32)
    # the band (80..90: x[8000:9100]) starts in the block at 6144 and does not fit in 50
    assert cpu_kernels.threshold_pass(*args, *short, 0, 0) == (0, 0, 3 * block)
    band = np.empty(1100, np.int64), np.empty(1100, np.float32)  # just long enough
    n_sure, n_band, stop = cpu_kernels.threshold_pass(*args, *band, 0, 3 * block)
    assert (n_sure, n_band, stop) == (900, 1100, 10_000)  # > 90: 9 values, 100 of each
    assert band[0][:n_band].tolist() == list(range(8000, 9100))
    assert band[1][:n_band].tolist() == x[8000:9100].tolist()
    one_short = np.empty(1099, np.int64), np.empty(1099, np.float32)
    assert cpu_kernels.threshold_pass(*args, *one_short, 0, 3 * block)[2] == 4 * block
    assert np.array_equal(sure.astype(bool)[6144:], x[6144:] > 90)


@pytest.mark.parametrize("band_fraction", [0.001, 0.04, 0.5, 1.0])
def test_threshold_pass_lists_every_band_entry_in_order(band_fraction):
    """The band is listed 64 flags at a time: sparse, dense and full bands, a last block
    shorter than 64 entries, eligibility flags and magnitudes."""
    cpu_kernels = kernel_loops()
    gen = np.random.default_rng(3)
    x = gen.standard_normal(5 * cpu_kernels.BLOCK + 37).astype(np.float32)
    flags = (gen.random(x.size) < 0.7).astype(np.uint8)
    inner, outer = np.quantile(np.abs(x), [0.1, min(1.0, 0.1 + band_fraction)])
    inner, outer = np.float32(inner), np.float32(outer)
    sure = np.empty(x.size, np.uint8)
    band, values = np.empty(x.size, np.int64), np.empty(x.size, np.float32)
    args = (x, flags, 1, True, False, inner, outer, True, sure, band, values)
    n_sure, n_band, stop = cpu_kernels.threshold_pass(*args, 0, 0)
    in_band = (np.abs(x) >= inner) & (np.abs(x) <= outer)
    expected = np.flatnonzero((flags == 1) & in_band)
    assert len(expected) >= band_fraction * 0.5 * x.size  # about 0.7 of it
    assert stop == x.size and n_sure == int(((flags == 1) & (np.abs(x) < inner)).sum())
    assert band[:n_band].tolist() == expected.tolist()
    assert values[:n_band].tolist() == np.abs(x[expected]).tolist()


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64]
)
@pytest.mark.parametrize("changed_fraction", [0.005, 0.3])
def test_apply_mask_change_is_multiply_and_zero_bit_for_bit(
    mask_path, dtype, changed_fraction
):
    """By index (few changes), compiled (float32/64 on that path) or torch: the bits of
    multiplying the weight by the mask and zeroing the state where it changed."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(300, 500, generator=gen) < 0.5
    changed = torch.rand(300, 500, generator=gen) < changed_fraction
    old_mask = mask ^ changed
    weight = (torch.randn(300, 500, generator=gen) * old_mask).to(dtype)
    states = [torch.randn(300, 500, generator=gen).to(dtype) for _ in range(2)]
    expected = [weight * mask] + [s.masked_fill(changed, 0) for s in states]
    apply_mask_change_(weight, mask, changed, states)
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[weight.element_size()]
    for got, want in zip([weight, *states], expected):
        assert torch.equal(got.view(int_type), want.view(int_type))


def test_out_and_known_count_and_bfloat16():
    values = torch.randn(200, 400, generator=torch.Generator().manual_seed(0))
    among = values > -0.5
    out = torch.empty(200 * 400, dtype=torch.bool)
    chosen = mark_top_k(values, 1000, among=among, n_eligible=int(among.sum()), out=out)
    assert chosen.data_ptr() == out.data_ptr()
    assert torch.equal(chosen, by_sorting(values, 1000, True, False, among))
    half = values.bfloat16()  # many ties
    assert torch.equal(
        mark_top_k(half, 7000, magnitude=True),
        by_sorting(half.float(), 7000, True, True, torch.ones_like(among)),
    )


def test_top_k_rejects_impossible_requests():
    with pytest.raises(ValueError, match="cannot pick 3 of 2 eligible entries"):
        mark_top_k(torch.zeros(4), 3, among=torch.tensor([True, True, False, False]))
    with pytest.raises(ValueError, match="either among or excluding"):
        flags = torch.ones(4, dtype=torch.bool)
        mark_top_k(torch.zeros(4), 1, among=flags, excluding=flags)


def test_masking_ops_match_torch_bit_for_bit(mask_path):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=gen)
    values[:10] = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0, 0.5, -2]
    )
    mask = torch.rand(1000, generator=gen) < 0.5
    expected = values * mask  # zeros carry the sign: -0.0 for negative values
    got = values.clone()
    multiply_by_mask_(got, mask)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    expected = values.masked_fill(mask, 0)  # +0.0 everywhere it writes
    got = values.clone()
    zero_where_(got, mask)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert flat_nonzero(mask).tolist() == mask.nonzero().squeeze(1).tolist()
    assert count_true(mask) == int(mask.sum())


def test_scratch_masks_are_reused_per_slot():
    first = scratch_mask(100, torch.device("cpu"), slot=0)
    again = scratch_mask(50, torch.device("cpu"), slot=0)
    other = scratch_mask(50, torch.device("cpu"), slot=1)
    assert first.numel() == 100 and again.numel() == 50
    assert again.data_ptr() == first.data_ptr() != other.data_ptr()
    free_scratch()
    assert scratch_mask(10, torch.device("cpu")).numel() == 10
