"""The ``lightning-sparse`` command: ``fit`` (with its end summary), ``validate`` and ``plan``
(dry run: text report, FLOP accounting, the PNG plot), as a user runs them."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import FEW_UPDATES, Classifier, TinyModule, fast_trainer, random_loader
from lightning.pytorch.cli import LightningCLI
from test_models import tiny_torchvision_vit
from torch import nn

from lightning_sparse import SparsityCallback
from lightning_sparse.cli.flops import linear_flops_per_token
from lightning_sparse.cli.main import SparseCLI, main
from lightning_sparse.cli.plan import format_plan, plan_schedule, run_length
from lightning_sparse.demo import GPTLanguageModel
from lightning_sparse.masks import NM

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
VIT_DEMO = RECIPES / "vit" / "cpu_demo.yaml"
# the ViT demo recipe, shrunk to a few steps of a one-block model
SMALL_VIT = [
    "--trainer.max_epochs=2",
    "--trainer.limit_train_batches=5",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.model_kwargs={img_size: 16, patch_size: 8, embed_dim: 32, depth: 1, "
    + "num_heads: 2}",
    "--data.init_args.image_size=16",
]

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), FEW_UPDATES]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    monkeypatch.chdir(
        tmp_path
    )  # a fit without default_root_dir writes config.yaml here


def test_help_lists_fit_validate_and_plan(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "{fit,validate,plan}" in capsys.readouterr().out


def test_fit_ends_with_the_phases_final_sparsity_metric_and_wall_time(
    tmp_path, capsys, lightning_log
):
    cli = SparseCLI(
        args=[
            "fit",
            f"--config={VIT_DEMO}",
            *SMALL_VIT,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 10
    summary = lightning_log.text.split("SparsityCallback 'sparsity' summary")[1]
    assert "steps 0-6: phase 1: 2:4 runtime" in summary  # round(0.7 * 10) = 7
    assert "steps 7-9: phase 2: dense" in summary
    assert "final sparsity: 0.0% over 2 parameters" in summary  # fc1 and fc2, now dense
    # the end of the run, on the same stream as the callback's summary
    end = summary[summary.index("Finished: 10 optimizer steps, 2 epochs in ") :]
    assert "Finished" not in capsys.readouterr().out
    assert "wall time" in end.splitlines()[0]
    acc = float(end.split("val/acc: ")[1].split()[0])
    assert acc == pytest.approx(float(cli.trainer.callback_metrics["val/acc"]))


def test_validate_prints_the_metrics(tmp_path, capsys):
    SparseCLI(
        args=[
            "validate",
            f"--config={VIT_DEMO}",
            *SMALL_VIT,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert "val/acc" in capsys.readouterr().out


def test_plan_reports_the_vit_demo_and_writes_the_plot_into_the_run_directory(
    tmp_path, capsys
):
    recipe = tmp_path / "recipes" / "cpu_demo.yaml"
    recipe.parent.mkdir()
    shutil.copy(VIT_DEMO, recipe)
    cli = SparseCLI(args=["plan", f"--config={recipe}"])
    out = capsys.readouterr().out
    assert cli.trainer.global_step == 0
    # run length: 30 epochs x ceil(1437 / 32) = 45 steps, as the trainer will estimate it
    assert (
        "Run: 1350 optimizer steps: max_epochs=30 x 45 optimizer steps per epoch" in out
    )
    assert "phase 1: steps 0-944" in out and "phase 2: steps 945-1349" in out
    fc1 = [line for line in out.splitlines() if "model.blocks.0.mlp.fc1.weight" in line]
    assert "384x96" in fc1[0] and "2:4 runtime" in fc1[0]
    assert "masked" in fc1[0] and "no CUDA GPU" in fc1[0]  # the backend here, and why
    assert fc1[1].split()[1:] == ["0.0737", "50.0%", "0.0%"]  # 2*96*384 FLOPs per token
    assert "not matched by params: model.cls_token" in out  # what stays dense, and why
    # MLPs: 8 of the 12 d^2 per block; heads and patch embedding aside: 66.5% of Linear FLOPs
    assert "(66.5% of the model's trainable Linear FLOPs)" in out
    assert "skips 33.3% of the forward Linear FLOPs" in out
    assert "over the run: 23.3% of the trainable nn.Linear matmul FLOPs" in out
    png = Path("runs/vit_cpu_demo/sparsity_plan.png")  # the recipe's default_root_dir
    assert f"Schedule plot: {png}" in out and list(recipe.parent.iterdir()) == [recipe]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def vit_demo_with(tmp_path, **init_args):
    """The ViT demo recipe with its SparsityCallback's arguments replaced by ``init_args``."""
    config = yaml.safe_load(VIT_DEMO.read_text())
    (callback,) = [
        c
        for c in config["trainer"]["callbacks"]
        if c["class_path"].endswith("Callback")
    ]
    callback["init_args"] = init_args
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_builds_the_model_on_the_meta_device(tmp_path, capsys):
    recipe = vit_demo_with(tmp_path, phases=[{"sparsity": "2:4"}])  # default selection
    cli = SparseCLI(args=["plan", f"--config={recipe}", "--plot=false"])
    assert all(p.is_meta for p in cli.model.parameters())  # no weight was ever made
    out = capsys.readouterr().out
    assert (
        "The model was built on the meta device (shapes and dtypes, no weights)." in out
    )
    assert "SparsityCallback 'sparsity': 16 parameters" in out


