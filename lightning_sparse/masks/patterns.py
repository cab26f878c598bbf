"""Sparsity targets and their layout: unstructured fractions and N:M patterns.

Structured (N:M) masks group ``M`` consecutive weights along the input dimension, i.e. along
the last axis of the weight viewed as ``(out_features, -1)``.

Example:
    >>> NM(2, 4).sparsity, describe(NM(2, 4)), describe(0.75), num_kept(8, 0.75)
    (0.5, '2:4', '75%', 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NM:
    """An N:M pattern: ``n`` weights kept out of every ``m`` consecutive along the input dim."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (0 < self.n < self.m):
            raise ValueError(
                f"sparsity='{self.n}:{self.m}' is impossible: N:M keeps N of every M weights, so "
                f"it needs 0 < N < M (for example '2:4')"
            )

    @property
    def sparsity(self) -> float:
        """Fraction of weights pruned."""
        return 1.0 - self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


Sparsity = float | NM
"""A target: a fraction of zeros in [0, 1) (unstructured) or an :class:`NM` pattern."""


def sparsity_fraction(target: Sparsity) -> float:
    """The fraction of zeros a target asks for."""
    return target.sparsity if isinstance(target, NM) else float(target)


def describe(target: Sparsity) -> str:
    """Human-readable target: ``'2:4'``, ``'70%'`` or ``'dense'``."""
    if isinstance(target, NM):
        return str(target)
    return (
        "dense"
        if target == 0
        else f"{target:.0%}"
        if round(target * 100, 6).is_integer()
        else f"{target:.2%}"
    )


def nm_groups(tensor: Tensor, m: int) -> Tensor:
    """View ``tensor`` as ``(out, in_groups, m)``: groups of ``m`` along the input dimension."""
    flat = tensor.reshape(tensor.shape[0], -1)
    if flat.shape[1] % m:
        raise ValueError(
            f"a weight of shape {tuple(tensor.shape)} has {flat.shape[1]} inputs per output, "
            f"not a multiple of M={m}"
        )
    return flat.reshape(flat.shape[0], flat.shape[1] // m, m)


def num_kept(numel: int, sparsity: float) -> int:
    """How many of ``numel`` weights an unstructured ``sparsity`` keeps (rounded to nearest)."""
    return numel - round(sparsity * numel)


def is_nm(mask: Tensor, target: NM) -> bool:
    """Whether at most ``n`` of every ``m`` along the input dimension are kept."""
    return bool((nm_groups(mask, target.m).sum(-1) <= target.n).all())


def not_a_mask(value: object) -> str | None:
    """Why ``value`` (read from a file) is not a mask, a dense bool tensor; ``None`` if it is.

    >>> not_a_mask(torch.ones(2, dtype=torch.bool)), not_a_mask(torch.ones(2))
    (None, 'a torch.float32 torch.strided tensor, not a dense bool tensor')
    """
    if not isinstance(value, Tensor):
        return f"a {type(value).__name__}, not a dense bool tensor"
    if value.dtype != torch.bool or value.layout != torch.strided:
        return f"a {value.dtype} {value.layout} tensor, not a dense bool tensor"
    return None
