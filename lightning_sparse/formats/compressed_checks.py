"""Checks of a compressed safetensors file against the format, before any dense tensor is built.

Every check raises a ``ValueError`` naming the file, the tensor and what is wrong (see
``docs/safe-loading.md``); :func:`~lightning_sparse.formats.compressed.load_compressed` runs
them. :func:`sparse_tensors` reads only the file's header; :func:`checked_bitmask` and
:func:`check_pattern` check one tensor's bitmask once it is read.

Example:
    >>> check_format("lightning_sparse.compressed/2", "model.safetensors")
    2
    >>> check_format("other/1", "model.safetensors")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: model.safetensors is not a lightning_sparse compressed file ...
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_sparse.formats.compressed_layout import (
    DAMAGED,
    FORMAT,
    FORMAT_NAMES,
    MAX_DIMS,
    SEP,
    VALUE_DTYPES,
    VERSION,
    along_inputs,
    has_no_groups,
    unpack_bits,
)
from lightning_sparse.masks import NM, is_nm


def sparse_tensors(
    f: Any, path: str | Path
) -> dict[str, tuple[list[int], NM | None, int | None, int]]:
    """Name -> (shape, N:M pattern, input dimension, number of values) of the file's sparse
    tensors, checked against the file's header (tensor names, dtypes and sizes; no tensor data
    is read)."""
    metadata = f.metadata() or {}
    version = check_format(metadata.get("format"), path)
    if "sparse" not in metadata:
        raise ValueError(
            f"{path}: the metadata has no 'sparse' entry (the list of sparse tensors){DAMAGED}"
        )
    try:
        entries = json.loads(metadata["sparse"])
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}: the 'sparse' metadata entry is not valid JSON ({err}){DAMAGED}"
        ) from err
    if not isinstance(entries, dict):
        raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
            f"{path}: the 'sparse' metadata entry is a JSON {type(entries).__name__}, not an "
            f"object of tensor name -> {{'shape', 'pattern'}}{DAMAGED}"
        )
    names = set(f.keys())
    for key in names:
        base, _, part = key.rpartition(SEP)
        if SEP in key and (part not in ("values", "bitmask") or base not in entries):
            raise ValueError(
                f"{path}: tensor {key!r} is not a part of a sparse tensor listed in the "
                f"'sparse' metadata entry (parts are '<name>{SEP}values' and "
                f"'<name>{SEP}bitmask'){DAMAGED}"
            )
    sparse = {}
    for name, info in entries.items():
        if name in names:
            raise ValueError(
                f"{path}: tensor {name!r} is stored dense and listed as sparse in the metadata"
                f"{DAMAGED}"
            )
        shape, pattern, inputs = sparse_entry(info, path, name, version)
        numel = math.prod(shape)
        for part, dtypes in (("bitmask", {"U8"}), ("values", VALUE_DTYPES)):
            key = f"{name}{SEP}{part}"
            if key not in names:
                raise ValueError(
                    f"{path}: sparse tensor {name!r} has no {key!r} tensor{DAMAGED}"
                )
            header = f.get_slice(key)
            dtype, size = header.get_dtype(), header.get_shape()
            if dtype not in dtypes:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its {part} has dtype {dtype}, expected one "
                    f"of {sorted(dtypes)}{DAMAGED}"
                )
            if len(size) != 1:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its {part} has shape {size}, expected one "
                    f"dimension{DAMAGED}"
                )
            if part == "bitmask" and size[0] != -(-numel // 8):
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: its bitmask has {size[0]} bytes, but its "
                    f"shape {shape} needs ceil({numel} / 8) = {-(-numel // 8)}{DAMAGED}"
                )
            if part == "values" and size[0] > numel:
                raise ValueError(
                    f"{path}: sparse tensor {name!r}: {size[0]} values for a shape {shape} of "
                    f"{numel} elements{DAMAGED}"
                )
        sparse[name] = (shape, pattern, inputs, size[0])
    return sparse


def check_format(found: Any, path: str | Path) -> int:
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
                else f", which no lightning_sparse wrote (versions are 1, 2, ...){DAMAGED}"
            )
        )
    return int(version)


def sparse_entry(
    info: Any, path: str | Path, name: str, version: int
) -> tuple[list[int], NM | None, int | None]:
    """A sparse tensor's metadata entry as (shape, pattern, inputs), or a ValueError naming
    it."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: sparse tensor {name!r}: {what}{DAMAGED}")

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


def read_tensor(f: Any, key: str, path: str | Path) -> Tensor:
    """Tensor ``key`` of the open file ``f``, or a ValueError saying it cannot be read."""
    from safetensors import SafetensorError

    try:
        return f.get_tensor(key)
    except (SafetensorError, TypeError, KeyError) as err:  # a dtype torch cannot hold
        raise ValueError(
            f"{path}: tensor {key!r} cannot be read ({err}){DAMAGED}"
        ) from err


def checked_bitmask(
    packed: Tensor, shape: list[int], path: str | Path, name: str
) -> Tensor:
    """The bitmask as a flat bool tensor, with its padding bits zero."""
    numel = math.prod(shape)
    if numel % 8 and int(packed[-1]) >> (numel % 8):
        raise ValueError(
            f"{path}: sparse tensor {name!r}: its bitmask sets bits past its {numel} elements"
            f"{DAMAGED}"
        )
    return unpack_bits(packed, numel)


def check_pattern(
    nonzero: Tensor,
    shape: list[int],
    pattern: NM,
    inputs: int | None,
    path: str | Path,
    name: str,
) -> None:
    """Raise unless ``nonzero`` keeps at most ``pattern.n`` of every ``pattern.m`` along the
    inputs."""
    if has_no_groups(shape, pattern.m, inputs):
        along = "its inputs" if inputs is None else f"its inputs (dimension {inputs})"
        raise ValueError(
            f"{path}: sparse tensor {name!r}: the metadata claims pattern {pattern}, but shape "
            f"{shape} has no groups of {pattern.m} along {along}{DAMAGED}"
        )
    if not is_nm(along_inputs(nonzero.view(shape), inputs), pattern):
        raise ValueError(
            f"{path}: sparse tensor {name!r}: the metadata claims pattern {pattern}, but its "
            f"bitmask keeps more than {pattern.n} of some {pattern.m} consecutive weights"
            f"{DAMAGED}"
        )