def test_a_model_on_the_meta_device_finds_its_head_by_a_meta_forward():
    with torch.device("meta"):
        module = Classifier(tiny_torchvision_vit(), example=torch.randn(1, 3, 16, 16))
    cb = SparsityCallback(sparsity="2:4")
    text = format_plan(
        plan_schedule(fast_trainer(max_steps=10, callbacks=[cb]), module)
    )
    assert (
        "output head model.heads.head: returned by the forward of example_input_array"
        in text
    )


class CompiledInConfigureModel(Classifier):
    """Compiled in ``configure_model``, as the demo models are, by a backend that must never
    run in a plan."""

    def configure_model(self) -> None:
        def refuse(graph: object, inputs: object) -> None:
            raise AssertionError("the plan compiled the model")

        self.model.compile(backend=refuse)


def test_plan_runs_configure_model_and_records_the_head_without_compiling():
    with torch.device("meta"):
        module = CompiledInConfigureModel(
            tiny_torchvision_vit(), example=torch.randn(1, 3, 16, 16)
        )
    cb = SparsityCallback(sparsity="2:4")  # default selection: a forward finds the head
    text = format_plan(
        plan_schedule(fast_trainer(max_steps=10, callbacks=[cb]), module)
    )
    assert module.model._compiled_call_impl is not None  # configure_model ran
    assert "output head model.heads.head: returned by the forward" in text


def test_plan_builds_a_model_that_reads_its_weights_for_real_and_says_so(capsys):
    cli = SparseCLI(
        args=[
            "plan",
            "--seed_everything=0",
            "--model=helpers.ReadsItsWeights",
            "--data=lightning.pytorch.LightningDataModule",
            "--trainer.max_steps=10",
            (
                '--trainer.callbacks=[{"class_path": "lightning_sparse.SparsityCallback", '
                '"init_args": {"sparsity": 0.5}}]'
            ),
            "--plot=false",
        ]
    )
    assert not any(p.is_meta for p in cli.model.parameters())
    out = capsys.readouterr().out
    assert (
        "The model was built with its weights: its __init__ cannot run on the meta device "
        "(Tensor.item() cannot be called on meta tensors)." in out
    )
    assert "SparsityCallback 'sparsity': 2 parameters" in out


def test_plan_on_the_meta_device_shows_the_group_target_of_a_global_phase(
    tmp_path, capsys
):
    recipe = vit_demo_with(tmp_path, sparsity=0.8, distribution="global")
    SparseCLI(args=["plan", f"--config={recipe}", "--plot=false"])
    out = capsys.readouterr().out
    fc1 = [line for line in out.splitlines() if "model.blocks.0.mlp.fc1.weight" in line]
    assert fc1[1].split()[-1] == "80.0%"
    assert (
        "phase 1: the group's target on every layer; fit start spreads it by the" in out
    )


