"""Compressed exports of a sparse model: a portable file, and 2:4 sparse tensors for GPU inference.

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

:func:`to_semi_structured` swaps 2:4-sparse ``nn.Linear`` and ``Conv1D`` weights for PyTorch's
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
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_sparse.core.layers import LayerType, layer_type, layer_types
from lightning_sparse.formats.export import export_state_dict
from lightning_sparse.masks import NM, is_nm

VERSION = 2
"""The newest format version, read and written here. Version 2 adds a sparse tensor's
``inputs`` entry; a file that has none is written as version 1."""
FORMAT = f"lightning_sparse.compressed/{VERSION}"
"""The ``format`` metadata entry of a file that needs version 2: ``<name>/<version>``."""
FORMAT_NAMES = ("lightning_sparse.compressed", "lightning_sparse.formats.compressed")
"""Names :func:`load_compressed` reads; the second was written for a while after the module
moved into ``formats/``, with the same layout."""
VALUE_DTYPES = frozenset(
    {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ"}
)
"""safetensors dtypes a sparse tensor's values may have: the floating types with a zero."""
_SPARSE_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    *(
        getattr(torch, f"float8_{t}", None)
        for t in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")
    ),
} - {None}  # the same types as torch dtypes (float8_e8m0fnu has no zero to prune to)
MAX_DIMS = 64
"""The most dimensions a sparse tensor's shape may have."""
LAYOUT = (
    "sparse tensor <name>: '<name>::values' (the non-zero values, row-major) and "
    "'<name>::bitmask' (uint8; bit j of byte i is element 8*i+j of the flattened tensor, "
    "1 = non-zero); shapes and N:M patterns in the 'sparse' metadata entry (groups along the "
    "dimension 'inputs' where given, else along the last axis of the (shape[0], -1) view)"
)
_SEP = "::"
_DAMAGED = (
    "; the file is damaged or was not written by save_compressed: export it again with "
    "save_compressed"
)
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
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


def _rows(tensor: Tensor, inputs: int | None) -> Tensor:
    """``tensor`` with the stored dimension ``inputs`` last (as is, for ``None``)."""
    return tensor if inputs is None else tensor.movedim(inputs, -1)


def _nm_pattern(nonzero: Tensor, inputs: int | None = None) -> str | None:
    """``"2:4"`` if ``nonzero`` keeps at most 2 of every 4 along the inputs, else ``None``."""
    target = NM(2, 4)
    rows = _rows(nonzero, inputs)
    if _no_groups(list(nonzero.shape), target.m, inputs):
        return None
    return str(target) if is_nm(rows, target) else None


