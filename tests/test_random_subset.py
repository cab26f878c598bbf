"""random_subset: exact size, never an excluded entry, reproducible, and uniform in all three of
its regimes (draw the chosen, draw the left-out, score every entry)."""

import pytest
import torch

from lightning_sparse.masks.random import random_subset


def excluded_mask(n, fraction, seed):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) < fraction


@pytest.mark.parametrize(
    ("n", "k"),
    [
        (100_000, 300),  # a few: drawn directly
        (100_000, 92_000),  # most of the eligible: the left-out ones are drawn
        (100_000, 30_000),  # a large share of the tensor: a score per entry
        (1000, 0),
    ],
)
def test_exact_size_outside_the_excluded_and_reproducible(n, k):
    excluded = excluded_mask(n, 0.07, 1)
    chosen = random_subset(k, excluded, seed=11)
    assert chosen.dtype == torch.bool and chosen.shape == excluded.shape
    assert int(chosen.sum()) == k
    assert not bool((chosen & excluded).any())
    assert torch.equal(chosen, random_subset(k, excluded, seed=11))
    if k:
        assert not torch.equal(chosen, random_subset(k, excluded, seed=12))


@pytest.mark.parametrize("left_out", [False, True])  # draw the chosen, or the others
def test_every_eligible_entry_is_equally_likely(left_out):
    n = 2000
    excluded = excluded_mask(n, 0.05, 2)
    k = int((~excluded).sum()) - 40 if left_out else 40
    hits = torch.zeros(n)
    runs = 400
    for seed in range(runs):
        hits += random_subset(k, excluded, seed).float()
    assert bool((hits[excluded] == 0).all())
    eligible = hits[~excluded]
    p = k / eligible.numel()
    assert int(eligible.sum()) == runs * k
    spread = float(eligible.std()) / (runs * p * (1 - p)) ** 0.5
    assert 0.7 < spread < 1.3, (
        "counts spread like binomial ones: every entry equally likely"
    )


def test_a_shaped_tensor_and_impossible_counts():
    excluded = torch.zeros(30, 40, dtype=torch.bool)
    excluded[:, :10] = True
    chosen = random_subset(50, excluded, seed=3)
    assert chosen.shape == (30, 40) and int(chosen.sum()) == 50
    with pytest.raises(ValueError, match="cannot pick 901 of 900 eligible entries"):
        random_subset(901, excluded, seed=3)