def test_plan_without_matplotlib_says_how_to_get_the_plot(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    SparseCLI(
        args=["plan", f"--config={VIT_DEMO}", f"--plot_path={tmp_path / 'p.png'}"]
    )
    out = capsys.readouterr().out
    assert "pip install 'lightning-sparse[plot]'" in out and "Run: 1350" in out
    assert not (tmp_path / "p.png").exists()


def test_plan_without_a_sparsity_callback_stops_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SparseCLI(args=["plan", f"--config={VIT_DEMO}", "--trainer.callbacks=[]"])
    assert "has no SparsityCallback" in str(exit_info.value)
    assert "recipes/overlays/sparsity_24_70pct.yaml" in str(exit_info.value)


@pytest.mark.parametrize(
    ("trainer_kwargs", "batches"),
    [
        ({"max_epochs": 3}, 10),
        ({"max_epochs": 3, "accumulate_grad_batches": 3}, 10),
        ({"max_epochs": 3, "limit_train_batches": 0.5}, 10),
        ({"max_epochs": 5, "limit_train_batches": 4, "max_steps": 13}, 10),
        ({"max_steps": 7}, 10),
    ],
)
def test_run_length_is_what_the_trainer_estimates_at_fit_start(trainer_kwargs, batches):
    class Loaders(L.LightningDataModule):
        def train_dataloader(self):
            return random_loader(n=8 * batches, batch_size=8)

    class Record(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.total = trainer.estimated_stepping_batches

    record = Record()
    planned, _ = run_length(fast_trainer(**trainer_kwargs), Loaders())
    fast_trainer(callbacks=[record], **trainer_kwargs).fit(TinyModule(), Loaders())
    assert planned.total_steps == record.total


def test_run_length_of_an_unsized_loader_is_max_steps():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(8), torch.randn(4))] * 5)

    class Loaders(L.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Stream(), batch_size=2)

    run, how = run_length(fast_trainer(max_epochs=2, max_steps=9), Loaders())
    assert run.total_steps == 9 and "max_steps" in how
    with pytest.raises(ValueError, match="has no length"):
        run_length(fast_trainer(max_epochs=2), Loaders())


def test_run_length_needs_a_bound():
    with pytest.raises(ValueError, match="set trainer.max_steps or trainer.max_epochs"):
        run_length(fast_trainer(max_epochs=-1))


def test_plan_builds_groups_as_fit_start_does_and_averages_ramps():
    cb = SparsityCallback(
        phases=[
            {"sparsity": 0.8, "algorithm": "gmp", "ramp": "linear", "until": 0.5},
            {"sparsity": 0.8, "until": 0.75, "distribution": "erk"},
            {"sparsity": 0.0},
        ],
        params=["net.fc1.weight", "net.fc2.weight"],
    )
    plan = plan_schedule(fast_trainer(max_steps=100, callbacks=[cb]), TinyModule())
    (group,) = plan.groups
    assert [(p.start, p.end) for p in group.sparsifier.phases] == [
        (0, 50),
        (50, 75),
        (75, 100),
    ]
    fc1, fc2 = (
        group.end_sparsity["net.fc1.weight"],
        group.end_sparsity["net.fc2.weight"],
    )
    assert fc1[0] == fc2[0] == pytest.approx(0.8)  # gmp ends at its target, uniform
    assert fc1[1] != fc2[1]  # erk gives the layers different sparsities
    # a linear ramp from 0 to 0.8 (updates every 100 steps: the whole phase is one window
    # ending at step 50) averages about half its final value over the phase
    mean = group.mean_sparsity["net.fc1.weight"][0]
    assert 0.3 < mean < 0.5
    assert group.mean_sparsity["net.fc1.weight"][2] == 0.0
    # the saving over the run: phases weighted by their share of the run
    expected = sum(
        fraction * saved
        for fraction, saved in zip([0.5, 0.25, 0.25], group.savings.per_phase)
    )
    assert group.savings.run == pytest.approx(expected)


