import pytest
import torch

from lightning_sparse.masks import (
    NM,
    describe,
    is_nm,
    name_seed,
    num_kept,
    random_score,
    target_mask,
)


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.5, 0.7, 0.95, 0.999])
@pytest.mark.parametrize("shape", [(16, 8), (7, 13), (4, 3, 3, 3)])
def test_unstructured_mask_has_exact_count(sparsity, shape):
    score = torch.randn(shape)
    mask = target_mask(score, sparsity)
    numel = score.numel()
    assert mask.dtype == torch.bool and mask.shape == score.shape
    assert int(mask.sum()) == num_kept(numel, sparsity)
    # kept entries are the largest ones
    if 0 < int(mask.sum()) < numel:
        assert score[mask].min() >= score[~mask].max()


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (1, 2)])
def test_nm_mask_keeps_n_of_every_m_along_inputs(n, m):
    score = torch.randn(12, 4 * m)
    mask = target_mask(score, NM(n, m))
    groups = mask.reshape(12, -1, m)
    assert bool((groups.sum(-1) == n).all())
    assert is_nm(mask, NM(n, m))
    kept_min = torch.where(groups, score.reshape(12, -1, m), torch.inf).min(-1).values
    dropped_max = (
        torch.where(~groups, score.reshape(12, -1, m), -torch.inf).max(-1).values
    )
    assert bool((kept_min >= dropped_max).all())


def test_nm_on_conv_groups_input_channels_times_kernel():
    score = torch.randn(8, 4, 3, 3)  # 36 inputs per output
    mask = target_mask(score, NM(2, 4))
    assert is_nm(mask, NM(2, 4)) and int(mask.sum()) == 8 * 18


def test_nm_needs_divisible_inputs():
    with pytest.raises(
        ValueError,
        match=r"shape \(4, 6\) has 6 inputs per output, not a multiple of M=4",
    ):
        target_mask(torch.randn(4, 6), NM(2, 4))


def test_seeds_depend_on_name_and_step_not_order():
    assert name_seed(0, "a.weight", 5) == name_seed(0, "a.weight", 5)
    assert (
        len(
            {
                name_seed(0, "a", 0),
                name_seed(0, "b", 0),
                name_seed(1, "a", 0),
                name_seed(0, "a", 1),
            }
        )
        == 4
    )
    like = torch.empty(4, 4)
    assert torch.equal(random_score(like, 3), random_score(like, 3))
    assert not torch.equal(random_score(like, 3), random_score(like, 4))


def test_describe():
    assert [describe(t) for t in (NM(2, 4), 0.0, 0.7, 0.125)] == [
        "2:4",
        "dense",
        "70%",
        "12.50%",
    ]
