"""DINO: teacher outside the optimizer and EMA-only, loss, evaluation metrics, a few steps."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import demo_trainer

from lightning_sparse.demo import (
    DigitsMultiCropDataModule,
    DINOSelfDistillation,
    knn_predict,
)
from lightning_sparse.demo.dino import (
    centered_teacher_probs,
    dino_loss,
    sinkhorn_knopp_teacher_probs,
)

TINY = {
    "img_size": 16,
    "patch_size": 8,
    "embed_dim": 32,
    "depth": 1,
    "num_heads": 2,
    "dynamic_img_size": True,
}
SMALL_HEAD = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16}


def tiny_datamodule() -> DigitsMultiCropDataModule:
    return DigitsMultiCropDataModule(
        image_size=16, local_crop_size=8, local_crops_number=2, batch_size=16
    )


class RecordTeacher(L.Callback):
    """Snapshots of student and teacher parameters after every training batch."""

    def __init__(self) -> None:
        self.snapshots = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # runs before the module's own on_train_batch_end, i.e. before this step's EMA update
        self.snapshots.append(
            (
                [p.detach().clone() for p in pl_module.student.parameters()],
                [p.detach().clone() for p in pl_module.teacher.parameters()],
            )
        )


def test_dino_trains_logs_and_updates_teacher_by_ema_only():
    torch.manual_seed(0)
    model = DINOSelfDistillation(
        model_kwargs=TINY, **SMALL_HEAD, warmup_steps=1, probe_steps=20
    )
    recorder = RecordTeacher()
    trainer = demo_trainer(val_check_interval=3, callbacks=[recorder])
    trainer.fit(model, tiny_datamodule())

    metrics = trainer.callback_metrics
    for key in (
        "train/loss",
        "train/teacher_temp",
        "train/ema_momentum",
        "val/knn_acc",
        "val/linear_probe_acc",
    ):
        assert key in metrics and math.isfinite(float(metrics[key])), key

    # the teacher is frozen and not in the optimizer
    optimizer = trainer.optimizers[0]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in in_optimizer for p in model.teacher.parameters())
    assert all(not p.requires_grad for p in model.teacher.parameters())
    assert {id(p) for p in model.student.parameters()} == in_optimizer

    # after step k: teacher_k = m_k * teacher_{k-1} + (1 - m_k) * student_k
    final_teacher = [p.detach().clone() for p in model.teacher.parameters()]
    teachers = [t for _, t in recorder.snapshots] + [final_teacher]
    for step, (student, _) in enumerate(recorder.snapshots):
        m = model.teacher_momentum(step)
        for t_prev, s, t_next in zip(teachers[step], student, teachers[step + 1]):
            torch.testing.assert_close(t_next, m * t_prev + (1 - m) * s)
    assert any(not torch.equal(a, b) for a, b in zip(teachers[0], final_teacher))


def test_teacher_starts_equal_to_student_and_is_a_separate_copy():
    model = DINOSelfDistillation(
        model_kwargs={**TINY, "depth": 2, "drop_path_rate": 0.1}, **SMALL_HEAD
    )
    for (name, s), (_, t) in zip(
        model.student.named_parameters(), model.teacher.named_parameters()
    ):
        assert torch.equal(s, t) and s is not t, name
    assert "student.backbone.blocks.0.mlp.fc1.weight" in dict(model.named_parameters())
    assert "teacher.backbone.blocks.0.mlp.fc1.weight" in dict(model.named_parameters())
    # stochastic depth regularizes the student only (block 1: rate 0.1)
    assert model.teacher.backbone.blocks[1].drop_path1.__class__.__name__ == "Identity"
    assert model.student.backbone.blocks[1].drop_path1.__class__.__name__ == "DropPath"


def test_knn_on_identical_features_is_perfect():
    model = DINOSelfDistillation(model_kwargs=TINY, **SMALL_HEAD, probe_steps=100)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(200, 32, generator=g)
    labels = torch.randint(0, 10, (200,), generator=g)
    metrics = model.evaluate_features(features, labels, features, labels)
    assert (
        metrics["knn_acc"].item() == 1.0
    )  # random labels: only a real lookup gets them all
    assert set(metrics) == {"knn_acc", "linear_probe_acc"}


def test_linear_probe_separates_clusters():
    model = DINOSelfDistillation(model_kwargs=TINY, **SMALL_HEAD, probe_steps=100)
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 32, generator=g)
    train_labels, val_labels = torch.arange(300) % 10, torch.arange(100) % 10
    train = centers[train_labels] + 0.3 * torch.randn(300, 32, generator=g)
    val = centers[val_labels] + 0.3 * torch.randn(100, 32, generator=g)
    metrics = model.evaluate_features(train, train_labels, val, val_labels)
    assert (
        metrics["linear_probe_acc"].item() == 1.0 and metrics["knn_acc"].item() == 1.0
    )
    shuffled = model.evaluate_features(
        train, train_labels[torch.randperm(300, generator=g)], val, val_labels
    )
    assert (
        shuffled["linear_probe_acc"].item() < 0.5 and shuffled["knn_acc"].item() < 0.5
    )


def test_knn_weighted_vote():
    train = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    query = torch.tensor([[0.1, 1.0], [1.0, 0.05]])
    assert knn_predict(train, labels, query, num_classes=2, k=1).tolist() == [1, 0]
    # with k=3 the two class-0 neighbours would outvote, but the temperature favours the nearest
    assert knn_predict(
        train, labels, query, num_classes=2, k=3, temperature=0.01
    ).tolist() == [1, 0]


def test_dino_loss_matches_reference_and_skips_same_view():
    g = torch.Generator().manual_seed(0)
    batch, k, n_crops = 3, 5, 4
    student = torch.randn(n_crops * batch, k, generator=g)
    probs = torch.softmax(torch.randn(2 * batch, k, generator=g), dim=-1)

    def ce(q, s):
        return -(q * torch.log_softmax(s / 0.1, dim=-1)).sum(-1).mean()

    s, q = student.split(batch), probs.split(batch)
    pairs = [(i, v) for i in range(2) for v in range(n_crops)]
    expected = sum(ce(q[i], s[v]) for i, v in pairs if i != v) / (2 * (n_crops - 1))
    with_same_view = sum(ce(q[i], s[v]) for i, v in pairs) / (2 * n_crops)
    loss = dino_loss(student, probs, student_temp=0.1)
    torch.testing.assert_close(loss, expected)
    assert not torch.isclose(loss, with_same_view)


def test_teacher_targets_centering_and_sinkhorn():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    logits[:, 0] += 5.0  # one prototype dominates every sample
    plain = centered_teacher_probs(logits, torch.zeros(1, 8), 0.5)
    centered = centered_teacher_probs(logits, logits.mean(0, keepdim=True), 0.5)
    balanced = sinkhorn_knopp_teacher_probs(logits, 0.5)
    for probs in (plain, centered, balanced):
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(64))
    assert plain.mean(0)[0] > 0.9  # without centering: collapse onto prototype 0
    assert (
        centered.mean(0)[0] < 0.5 and balanced.mean(0).max() < 0.2
    )  # SK: about 1/8 each


def test_sinkhorn_centering_trains():
    model = DINOSelfDistillation(
        model_kwargs=TINY, **SMALL_HEAD, centering="sinkhorn_knopp", probe_steps=0
    )
    trainer = demo_trainer(max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(model, tiny_datamodule())
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert "val/knn_acc" in trainer.callback_metrics
    assert (
        "val/linear_probe_acc" not in trainer.callback_metrics
    )  # probe_steps=0 skips it
    assert torch.equal(model.center, torch.zeros_like(model.center))  # unused by SK


def test_schedules():
    model = DINOSelfDistillation(
        model_kwargs=TINY, **SMALL_HEAD, teacher_temp=0.07, warmup_teacher_temp_steps=10
    )
    model.trainer = demo_trainer(max_steps=100)
    assert model.teacher_temperature(0) == pytest.approx(0.04)
    assert model.teacher_temperature(5) == pytest.approx(0.055)
    assert model.teacher_temperature(10) == pytest.approx(0.07)
    assert model.teacher_momentum(0) == pytest.approx(0.996)
    assert model.teacher_momentum(100) == pytest.approx(1.0)


def test_local_crops_need_dynamic_size():
    kwargs = {k: v for k, v in TINY.items() if k != "dynamic_img_size"}
    model = DINOSelfDistillation(model_kwargs=kwargs, **SMALL_HEAD)
    crops = [torch.randn(2, 3, 16, 16)] * 2 + [torch.randn(2, 3, 8, 8)]
    with pytest.raises(ValueError, match="dynamic_img_size"):
        model.student(crops)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"momentum_teacher": 1.5}, "momentum_teacher"),
        ({"center_momentum": -0.1}, "center_momentum"),
        ({"student_temp": 0.0}, "student_temp"),
        ({"out_dim": 0}, "out_dim"),
        ({"warmup_teacher_temp_steps": 2.5}, "warmup_teacher_temp_steps"),
        ({"knn_k": 0}, "knn_k"),
        ({"centering": "batchnorm"}, "centering"),
    ],
)
def test_dino_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DINOSelfDistillation(model_kwargs=TINY, **kwargs)


def test_checkpoint_round_trip_keeps_teacher_and_center(tmp_path):
    model = DINOSelfDistillation(model_kwargs=TINY, **SMALL_HEAD, probe_steps=0)
    trainer = demo_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(model, tiny_datamodule())
    path = tmp_path / "dino.ckpt"
    trainer.save_checkpoint(path)
    loaded = DINOSelfDistillation.load_from_checkpoint(path)
    assert loaded.hparams.out_dim == SMALL_HEAD["out_dim"]
    assert torch.equal(loaded.center, model.center) and model.center.abs().sum() > 0
    for a, b in zip(
        loaded.teacher.state_dict().values(), model.teacher.state_dict().values()
    ):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in loaded.teacher.parameters())
