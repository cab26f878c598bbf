"""Compressed exports: the portable safetensors format (exact round trip) and 2:4 GPU tensors."""

import lightning as L
import pytest
import torch
from helpers import TinyModule, fast_trainer, random_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_sparse import (
    SparsityCallback,
    export_state_dict,
    load_compressed,
    save_compressed,
    to_semi_structured,
)
from lightning_sparse.formats.compressed_layout import pack_bits, unpack_bits
from lightning_sparse.masks import NM, target_mask


def trained_checkpoint(tmp_path, phases):
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="last")
    trainer = fast_trainer(
        max_steps=5,
        callbacks=[SparsityCallback(phases=phases, verbose=False), ckpt],
        enable_checkpointing=True,
    )
    trainer.fit(TinyModule(), random_loader())
    return tmp_path / "last.ckpt"


@pytest.mark.parametrize(
    ("phase", "pattern"),
    [
        ({"sparsity": 0.7}, None),
        ({"sparsity": "2:4", "algorithm": "static"}, "2:4"),
        ({"sparsity": "2:4"}, "2:4"),  # runtime: straight-through, projected at export
    ],
)
def test_compressed_file_round_trips_exactly_and_is_smaller(
    tmp_path, capsys, phase, pattern
):
    save_file = pytest.importorskip("safetensors.torch").save_file
    ckpt = trained_checkpoint(tmp_path, [phase])
    expected = export_state_dict(ckpt)
    size = save_compressed(ckpt, tmp_path / "model.safetensors")
    loaded = load_compressed(tmp_path / "model.safetensors")
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert loaded[key].dtype == expected[key].dtype
        assert torch.equal(loaded[key], expected[key]), key
    model = TinyModule()
    model.load_state_dict(loaded, strict=True)
    # the sparse weights are stored sparse, with their pattern; biases and the head stay dense
    assert sorted(size.sparse) == ["net.fc1.weight", "net.fc2.weight"]
    assert {info[2] for info in size.sparse.values()} == {pattern}
    save_file(expected, tmp_path / "dense.safetensors")
    assert size.file_bytes < (tmp_path / "dense.safetensors").stat().st_size
    fc2_dense, fc2_stored, _ = size.sparse["net.fc2.weight"]
    kept = int(expected["net.fc2.weight"].count_nonzero())
    assert kept <= (
        77 if pattern is None else 128
    )  # 70% unstructured / 2:4 (runtime: <= 50%)
    assert (fc2_dense, fc2_stored) == (256 * 4, kept * 4 + 256 // 8)
    printed = capsys.readouterr().out
    assert "net.fc2.weight" in printed and "all tensors" in printed
    assert str(tmp_path / "model.safetensors") in printed


def test_odd_sizes_bf16_empty_and_tied_tensors_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(7, 5, generator=gen).to(
        torch.bfloat16
    )  # 35 bits: a partial byte
    weight[weight.abs() < 0.8] = 0
    tied = torch.randn(4, 3, generator=gen)
    state = {
        "sparse_bf16": weight,
        "all_zero": torch.zeros(3, 8),
        "tied_a": tied,
        "tied_b": tied,
        "steps": torch.tensor(3),
        "conv": torch.where(torch.rand(2, 4, 3, 3, generator=gen) > 0.5, 1.0, 0.0),
    }
    size = save_compressed(state, tmp_path / "x.safetensors", verbose=False)
    assert set(size.sparse) == {"sparse_bf16", "all_zero", "conv"}
    loaded = load_compressed(tmp_path / "x.safetensors")
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_bit_packing_is_little_endian_and_exact():
    mask = torch.rand(1001, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == 126
    assert torch.equal(unpack_bits(packed, 1001), mask)
    assert pack_bits(torch.tensor([False, True])).tolist() == [2]


def test_loading_another_file_names_the_format(tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    save_file({"w": torch.ones(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match=r"is not a lightning_sparse compressed file"):
        load_compressed(tmp_path / "plain.safetensors")


def test_semi_structured_export_explains_what_it_skips_on_cpu():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    before = model[0].weight.detach().clone()
    report = to_semi_structured(model)
    assert report == {
        "0.weight": "no CUDA GPU",
        "1.weight": "no CUDA GPU",
    }
    assert torch.equal(model[0].weight, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_semi_structured_export_runs_2_4_weights_on_sparse_kernels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    model = model.half().cuda().eval()
    with torch.no_grad():
        model[0].weight.mul_(target_mask(model[0].weight.abs(), NM(2, 4)))
    x = torch.randn(64, 128, device="cuda", dtype=torch.half)
    with torch.no_grad():
        expected = model(x)
        report = to_semi_structured(model)
        got = model(x)
    assert report == {"0.weight": "converted", "2.weight": "not 2:4 sparse"}
    assert type(model[0].weight).__name__.startswith("SparseSemiStructuredTensor")
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
