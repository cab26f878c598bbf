"""Compressed files from elsewhere: every file that breaks the format raises a ValueError naming
the file, the tensor and what is wrong, before any dense tensor larger than the file implies is
built; older format names load; a hypothesis fuzz over damaged and crafted files."""

import json
import struct
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save

from lightning_sparse import load_compressed, save_compressed
from lightning_sparse.formats.compressed_layout import FORMAT, MAX_DIMS


def valid_state():
    gen = torch.Generator().manual_seed(0)
    nm = torch.randn(8, 8, generator=gen)
    nm.view(8, 2, 4)[..., 2:] = 0  # 2:4 along the inputs
    odd = torch.randn(7, 5, generator=gen).to(torch.bfloat16)  # 35 bits: a partial byte
    odd[odd.abs() < 0.8] = 0
    return {
        "nm": nm,
        "odd": odd,
        "bias": torch.randn(8, generator=gen),
        "steps": torch.tensor([3, 4]),
    }


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid file's tensors and metadata (as safetensors reads them) and its bytes."""
    path = tmp_path_factory.mktemp("valid") / "model.safetensors"
    save_compressed(valid_state(), path, verbose=False)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return load_file(path), metadata, path.read_bytes()


def write(path, tensors, metadata):
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def sparse_meta(metadata):
    return json.loads(metadata["sparse"])


def with_sparse(metadata, entries):
    return {**metadata, "sparse": json.dumps(entries)}


def test_save_writes_the_original_format_name_and_both_names_load(tmp_path, valid):
    tensors, metadata, _ = valid
    # no tensor needs version 2 (an 'inputs' entry), so the file is version 1
    assert metadata["format"] == "lightning_sparse.compressed/1"
    assert FORMAT == "lightning_sparse.compressed/2"
    expected = valid_state()
    for name in (
        "lightning_sparse.compressed/1",
        "lightning_sparse.formats.compressed/1",
    ):
        path = write(tmp_path / "m.safetensors", tensors, {**metadata, "format": name})
        loaded = load_compressed(path)
        assert list(loaded) == ["bias", "steps", "nm", "odd"]  # dense first, as written
        for key, value in expected.items():
            assert loaded[key].dtype == value.dtype and torch.equal(
                loaded[key], value
            ), key


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (
            "3",
            r"format version '3', newer than this reader: this lightning_sparse reads versions 1 to 2 \('lightning_sparse.compressed/2'\); upgrade lightning_sparse",
        ),
        ("0", r"format version '0', which no lightning_sparse wrote"),
        ("", r"format version '', which no lightning_sparse wrote"),
    ],
)
def test_other_format_versions_say_which_and_what_reads_them(
    tmp_path, valid, version, message
):
    tensors, metadata, _ = valid
    path = write(
        tmp_path / "m.safetensors",
        tensors,
        {**metadata, "format": f"lightning_sparse.compressed/{version}"},
    )
    with pytest.raises(ValueError, match=message):
        load_compressed(path)


def shape_of(name):
    return list(valid_state()[name].shape)


@pytest.mark.parametrize(
    ("tensor", "change", "message"),
    [
        (
            "nm",
            {"shape": [8, 9]},
            r"its bitmask has 8 bytes, but its shape \[8, 9\] needs ceil\(72 / 8\) = 9",
        ),
        (
            "nm",
            {"shape": [2**40, 2**40]},
            r"needs ceil\(1208925819614629174706176 / 8\)",
        ),
        (
            "nm",
            {"shape": [-8, -8]},
            r"shape \[-8, -8\] is not a list of at most 64 non-negative",
        ),
        ("nm", {"shape": [8, 0]}, r"shape \[8, 0\] has no elements"),
        (  # 64 elements in 65 dimensions
            "nm",
            {"shape": [1] * 63 + [8, 8]},
            r"shape \[1, 1, .*, 8, 8\] is not a list of at most 64 non-negative",
        ),
        (
            "nm",
            {"shape": [8] + [1] * 198 + [8]},
            r"shape \[8, 1, .*, 1, 8\] is not a list of at most 64 non-negative",
        ),
        ("nm", {"shape": "8x8"}, r"shape '8x8' is not a list"),
        ("nm", {"shape": [8.0, 8]}, r"is not a list"),
        ("nm", {"shape": [True, 64]}, r"is not a list"),
        (
            "nm",
            {"pattern": "3:2"},
            r"pattern '3:2' is not an N:M pattern with 0 < N < M",
        ),
        ("nm", {"pattern": 24}, r"pattern 24 is not an N:M pattern"),
        (
            "nm",
            {"pattern": "1:4"},
            r"claims pattern 1:4, but its bitmask keeps more than 1 of some 4",
        ),
        (
            "nm",
            {"pattern": "2:3"},
            r"claims pattern 2:3, but shape \[8, 8\] has no groups of 3",
        ),
        (
            "odd",
            {"pattern": "2:4"},
            r"claims pattern 2:4, but shape \[7, 5\] has no groups of 4",
        ),
        ("nm", {"extra": 1}, r"unknown fields \['extra'\]"),
        ("nm", None, r"metadata entry None is not an object with a 'shape'"),
    ],
)
def test_metadata_that_lies_is_named(tmp_path, valid, tensor, change, message):
    tensors, metadata, _ = valid
    entries = sparse_meta(metadata)
    entries[tensor] = None if change is None else {**entries[tensor], **change}
    path = write(tmp_path / "m.safetensors", tensors, with_sparse(metadata, entries))
    with pytest.raises(ValueError, match=message) as err:
        load_compressed(path)
    assert str(path) in str(err.value) and repr(tensor) in str(err.value)