def test_two_groups_claiming_a_parameter_fail_in_plan_as_in_fit():
    groups = [
        SparsityCallback(sparsity=0.5, params=["net.fc1.weight"], name="a"),
        SparsityCallback(sparsity="2:4", params=["net.*.weight"], name="b"),
    ]
    with pytest.raises(
        ValueError, match="claimed by SparsityCallback 'a' and SparsityCallback 'b'"
    ):
        plan_schedule(fast_trainer(max_steps=10, callbacks=groups), TinyModule())


def test_linear_flops_count_the_tied_head_and_leave_out_frozen_layers():
    lm = GPTLanguageModel(n_layer=1, n_embd=32, n_head=2, block_size=8)
    flops = linear_flops_per_token(lm)
    assert flops["model.transformer.wte.weight"] == 2 * 32 * 256  # the tied lm_head
    assert flops["model.transformer.h.0.mlp.c_fc.weight"] == 2 * 32 * 128
    frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    frozen[0].requires_grad_(False)
    assert list(linear_flops_per_token(frozen)) == ["1.weight"]


def test_quoted_nm_pattern_survives_a_plain_lightning_cli_yaml(tmp_path):
    """YAML 1.1 reads an unquoted 2:4 as the base-60 number 124; jsonargparse re-reads strings
    typed float-or-str, so the callback's types put str first to keep a quoted '2:4'."""
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  max_steps: 1
  callbacks:
    - class_path: lightning_sparse.SparsityCallback
      init_args:
        phases: [{sparsity: "2:4", until: 0.5}, {sparsity: 0.7, until: "90%"}, {sparsity: 0.0}]
    - class_path: lightning_sparse.SparsityCallback
      init_args: {sparsity: "2:4", name: other, params: [net.fc2.weight]}
"""
    )
    cli = LightningCLI(TinyModule, run=False, args=["--config", str(config)])
    first, second = [
        c for c in cli.trainer.callbacks if isinstance(c, SparsityCallback)
    ]
    assert [p.target for p in first.phases] == [NM(2, 4), 0.7, 0.0]
    assert first.phases[1].until == "90%"
    assert second.phases[0].target == NM(2, 4)


def test_an_unquoted_nm_pattern_gets_an_error_that_says_to_quote_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_sparse.SparsityCallback\n"
        "      init_args: {sparsity: 2:4}\n"
    )
    with pytest.raises(
        ValueError, match="how YAML 1.1 reads an unquoted 2:4.*quote it"
    ):
        LightningCLI(TinyModule, run=False, args=["--config", str(config)])


@pytest.mark.slow
def test_main_job_reaches_over_90_percent_in_minutes(
    tmp_path, lightning_log, monkeypatch
):
    """The README's first command, unchanged: ViT on digits, 2:4 for 70% then dense."""
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)
    main(["fit", f"--config={VIT_DEMO}"])
    out = lightning_log.text
    acc = float(out.split("val/acc: ")[1].split()[0])
    seconds = float(out.split("epochs in ")[1].split()[0])
    assert acc > 0.9 and seconds < 300 and not math.isnan(acc)


BAD_FIT = """
trainer:
  max_steps: 2
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_sparse.SparsityCallback
      init_args:
        params: [{params}]
        phases:
          - {{sparsity: {sparsity}}}
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
data:
  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule
"""


@pytest.mark.parametrize(
    ("params", "sparsity", "message"),
    [
        (
            '"layer.weight"',
            "1.5",
            "sparsity=1.5 is outside",
        ),  # when the callback is built
        (
            '"nothing.here"',
            "0.5",
            "'nothing.here' matches no parameter",
        ),  # at fit start
        ('"layer.weight"', "'2:5:1'", "sparsity"),
    ],
)
def test_config_errors_end_fit_with_a_message_not_a_traceback(
    tmp_path, params, sparsity, message, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # fit saves its config.yaml in the working directory
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_FIT.format(params=params, sparsity=sparsity))
    with pytest.raises(SystemExit) as err:
        main(["fit", f"--config={config}"])
    assert str(err.value).startswith("lightning-sparse fit: ") and message in str(
        err.value
    )


