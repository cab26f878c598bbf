"""Learned 2:4 masks handed over transposable (``transposable: tiles | project``): the tile
candidates and the projection against a brute force over every transposable tile, the mask
handed to the next phase is 2:4 along rows and columns, resumes are bitwise, the next phase
runs the 2:4 kernel ops on a pretended GPU, and configuration mistakes are named."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_sparse.masks import NM
from lightning_sparse.masks.candidates import candidate_patterns, pattern_indices
from lightning_sparse.masks.tile_candidates import (
    project_to_tiles,
    tile_indices,
    tiles_to_mask,
)
from lightning_sparse.masks.tiles import is_transposable_2to4


def all_transposable_tiles() -> list[torch.Tensor]:
    """Every 4x4 0/1 tile with exactly 2 per row and per column, by enumeration."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
    found = []
    for tile in itertools.product(rows, repeat=4):
        grid = torch.tensor(tile, dtype=torch.bool)
        if bool((grid.sum(0) == 2).all()):
            found.append(grid)
    return found


def brute_force_projection(scores: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Per tile, the transposable tile whose rows' pattern scores sum highest (loops)."""
    r, c = shape
    tiles = all_transposable_tiles()
    table = candidate_patterns(NM(2, 4)).tolist()
    per_group = scores.view(r, c // 4, 6)
    out = torch.zeros(shape, dtype=torch.bool)
    for i in range(r // 4):
        for j in range(c // 4):
            def total(tile: torch.Tensor) -> float:
                return sum(
                    float(per_group[4 * i + k, j, table.index(tile[k].tolist())])
                    for k in range(4)
                )

            best = max(tiles, key=total)
            out[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] = best
    return out


def test_there_are_90_transposable_tiles():
    assert len(all_transposable_tiles()) == 90


@pytest.mark.parametrize("shape", [(4, 4), (8, 16), (12, 8)])
def test_the_projection_is_the_best_of_the_90_tiles(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    scores = torch.randn(shape[0] * shape[1] // 4, 6, generator=gen)  # no ties
    got = tiles_to_mask(project_to_tiles(scores, shape), shape)
    assert torch.equal(got, brute_force_projection(scores, shape))
    assert is_transposable_2to4(got)


def test_tile_indices_round_trip_and_refuse_a_row_wise_mask():
    gen = torch.Generator().manual_seed(0)
    tiles = all_transposable_tiles()
    picks = torch.randint(0, 90, (2, 3), generator=gen)
    mask = torch.cat(
        [torch.cat([tiles[int(k)] for k in row], dim=1) for row in picks], dim=0
    )
    index = tile_indices(mask)
    assert index.shape == (6,) and torch.equal(tiles_to_mask(index, mask.shape), mask)
    row_wise = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)  # 4 in columns 0, 1
    assert pattern_indices(row_wise, NM(2, 4)).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="match no transposable 2:4 tile"):
        tile_indices(row_wise)