def file_metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_a_pattern_along_another_dimension_is_version_2_and_checked_there(tmp_path):
    conv = torch.nn.Conv2d(8, 4, 3, bias=False)
    with torch.no_grad():
        conv.weight.view(4, 2, 4, 3, 3)[:, :, 2:] = 0  # 2 of every 4 input channels
    path = tmp_path / "conv.safetensors"
    save_compressed(conv.state_dict(), path, verbose=False)  # no model: as stored
    metadata = file_metadata(path)
    assert metadata["format"] == "lightning_sparse.compressed/1"
    # as stored, (in, kh, kw) flattened: groups of 4 run along the kernel taps
    assert sparse_meta(metadata)["weight"]["pattern"] is None
    save_compressed(conv.state_dict(), path, model=conv, verbose=False)
    metadata = file_metadata(path)
    assert metadata["format"] == "lightning_sparse.compressed/2"
    entry = sparse_meta(metadata)["weight"]
    assert entry == {"shape": [4, 8, 3, 3], "pattern": "2:4", "inputs": 1}
    assert torch.equal(load_compressed(path)["weight"], conv.weight)
    tensors = load_file(path)
    cases = {  # what the entry says -> what the reader says
        "dimension 4": ({**entry, "inputs": 4}, r"inputs 4 is not a dimension"),
        "a bool": ({**entry, "inputs": True}, r"inputs True is not a dimension"),
        "the stored rows": (
            {k: v for k, v in entry.items() if k != "inputs"},
            r"claims pattern 2:4, but its bitmask keeps more than 2 of some 4",
        ),
        "kernel rows": (
            {**entry, "inputs": 2},
            r"shape \[4, 8, 3, 3\] has no groups of 4 along its inputs \(dimension 2\)",
        ),
    }
    changed_path = tmp_path / "changed.safetensors"  # path's tensors are read from it
    for changed, message in cases.values():
        write(changed_path, tensors, with_sparse(metadata, {"weight": changed}))
        with pytest.raises(ValueError, match=message):
            load_compressed(changed_path)
    v1 = {**metadata, "format": "lightning_sparse.compressed/1"}
    write(changed_path, tensors, v1)
    with pytest.raises(
        ValueError,
        match=r"unknown fields \['inputs'\] \(known in format version 1: shape, pattern\)",
    ):
        load_compressed(changed_path)


def test_bitmask_and_values_that_disagree_are_named(tmp_path, valid):
    tensors, metadata, _ = valid
    path = tmp_path / "m.safetensors"
    one_bit = tensors["nm::bitmask"].clone()
    one_bit[0] ^= 1
    cases = {
        "marks 31 non-zeros, but it has 32 values": {"nm::bitmask": one_bit},
        "its values has dtype I32": {
            "nm::values": tensors["nm::values"].view(torch.int32)
        },
        "its values has dtype BOOL": {"nm::values": tensors["nm::values"] != 0},
        "its bitmask has dtype I8": {
            "nm::bitmask": tensors["nm::bitmask"].view(torch.int8)
        },
        r"its bitmask has shape \[2, 4\], expected one dimension": {
            "nm::bitmask": tensors["nm::bitmask"].view(2, 4)
        },
        "65 values for a shape": {"nm::values": torch.zeros(65)},
        "sets bits past its 35 elements": {
            "odd::bitmask": torch.cat(
                [tensors["odd::bitmask"][:-1], torch.tensor([255], dtype=torch.uint8)]
            )
        },
    }
    for message, change in cases.items():
        write(path, {**tensors, **change}, metadata)
        with pytest.raises(ValueError, match=message) as err:
            load_compressed(path)
        assert str(path) in str(err.value)
    for missing in ("nm::values", "odd::bitmask"):
        write(path, {k: v for k, v in tensors.items() if k != missing}, metadata)
        with pytest.raises(ValueError, match=rf"has no '{missing}' tensor"):
            load_compressed(path)
    write(path, {**tensors, "ghost::values": torch.ones(1)}, metadata)
    with pytest.raises(
        ValueError, match=r"tensor 'ghost::values' is not a part of a sparse tensor"
    ):
        load_compressed(path)
    write(path, {**tensors, "nm": torch.ones(1)}, metadata)
    with pytest.raises(
        ValueError, match=r"tensor 'nm' is stored dense and listed as sparse"
    ):
        load_compressed(path)


