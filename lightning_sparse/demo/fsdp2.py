"""FSDP2 as LLM training runs it: ``fully_shard`` per decoder block, then the root, with
FSDP2's mixed precision, each block compiled on its own (as torchtitan and litgpt do).

Call :func:`shard_per_block` in ``LightningModule.configure_model`` under Lightning's
``ModelParallelStrategy``. Parameters stay float32 shards (the optimizer and the masks work on
them); each block's forward gets its weights gathered in ``param_dtype`` (bfloat16: what the
2:4 kernels run), and gradients are reduce-scattered in ``reduce_dtype``. FSDP2's collectives
run between the compiled blocks, outside their graphs.

Example (one process, gloo):
    >>> import torch, torch.distributed as dist
    >>> from torch import nn
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> class Block(nn.Linear): pass
    >>> net = nn.Sequential(Block(8, 8), Block(8, 8))
    >>> net._no_split_modules = ["Block"]  # as transformers models declare their blocks
    >>> blocks = shard_per_block(net, init_device_mesh("cpu", (1,)), "bfloat16", "float32")
    >>> len(blocks), type(net[0].weight).__name__, net[0].weight.dtype
    (2, 'DTensor', torch.float32)
    >>> net(torch.ones(1, 8)).dtype  # the gathered weights: bfloat16
    torch.bfloat16
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_sparse.demo._checks import check_choice

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a demo model's ``param_dtype`` and ``reduce_dtype`` name."""


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: modules of the classes it lists in ``_no_split_modules`` (what
    ``transformers`` models declare must not be split across devices, e.g.
    ``LlamaDecoderLayer``), in model order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} declares no blocks (_no_split_modules: "
            f"{sorted(names)}): FSDP2 shards per block; use a model that lists its block "
            f"classes, as transformers models do"
        )
    return blocks


def shard_per_block(
    model: nn.Module, mesh: DeviceMesh, param_dtype: str, reduce_dtype: str
) -> list[nn.Module]:
    """``fully_shard`` every block of ``model`` (:func:`decoder_blocks`), then ``model``, over
    ``mesh`` with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``; return the blocks."""
    policy = MixedPrecisionPolicy(
        param_dtype=_dtype("param_dtype", param_dtype),
        reduce_dtype=_dtype("reduce_dtype", reduce_dtype),
    )
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return blocks


def _dtype(name: str, value: str) -> torch.dtype:
    return getattr(torch, check_choice(name, value, DTYPES))


__all__ = ["DTYPES", "decoder_blocks", "shard_per_block"]
