"""Every recipe in recipes/ goes through the real ``lightning-sparse`` CLI: parsed, its classes
instantiated, and its sparsity schedule planned (``plan``: selection, phases resolved against
the run, backends, FLOPs), without training.

``plan`` builds every model on the ``meta`` device (no memory, no init time), so the
full-scale recipes (ViT-L/S DINOv2, GPT-2, a 7B Llama) plan as they are: ``plan`` never builds
their GPU accelerator, and never builds their data (their token files do not exist here), since
``max_steps`` gives the run length.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from helpers import pretend_gpu, speed_rows

from lightning_sparse import SparsityCallback
from lightning_sparse.backends import speed
from lightning_sparse.cli.main import SparseCLI
from lightning_sparse.masks import NM

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ALL = sorted(p for p in RECIPES.rglob("*.yaml") if p.parent.name != "overlays")
OVERLAYS = sorted((RECIPES / "overlays").glob("*.yaml"))
CPU_DEMOS = [p for p in ALL if p.name == "cpu_demo.yaml"]
VIT_L = RECIPES / "dinov2" / "vitl14_24_70pct.yaml"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])


def plan(recipe: Path, tmp_path: Path, *extra: str) -> SparseCLI:
    """``lightning-sparse plan`` on ``recipe``."""
    args = ["plan", f"--config={recipe}", *extra, f"--plot_path={tmp_path / 'p.png'}"]
    return SparseCLI(args=args)


def test_recipes_are_found():
    names = {str(p.relative_to(RECIPES)) for p in ALL + OVERLAYS}
    assert {
        "vit/cpu_demo.yaml",
        "dinov2/cpu_demo.yaml",
        "gpt/cpu_demo.yaml",
        "overlays/sparsity_24_70pct.yaml",
    } <= names
    assert len(ALL) >= 7


@pytest.mark.parametrize("recipe", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_plans_through_the_cli(recipe, tmp_path, capsys):
    header = recipe.read_text().split("\n", 1)[0]
    assert header.startswith("# "), "a recipe starts with a comment saying what it is"
    assert "Launch" in recipe.read_text() and "Expect" in recipe.read_text()
    cli = plan(recipe, tmp_path, "--plot=false")
    out = capsys.readouterr().out
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
    assert len(callbacks) == 1
    assert f"SparsityCallback '{callbacks[0].name}'" in out
    assert "Theoretical forward FLOP savings over the run" in out
    assert cli.trainer.global_step == 0
    # GPU recipes compile their model, with CUDA graphs where 2:4 kernels run (docs/recipes.md
    # says why; learned masks run masked math), per block without CUDA graphs under FSDP2
    # (docs/distributed.md); CPU recipes run eagerly
    config = yaml.safe_load(recipe.read_text())
    compile = cli.model.hparams.get("compile", False)
    kernels = '"2:4"' in recipe.read_text() and "learned" not in recipe.read_text()
    if config["trainer"].get("accelerator") != "gpu":
        assert compile is False
    elif "ModelParallelStrategy" in str(config["trainer"].get("strategy")):
        assert compile == "default"
    elif kernels:
        assert compile == "reduce-overhead"
    else:
        assert compile == "default"
    if "dinov2" in str(
        recipe
    ):  # the student only: never the EMA teacher or the DINO head
        assert "student.backbone.blocks.0.mlp.fc1.weight" in out
        assert "teacher." not in out.split("left dense:")[0]
        assert "student.head" not in out.split("left dense:")[0]


def test_gpt2_24_recipe_would_run_its_mlps_on_2to4_kernels_on_an_sm80_gpu(
    tmp_path, capsys, monkeypatch
):
    pretend_gpu(monkeypatch)
    timed = []  # verify_speed: true in the recipe, but a plan times nothing
    monkeypatch.setattr(speed, "measure_speedup", lambda *args: timed.append(args))
    plan(RECIPES / "gpt" / "gpt2_24_70pct.yaml", tmp_path, "--plot=false")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if ".mlp.c_fc.weight " in line]
    assert len(rows) == 2 * 12  # the plan table and the per-layer sparsity table
    assert all(
        "3072x768" in row and "semi_structured" in row and "cuSPARSELt" in row
        for row in rows[:12]
    )
    assert rows[0].endswith(
        "cuSPARSELt, sm80, bfloat16"
    )  # bf16-mixed: autocast matmuls
    assert timed == []


def test_gpt2_learn_masks_recipe_fine_tunes_on_2to4_kernels_on_an_h100(
    tmp_path, capsys
):
    """Its learned masks are handed over transposable, so the fine-tuning phase is planned
    on the 2:4 kernels (the learned phase samples on masked math)."""
    plan(
        RECIPES / "gpt" / "gpt2_learn_masks_24.yaml",
        tmp_path,
        "--gpu=h100",
        "--plot=false",
    )
    out = capsys.readouterr().out
    assert "learns 2:4 masks, transposable: project" in out
    rows = [line for line in out.splitlines() if ".mlp.c_fc.weight " in line]
    assert rows and all(
        "masked/semi_structured" in row and "cuSPARSELt, sm90" in row
        for row in rows[:12]
    )
    assert "which are not transposable" not in out


def test_overlay_adds_the_callback_to_a_dense_base_recipe(tmp_path, capsys):
    config = yaml.safe_load((RECIPES / "vit" / "cpu_demo.yaml").read_text())
    del config["trainer"]["callbacks"]
    base = tmp_path / "dense.yaml"
    base.write_text(yaml.safe_dump(config))
    cli = plan(base, tmp_path, f"--config={OVERLAYS[0]}", "--plot=false")
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)]
    assert callback.phases[0].target == NM(2, 4) and callback.phases[1].is_dense
    out = capsys.readouterr().out
    # no params: the default selection, attention and MLP linears of the 4 blocks
    assert "16 parameters" in out and "model.blocks.3.attn.qkv.weight" in out
    assert "model.head.weight" not in out.split("left dense:")[0]


def test_full_scale_recipes_plan_as_configured_without_gpu_or_data(tmp_path, capsys):
    """No override: the recipe's gpu accelerator, 8 devices and ddp are assumed, not built,
    and its token files (absent here) are never opened."""
    cli = plan(RECIPES / "gpt" / "gpt2_24_70pct.yaml", tmp_path, "--plot=false")
    out = capsys.readouterr().out
    assert "accelerator=gpu, devices=8" in out and "strategy=ddp" in out
    assert "precision=bf16-mixed" in out and "No data was read" in out
    assert cli.datamodule is None and cli.trainer.global_step == 0


def test_a_7b_llama_plans_on_the_meta_device_with_its_mlps_on_2to4_kernels(
    tmp_path, capsys
):
    """A model of any size plans on a laptop: the 7B Llama is never materialised."""
    recipe = RECIPES / "hf" / "llama7b_24_plan.yaml"
    cli = plan(recipe, tmp_path, "--gpu=h100", "--plot=false")
    params = list(cli.model.parameters())
    assert all(p.is_meta for p in params)
    assert 6.7e9 < sum(p.numel() for p in params) < 6.8e9
    out = capsys.readouterr().out
    assert "SparsityCallback 'sparsity': 96 parameters, 2 phase(s)" in out
    rows = speed_rows(out)
    assert rows["4096->11008"][0] == "64" and rows["11008->4096"][0] == "32"


def test_plan_for_a_target_gpu_predicts_each_layers_kernel(tmp_path, capsys):
    plan(VIT_L, tmp_path, "--plot=false", "--gpu=h100")
    out = capsys.readouterr().out
    assert "predicted for H100 SXM (sm90" in out and "not a measured speed" in out
    rows = [line for line in out.splitlines() if ".mlp.fc1.weight " in line]
    assert rows and all(
        "semi_structured" in r and "cuSPARSELt, sm90" in r for r in rows[:24]
    )
    assert "at peak rates" in out
    # as fit will time them: the recipe compiles with CUDA graphs (reduce-overhead)
    assert (
        "verify_speed: on: each layer shape on a 2:4 kernel timed at fit start, as CUDA "
        "graphs, at 32896 tokens; slower ones keep dense math" in " ".join(out.split())
    )
    # what decides on the GPU, and what 2:4 kernels did on an H100, not a range from elsewhere
    assert (
        "Fit start decides on the GPU itself: a kernel check runs a small 2:4 matmul"
        in out
    )
    assert (
        "0.15-0.24x dense per layer in eager training" in out and "1.1-1.4x" not in out
    )


def test_plan_times_a_model_compiled_without_cuda_graphs_eagerly(tmp_path, capsys):
    recipe = (
        RECIPES / "hf" / "llama_1b_fsdp2_24_70pct.yaml"
    )  # compile: default, per block
    plan(recipe, tmp_path, "--plot=false", "--gpu=h100")
    assert (
        "verify_speed: on: each layer shape on a 2:4 kernel timed at fit start, eagerly, at "
        "16384 tokens" in " ".join(capsys.readouterr().out.split())
    )


@pytest.mark.parametrize(
    "gpu, measured_on",
    [
        ("h100", "measured on this GPU (H100 80GB HBM3 SXM; torch 2.11.0+cu130"),
        (
            "h200",
            "measured on an H100 80GB HBM3 SXM, another sm90 GPU (torch 2.11.0+cu130",
        ),
    ],
)
def test_plan_for_an_sm90_gpu_estimates_the_mlps_speed_from_measured_ratios(
    gpu, measured_on, tmp_path, capsys
):
    """ViT-L/14's fc1 (1024->4096) and fc2 (4096->1024) matmuls were measured on an H100 SXM
    at 12336 tokens, fc1's also at 32896; there fc2's is taken equal to it."""
    plan(VIT_L, tmp_path, "--plot=false", f"--gpu={gpu}")
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the speed block wraps its sentences
    assert (
        f"48 of the 48 layers on 2:4 kernels have a measured shape, {measured_on}"
        in text
    )
    low, high = (
        3 / (1 / 1.19 + 1 / 1.34 + 1),
        3 / (2 / 1.37 + 1),
    )  # the step at 12336 and 32896 tokens
    step = f"{low:.2f}-{high:.2f}x"
    assert speed_rows(out) == {
        "1024->4096": ["24", "12336-32896", "1.19-1.37x", "1.34x, else equal", step],
        "4096->1024": ["24", "12336-32896", "1.34x, else equal", "1.19-1.37x", step],
    }
    assert "packing W and W.T not counted, so an upper estimate" in text
    assert "fit start decides on the GPU itself (kernel check, verify_speed)" in text


def test_plan_for_a_gpu_without_measurements_bounds_the_speed_by_peak_rates(
    tmp_path, capsys
):
    plan(VIT_L, tmp_path, "--plot=false", "--gpu=a100")
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "0 of the 48 layers on 2:4 kernels have a measured shape" in text
    bound = ["-", "<= 2.0x (peak)", "<= 2.0x (peak)", "<= 1.50x (peak)"]
    assert speed_rows(out) == {
        "1024->4096": ["24", *bound],
        "4096->1024": ["24", *bound],
    }
    assert (
        "bounds from its peak rates (312 TFLOP/s dense, 624 with 2:4), not predictions"
        in text
    )
    assert "measured on this GPU" not in text and "another sm90 GPU" not in text


def test_plan_for_a_target_gpu_says_why_a_shape_stays_masked(tmp_path, capsys):
    """The tiny ViT's 384x96 fc1 takes no 2:4 kernel: cuSPARSELt needs multiples of 128, and
    CUTLASS (sm8x only) multiples of 64."""
    recipe = RECIPES / "vit" / "cpu_demo.yaml"
    for gpu, cutlass in [("h100", "CUTLASS 2:4 kernels are sm8x only"), ("sm80", "64")]:
        plan(
            recipe,
            tmp_path,
            "--plot=false",
            f"--gpu={gpu}",
            "--trainer.precision=bf16-mixed",
        )
        out = capsys.readouterr().out
        row = next(
            line for line in out.splitlines() if "blocks.0.mlp.fc1.weight " in line
        )
        assert "384x96" in row and " masked " in row
        assert (
            "cuSPARSELt needs both dimensions multiples of 128" in row
            and cutlass in row
        )


def test_plan_rejects_an_unknown_gpu_with_the_names_it_knows(tmp_path):
    with pytest.raises(SystemExit, match="neither a GPU this plan knows.*'h100'"):
        plan(RECIPES / "vit" / "cpu_demo.yaml", tmp_path, "--plot=false", "--gpu=h1000")


def test_an_overlay_alone_says_to_combine_it_with_a_base_config(tmp_path):
    with pytest.raises(SystemExit, match="give a base config first") as err:
        SparseCLI(args=["plan", f"--config={OVERLAYS[0]}"])
    assert "Traceback" not in str(err.value)


def test_an_epoch_counted_run_without_its_data_says_what_to_add(tmp_path):
    """Counted in epochs, the run's length needs the train loader, whose token file is not
    here: the message names the file and the setting that plans without it."""
    recipe = RECIPES / "gpt" / "gpt2_24_70pct.yaml"
    epochs = ["--plot=false", "--trainer.max_steps=-1", "--trainer.max_epochs=2"]
    with pytest.raises(SystemExit, match="train_path.*max_steps=N") as err:
        plan(recipe, tmp_path, *epochs)
    assert "Traceback" not in str(err.value)
