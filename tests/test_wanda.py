"""``init: wanda``: masks by ``|W_ij| * ||X_j||`` from calibration forwards on the train loader.

The masks equal hand-computed references (Linear, Hugging Face ``Conv1D``, ``ConvNd`` with its
unfolded input patches; unstructured per output row, N:M, transposable 2:4), the calibration
leaves the training run as it was (batches, every RNG), and a resume restores the mask without
calibrating again. DDP and FSDP2 agreement is checked in ``test_distributed.py``.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import fast_trainer, resumable_fit
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_sparse import Phase, SparsityCallback
from lightning_sparse.algorithms import RunLength
from lightning_sparse.core.layers import layer_type
from lightning_sparse.core.schedule import resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.input_norms import InputNorms
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import NM, is_nm, row_target_mask, target_mask
from lightning_sparse.masks.tiles import (
    is_transposable_2to4,
    optimal_transposable_2to4_mask,
)


class Probe(L.LightningModule):
    """``layer`` (selected as ``layer.weight``) on the batches' first tensor; counts the
    ``training_step`` calls made without gradients (the calibration forwards)."""

    def __init__(self, layer: nn.Module, dropout: float = 0.0) -> None:
        super().__init__()
        self.layer = layer
        self.drop = nn.Dropout(dropout)
        self.calibration_calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not torch.is_grad_enabled():
            self.calibration_calls += 1
        self.log("train/loss", 0.0)  # ignored during calibration
        return self.layer(self.drop(batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def wanda_mask(layer: nn.Module, x: torch.Tensor, phase: dict, batches: int = 2):
    """The mask ``SparsityCallback`` chooses at step 0 for ``layer.weight``, calibrated on
    ``batches`` batches that are all ``x``, and the weight it was chosen from."""
    weight = layer.weight.detach().clone()
    data = TensorDataset(x.unsqueeze(0).expand(batches, *x.shape))
    cb = SparsityCallback(phases=[phase], params=["layer.weight"], verbose=False)
    module = Probe(layer)
    loader = DataLoader(data, batch_size=None)
    fast_trainer(max_steps=1, callbacks=[cb]).fit(module, loader)
    assert module.calibration_calls == batches
    return cb.sparsifier.masks["layer.weight"], weight


def rms(x: torch.Tensor) -> torch.Tensor:
    """Each feature's root mean square over the rows of ``x`` (n, features)."""
    return x.square().mean(0).sqrt()


def test_mask_of_a_linear_equals_the_hand_computed_one():
    layer = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.1, 4.0, 3.0, 2.0]]))
    x = torch.tensor([[3.0, 1.0, 0.5, 0.1], [-4.0, 1.0, -0.5, 0.1]])
    # input norms (root mean square over the 4 inputs of 2 batches): 3.5355, 1, 0.5, 0.1
    # scores: row 0: 3.54, 2.0, 1.5, 0.4 -> keep 0, 1 (magnitude would keep 2, 3)
    #         row 1: 0.35, 4.0, 1.5, 0.2 -> keep 1, 2
    phase = {"sparsity": 0.5, "init": "wanda", "calibration_batches": 2}
    mask, _ = wanda_mask(layer, x, phase)
    assert mask.int().tolist() == [[1, 1, 0, 0], [0, 1, 1, 0]]


def test_input_norms_are_the_root_mean_square_of_each_feature():
    layer = nn.Linear(4, 2)
    x = torch.tensor([[3.0, 1.0, 0.5, 0.1], [-4.0, 1.0, -0.5, 0.1]])
    with InputNorms(select_parameters(layer, params=["weight"]).targets) as norms:
        layer(x)
        layer(x.view(1, 2, 4))  # a sequence: every position is an input
    expected = torch.tensor([[(25 / 2) ** 0.5, 1.0, 0.5, 0.1]])
    torch.testing.assert_close(norms.result()["weight"], expected)