@pytest.mark.parametrize(
    ("sparse", "message"),
    [
        (None, r"the metadata has no 'sparse' entry"),
        ('{"nm": {"shape": [8, 8]', r"the 'sparse' metadata entry is not valid JSON"),
        ("[1, 2]", r"the 'sparse' metadata entry is a JSON list, not an object"),
    ],
)
def test_bad_sparse_entry_is_named(tmp_path, valid, sparse, message):
    tensors, metadata, _ = valid
    metadata = {k: v for k, v in metadata.items() if k != "sparse"}
    if sparse is not None:
        metadata["sparse"] = sparse
    path = write(tmp_path / "m.safetensors", tensors, metadata)
    with pytest.raises(ValueError, match=message):
        load_compressed(path)


def test_a_damaged_file_is_a_value_error_and_a_missing_one_is_not_found(
    tmp_path, valid
):
    data = valid[2]
    path = tmp_path / "m.safetensors"
    path.write_bytes(data[:-5])
    with pytest.raises(
        ValueError, match=r"is not a readable safetensors file .*export it again"
    ):
        load_compressed(path)
    with pytest.raises(FileNotFoundError):
        load_compressed(tmp_path / "nowhere.safetensors")


# -- fuzz --------------------------------------------------------------------------------------

_INTS = st.integers(-(2**70), 2**70) | st.integers(-2, 70)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_DTYPES = [
    torch.float64,
    torch.float16,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.int8,
    torch.bool,
    torch.int64,
]


@st.composite
def corrupted(draw, valid):
    """(what changed, the sparse tensor it concerns, the file as bytes or (tensors, metadata)):
    a valid file changed in one of the ways files break."""
    tensors, metadata, data = valid
    tensors, metadata = dict(tensors), dict(metadata)
    entries = sparse_meta(metadata)
    name = draw(st.sampled_from(sorted(entries)))
    kind = draw(
        st.sampled_from(
            [
                "truncate",
                "flip_byte",
                "header_length",
                "format",
                "bad_json",
                "json_value",
                "shape",
                "pattern",
                "entry",
                "drop_tensor",
                "values_count",
                "bitmask_bits",
                "dtype",
                "bitmask_length",
            ]
        )
    )
    event(kind)
    if kind == "truncate":
        return kind, None, data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip_byte":
        i = draw(st.integers(0, len(data) - 1))
        return (
            kind,
            None,
            data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :],
        )
    if kind == "header_length":
        return kind, None, struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + data[8:]
    if kind == "format":
        metadata["format"] = draw(
            st.text(max_size=40)
            | st.sampled_from(
                [
                    "lightning_sparse.compressed/3",
                    "lightning_sparse.compressed/01",
                    "lightning_sparse.compressed/x",
                ]
            )
        )
    elif kind == "bad_json":
        text = metadata["sparse"]
        metadata["sparse"] = text[: draw(st.integers(0, len(text) - 1))]
    elif kind == "json_value":
        metadata["sparse"] = json.dumps(draw(_JSON))
    elif kind == "shape":
        shape = entries[name]["shape"]
        entries[name]["shape"] = draw(
            st.lists(_INTS, max_size=4)
            | st.integers(1, 300).map(lambda ones: [1] * ones + shape)  # same elements
            | _JSON
        )
    elif kind == "pattern":
        entries[name]["pattern"] = draw(
            st.from_regex(r"\A-?\d{1,6}:-?\d{1,6}\Z") | _JSON
        )
    elif kind == "entry":
        entries[name] = draw(
            _JSON
            | st.dictionaries(
                st.sampled_from(["shape", "pattern", "inputs", "x"]), _JSON
            )
        )
    elif kind == "drop_tensor":
        del tensors[draw(st.sampled_from(sorted(tensors)))]
    elif kind == "values_count":
        values = tensors[f"{name}::values"]
        n = draw(st.integers(0, values.numel() + 8))
        tensors[f"{name}::values"] = torch.cat([values, values.new_zeros(8)])[
            :n
        ].clone()
    elif kind == "bitmask_bits":
        bitmask = tensors[f"{name}::bitmask"].clone()
        i = draw(st.integers(0, bitmask.numel() - 1))
        bitmask[i] ^= draw(st.integers(1, 255))
        tensors[f"{name}::bitmask"] = bitmask
    elif kind == "dtype":
        part = draw(st.sampled_from(["values", "bitmask"]))
        tensors[f"{name}::{part}"] = tensors[f"{name}::{part}"].to(
            draw(st.sampled_from(_DTYPES))
        )
    elif kind == "bitmask_length":
        bitmask = tensors[f"{name}::bitmask"]
        n = draw(st.integers(0, bitmask.numel() + 4))
        tensors[f"{name}::bitmask"] = torch.cat([bitmask, bitmask.new_zeros(4)])[
            :n
        ].clone()
    if kind in ("shape", "pattern", "entry"):
        metadata["sparse"] = json.dumps(entries)
    return kind, name if kind in _OF_A_TENSOR else None, (tensors, metadata)


