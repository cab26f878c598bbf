"""Loops compiled by Numba, each the twin of a torch operation in :mod:`lightning_sparse.masks`.

Each makes one pass where the torch operations make several, and writes the same bits:
:func:`threshold_pass` (the pass of :func:`~lightning_sparse.masks.top_k.mark_top_k`),
:func:`multiply`, :func:`multiply_where` and :func:`zero_where` (masking weights, gradients and
optimizer state), :func:`refill_groups` and :func:`refill_tiles` (the refills of
:mod:`~lightning_sparse.masks.refill`). They take NumPy views of float32 or float64 tensors,
with bool masks viewed as ``uint8`` (or ``uint32`` words); :mod:`lightning_sparse.kernels` is
their only caller. The first call for a signature compiles (under a second) and caches the
machine code next to this file, or in Numba's user cache directory when that is read-only.

Example:
    >>> import numpy as np
    >>> x = np.array([0.5, -3.0, 2.0, -0.1], dtype=np.float32)
    >>> sure, band, values = np.empty(4, np.uint8), np.empty(4, np.int64), np.empty(4, x.dtype)
    >>> threshold_pass(x, None, 1, True, True, 2.5, 0.4, True, sure, band, values, 0, 0)
    (1, 2, 4)
    >>> sure.tolist(), band[:2].tolist(), values[:2].tolist()
    ([0, 1, 0, 0], [0, 2], [0.5, 2.0])
"""

from __future__ import annotations

import numpy as np
from numba import njit

BLOCK = 2048
"""Entries per block of :func:`threshold_pass`: its band flags stay in the L1 cache."""


@njit(cache=True, nogil=True, boundscheck=False)
def threshold_pass(
    x,
    flags,
    keep,
    magnitude,
    largest,
    inner,
    outer,
    has_outer,
    sure,
    band,
    band_values,
    n_band,
    start,
):
    """One pass over the flat float array ``x`` (values, or ``|x|`` with ``magnitude``) from
    entry ``start`` (a multiple of :data:`BLOCK`): marks in ``sure`` (uint8, as long as ``x``)
    the eligible entries beyond ``inner`` (``> inner``, or ``< inner`` unless ``largest``) and
    lists in ``band`` (int64), after its first ``n_band`` entries, the eligible ones at or
    beyond ``outer`` but not beyond ``inner`` (every eligible one that is not sure, without
    ``has_outer``), and their values (or ``|x|``) in ``band_values`` (as long as ``band``).
    Eligible: where ``flags`` (uint8) equals ``keep``, or everywhere if ``flags`` is ``None``
    (compiled separately). NaN is beyond nothing.

    Returns ``(sure count, band count, stop)``: ``stop`` is ``len(x)``, or the start of the
    block whose band entries did not fit in ``band`` (call again from there with longer
    ``band`` and ``band_values`` holding the entries listed so far; the counts are of the
    entries before ``stop``)."""
    n = x.shape[0]
    n_sure = 0
    hits = np.empty(BLOCK, np.uint8)  # a block's band flags
    words = hits.view(np.uint64)
    flip = np.uint8(not keep)  # eligible: flag ^ flip
    no_outer = np.uint8(not has_outer)
    # (selects and uint8 arithmetic, no branches, index into block slices: the inner loop
    # vectorizes; a branch on ``magnitude`` or indexing ``flags[first + j]`` would stop that)
    for first in range(start, n, BLOCK):
        length = min(BLOCK, n - first)
        xs = x[first : first + length]
        ss = sure[first : first + length]
        fs = ss if flags is None else flags[first : first + length]
        in_band = 0
        block_sure = 0
        for j in range(length):
            v = abs(xs[j]) if magnitude else xs[j]
            eligible = np.uint8(1) if flags is None else fs[j] ^ flip
            beyond = np.uint8((v > inner) if largest else (v < inner))
            at_outer = np.uint8((v >= outer) if largest else (v <= outer))
            s = eligible & beyond
            b = eligible & (beyond ^ np.uint8(1)) & (at_outer | no_outer)
            ss[j] = s
            hits[j] = b
            block_sure += s
            in_band += b
        if n_band + in_band > band.shape[0]:
            return n_sure, n_band, first
        n_sure += block_sure
        if in_band:
            if length < BLOCK:  # the last block: no stale flags past its end
                hits[length:] = 0
            n_band = _list_band(xs, magnitude, words, first, band, band_values, n_band)
    return n_sure, n_band, n