def test_a_bad_key_in_a_config_is_a_message(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_FIT.format(params='"layer.weight"', sparsity="0.5"))
    with pytest.raises(SystemExit, match="lightning-sparse: .*max_stepz"):
        main(["fit", f"--config={config}", "--trainer.max_stepz=3"])


def test_fit_resumes_from_ckpt_path_and_names_a_changed_schedule(
    tmp_path, lightning_log
):
    def fit(*args):
        return SparseCLI(
            args=["fit", f"--config={VIT_DEMO}", *SMALL_VIT[1:], *args]
        ).trainer

    fit(
        "--trainer.max_epochs=1",
        "--trainer.enable_checkpointing=true",
        f"--trainer.default_root_dir={tmp_path / 'first'}",
    )
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    resume = ["--trainer.max_epochs=2", f"--ckpt_path={ckpt}"]
    trainer = fit(*resume, f"--trainer.default_root_dir={tmp_path / 'resumed'}")
    assert trainer.global_step == 10
    summary = lightning_log.text.split("SparsityCallback 'sparsity' summary")[-1]
    # 5 steps put the boundary at 4, 10 at 7: phase 1 begins again at the resume step
    for line in (
        "0-3: phase 1: 2:4",
        "4-4: phase 2: dense",
        "5-6: phase 1",
        "7-9: phase 2",
    ):
        assert f"steps {line}" in summary
    changed = (
        "--trainer.callbacks.init_args.phases="
        "[{sparsity: 0.5, until: 0.7}, {sparsity: 0.0}]"
    )
    with pytest.raises(SystemExit) as exit_info:
        fit(*resume, changed, f"--trainer.default_root_dir={tmp_path / 'refused'}")
    assert (
        "lightning-sparse fit: [sparsity] the checkpoint was trained with another"
        in str(exit_info.value)
    )
    assert "phases[0].sparsity: 2:4 in the checkpoint, 0.5 now" in str(exit_info.value)


def test_plan_leaves_nm_misfits_dense_and_finds_the_head_by_the_example_forward():
    module = Classifier(tiny_torchvision_vit(), example=torch.randn(1, 3, 16, 16))
    cb = SparsityCallback(phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
    text = format_plan(
        plan_schedule(fast_trainer(max_steps=10, callbacks=[cb]), module)
    )
    assert (
        "3 input channels, not a multiple of M=4 (2:4 in phase 1): model.conv_proj.weight"
        in text
    )
    assert (
        "output head model.heads.head: returned by the forward of example_input_array"
        in text
    )
    # an explicit pattern that names the misfit keeps the error
    cb = SparsityCallback(sparsity="2:4", params=["conv_proj.weight"])
    with pytest.raises(
        ValueError, match=r"'model.conv_proj.weight': .*3 input channels"
    ):
        plan_schedule(fast_trainer(max_steps=10, callbacks=[cb]), module)


def test_plan_splits_learned_logits_over_the_ddp_ranks(tmp_path, capsys):
    """The plan of a learned phase under DDP on 2 devices: whole weights and masks on each
    rank, each rank's half of the logits (the table's logits column halves)."""
    phases = [
        {"sparsity": "2:4", "algorithm": "learned", "until": 0.5},
        {"sparsity": 0.0},
    ]
    recipe = vit_demo_with(tmp_path, phases=phases)
    logits = {}
    for devices in (1, 2):
        SparseCLI(
            args=[
                "plan",
                f"--config={recipe}",
                "--plot=false",
                f"--trainer.devices={devices}",
                "--trainer.strategy=ddp",
            ]
        )
        out = " ".join(capsys.readouterr().out.split())
        split = "each of 2 ranks, learned-mask logits split over them"
        assert (split in out) == (devices == 2)
        row = out.split("memory per rank", 1)[1].split("phase 1 ", 1)[1].split()
        logits[devices] = float(row[6])
    assert logits[2] == pytest.approx(logits[1] / 2, abs=0.1)
