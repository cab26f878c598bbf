"""The measured 2:4 ratios ``plan --gpu`` predicts from: the records equal the table in
docs/hopper.md, the lookup picks the measurements that speak for a GPU, and a layer's training
step is estimated from its two sparse matmuls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import fast_trainer, speed_rows
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_sparse import SparsityCallback
from lightning_sparse.backends.gpus import parse_gpu
from lightning_sparse.backends.measured import (
    H100_FORWARD,
    RATIOS,
    setup_for,
    step_estimates,
    step_speed,
)
from lightning_sparse.cli.plan import MEASURED_2TO4, format_plan, plan_schedule

HOPPER = Path(__file__).resolve().parents[1] / "docs" / "hopper.md"
COLUMN = "searched, graphed"  # the forward table's column the records hold


def documented_ratios() -> list[tuple[int, int, int, float]]:
    """``(tokens, in, out, ratio)`` of each row of the forward table in docs/hopper.md."""
    lines = HOPPER.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if COLUMN in line)
    cells = [c.strip() for c in lines[header].strip("|").split("|")]
    column = cells.index(COLUMN)
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        shape = re.match(r"`?(\d+)x(\d+)->(\d+)", cells[0])
        assert shape, (
            f"docs/hopper.md: a row of the forward table without a shape: {line}"
        )
        tokens, inputs, outputs = map(int, shape.groups())
        rows.append((tokens, inputs, outputs, float(cells[column].removesuffix("x"))))
    return rows


def test_the_records_are_the_forward_table_of_the_hopper_page():
    documented = [r for r in RATIOS if r.setup.documented == "docs/hopper.md"]
    assert [
        (r.tokens, r.in_features, r.out_features, r.ratio) for r in documented
    ] == documented_ratios()
    # the page names what the records say about the conditions
    text = " ".join(HOPPER.read_text().split())
    for fact in ("torch 2.11.0+cu130", "cuSPARSELt 0.8.0", "bf16", "H100 80GB HBM3"):
        assert fact in text
    assert "plan --gpu" in text


def test_the_quoted_sentence_is_derived_from_the_records():
    assert "1.05-1.79x for the forward x @ W.T with W packed once" in MEASURED_2TO4
    assert "torch 2.11.0+cu130 and cuSPARSELt 0.8.0" in MEASURED_2TO4


@pytest.mark.parametrize(
    "gpu, dtype, found",
    [
        ("h100", torch.bfloat16, True),
        ("h200", torch.bfloat16, True),  # another sm90 GPU
        ("h100-pcie", torch.bfloat16, True),
        ("sm90", torch.bfloat16, True),
        ("h100", torch.float16, False),  # measured in bfloat16 only
        ("a100", torch.bfloat16, False),
        ("b200", torch.bfloat16, False),
    ],
)
def test_the_measurements_speak_for_gpus_of_their_capability_and_dtype(
    gpu, dtype, found
):
    assert setup_for(parse_gpu(gpu), dtype) == (H100_FORWARD if found else None)


def test_a_layers_step_is_estimated_from_its_forward_and_input_gradient():
    # GPT-2 c_fc (768 -> 3072): its forward was measured, its input gradient taken equal
    c_fc = step_estimates(768, 3072, H100_FORWARD)
    assert [(s.tokens, s.forward, s.input_grad, s.assumed) for s in c_fc] == [
        (8192, 1.17, 1.17, "input gradient")
    ]
    assert c_fc[0].training == pytest.approx(3 / (1 / 1.17 + 1 / 1.17 + 1))
    # GPT-2 c_proj (3072 -> 768): its input gradient is the measured 768 -> 3072 matmul
    c_proj = step_estimates(3072, 768, H100_FORWARD)
    assert [(s.tokens, s.input_grad, s.assumed) for s in c_proj] == [
        (8192, 1.17, "forward")
    ]
    assert step_estimates(384, 1536, H100_FORWARD) == []
    assert step_speed(2.0, 2.0) == 1.5  # the bound at twice the dense rate


def test_both_matmuls_measured_at_a_token_count_are_paired():
    # ViT-L fc1 (1024 -> 4096): both measured at 12336 tokens, the forward only at 32896
    first, second = step_estimates(1024, 4096, H100_FORWARD)
    assert (first.forward, first.input_grad, first.assumed) == (1.19, 1.34, None)
    assert first.training == pytest.approx(3 / (1 / 1.19 + 1 / 1.34 + 1))
    assert (second.tokens, second.assumed) == (32896, "input gradient")


class Mlp(BoringModel):
    """A measured MLP shape and an unmeasured one, each multiple of 128 (cuSPARSELt)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(1024, 4096), nn.Linear(4096, 1024)
        self.up, self.down = nn.Linear(384, 1536), nn.Linear(1536, 384)


def test_a_plan_for_the_measured_gpu_estimates_measured_shapes_and_bounds_the_rest():
    cb = SparsityCallback(
        sparsity="2:4", params=["fc*.weight", "up.weight", "down.weight"]
    )
    trainer = fast_trainer(max_steps=10, callbacks=[cb])
    with torch.device("meta"):
        model = Mlp()
    plan = plan_schedule(trainer, model, gpu=parse_gpu("h100"), precision="bf16-mixed")
    text = format_plan(plan)
    flat = " ".join(text.split())
    assert (
        "2 of the 4 layers on 2:4 kernels have a measured shape, measured on this GPU"
        in flat
    )
    rows = speed_rows(text)
    low, high = 3 / (1 / 1.19 + 1 / 1.34 + 1), 3 / (2 / 1.37 + 1)
    assert rows["1024->4096"] == [
        "1",
        "12336-32896",
        "1.19-1.37x",
        "1.34x, else equal",
        f"{low:.2f}-{high:.2f}x",
    ]
    assert rows["384->1536"] == [
        "1",
        "-",
        "<= 2.0x (peak)",
        "<= 2.0x (peak)",
        "<= 1.50x (peak)",
    ]
    assert "bounds from its peak rates (989 TFLOP/s dense, 1979 with 2:4)" in flat
    assert "packing W and W.T not counted, so an upper estimate" in flat
    assert all(len(line) <= 100 for line in text.splitlines() if "->" in line)