def _no_groups(shape: list[int], m: int, inputs: int | None) -> bool:
    """Whether a tensor of ``shape`` has no whole groups of ``m`` along its inputs."""
    if len(shape) < 2:
        return True
    along = math.prod(shape[1:]) if inputs is None else shape[inputs]
    return along % m != 0


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
        if tensor.dtype in _SPARSE_DTYPES and tensor.ndim >= 2 and sparse < dense:
            inputs = _inputs(layers.get(name), tensor.ndim)
            pattern = _nm_pattern(nonzero, inputs)
            tensors[f"{name}{_SEP}values"] = tensor[nonzero].contiguous()
            tensors[f"{name}{_SEP}bitmask"] = pack_bits(nonzero)
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

    The file is checked before any dense tensor is built (see :func:`_sparse_tensors`): a file
    that breaks the format raises a ``ValueError`` naming the file, the tensor and what is
    wrong, and no tensor is larger than the file's bitmasks allow (8 elements a byte).
    """
    from safetensors import SafetensorError, safe_open

    device = torch.device(device)
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}){_DAMAGED}"
        ) from err
    with handle as f:
        sparse = _sparse_tensors(f, path)
        # dense tensors first, then the sparse ones in the metadata's order, as written
        state = {k: _read(f, k, path) for k in f.keys() if _SEP not in k}  # noqa: SIM118
        for name, (shape, pattern, inputs, count) in sparse.items():
            numel = math.prod(shape)
            nonzero = _checked_bitmask(
                _read(f, f"{name}{_SEP}bitmask", path), shape, path, name
            )
            marked = int(nonzero.count_nonzero())
            if marked != count:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its bitmask marks {marked} non-zeros, "
                    f"but it has {count} values{_DAMAGED}"
                )
            if pattern is not None:
                _check_pattern(nonzero, shape, pattern, inputs, path, name)
            values = _read(f, f"{name}{_SEP}values", path)
            # placed as integers of the same width: bit-exact for every dtype (float8 has no
            # masked_scatter), and zero bits are 0.0 in every format
            bits = _SAME_WIDTH[values.element_size()]
            dense = torch.zeros(numel, dtype=bits, device=values.device)
            dense.masked_scatter_(nonzero, values.view(bits))
            state[name] = dense.view(values.dtype).view(shape)
    return state


def _sparse_tensors(
    f: Any, path: str | Path
) -> dict[str, tuple[list[int], NM | None, int | None, int]]:
    """Name -> (shape, N:M pattern, input dimension, number of values) of the file's sparse
    tensors, checked against the file's header (tensor names, dtypes and sizes; no tensor data
    is read)."""
    metadata = f.metadata() or {}
    version = _check_format(metadata.get("format"), path)
    if "sparse" not in metadata:
        raise ValueError(
            f"{path}: the metadata has no 'sparse' entry (the list of sparse tensors){_DAMAGED}"
        )
    try:
        entries = json.loads(metadata["sparse"])
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}: the 'sparse' metadata entry is not valid JSON ({err}){_DAMAGED}"
        ) from err
    if not isinstance(entries, dict):
        raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
            f"{path}: the 'sparse' metadata entry is a JSON {type(entries).__name__}, not an "
            f"object of tensor name -> {{'shape', 'pattern'}}{_DAMAGED}"
        )
    names = set(f.keys())
    for key in names:
        base, _, part = key.rpartition(_SEP)
        if _SEP in key and (part not in ("values", "bitmask") or base not in entries):
            raise ValueError(
                f"{path}: tensor {key!r} is not a part of a sparse tensor listed in the "
                f"'sparse' metadata entry (parts are '<name>{_SEP}values' and "
                f"'<name>{_SEP}bitmask'){_DAMAGED}"
            )
    sparse = {}
    for name, info in entries.items():
        if name in names:
            raise ValueError(
                f"{path}: tensor {name!r} is stored dense and listed as sparse in the metadata"
                f"{_DAMAGED}"
            )
        shape, pattern, inputs = _entry(info, path, name, version)
        numel = math.prod(shape)
        for part, dtypes in (("bitmask", {"U8"}), ("values", VALUE_DTYPES)):
            key = f"{name}{_SEP}{part}"
            if key not in names:
                raise ValueError(
                    f"{path}: sparse tensor {name!r} has no {key!r} tensor{_DAMAGED}"
                )
            header = f.get_slice(key)
            dtype, size = header.get_dtype(), header.get_shape()
            if dtype not in dtypes:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its {part} has dtype {dtype}, expected one "
                    f"of {sorted(dtypes)}{_DAMAGED}"
                )
            if len(size) != 1:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its {part} has shape {size}, expected one "
                    f"dimension{_DAMAGED}"
                )
            if part == "bitmask" and size[0] != -(-numel // 8):
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its bitmask has {size[0]} bytes, but its "
                    f"shape {shape} needs ceil({numel} / 8) = {-(-numel // 8)}{_DAMAGED}"
                )
            if part == "values" and size[0] > numel:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: {size[0]} values for a shape {shape} of "
                    f"{numel} elements{_DAMAGED}"
                )
        sparse[name] = (shape, pattern, inputs, size[0])
    return sparse


def _check_format(found: Any, path: str | Path) -> int:
    """The file's format version, or a ValueError saying what the ``format`` entry is."""
    name, _, version = found.rpartition("/") if isinstance(found, str) else ("", "", "")
    if name not in FORMAT_NAMES:
        raise ValueError(
            f"{path} is not a lightning_sparse compressed file (format={found!r}, expected "
            f"{FORMAT!r}); write it with save_compressed, or load a plain safetensors file with "
            f"safetensors.torch.load_file"
        )
    if version not in {str(v) for v in range(1, VERSION + 1)}:
        newer = version.isdigit() and int(version) > VERSION
        raise ValueError(
            f"{path} is a lightning_sparse compressed file of format version {version!r}"
            + (
                f", newer than this reader: this lightning_sparse reads versions 1 to "
                f"{VERSION} ({FORMAT!r}); upgrade lightning_sparse to read it"
                if newer
                else f", which no lightning_sparse wrote (versions are 1, 2, ...){_DAMAGED}"
            )
        )
    return int(version)


