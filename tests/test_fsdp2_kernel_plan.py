"""``plan`` for the Llama FSDP2 recipe: every MLP on a 2:4 kernel on an H100, the per-shape
estimate, and the memory per rank for weights, masks and packing, phase by phase."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import pretend_gpu, speed_rows
from torch import nn

from lightning_sparse.cli.main import SparseCLI
from lightning_sparse.cli.memory import PACKING_BYTES, phase_memory
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.sparsifier import Sparsifier

RECIPE = (
    Path(__file__).resolve().parents[1]
    / "recipes"
    / "hf"
    / "llama_1b_fsdp2_24_70pct.yaml"
)
MLP = 16 * 3 * 2048 * 8192  # the selected weights: 3 MLP matrices in each of 16 blocks
# every parameter: the (tied) embedding, 16 blocks of attention (32 query and 8 key-value heads
# of 64), MLP and 2 norms, and the final norm
BLOCK = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048
LLAMA_1B = 128256 * 2048 + 16 * BLOCK + 2048
MIB = 2**20

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def plan(capsys, *extra: str) -> str:
    """``lightning-sparse plan`` of the recipe for an H100, the model on the meta device."""
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(sys, "argv", ["lightning-sparse"])
        SparseCLI(
            args=["plan", f"--config={RECIPE}", "--gpu=h100", "--plot=false", *extra]
        )
    return capsys.readouterr().out


def memory_rows(out: str) -> dict[str, list[str]]:
    """The memory table's rows by phase: parameters, gradients, optimizer state, masks, whole
    masks, packing, logits, total, until backward, at a mask choice, fits the GPU."""
    table = out.split("memory per rank", 1)[1]
    rows = (re.split(r"\s{2,}", line.strip()) for line in table.splitlines())
    return {
        cells[0]: cells[1:] for cells in rows if re.fullmatch(r"phase \d+", cells[0])
    }


def test_fsdp2_kernel_plan_of_the_llama_recipe_on_8_h100s(capsys):
    out = plan(capsys)
    assert "strategy=lightning.pytorch.strategies.ModelParallelStrategy" in out
    mlp = [line for line in out.splitlines() if ".mlp." in line and "x" in line]
    kernel = [line for line in mlp if "semi_structured" in line]
    assert len(kernel) == 48  # every MLP weight, predicted on cuSPARSELt in bfloat16
    assert all(line.endswith("cuSPARSELt, sm90, bfloat16") for line in kernel)
    assert "timed at fit start, eagerly, at 16384 tokens" in out
    # the per-shape estimate: no measured ratio at these shapes, so the peak-rate bounds
    rows = speed_rows(out)
    assert rows["2048->8192"] == ["32", "-", "<= 2.0x (peak)", "<= 2.0x (peak)"] + [
        "<= 1.50x (peak)"
    ]
    assert rows["8192->2048"][0] == "16"
    # float32 parameters (each of them, the MLPs' among them), their gradients, Adam's two
    # moments and bool masks of the MLPs sharded over 8 ranks; runtime keeps no whole mask and
    # no packing; choosing the masks at the phase start gathers one layer and its mask at once
    assert "FSDP2 over 8 rank(s)" in out
    params, masks = LLAMA_1B * 4 / 8, MLP / 8
    total = params * 4 + masks  # parameters, gradients, 2 moments
    need = (total + 2048 * 8192 * 5) / 2**30
    assert (
        memory_rows(out)
        == {
            "phase 1": [
                f"{params / MIB:.1f}",
                f"{params / MIB:.1f}",
                f"{2 * params / MIB:.1f}",
                f"{masks / MIB:.1f}",
                "0.0",
                "0.0",
                "0.0",
                f"{total / MIB:.1f}",
                "-",  # the cuSPARSELt op saves FSDP2's gathered weight, freed after the forward
                f"+{2048 * 8192 * 5 / MIB:.1f} (transient)",  # one layer's weight and mask
                f"yes: {need:.1f} GiB, {80 - need:.1f} left",
            ],
            "phase 2": [  # dense: no masks
                *[f"{v / MIB:.1f}" for v in (params, params, 2 * params)],
                *["0.0"] * 4,
                f"{4 * params / MIB:.1f}",
                "-",
                "-",
                f"yes: {4 * params / 2**30:.1f} GiB, {80 - 4 * params / 2**30:.1f} left",
            ],
        }
    )


def test_fsdp2_kernel_plan_shards_over_the_devices_given(capsys):
    out = plan(capsys, "--trainer.devices=4")
    assert "FSDP2 over 4 rank(s)" in out
    row = memory_rows(out)["phase 1"]
    assert [row[0], row[3]] == [f"{LLAMA_1B * 4 / 4 / MIB:.1f}", f"{MLP / 4 / MIB:.1f}"]


@pytest.mark.parametrize("algorithm", ["magnitude", "static"])
@pytest.mark.parametrize("shards", [1, 8])
def test_fsdp2_kernel_memory_of_stored_masks_on_the_kernel(
    monkeypatch, shards, algorithm
):
    """A stored mask on cuSPARSELt, straight-through (``magnitude``) or hard (``static``),
    keeps each layer's packing whole on every rank, and under FSDP2 also its whole mask
    (the forward runs on the gathered weight)."""
    pretend_gpu(monkeypatch, (9, 0))
    net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    phases = resolve_phases(
        [Phase(sparsity="2:4", algorithm=algorithm, until=50), Phase(sparsity=0.0)],
        100,
    )
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    sp = Sparsifier("g", targets, phases, compute_dtype=torch.bfloat16)
    assert {c.kernel for c in sp.backends.values()} == {"cusparselt"}
    numel = 2 * 1024 * 4096
    memory, dense = phase_memory(sp, shards)
    assert dense.masks == dense.packing == dense.at_mask_choice == 0
    assert (
        memory.weights == memory.parameters == numel * 4 // shards
    )  # the group's only
    assert memory.optimizer_state == 2 * memory.gradients == 2 * memory.parameters
    assert memory.masks == numel // shards
    assert memory.whole_masks == (numel if shards > 1 else 0)
    assert memory.packing == numel * PACKING_BYTES
    assert memory.until_backward == 0  # the stored-mask ops multiply the weight itself
    assert memory.at_mask_choice == (numel // 2 * 5 if shards > 1 else 0)  # one layer


def test_the_hf_module_names_a_bad_fsdp2_dtype():
    pytest.importorskip("transformers")
    from lightning_sparse.demo.hf import HuggingFaceCausalLM

    with pytest.raises(ValueError, match="param_dtype='bf16' is invalid"):
        HuggingFaceCausalLM("llama", param_dtype="bf16")


def test_plan_says_whether_each_phase_of_a_7b_llama_on_8_ranks_fits_80_gib(capsys):
    """Llama-2-7B's shapes under FSDP2 over 8 ranks: float32 parameters, gradients and AdamW's
    two moments sharded 8 ways, the MLPs' mask shards in the 2:4 phase, one MLP weight and mask
    gathered to choose it; the plan says each phase fits an H100's 80 GiB, and by how much."""
    recipe = RECIPE.with_name("llama7b_fsdp2_24_plan.yaml")
    with pytest.MonkeyPatch.context() as patch, torch.device("meta"):
        patch.setattr(sys, "argv", ["lightning-sparse"])
        SparseCLI(args=["plan", f"--config={recipe}", "--gpu=h100", "--plot=false"])
    out = capsys.readouterr().out
    # the (untied) embedding and head, 32 blocks of attention, MLP and 2 norms, a final norm
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    params = (2 * 32000 * 4096 + 32 * block + 4096) * 4 / 8
    masks = 96 * 4096 * 11008 / 8
    one_layer = 4096 * 11008 * 5
    rows = memory_rows(out)
    for phase, kept in (("phase 1", 4 * params + masks), ("phase 2", 4 * params)):
        row = rows[phase]
        assert row[0] == f"{params / MIB:.1f}" and row[7] == f"{kept / MIB:.1f}"
        transient = one_layer if phase == "phase 1" else 0
        need = (kept + transient) / 2**30
        assert row[-1] == f"yes: {need:.1f} GiB, {80 - need:.1f} left"
    assert rows["phase 1"][3] == f"{masks / MIB:.1f}"
    assert rows["phase 1"][9] == f"+{one_layer / MIB:.1f} (transient)"