_BYTE_BITS = np.uint64(0x0102040810204080)
"""Multiplying 8 bytes of 0/1 (a uint64, little-endian) by this puts byte ``i`` at bit 56 + i."""
_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
"""A de Bruijn sequence: the top 6 bits of ``2**i`` times it (mod 2**64) differ for every
``i`` < 64, so they index :data:`_LOWEST_BIT`."""
_LOWEST_BIT = np.zeros(64, np.int64)
for _i in range(64):
    _LOWEST_BIT[((int(_DE_BRUIJN) << _i) % (1 << 64)) >> 58] = _i


@njit(inline="always", boundscheck=False)
def _list_band(xs, magnitude, words, first, band, band_values, n_band):
    """Lists the band entries of a block (``words``: its flags, 8 bytes of 0/1 per uint64)
    after the first ``n_band`` of ``band``, 64 flags at a time as the bits of one word, set
    bit by set bit: a loop per band entry, not per flag.
    Returns the new ``n_band``."""
    for group in range(words.shape[0] // 8):
        bits = np.uint64(0)
        for q in range(8):
            flags = words[8 * group + q]
            bits |= ((flags * _BYTE_BITS) >> np.uint64(56)) << np.uint64(8 * q)
        while bits:
            lowest = bits & (~bits + np.uint64(1))
            j = 64 * group + _LOWEST_BIT[(lowest * _DE_BRUIJN) >> np.uint64(58)]
            v = xs[j]
            band[n_band] = first + j
            band_values[n_band] = abs(v) if magnitude else v
            n_band += 1
            bits ^= lowest
    return n_band


@njit(cache=True, nogil=True, boundscheck=False)
def multiply(values, mask):
    """``values *= mask`` (flat arrays of one length; the mask as uint8): a pruned value
    becomes a zero of its sign, as ``torch.mul_`` writes."""
    for j in range(mask.shape[0]):
        values[j] = values[j] * mask[j]


@njit(cache=True, nogil=True, boundscheck=False)
def multiply_where(values, mask, changed):
    """``values *= mask`` where ``changed`` is set (flat arrays of one length; masks as uint8):
    a dropped value becomes a zero of its sign, as multiplying by the mask writes."""
    for j in range(changed.shape[0]):
        values[j] = values[j] * mask[j] if changed[j] else values[j]


@njit(cache=True, nogil=True, boundscheck=False)
def zero_where(values, changed):
    """``values`` becomes ``+0.0`` where ``changed`` (uint8, as long) is set."""
    for j in range(changed.shape[0]):
        values[j] = 0 if changed[j] else values[j]


_MIX = tuple(
    np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)
"""SplitMix64's increment and its mixer's two multipliers."""


@njit(cache=True, nogil=True)
def splitmix_bits(index, offset):
    """53 uniform random bits from an index and a seed's ``offset`` (uint64): the bits of
    :func:`~lightning_sparse.masks.refill.position_bits` (SplitMix64's mixer)."""
    x = np.uint64(index) * _MIX[0] + offset
    x = (x ^ (x >> np.uint64(30))) * _MIX[1]
    x = (x ^ (x >> np.uint64(27))) * _MIX[2]
    x = x ^ (x >> np.uint64(31))
    return x >> np.uint64(11)


def refill_groups(mask, changed, n, keys, magnitude, offset) -> None:
    """Per group of ``m`` (a row of the uint8 ``(groups, m)`` arrays), in place: ``mask`` holds
    the group before the drop and ``changed`` the dropped entries (a subset); the group keeps
    its survivors and takes the free positions that bring it back to ``n`` (none where it
    holds ``n`` already), and ``changed`` becomes the entries whose flag changed. The taken
    positions are the highest float64 ``keys`` (``|keys|`` with ``magnitude``; shaped like
    ``mask``), or with ``keys`` ``None`` the highest :func:`splitmix_bits` of the flat
    position, ranked as :func:`~lightning_sparse.masks.refill.refill_groups_` ranks them for ``m <= 8``: by pairwise ``>``, the lower
    column first on a tie, NaN as ``-inf``, survivors above all. Groups of 2 and 8 run a
    loop compiled for their size (the compiler unrolls it), groups of 4 one written out for
    them (:func:`_refill_groups_of_4`)."""
    kernel = _GROUP_KERNELS.get(mask.shape[1], _GROUP_KERNELS[0])
    kernel(mask, changed, n, keys, magnitude, offset)


_FOUR_BYTES = np.uint32(0x01010101)
"""Multiplying a uint32 of 4 bytes by this sums them into its top byte."""


@njit(inline="always")
def _group_score(keys, g, c, m, magnitude, offset, taken):
    """Entry ``c`` of group ``g`` (of ``m``) as :func:`refill_groups` ranks it: ``inf`` if
    ``taken``."""
    if keys is None:
        v = np.float64(splitmix_bits(g * m + c, offset))
    else:
        v = np.float64(abs(keys[g, c]) if magnitude else keys[g, c])
        v = -np.inf if np.isnan(v) else v
    return np.inf if taken else v


@njit(cache=True, nogil=True, boundscheck=False)
def _refill_groups_of_4(mask, changed, n, keys, magnitude, offset):
    """:func:`refill_groups` for groups of 4 (C-contiguous arrays): the drop on words of 4
    flags, and the ranking of each short group in registers (12 comparisons, no loops)."""
    words = mask.view(np.uint32).reshape(-1)
    lost = changed.view(np.uint32).reshape(-1)
    short = np.empty(BLOCK, np.int64)
    groups = words.shape[0]
    one = np.uint8(1)
    for first in range(0, groups, BLOCK):
        n_short = 0
        for g in range(first, min(first + BLOCK, groups)):
            survivors = words[g] & ~lost[g]
            words[g] = survivors
            # the sum of the 4 flag bytes lands in the top byte (in either byte order)
            kept = ((survivors * _FOUR_BYTES) >> np.uint32(24)) & np.uint32(0xFF)
            short[n_short] = g
            n_short += kept < n
        for g in short[:n_short]:
            t0, t1, t2, t3 = mask[g, 0], mask[g, 1], mask[g, 2], mask[g, 3]
            s0 = _group_score(keys, g, 0, 4, magnitude, offset, t0 != 0)
            s1 = _group_score(keys, g, 1, 4, magnitude, offset, t1 != 0)
            s2 = _group_score(keys, g, 2, 4, magnitude, offset, t2 != 0)
            s3 = _group_score(keys, g, 3, 4, magnitude, offset, t3 != 0)
            # ahead of c: higher, or as high and to its left
            a0 = np.int64(s1 > s0) + np.int64(s2 > s0) + np.int64(s3 > s0)
            a1 = np.int64(s0 >= s1) + np.int64(s2 > s1) + np.int64(s3 > s1)
            a2 = np.int64(s0 >= s2) + np.int64(s1 >= s2) + np.int64(s3 > s2)
            a3 = np.int64(s0 >= s3) + np.int64(s1 >= s3) + np.int64(s2 >= s3)
            g0 = np.uint8(a0 < n) & (t0 ^ one)
            g1 = np.uint8(a1 < n) & (t1 ^ one)
            g2 = np.uint8(a2 < n) & (t2 ^ one)
            g3 = np.uint8(a3 < n) & (t3 ^ one)
            mask[g, 0], mask[g, 1] = t0 | g0, t1 | g1
            mask[g, 2], mask[g, 3] = t2 | g2, t3 | g3
            changed[g, 0] ^= g0
            changed[g, 1] ^= g1
            changed[g, 2] ^= g2
            changed[g, 3] ^= g3


@njit(inline="always", boundscheck=False)
def _refill_groups(m, mask, changed, n, keys, magnitude, offset):
    scores = np.empty(m)
    short = np.empty(BLOCK, np.int64)
    groups = mask.shape[0]
    # per block: drop, and list the groups that lost some (a store per group, not a branch:
    # about half of them did, at random), then refill the listed ones
    for first in range(0, groups, BLOCK):
        n_short = 0
        for g in range(first, min(first + BLOCK, groups)):
            kept = 0
            for c in range(m):
                survives = mask[g, c] & (changed[g, c] ^ np.uint8(1))
                mask[g, c] = survives
                kept += survives
            short[n_short] = g
            n_short += kept < n
        for g in short[:n_short]:
            for c in range(m):
                taken = mask[g, c] != 0
                scores[c] = _group_score(keys, g, c, m, magnitude, offset, taken)
            for c in range(m):  # ahead of c: higher, or as high and to its left
                ahead = 0
                for d in range(c):
                    ahead += scores[d] >= scores[c]
                for d in range(c + 1, m):
                    ahead += scores[d] > scores[c]
                grow = np.uint8((ahead < n) & (mask[g, c] == 0))
                mask[g, c] |= grow
                changed[g, c] ^= grow


def _group_kernel(m: int):
    """:func:`refill_groups` compiled for groups of ``m`` (0: any size, read from the shape)."""

    @njit(cache=True, nogil=True, boundscheck=False)
    def kernel(mask, changed, n, keys, magnitude, offset):
        size = m if m else mask.shape[1]
        _refill_groups(size, mask, changed, n, keys, magnitude, offset)

    return kernel


_GROUP_KERNELS = {m: _group_kernel(m) for m in (0, 2, 8)}
_GROUP_KERNELS[4] = _refill_groups_of_4


_NIBBLE = np.uint32(0x01020408)
"""Multiplying 4 bytes of 0/1 (a uint32, little-endian) by this puts them as 4 bits at bit 24."""
_SPREAD, _BYTES = np.uint32(0x00204081), np.uint32(0x01010101)
"""And back: multiplying 4 bits by ``_SPREAD`` puts copies at bits 0, 7, 14 and 21 (no two
overlap), so bit ``i`` of copy ``i`` lands at bit ``8 * i``; ``_BYTES`` keeps those."""
_LOW4 = np.uint32(0xF)


@njit(cache=True, nogil=True, boundscheck=False)
def refill_tiles(
    mask, changed, keys, magnitude, offset, codes, count, first, completions, pairs
):
    """Per 4x4 tile of a transposable 2:4 mask, in place: ``mask`` holds the tile before the
    drop and ``changed`` the dropped entries (a subset), both bool masks seen as uint32 words
    of 4 flags, ``(rows, cols // 4)``; the tile becomes its survivors plus the completion to
    regrow, and ``changed`` the entries whose flag changed (a tile with a single completion
    regrows what it dropped, so it does not change). The completion has the largest total of
    float64 ``keys`` (``|keys|`` with ``magnitude``; 2-D like the mask) summed as the torch
    path sums them (the pair of each row, then the rows in order), ties and NaN to the first
    as ``argmax`` takes them; or, with ``keys`` ``None``, one drawn by :func:`splitmix_bits` of
    the tile's index. ``codes``/``count``/``first``/``completions``/``pairs`` are the tables of
    :mod:`~lightning_sparse.masks.refill` (``pairs``: ``completion_pairs``; any
    integer dtypes). Returns how many tile rows (4 rows of the mask) were refilled: fewer than
    ``rows // 4`` if the survivors of a tile in the next one fit no pattern (that tile row
    and those after it are left as they were). Little-endian machines only.

    A tile row (4 rows of the mask) at a time, in three loops: the survivor codes of its tiles
    from the flag words, and the new tiles back into words, each in vector instructions over
    the tile row's words; in between, each tile's completion is chosen (by ``keys``, only for
    the tiles with more than one: a list, not a branch). The choice is written out in the
    loop: Numba compiles an inlined helper for it into slower code."""
    rows, per_row = mask.shape
    sums = np.empty(24)
    survivors = np.empty(per_row, np.uint32)  # the tiles' survivor codes
    tiles = np.empty(per_row, np.uint32)  # and their new codes
    several = np.empty(per_row, np.int64)  # the tiles with a choice (with keys)
    for tile_row in range(rows // 4):
        top = 4 * tile_row
        m0, m1, m2, m3 = mask[top], mask[top + 1], mask[top + 2], mask[top + 3]
        c0, c1, c2, c3 = (
            changed[top],
            changed[top + 1],
            changed[top + 2],
            changed[top + 3],
        )
        for t in range(per_row):
            n0 = ((m0[t] & ~c0[t]) * _NIBBLE) >> np.uint32(24)
            n1 = ((m1[t] & ~c1[t]) * _NIBBLE) >> np.uint32(24)
            n2 = ((m2[t] & ~c2[t]) * _NIBBLE) >> np.uint32(24)
            n3 = ((m3[t] & ~c3[t]) * _NIBBLE) >> np.uint32(24)
            survivors[t] = (
                (n0 & _LOW4)
                | ((n1 & _LOW4) << np.uint32(4))
                | ((n2 & _LOW4) << np.uint32(8))
                | ((n3 & _LOW4) << np.uint32(12))
            )
        fits = True
        if keys is None:
            for t in range(per_row):
                code = survivors[t]
                n = np.int64(count[code])
                fits &= n != 0
                bits = splitmix_bits(tile_row * per_row + t, offset)
                pick = np.int64((bits * np.uint64(n)) >> np.uint64(53))
                tiles[t] = codes[completions[np.int64(first[code]) + pick]]
            if not fits:
                return tile_row
        else:
            n_several = 0
            for t in range(per_row):  # the first completion; list the tiles with more
                code = survivors[t]
                n = count[code]
                fits &= n != 0
                tiles[t] = codes[completions[first[code]]]
                several[n_several] = t
                n_several += n > 1  # (a store, no branch)
            if not fits:
                return tile_row
            for t in several[:n_several]:
                code = survivors[t]
                n = np.int64(count[code])
                start = np.int64(first[code])
                left = 4 * t
                check = 0.0
                for r in range(4):  # the sums of the 6 column pairs of each row
                    a = np.float64(keys[top + r, left])
                    b = np.float64(keys[top + r, left + 1])
                    c = np.float64(keys[top + r, left + 2])
                    d = np.float64(keys[top + r, left + 3])
                    if magnitude:
                        a, b, c, d = abs(a), abs(b), abs(c), abs(d)
                    # (in the order of refill.PAIR_COLUMNS, written out rather than indexed)
                    s = 6 * r
                    sums[s], sums[s + 1], sums[s + 2] = a + b, a + c, a + d
                    sums[s + 3], sums[s + 4], sums[s + 5] = b + c, b + d, c + d
                    check += (a + b) + (c + d)  # NaN if a key of the row is
                if np.isnan(check):
                    best = _first_best_or_nan(sums, start, n, pairs)
                else:
                    best = _first_best(sums, start, n, pairs)
                tiles[t] = codes[completions[best]]
        for r in range(4):
            kept_row, changed_row = mask[top + r], changed[top + r]
            shift = np.uint32(4 * r)
            for t in range(per_row):
                kept = (tiles[t] >> shift) & _LOW4
                added = ((tiles[t] & ~survivors[t]) >> shift) & _LOW4
                kept_row[t] = (kept * _SPREAD) & _BYTES
                changed_row[t] ^= (added * _SPREAD) & _BYTES
    return rows // 4


@njit(inline="always", boundscheck=False)
def _total(sums, pairs, i):
    """Completion ``i``'s total: it keeps pair ``pairs[i, r] - 6 * r`` of row ``r``."""
    total = sums[pairs[i, 0]] + sums[pairs[i, 1]]
    return total + sums[pairs[i, 2]] + sums[pairs[i, 3]]


@njit(inline="always", boundscheck=False)
def _first_best(sums, start, n, pairs):
    """The first of completions ``start, ..., start + n - 1`` with the largest total (no NaN
    among the sums), chosen by selects: which one wins is unpredictable."""
    best, best_total = start, _total(sums, pairs, start)
    for i in range(start + 1, start + n):
        total = _total(sums, pairs, i)
        better = total > best_total
        best = i if better else best
        best_total = total if better else best_total
    return best


@njit(boundscheck=False)
def _first_best_or_nan(sums, start, n, pairs):
    """:func:`_first_best` as ``argmax`` takes it when NaN may occur: the first NaN total."""
    best, best_total = start, _total(sums, pairs, start)
    for i in range(start + 1, start + n):
        if np.isnan(best_total):
            break
        total = _total(sums, pairs, i)
        if total > best_total or np.isnan(total):
            best, best_total = i, total
    return best
