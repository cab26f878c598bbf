"""The 90 transposable 2:4 tiles as candidate patterns: masks as one tile index per 4x4 tile,
and N:M group scores projected onto those tiles.

A 2-D mask (rows, inputs last) is cut into 4x4 tiles in row-major tile order; each tile of a
transposable mask that keeps exactly 2 per row and column is one of the 90 patterns of
:func:`~lightning_sparse.masks.tiles.tile_patterns` (position ``p = 4 * row + col``).
:func:`tile_indices` gives each tile's index among them and :func:`tiles_to_mask` goes back.
:func:`project_to_tiles` chooses, per tile, the pattern whose 4 rows have the largest summed
score when every 2:4 group has one score per candidate pattern
(:func:`~lightning_sparse.masks.candidates.candidate_patterns`): exactly, over the 90.

Example:
    >>> import torch
    >>> mask = torch.eye(4, dtype=torch.bool).roll(1, 0) | torch.eye(4, dtype=torch.bool)
    >>> index = tile_indices(mask)
    >>> torch.equal(tiles_to_mask(index, mask.shape), mask)
    True
    >>> scores = torch.zeros(4, 6)
    >>> scores[:, 0] = 1.0  # every row would keep its first two columns: not transposable
    >>> scores[2:, 5] = 0.5  # the last two rows would rather keep their last two
    >>> tiles_to_mask(project_to_tiles(scores, (4, 4)), (4, 4)).int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_sparse.masks.candidates import candidate_count, pattern_indices
from lightning_sparse.masks.patterns import NM
from lightning_sparse.masks.refill import tile_codes, tile_tables
from lightning_sparse.masks.tiles import tile_patterns

TILE_CANDIDATES = 90
"""The transposable 2:4 tiles that keep exactly 2 per row and per column."""

_CHUNK_TILES = (
    1 << 16
)  # tiles scored at once by the projection (90 float64 scores each)


def tile_candidates(device: torch.device | str | None = None) -> Tensor:
    """The ``(90, 16)`` bool table of the transposable tiles, position ``4 * row + col``."""
    return tile_patterns(True).to(device)


def as_tiles(rows: Tensor) -> Tensor:
    """A 2-D tensor (both dimensions multiples of 4) as ``(tiles, 16)``, tiles in row-major
    order, each tile's entries at ``4 * row + col``."""
    r, c = rows.shape
    return rows.reshape(r // 4, 4, c // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def from_tiles(tiles: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """The inverse of :func:`as_tiles`: ``(tiles, 16)`` back to the 2-D ``shape``."""
    r, c = shape
    return tiles.reshape(r // 4, c // 4, 4, 4).permute(0, 2, 1, 3).reshape(r, c)


def tile_indices(mask: Tensor) -> Tensor:
    """The index (in :func:`tile_candidates`) of every 4x4 tile of the 2-D bool ``mask``, flat
    ``int64`` in row-major tile order; a ``ValueError`` if a tile is not one of the 90."""
    codes = tile_tables(mask.device).codes  # ascending, in the order of the table
    found = tile_codes(mask)
    index = torch.searchsorted(codes, found).clamp_(max=TILE_CANDIDATES - 1)
    if not bool((codes[index] == found).all()):
        raise ValueError(
            f"a mask of shape {tuple(mask.shape)} has 4x4 tiles that do not keep exactly 2 "
            f"per row and per column, so they match no transposable 2:4 tile"
        )
    return index


def tiles_to_mask(indices: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """The 2-D bool mask of ``shape`` whose tiles are the patterns ``indices``."""
    return from_tiles(tile_candidates(indices.device)[indices], shape)


@functools.cache
def _row_selector(device: torch.device) -> Tensor:
    """``(24, 90)`` float64: column ``k`` has a one at ``6 * row + pattern`` for each of tile
    ``k``'s 4 rows, ``pattern`` the 2:4 candidate that row keeps."""
    rows = pattern_indices(tile_patterns(True), NM(2, 4)).view(TILE_CANDIDATES, 4)
    selector = torch.zeros(4 * candidate_count(NM(2, 4)), TILE_CANDIDATES)
    selector[rows + 6 * torch.arange(4), torch.arange(TILE_CANDIDATES)[:, None]] = 1.0
    return selector.to(device, torch.float64)


def project_to_tiles(scores: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Per 4x4 tile of a 2-D weight of ``shape`` (rows), the index of the transposable tile
    whose rows' 2:4 patterns have the largest summed score; ``scores`` is ``(groups, 6)``, one
    score per candidate pattern of every group of 4 along the rows (in row order). Sums in
    float64 (no TF32 shortcut); ties go to the first tile of :func:`tile_candidates`."""
    r, c = shape
    per_tile = scores.reshape(r // 4, 4, c // 4, 6).permute(0, 2, 1, 3).reshape(-1, 24)
    selector = _row_selector(scores.device)
    out = torch.empty(per_tile.shape[0], dtype=torch.int64, device=scores.device)
    for start in range(0, per_tile.shape[0], _CHUNK_TILES):
        chunk = per_tile[start : start + _CHUNK_TILES].to(torch.float64)
        out[start : start + _CHUNK_TILES] = (chunk @ selector).argmax(1)
    return out