def test_equal_scores_keep_the_lower_index_and_each_row_keeps_its_share():
    layer = nn.Linear(8, 3, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    x = torch.ones(5, 8)
    mask, _ = wanda_mask(layer, x, {"sparsity": 0.5, "init": "wanda"})
    assert mask.int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]] * 3
    # 10 of 24 kept over 3 rows: each keeps 3, the first 10 % 3 = 1 row one more
    assert row_target_mask(torch.ones(3, 8), 14 / 24).sum(1).tolist() == [4, 3, 3]
    assert int(row_target_mask(torch.rand(5, 7), 0.3).sum()) == 35 - round(0.3 * 35)


def test_nm_groups_along_the_inputs_keep_the_highest_scores():
    torch.manual_seed(0)
    layer = nn.Linear(8, 2, bias=False)  # 2 rows: no 4x4 tiles, so N of every M
    x = torch.randn(6, 8) * torch.tensor([5.0, 1, 1, 1, 0.1, 1, 1, 3])
    phase = {"sparsity": "2:4", "algorithm": "static", "init": "wanda"}
    mask, weight = wanda_mask(layer, x, phase)
    score = weight.abs() * rms(x)
    assert torch.equal(mask, target_mask(score, NM(2, 4)))
    assert is_nm(mask, NM(2, 4))
    assert not torch.equal(mask, target_mask(weight.abs(), NM(2, 4)))


def test_2to4_on_4x4_tiles_is_the_transposable_mask_of_the_wanda_score():
    torch.manual_seed(1)
    layer = nn.Linear(8, 8, bias=False)
    x = torch.randn(16, 8) * torch.linspace(0.1, 4.0, 8)
    phase = {"sparsity": "2:4", "algorithm": "static", "init": "wanda"}
    mask, weight = wanda_mask(layer, x, phase)
    score = weight.abs() * rms(x)
    assert torch.equal(mask, optimal_transposable_2to4_mask(score))
    assert is_transposable_2to4(mask)


def test_hugging_face_conv1d_reads_its_weight_transposed():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    layer = transformers.pytorch_utils.Conv1D(6, 8)  # weight (8 inputs, 6 outputs)
    x = torch.randn(3, 5, 8) * torch.linspace(0.2, 3.0, 8)  # (batch, sequence, inputs)
    phase = {"sparsity": "2:4", "algorithm": "static", "init": "wanda"}
    mask, weight = wanda_mask(layer, x, phase)
    rows = weight.T  # (out, in): groups along the inputs
    expected = target_mask(rows.abs() * rms(x.reshape(-1, 8)), NM(2, 4)).T
    assert mask.shape == (8, 6) and torch.equal(mask, expected)


