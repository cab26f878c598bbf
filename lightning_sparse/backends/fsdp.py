"""FSDP2 and the 2:4 kernels: the weight a ``fully_shard`` ed layer's forward multiplies.

``fully_shard`` stores each parameter as a DTensor shard and, between its module's pre-forward
and post-backward, hands the module the unsharded (all-gathered) tensor instead: a plain tensor
of the whole shape, in the ``MixedPrecisionPolicy``'s ``param_dtype`` where it sets one. So a
sharded layer's forward sees a whole weight, which the 2:4 kernels can run; its dense weight
gradient reaches that tensor, which FSDP2 reduce-scatters as usual. :func:`gathered_weight`
says, at fit start, how a sharded parameter will reach its forward, or why it will not as a
plain tensor (tensor parallelism: a DTensor reaches the forward).

FSDP2 has no public way to ask which parameters it manages; :func:`gathered_weight` reads its
per-module state (``torch.distributed._composable_state``), and a torch release that lays that
state out otherwise is named as the reason, never guessed at.

Example:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(8, 4)
    >>> gathered_weight(layer.weight)  # a plain tensor is its own
    GatheredWeight(shape=(4, 8), dtype=torch.float32, shards=None)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

if torch.distributed.is_available():
    from torch.distributed import _composable_state
    from torch.distributed.tensor import DTensor
else:  # pragma: no cover - builds without torch.distributed
    _composable_state = None  # type: ignore[assignment]
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class GatheredWeight:
    """The weight a layer's forward multiplies: its whole shape, its dtype there (FSDP2's
    ``param_dtype`` where a ``MixedPrecisionPolicy`` sets one), and for a parameter that
    FSDP2 shards, over how many ranks (``None``: a plain tensor, multiplied as stored)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shards: int | None = None

    def describe(self) -> str:
        """How the weight reaches the forward, for the fit-start table (empty when stored so).

        Example:
            >>> GatheredWeight((4096, 1024), torch.bfloat16, 8).describe()
            'on the bfloat16 weight FSDP2 gathers from 8 shards'
        """
        if self.shards is None:
            return ""
        dtype = str(self.dtype).removeprefix("torch.")
        shards = f"{self.shards} shard" + ("s" if self.shards != 1 else "")
        return f"on the {dtype} weight FSDP2 gathers from {shards}"


def gathered_weight(weight: Tensor) -> GatheredWeight | str:
    """How ``weight`` reaches its layer's forward: itself for a plain tensor; for a DTensor
    that ``fully_shard`` manages (not combined with tensor parallelism), the whole tensor
    FSDP2 gathers, in its ``param_dtype``; else why the forward sees a DTensor."""
    if DTensor is None or not isinstance(weight, DTensor):
        return GatheredWeight(tuple(weight.shape), weight.dtype)
    managed = _fsdp_param(weight)
    if isinstance(managed, str):
        return managed
    if managed is None:
        return (
            f"a {_placements(weight)} DTensor not sharded by FSDP2 (fully_shard), e.g. by "
            f"tensor parallelism: the forward multiplies a DTensor, and the 2:4 kernels "
            f"take plain tensors"
        )
    if getattr(managed, "is_dtensor", False):
        return (
            "sharded by FSDP2 over a tensor-parallel DTensor (a 2-D mesh): the forward "
            "multiplies a DTensor, and the 2:4 kernels take plain tensors"
        )
    cast = managed.mp_policy.param_dtype  # type: ignore[attr-defined]
    dtype = (
        cast if cast is not None and weight.dtype.is_floating_point else weight.dtype
    )
    shards = weight.device_mesh.size()  # type: ignore[attr-defined]
    return GatheredWeight(tuple(weight.shape), dtype, shards)


def _placements(weight: Tensor) -> str:
    return "".join(map(str, weight.placements))  # type: ignore[attr-defined]


def _fsdp_param(weight: Tensor) -> object | str | None:
    """FSDP2's record of the sharded parameter ``weight`` (an ``FSDPParam``), ``None`` where
    no ``fully_shard`` manages it, or why this torch's FSDP2 state cannot be read."""
    try:
        for record in _fsdp_params():
            if record.sharded_param is weight:  # type: ignore[attr-defined]
                return record
    except AttributeError as err:
        return (
            f"sharded by FSDP2, whose state this torch ({torch.__version__}) lays out "
            f"otherwise ({err}): the weight its forward sees is unknown, so no 2:4 kernel"
        )
    return None


def _fsdp_params() -> Iterator[object]:
    """Every parameter record of every ``fully_shard`` in this process."""
    if _composable_state is None:
        return
    for ref in list(_composable_state._module_state_mapping.values()):
        state = ref()
        if state is None or not hasattr(state, "_fsdp_param_group"):
            continue  # another composable API's state (e.g. replicate)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch releases with one group per fully_shard
            groups = (
                [] if state._fsdp_param_group is None else [state._fsdp_param_group]
            )
        for group in groups:
            yield from group.fsdp_params
