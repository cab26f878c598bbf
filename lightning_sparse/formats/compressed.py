"""Compressed exports of a sparse model: a portable safetensors file, written and read back.

:func:`save_compressed` writes a safetensors file in which every floating weight of two or more
dimensions (a float8_e8m0fnu one has no zero) that is smaller stored sparse is stored as its
non-zero values (in row-major order)
plus a bitmask of where they sit (1 bit per weight, packed little-endian into bytes); other
tensors are stored as they are. The metadata names the sparse tensors, their shapes, and the
N:M pattern they satisfy (``"2:4"``) along their layer's inputs, if any: the last axis of the
``(shape[0], -1)`` view, or, where the layer reads its inputs along another stored dimension
(Hugging Face ``Conv1D``: ``(in, out)``; a convolution: input channels), along the dimension
named by the entry's ``inputs`` (format version 2; a file with no such entry is written as
version 1, which every reader reads). :func:`load_compressed` rebuilds the dense state
dict, equal to what was saved (a pruned ``-0.0`` comes back as ``0.0``), after checking the file
against the format (see ``docs/safe-loading.md``): a damaged or crafted file raises a
``ValueError`` naming the file, the tensor and what is wrong, before any dense tensor is built.
Any safetensors reader can open the file; the layout is described in the ``layout`` metadata
entry.

The format's constants live in :mod:`~lightning_sparse.formats.compressed_layout`, the checks
of a file in :mod:`~lightning_sparse.formats.compressed_checks`.

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
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_sparse.core.layers import LayerType, layer_types
from lightning_sparse.formats.compressed_checks import (
    check_pattern,
    checked_bitmask,
    read_tensor,
    sparse_tensors,
)
from lightning_sparse.formats.compressed_layout import (
    DAMAGED,
    FORMAT_NAMES,
    LAYOUT,
    SEP,
    SPARSE_DTYPES,
    nm_pattern,
    pack_bits,
)
from lightning_sparse.formats.export import export_state_dict

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def _inputs(layer: LayerType | None, ndim: int) -> int | None:
    """The ``inputs`` entry of a tensor of ``layer``: its input dimension where that is not
    the last stored one (where it is, the v1 layout already says it)."""
    if layer is None or layer.input_dim >= ndim - 1:
        return None
    return layer.input_dim


def save_compressed(
    source: pl.Trainer | Mapping[str, Any] | str | Path,
    path: str | Path,
    verbose: bool = True,
    trusted: bool = False,
    model: nn.Module | None = None,
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
        trusted: for a checkpoint path, unpickle it in full (see
            :func:`~lightning_sparse.export_state_dict`).
        model: the module whose state this is (for a checkpoint: the LightningModule), so that
            N:M patterns are found along each layer's inputs (``Conv1D``, convolutions);
            a Trainer's own module by default. Without one, patterns are looked for along
            the last axis of each tensor's ``(shape[0], -1)`` view.
    """
    from safetensors.torch import save_file

    if isinstance(source, pl.Trainer) and model is None:
        model = source.lightning_module
    layers = {} if model is None else layer_types(model)
    if isinstance(source, Mapping) and "state_dict" not in source:
        state = dict(source)
    else:
        state = export_state_dict(source, trusted=trusted)
    tensors: dict[str, Tensor] = {}
    sparse_meta: dict[str, dict[str, Any]] = {}
    size = CompressedSize(Path(path), 0)
    seen_storage: set[int] = set()
    for name, value in state.items():
        if SEP in name:
            raise ValueError(
                f"state dict key {name!r} contains {SEP!r}, which this format reserves for "
                f"sparse tensors' parts; rename the parameter"
            )
        tensor = value.detach().cpu()
        dense = tensor.numel() * tensor.element_size()
        size.dense_bytes += dense
        nonzero = tensor != 0
        nnz = int(nonzero.sum())
        sparse = nnz * tensor.element_size() + (tensor.numel() + 7) // 8
        if tensor.dtype in SPARSE_DTYPES and tensor.ndim >= 2 and sparse < dense:
            inputs = _inputs(layers.get(name), tensor.ndim)
            pattern = nm_pattern(nonzero, inputs)
            tensors[f"{name}{SEP}values"] = tensor[nonzero].contiguous()
            tensors[f"{name}{SEP}bitmask"] = pack_bits(nonzero)
            sparse_meta[name] = {"shape": list(tensor.shape), "pattern": pattern}
            if pattern is not None and inputs is not None:
                sparse_meta[name]["inputs"] = inputs
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
    version = 2 if any("inputs" in e for e in sparse_meta.values()) else 1
    metadata = {
        "format": f"{FORMAT_NAMES[0]}/{version}",
        "layout": LAYOUT,
        "sparse": json.dumps(sparse_meta),
    }
    save_file(tensors, str(path), metadata=metadata)
    size.file_bytes = Path(path).stat().st_size
    if verbose:
        print(size)
    return size


def load_compressed(
    path: str | Path, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Rebuild the dense state dict from a :func:`save_compressed` file (loads with
    ``model.load_state_dict(..., strict=True)`` into the plain model).

    The file is checked before any dense tensor is built
    (:mod:`~lightning_sparse.formats.compressed_checks`): a file that breaks the format raises
    a ``ValueError`` naming the file, the tensor and what is wrong, and no tensor is larger
    than the file's bitmasks allow (8 elements a byte).
    """
    from safetensors import SafetensorError, safe_open

    device = torch.device(device)
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}){DAMAGED}"
        ) from err
    with handle as f:
        sparse = sparse_tensors(f, path)
        # dense tensors first, then the sparse ones in the metadata's order, as written
        state = {k: read_tensor(f, k, path) for k in f.keys() if SEP not in k}  # noqa: SIM118
        for name, (shape, pattern, inputs, count) in sparse.items():
            numel = math.prod(shape)
            nonzero = checked_bitmask(
                read_tensor(f, f"{name}{SEP}bitmask", path), shape, path, name
            )
            marked = int(nonzero.count_nonzero())
            if marked != count:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its bitmask marks {marked} non-zeros, "
                    f"but it has {count} values{DAMAGED}"
                )
            if pattern is not None:
                check_pattern(nonzero, shape, pattern, inputs, path, name)
            values = read_tensor(f, f"{name}{SEP}values", path)
            # placed as integers of the same width: bit-exact for every dtype (float8 has no
            # masked_scatter), and zero bits are 0.0 in every format
            bits = _SAME_WIDTH[values.element_size()]
            dense = torch.zeros(numel, dtype=bits, device=values.device)
            dense.masked_scatter_(nonzero, values.view(bits))
            state[name] = dense.view(values.dtype).view(shape)
    return state