def unfolded_norms(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Reference: the norm of each unfolded input-patch feature, as ``(in, kh, kw)``."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    patches = F.unfold(padded, conv.kernel_size, conv.dilation, 0, conv.stride)
    features = patches.transpose(1, 2).reshape(
        -1, patches.shape[1]
    )  # (B * L, in * kh * kw)
    return rms(features).view(conv.in_channels, *conv.kernel_size)


def test_conv_masks_use_the_norms_of_the_unfolded_patches_along_input_channels():
    torch.manual_seed(3)
    conv = nn.Conv2d(8, 4, 3, padding=1)
    x = torch.randn(2, 8, 5, 5) * torch.linspace(0.2, 3.0, 8).view(8, 1, 1)
    norms = unfolded_norms(conv, x).movedim(0, -1)  # (kh, kw, in): inputs last, as rows
    rows = conv.weight.detach().movedim(1, -1)  # (out, kh, kw, in)
    for sparsity, expected in [
        ("2:4", target_mask(rows.abs() * norms, NM(2, 4))),
        (0.5, row_target_mask(rows.abs() * norms, 0.5)),
    ]:
        phase = {"sparsity": sparsity, "algorithm": "static", "init": "wanda"}
        mask, _ = wanda_mask(copy.deepcopy(conv), x, phase)
        assert torch.equal(mask, expected.movedim(-1, 1)), sparsity


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"stride": 2, "padding": 2, "dilation": 2},
        pytest.param(  # torch notes the zero-padded copy this even kernel needs
            {"padding": "same"},
            marks=pytest.mark.filterwarnings("ignore:Using padding='same' with even"),
        ),
        {"padding": 1, "padding_mode": "reflect"},
        {"padding": 1, "padding_mode": "circular", "stride": (1, 2)},
        {"groups": 2},
    ],
    ids=str,
)
def test_conv_input_norms_equal_those_of_torch_unfold(options):
    torch.manual_seed(4)
    conv = nn.Conv2d(4, 6, (3, 2), **options)
    x = torch.randn(3, 4, 7, 6)
    with InputNorms(select_parameters(conv, params=["weight"]).targets) as norms:
        out = conv(x)
    reference = unfolded_norms(conv, x)  # (in, kh, kw)
    groups = conv.groups
    rows = reference.view(groups, -1, 3, 2).movedim(
        1, -1
    )  # (groups, kh, kw, in / groups)
    expected = rows.repeat_interleave(6 // groups, 0) if groups > 1 else rows
    torch.testing.assert_close(norms.result()["weight"], expected)
    assert norms.counts["weight"] == out.shape[0] * out.shape[2] * out.shape[3]


class Indexed(Dataset):
    """Sample ``i`` is ``(x_i, i)``: a run's batches say which samples it saw."""

    def __init__(self, n: int = 48) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


class Trail(L.Callback):
    """At every batch: which samples it holds, and the state of every global RNG."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.rng: list[tuple[Any, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[1].tolist())
        state = np.random.get_state()
        self.rng.append(
            (torch.get_rng_state(), state[1].tolist(), state[2], random.getstate())
        )


def trail(init: str) -> tuple[Trail, Probe]:
    L.seed_everything(0, verbose=False)
    module = Probe(
        nn.Linear(8, 8), dropout=0.5
    )  # dropout draws from the RNG in training
    phases = [
        {"sparsity": 0.5, "until": 3},
        {"sparsity": "2:4", "algorithm": "static", "init": init, "until": 8},
        {"sparsity": 0.0},
    ]
    cb = SparsityCallback(phases=phases, params=["layer.weight"], verbose=False)
    record = Trail()
    loader = DataLoader(
        Indexed(), batch_size=4, shuffle=True
    )  # order drawn from the RNG
    fast_trainer(max_steps=16, callbacks=[cb, record]).fit(module, loader)
    return record, module


def test_calibration_changes_neither_the_batches_nor_any_rng_state():
    with_calibration, module = trail("wanda")
    without, reference = trail("topk")
    assert module.calibration_calls == 8 and reference.calibration_calls == 0
    assert with_calibration.batches == without.batches  # 16 steps over two epochs
    assert len(with_calibration.rng) == len(without.rng) == 16
    for step, (a, b) in enumerate(zip(with_calibration.rng, without.rng)):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], step


PHASES = [
    {"sparsity": 0.5, "until": 3},
    {"sparsity": "2:4", "algorithm": "static", "init": "wanda", "until": 7},
    {"sparsity": 0.6, "init": "wanda", "calibration_batches": 3, "until": 9},
    {"sparsity": 0.0},
]


def resume_run(tmp_path, stop_at=None, ckpt_path=None, seed=0):
    callback = SparsityCallback(phases=PHASES, verbose=False)
    calls: list[int] = []
    callbacks = [callback, CountCalibration(calls)]
    model = resumable_fit(tmp_path, callbacks, 11, stop_at, ckpt_path, seed)
    return model, callback, calls


class CountCalibration(L.Callback):
    """Records the step of every training_step run without gradients."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def on_fit_start(self, trainer, pl_module) -> None:
        step = pl_module.training_step

        def counted(batch, batch_idx):
            if not torch.is_grad_enabled():
                self.calls.append(trainer.global_step)
            return step(batch, batch_idx)

        pl_module.training_step = counted


@pytest.mark.parametrize("resume_step", [2, 5])
def test_resume_restores_the_wanda_mask_and_calibrates_only_at_later_phase_starts(
    tmp_path, resume_step
):
    reference, ref_cb, ref_calls = resume_run(tmp_path / "ref")
    # each wanda phase start runs its calibration batches (8 asked, the loader has 4; then 3)
    assert ref_calls == [3] * 4 + [7] * 3
    resume_run(tmp_path / "ck", stop_at=resume_step)
    (ckpt,) = (tmp_path / "ck").glob("*.ckpt")
    resumed, cb, calls = resume_run(tmp_path / "resumed", ckpt_path=ckpt, seed=123)
    assert calls == [c for c in ref_calls if c >= resume_step]
    assert cb.sparsifier.history == ref_cb.sparsifier.history
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_calibration_batches_needs_init_wanda_and_a_positive_count():
    with pytest.raises(ValueError, match="does nothing without init='wanda'"):
        Phase(sparsity=0.5, calibration_batches=4)
    with pytest.raises(
        ValueError, match="calibration_batches=0: use a positive integer"
    ):
        Phase(sparsity=0.5, init="wanda", calibration_batches=0)
    with pytest.raises(ValueError, match="init='magic': use 'topk'.*or 'wanda'"):
        Phase(sparsity=0.5, init="magic")


def test_init_wanda_with_runtime_says_to_use_static():
    with pytest.raises(  # when the callback is built
        ValueError,
        match="'init' does nothing for algorithm 'runtime'.*use algorithm: static",
    ):
        SparsityCallback(phases=[{"sparsity": "2:4", "init": "wanda"}])


def test_a_weight_whose_inputs_no_hook_sees_is_refused_at_fit_start():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    cb = SparsityCallback(
        phases=[{"sparsity": 0.5, "init": "wanda"}], params=["attn.in_proj_weight"]
    )
    with pytest.raises(
        ValueError, match="'attn.in_proj_weight' cannot have one.*exclude"
    ):
        cb.build(Attention(), RunLength(10))


def test_a_layer_that_never_runs_and_a_sparsifier_without_forwards_are_refused():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    targets = select_parameters(net, params=["*.weight"]).targets
    phases = resolve_phases([Phase(sparsity=0.5, init="wanda")], 10)
    with pytest.raises(ValueError, match="calibration_forwards="):
        Sparsifier("g", targets, phases).on_step_start(0, [])

    def first_layer_only(batches: int, seed: int) -> int:
        net[0](torch.randn(2, 4))
        return 1

    sparsifier = Sparsifier("g", targets, phases, calibration_forwards=first_layer_only)
    with pytest.raises(
        ValueError, match=r"no input reached the layers of parameters \['1.weight'\]"
    ):
        sparsifier.on_step_start(0, [])


def test_manual_optimization_is_refused_with_the_fix():
    class Manual(Probe):
        def __init__(self) -> None:
            super().__init__(nn.Linear(8, 8))
            self.automatic_optimization = False

    phases = [{"sparsity": 0.5, "init": "wanda"}]
    cb = SparsityCallback(phases=phases, params=["layer.weight"], verbose=False)
    loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    with pytest.raises(ValueError, match="automatic_optimization = False.*init: topk"):
        fast_trainer(max_steps=1, callbacks=[cb]).fit(Manual(), loader)


def test_sparsifier_driven_directly_gathers_norms_from_its_forwards():
    torch.manual_seed(6)
    net = nn.Linear(8, 4, bias=False)
    x = torch.randn(10, 8) * torch.linspace(0.1, 2.0, 8)
    seeds = []

    def forwards(batches: int, seed: int) -> int:
        seeds.append(seed)
        for _ in range(batches):
            net(x)
        return batches

    phase = Phase(sparsity=0.5, init="wanda", calibration_batches=3)
    targets = select_parameters(net, params=["weight"]).targets
    sparsifier = Sparsifier(
        "g", targets, resolve_phases([phase], 10), calibration_forwards=forwards
    )
    sparsifier.on_step_start(0, [])
    expected = row_target_mask(net.weight.detach().abs() * rms(x), 0.5)
    assert torch.equal(sparsifier.masks["weight"], expected)
    assert len(seeds) == 1
    assert layer_type(net).input_squares is not None


def test_a_training_step_without_batch_idx_is_called_as_lightning_calls_it():
    class BatchOnly(Probe):
        def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
            return super().training_step(batch, -1)

    module = BatchOnly(nn.Linear(8, 8))
    phases = [{"sparsity": 0.5, "init": "wanda", "calibration_batches": 2}]
    cb = SparsityCallback(phases=phases, params=["layer.weight"], verbose=False)
    loader = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    fast_trainer(max_steps=1, callbacks=[cb]).fit(module, loader)
    assert module.calibration_calls == 2