_OF_A_TENSOR = {
    "shape",
    "pattern",
    "entry",
    "values_count",
    "bitmask_bits",
    "dtype",
    "bitmask_length",
}
_FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)


@_FUZZ
@given(data=st.data())
def test_fuzzed_files_raise_value_errors_naming_the_file_and_allocate_no_more_than_they_hold(
    tmp_path, valid, data
):
    _, name, case = data.draw(corrupted(valid))
    path = tmp_path / "fuzz.safetensors"
    if isinstance(case, bytes):
        path.write_bytes(case)
    else:
        write(path, *case)
    limit = 8 * path.stat().st_size  # 8 elements per bitmask byte at most
    zeros = torch.zeros

    def bounded_zeros(*size, **kwargs):
        numel = 1
        for n in size[0] if len(size) == 1 and not isinstance(size[0], int) else size:
            numel *= n
        assert numel <= limit, (
            f"torch.zeros({size}) from a file of {path.stat().st_size} bytes"
        )
        return zeros(*size, **kwargs)

    with mock.patch.object(torch, "zeros", bounded_zeros):
        try:
            state = load_compressed(path)
        except ValueError as err:
            assert str(path) in str(err)
            if name is not None:  # the tensor the change concerns is named
                assert repr(name) in str(err) or f"'{name}::" in str(err), str(err)
            event("ValueError")
            return
    event("loaded")
    # what still loads is a file that the corruption left valid (e.g. a changed value)
    for key, tensor in state.items():
        assert isinstance(tensor, torch.Tensor) and tensor.dim() <= MAX_DIMS, key


def test_every_valid_file_loads_as_written(tmp_path):
    """Valid files of many shapes, dtypes and densities load bit for bit (with the checks on)."""
    gen = torch.Generator().manual_seed(3)
    for i, (shape, dtype, density) in enumerate(
        [
            ((3, 1), torch.float32, 0.1),
            ((1, 9), torch.float16, 0.0),
            ((5, 4, 3, 3), torch.float64, 0.3),
            ((16, 8), torch.bfloat16, 0.5),
            ((6, 6), torch.float8_e4m3fn, 0.2),
            ((2, 3, 5), torch.float32, 0.0),
        ]
    ):
        weight = torch.randn(shape, generator=gen)
        weight[torch.rand(shape, generator=gen) > density] = 0
        state = {"w": weight.to(dtype), "b": torch.ones(2)}
        path = tmp_path / f"{i}.safetensors"
        size = save_compressed(state, path, verbose=False)
        assert "w" in size.sparse, (shape, dtype, density)
        loaded = load_compressed(path)
        assert loaded["w"].dtype == dtype
        assert torch.equal(loaded["w"].view(torch.uint8), state["w"].view(torch.uint8))
    if hasattr(torch, "float8_e8m0fnu"):  # no zero: stored dense
        e8m0 = torch.full((4, 8), 0.5).to(torch.float8_e8m0fnu)
        size = save_compressed({"w": e8m0}, tmp_path / "e8.safetensors", verbose=False)
        assert not size.sparse
        loaded = load_compressed(tmp_path / "e8.safetensors")["w"]
        assert torch.equal(loaded.view(torch.uint8), e8m0.view(torch.uint8))
    # a float8 weight with a single non-zero (it once raised: torch has no float8 masked_fill)
    state = {"w": torch.zeros(4, 8)}
    state["w"][2, 5] = 1.5
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        save_compressed(
            {"w": state["w"].to(dtype)}, tmp_path / "f8.safetensors", verbose=False
        )
        assert torch.equal(
            load_compressed(tmp_path / "f8.safetensors")["w"].float(), state["w"]
        )