def _entry(
    info: Any, path: str | Path, name: str, version: int
) -> tuple[list[int], NM | None, int | None]:
    """A sparse tensor's metadata entry as (shape, pattern, inputs), or a ValueError naming
    it."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: sparse tensor {name!r}: {what}{_DAMAGED}")

    if not isinstance(info, dict) or "shape" not in info:
        raise bad(f"its metadata entry {info!r} is not an object with a 'shape'")
    known = ["shape", "pattern"] + (["inputs"] if version >= 2 else [])
    unknown = sorted(set(info) - set(known))
    if unknown:
        raise bad(
            f"its metadata entry has unknown fields {unknown} (known in format version "
            f"{version}: {', '.join(known)})"
        )
    shape = info["shape"]
    if not (
        isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)  # bool is no dimension
        and len(shape) <= MAX_DIMS
    ):
        raise bad(
            f"shape {shape!r} is not a list of at most {MAX_DIMS} non-negative integers"
        )
    if math.prod(shape) == 0:  # save_compressed stores empty tensors dense
        raise bad(
            f"shape {shape} has no elements, and save_compressed stores those dense"
        )
    inputs = info.get("inputs")
    if inputs is not None and not (type(inputs) is int and 0 <= inputs < len(shape)):
        raise bad(f"inputs {inputs!r} is not a dimension of its shape {shape}")
    pattern = info.get("pattern")
    if pattern is None:
        return shape, None, inputs
    match = (
        re.fullmatch(r"(\d{1,4}):(\d{1,4})", pattern)
        if isinstance(pattern, str)
        else None
    )
    try:
        nm = NM(int(match[1]), int(match[2])) if match else None
    except ValueError:
        nm = None
    if nm is None:
        raise bad(
            f"pattern {pattern!r} is not an N:M pattern with 0 < N < M (e.g. '2:4')"
        )
    return shape, nm, inputs


def _read(f: Any, key: str, path: str | Path) -> Tensor:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(key)
    except (SafetensorError, TypeError, KeyError) as err:  # a dtype torch cannot hold
        raise ValueError(
            f"{path}: tensor {key!r} cannot be read ({err}){_DAMAGED}"
        ) from err


def _checked_bitmask(
    packed: Tensor, shape: list[int], path: str | Path, name: str
) -> Tensor:
    """The bitmask as a flat bool tensor, with its padding bits zero."""
    numel = math.prod(shape)
    if numel % 8 and int(packed[-1]) >> (numel % 8):
        raise ValueError(
            f"{path}: sparse tensor {name!r}: its bitmask sets bits past its {numel} elements"
            f"{_DAMAGED}"
        )
    return unpack_bits(packed, numel)


def _check_pattern(
    nonzero: Tensor,
    shape: list[int],
    pattern: NM,
    inputs: int | None,
    path: str | Path,
    name: str,
) -> None:
    if _no_groups(shape, pattern.m, inputs):
        along = "its inputs" if inputs is None else f"its inputs (dimension {inputs})"
        raise ValueError(
            f"{path}: sparse tensor {name!r}: the metadata claims pattern {pattern}, but shape "
            f"{shape} has no groups of {pattern.m} along {along}{_DAMAGED}"
        )
    if not is_nm(_rows(nonzero.view(shape), inputs), pattern):
        raise ValueError(
            f"{path}: sparse tensor {name!r}: the metadata claims pattern {pattern}, but its "
            f"bitmask keeps more than {pattern.n} of some {pattern.m} consecutive weights"
            f"{_DAMAGED}"
        )


def to_semi_structured(model: nn.Module) -> dict[str, str]:
    """Swap every 2:4-sparse ``nn.Linear`` and Hugging Face ``Conv1D`` weight for a
    ``SparseSemiStructuredTensor`` (inference).

    A weight is converted when the ``(out, in)`` matrix its layer multiplies by (``W.T`` for a
    ``Conv1D``) is 2:4 along the input dimension (at most 2 non-zeros in every group of 4, e.g.
    after :func:`~lightning_sparse.export_state_dict`) and PyTorch's
    ``to_sparse_semi_structured`` accepts it (a CUDA GPU with sparse tensor cores, fp16/bf16
    or int8, supported shapes). A ``Conv1D`` keeps the transpose of the sparse matrix, which its
    ``addmm`` runs on the same kernel as ``F.linear``. Returns, for every such weight,
    ``"converted"`` or why not.
    """
    from torch.sparse import to_sparse_semi_structured

    report: dict[str, str] = {}
    for module_name, module in model.named_modules():
        matrix = layer_type(module).matrix
        if matrix is None:
            continue
        name = f"{module_name}.weight" if module_name else "weight"
        weight = module.weight.detach()
        if weight.device.type != "cuda":
            report[name] = f"on {weight.device.type}: 2:4 kernels need a CUDA device"
            continue
        if _nm_pattern(matrix(weight) != 0) is None:
            report[name] = "not 2:4 sparse"
            continue
        try:
            sparse = to_sparse_semi_structured(matrix(weight).contiguous())
        except (RuntimeError, ValueError, NotImplementedError) as err:
            report[name] = f"to_sparse_semi_structured refused it: {err}"
            continue
        stored = sparse if matrix(weight) is weight else sparse.t()  # Conv1D: (in, out)
        module.weight = nn.Parameter(stored, requires_grad=False)
        report[name] = "converted"
    return report
