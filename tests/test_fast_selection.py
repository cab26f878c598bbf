"""target_mask / mark_top_k / prune_smallest_: exact counts and the right entries, on the exact
and the fast paths."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.masks import mark_top_k, prune_smallest_, target_mask

# Above 2**16 entries the sampled-threshold paths run; below, a plain topk.
SIZES = [(7, 13), (300, 400), (1, 70_001)]


def scores(shape, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    if kind == "ties":  # few distinct values: thresholds fall inside large tie blocks
        return torch.randint(0, 5, shape, generator=gen).float()
    if kind == "sorted":  # adversarial for a strided sample
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float).reshape(shape)
    return torch.zeros(shape)  # all equal


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(SIZES),
    kind=st.sampled_from(["gaussian", "ties", "sorted", "zeros"]),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_target_mask_keeps_exactly_k_of_the_largest(shape, kind, fraction, seed):
    score = scores(shape, kind, seed)
    sparsity = min(fraction, 0.999)
    k = score.numel() - round(sparsity * score.numel())
    mask = target_mask(score, sparsity)
    assert mask.shape == score.shape and mask.dtype == torch.bool
    assert int(mask.sum()) == k
    if 0 < k < score.numel():
        assert score[mask].min() >= score[~mask].max()
    assert torch.equal(mask, target_mask(score.clone(), sparsity)), "deterministic"


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(SIZES),
    kind=st.sampled_from(["gaussian", "ties", "sorted"]),
    fraction=st.floats(0.0, 0.6),
    largest=st.booleans(),
    excluded=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_mark_top_k_picks_exactly_k_eligible_extremes(
    shape, kind, fraction, largest, excluded, seed
):
    score = scores(shape, kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    exclude = torch.rand(shape, generator=gen) < excluded
    eligible = ~exclude
    k = round(fraction * int(eligible.sum()))
    chosen = mark_top_k(score, k, largest=largest, excluding=exclude)
    assert chosen.shape == score.shape and int(chosen.sum()) == k
    assert not bool((chosen & exclude).any())
    rest = eligible & ~chosen
    if 0 < k and rest.any():
        if largest:
            assert score[chosen].min() >= score[rest].max()
        else:
            assert score[chosen].max() <= score[rest].min()


def test_selection_rejects_impossible_counts():
    with pytest.raises(ValueError, match="cannot pick 5 of 4 eligible entries"):
        mark_top_k(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="cannot pick 3 of 2 eligible entries"):
        mark_top_k(
            torch.zeros(4), 3, excluding=torch.tensor([True, True, False, False])
        )


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(SIZES),
    density=st.floats(0.05, 1.0),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_prune_smallest_removes_exactly_the_smallest_kept(
    shape, density, fraction, seed
):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) < density
    n_drop = round(fraction * int(mask.sum()))
    survivors = mask.clone()
    dropped = prune_smallest_(weight, survivors, n_drop).clone()
    assert torch.equal(dropped, mask & ~survivors)
    assert not bool((survivors & ~mask).any())
    assert int(dropped.sum()) == n_drop
    if dropped.any() and survivors.any():
        assert weight.abs()[dropped].max() <= weight.abs()[survivors].min()
