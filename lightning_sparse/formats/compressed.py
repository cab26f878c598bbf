"""Compressed exports of a sparse model: a portable file, and 2:4 sparse tensors for GPU inference.

:func:`save_compressed` writes a safetensors file in which every floating weight of two or more
dimensions that is smaller stored sparse is stored as its non-zero values (in row-major order)
plus a bitmask of where they sit (1 bit per weight, packed little-endian into bytes); other
tensors are stored as they are. The metadata names the sparse tensors, their shapes, and the
N:M pattern they satisfy (``"2:4"``), if any. :func:`load_compressed` rebuilds the dense state
dict, equal to what was saved (a pruned ``-0.0`` comes back as ``0.0``). Any safetensors reader
can open the file; the layout is described in the ``format`` metadata entry.

:func:`to_semi_structured` swaps 2:4-sparse ``nn.Linear`` weights for PyTorch's
``SparseSemiStructuredTensor`` (CUDA, sparse tensor cores) for inference.

Example:
    >>> import tempfile, torch
    >>> state = {"w": torch.tensor([[0.0, 1.5, 0.0, -2.0]] * 4), "b": torch.ones(4)}
    >>> path = tempfile.mkdtemp() + "/model.safetensors"
    >>> size = save_compressed(state, path, verbose=False)
    >>> sorted(size.sparse), torch.equal(load_compressed(path)["w"], state["w"])
    (['w'], True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_sparse.formats.export import export_state_dict
from lightning_sparse.masks import NM, is_nm

FORMAT = "lightning_sparse.formats.compressed/1"
LAYOUT = (
    "sparse tensor <name>: '<name>::values' (the non-zero values, row-major) and "
    "'<name>::bitmask' (uint8; bit j of byte i is element 8*i+j of the flattened tensor, "
    "1 = non-zero); shapes and N:M patterns in the 'sparse' metadata entry"
)
_SEP = "::"
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as packed bytes (little-endian bit order, padded with zeros).

    >>> pack_bits(torch.tensor([True, False, False, True, False, False, False, False, True])).tolist()
    [9, 1]
    """
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _BITS.to(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` bits of :func:`pack_bits` output, as a flat bool tensor."""
    bits = packed.reshape(-1, 1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:numel]


@dataclass
class CompressedSize:
    """What :func:`save_compressed` wrote: bytes dense vs stored, per tensor and in total."""

    path: Path
    file_bytes: int
    dense_bytes: int = 0
    stored_bytes: int = 0
    sparse: dict[str, tuple[int, int, str | None]] = field(default_factory=dict)
    """name -> (dense bytes, stored bytes, N:M pattern or None), for tensors stored sparse."""

    def __str__(self) -> str:
        lines = [f"{'tensor':<40} {'dense':>10} {'stored':>10}  pattern"]
        for name, (dense, stored, pattern) in self.sparse.items():
            lines.append(
                f"{name:<40} {_size(dense):>10} {_size(stored):>10}  {pattern or '-'}"
            )
        lines.append(
            f"{'all tensors':<40} {_size(self.dense_bytes):>10} "
            f"{_size(self.stored_bytes):>10}  ({self.stored_bytes / max(self.dense_bytes, 1):.0%} "
            f"of dense); file {self.path} {_size(self.file_bytes)}"
        )
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _nm_pattern(nonzero: Tensor) -> str | None:
    target = NM(2, 4)
    flat = nonzero.reshape(nonzero.shape[0], -1)
    if flat.shape[1] % target.m or not is_nm(flat, target):
        return None
    return str(target)


def save_compressed(
    source: pl.Trainer | Mapping[str, Any] | str | Path,
    path: str | Path,
    verbose: bool = True,
) -> CompressedSize:
    """Write a compressed safetensors file of the model's weights with the masks folded in.

    Args:
        source: a Trainer, a checkpoint (dict or path) written with
            :class:`~lightning_sparse.SparsityCallback` (its masks are folded in first, as in
            :func:`~lightning_sparse.export_state_dict`), or a plain state dict. With sharded
            parameters (FSDP2), call ``state = export_state_dict(trainer)`` on every rank and
            ``save_compressed(state, path)`` on rank 0.
        path: the file to write (conventionally ``*.safetensors``).
        verbose: print the sizes (per sparse tensor and in total).
    """
    from safetensors.torch import save_file

    if isinstance(source, Mapping) and "state_dict" not in source:
        state = dict(source)
    else:
        state = export_state_dict(source)
    tensors: dict[str, Tensor] = {}
    sparse_meta: dict[str, dict[str, Any]] = {}
    size = CompressedSize(Path(path), 0)
    seen_storage: set[int] = set()
    for name, value in state.items():
        if _SEP in name:
            raise ValueError(
                f"state dict key {name!r} contains {_SEP!r}, which this format reserves for "
                f"sparse tensors' parts; rename the parameter"
            )
        tensor = value.detach().cpu()
        dense = tensor.numel() * tensor.element_size()
        size.dense_bytes += dense
        nonzero = tensor != 0
        nnz = int(nonzero.sum())
        sparse = nnz * tensor.element_size() + (tensor.numel() + 7) // 8
        if tensor.is_floating_point() and tensor.ndim >= 2 and sparse < dense:
            pattern = _nm_pattern(nonzero)
            tensors[f"{name}{_SEP}values"] = tensor[nonzero].contiguous()
            tensors[f"{name}{_SEP}bitmask"] = pack_bits(nonzero)
            sparse_meta[name] = {"shape": list(tensor.shape), "pattern": pattern}
            size.sparse[name] = (dense, sparse, pattern)
            size.stored_bytes += sparse
            continue
        storage = tensor.untyped_storage().data_ptr()
        tensor = tensor.contiguous()
        if storage in seen_storage:  # tied weights: safetensors stores no shared memory
            tensor = tensor.clone()
        seen_storage.add(storage)
        tensors[name] = tensor
        size.stored_bytes += dense
    metadata = {"format": FORMAT, "layout": LAYOUT, "sparse": json.dumps(sparse_meta)}
    save_file(tensors, str(path), metadata=metadata)
    size.file_bytes = Path(path).stat().st_size
    if verbose:
        print(size)
    return size


def load_compressed(
    path: str | Path, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Rebuild the dense state dict from a :func:`save_compressed` file (loads with
    ``model.load_state_dict(..., strict=True)`` into the plain model)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not a lightning_sparse compressed file (format="
                f"{metadata.get('format')!r}, expected {FORMAT!r}); write it with "
                f"save_compressed, or load a plain safetensors file with safetensors.torch.load_file"
            )
        sparse = json.loads(metadata["sparse"])
        names = f.keys()  # a safetensors handle is not iterable
        state = {k: f.get_tensor(k) for k in names if _SEP not in k}
        for name, info in sparse.items():
            values = f.get_tensor(f"{name}{_SEP}values")
            shape = torch.Size(info["shape"])
            nonzero = unpack_bits(f.get_tensor(f"{name}{_SEP}bitmask"), shape.numel())
            dense = torch.zeros(shape.numel(), dtype=values.dtype, device=values.device)
            dense[nonzero] = values
            state[name] = dense.view(shape)
    return state


def to_semi_structured(model: nn.Module) -> dict[str, str]:
    """Swap every 2:4-sparse ``nn.Linear`` weight for a ``SparseSemiStructuredTensor`` (inference).

    A weight is converted when it is 2:4 along the input dimension (at most 2 non-zeros in
    every group of 4, e.g. after :func:`~lightning_sparse.export_state_dict`) and PyTorch's
    ``to_sparse_semi_structured`` accepts it (a CUDA GPU with sparse tensor cores, fp16/bf16
    or int8, supported shapes). Returns, for every Linear weight, ``"converted"`` or why not.
    """
    from torch.sparse import to_sparse_semi_structured

    report: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = f"{module_name}.weight" if module_name else "weight"
        weight = module.weight.detach()
        if weight.device.type != "cuda":
            report[name] = f"on {weight.device.type}: 2:4 kernels need a CUDA device"
            continue
        if _nm_pattern(weight != 0) is None:
            report[name] = "not 2:4 sparse"
            continue
        try:
            sparse = to_sparse_semi_structured(weight)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            report[name] = f"to_sparse_semi_structured refused it: {err}"
            continue
        module.weight = nn.Parameter(sparse, requires_grad=False)
        report[name] = "converted"
    return report