@pytest.mark.parametrize("cusparselt", [True, False], ids=["cuSPARSELt", "CUTLASS"])
def test_until_backward_counts_the_pruned_copy_on_cutlass_only(monkeypatch, cusparselt):
    """``runtime`` 2:4 on an A100: the cuSPARSELt ops save the weight itself; CUTLASS's
    forward keeps its pruned copy in the matmul dtype (bf16) until the backward."""
    pretend_gpu(monkeypatch, (8, 0), cusparselt=cusparselt)
    net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    phases = resolve_phases([Phase(sparsity="2:4")], 100)
    sp = Sparsifier("g", targets, phases, compute_dtype=torch.bfloat16)
    kernel = "cusparselt" if cusparselt else "cutlass"
    assert {c.kernel for c in sp.backends.values()} == {kernel}
    (memory,) = phase_memory(sp, 8, torch.bfloat16)
    assert memory.until_backward == (0 if cusparselt else 2 * 1024 * 4096 * 2)


@pytest.mark.parametrize(
    "skipped", [False, True], ids=["split", "allow_skipped_layers"]
)
def test_plan_splits_learned_logits_over_the_ranks_of_ddp_and_fsdp2(skipped):
    """A learned 2:4 phase on 8 ranks: each holds 1/8 of every weight's groups' logits (6 per
    group of 4, float32, with their gradient and Adam's moments: 24 bytes a weight over all
    ranks), under FSDP2 and under DDP; with ``allow_skipped_layers`` every rank holds them all."""
    net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    phases = resolve_phases(
        [Phase(sparsity="2:4", algorithm="learned", until=50), Phase(sparsity=0.0)], 100
    )
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    sp = Sparsifier("g", targets, phases, allow_skipped_layers=skipped)
    assert sp.algorithms[0].shards.split is not skipped  # what the engine learns with
    whole = 2 * 1024 * 4096 * 24
    share = whole if skipped else whole // 8
    for shards, ranks in ((8, None), (1, 8)):  # FSDP2 over 8 ranks; DDP on 8
        memory, dense = phase_memory(sp, shards, ranks=ranks)
        assert memory.logits == share and dense.logits == 0
    (alone, _) = phase_memory(sp)
    assert alone.logits == whole


def test_learned_logits_of_a_7b_llama_s_mlps_fit_8_ranks():
    """Llama-2-7B's 96 MLP weights (4096x11008) learning 2:4 masks: 96.75 GiB of logits with
    their gradient and Adam state in all, 12.09 GiB on each of 8 ranks (docs/distributed.md)."""
    with torch.device("meta"):
        mlps = nn.ModuleList(
            nn.Linear(4096, 11008) if i % 3 != 2 else nn.Linear(11008, 4096)
            for i in range(96)
        )
    phases = resolve_phases(
        [Phase(sparsity="2:4", algorithm="learned", until=50), Phase(sparsity=0.0)], 100
    )
    sp = Sparsifier("g", select_parameters(mlps, params=["*.weight"]).targets, phases)
    (memory, _) = phase_memory(sp, 8, torch.bfloat16)
    assert memory.logits / 2**20 == 12384.0
    assert phase_memory(sp, 1)[0].logits / 2**20 == 99072.0
