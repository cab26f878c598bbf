"""DINO self-distillation (Caron et al., 2021) with timm backbones, sized for demos.

A student network (``student.backbone`` + ``student.head``) is trained to match, on every crop,
the sharpened and centred output of an EMA teacher (``teacher.backbone`` + ``teacher.head``) on
the two global crops. Only the student is optimized; the teacher follows it by an exponential
moving average after every optimizer step. Quality is measured on frozen teacher CLS features
by weighted k-NN and by a linear probe (:mod:`lightning_sparse.demo.probes`).

**Sparsity targets the student only**: select its parameters with patterns such as
``student.backbone.blocks.*.mlp.fc1.weight``. The teacher's parameters have
``requires_grad=False``, are not in the optimizer and change only through the EMA (as in
PyTorch's 2:4 DINOv2 recipe, the teacher stays dense).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.functional.classification import multiclass_accuracy

from lightning_sparse.demo._checks import (
    check_choice,
    check_fraction,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
    resolve_steps,
)
from lightning_sparse.demo.compiling import compile_in_place, compile_mode
from lightning_sparse.demo.optim import (
    adamw_warmup_cosine,
    check_adamw_warmup_cosine,
    cosine_ramp,
    linear_ramp,
    param_groups_weight_decay,
    total_training_steps,
)
from lightning_sparse.demo.probes import knn_predict, linear_probe_predict
from lightning_sparse.demo.vit import TINY_VIT_KWARGS, create_timm_model

#: Backbone used when ``model_kwargs`` is left out: the tiny demo ViT, accepting any image size
#: (position embeddings are interpolated) so that local crops can be smaller than global ones.
TINY_DINO_VIT_KWARGS: dict[str, Any] = {**TINY_VIT_KWARGS, "dynamic_img_size": True}


class PrototypeLayer(nn.Module):
    """The DINO output layer: a bias-free linear layer with weight normalization.

    Each row of ``weight`` (a prototype) is L2-normalized before use; with ``learn_scale`` the
    row norms are learned (``scale``), otherwise they are fixed to 1 (DINO's
    ``norm_last_layer=True``, which stabilizes training).

    Example:
        >>> layer = PrototypeLayer(8, 32)
        >>> layer(torch.nn.functional.normalize(torch.randn(4, 8), dim=1)).abs().max().item() <= 1.0
        True
    """

    def __init__(
        self, in_features: int, out_features: int, learn_scale: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.trunc_normal_(self.weight, std=0.02)
        self.scale = nn.Parameter(torch.ones(out_features, 1)) if learn_scale else None

    def forward(self, x: Tensor) -> Tensor:
        weight = F.normalize(self.weight, dim=1)
        if self.scale is not None:
            weight = weight * self.scale
        return F.linear(x, weight)


class DINOHead(nn.Module):
    """MLP -> bottleneck -> L2 normalize -> :class:`PrototypeLayer` (DINO's projection head).

    Example:
        >>> DINOHead(in_dim=96, out_dim=512)(torch.randn(4, 96)).shape
        torch.Size([4, 512])
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 1024,
        hidden_dim: int = 256,
        bottleneck_dim: int = 64,
        num_layers: int = 3,
        norm_last_layer: bool = True,
        use_bn: bool = False,
    ) -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
            layers.append(nn.Linear(d_in, d_out))
            if i < num_layers - 1:
                if use_bn:
                    layers.append(nn.BatchNorm1d(d_out))
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        self.last_layer = PrototypeLayer(
            bottleneck_dim, out_dim, learn_scale=not norm_last_layer
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class DINONetwork(nn.Module):
    """A backbone (features, e.g. a timm model with ``num_classes=0``) followed by a DINO head.

    ``forward`` takes a list of crops, runs the backbone once per run of same-sized consecutive
    crops (so global and local crops are batched separately) and returns the head outputs of all
    crops concatenated in order: ``(len(crops) * B, out_dim)``.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops: list[Tensor]) -> Tensor:
        features = []
        start = 0
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            batch = torch.cat(crops[start:end])
            try:
                features.append(self.backbone(batch))
            except (AssertionError, RuntimeError) as err:
                if start == 0:
                    raise
                raise ValueError(
                    f"the backbone failed on {tuple(batch.shape[-2:])} crops after accepting "
                    f"{tuple(crops[0].shape[-2:])} crops: local crops of another size need a backbone "
                    f"that takes any image size (for timm ViTs add dynamic_img_size: true to model_kwargs)"
                ) from err
            start = end
        return self.head(torch.cat(features))


def centered_teacher_probs(
    teacher_out: Tensor, center: Tensor, teacher_temp: float
) -> Tensor:
    """DINO's teacher targets: ``softmax((teacher_out - center) / teacher_temp)``.

    Subtracting the running mean ``center`` keeps one prototype from dominating; the low
    temperature sharpens each sample's distribution so it does not collapse to uniform.
    """
    return F.softmax((teacher_out - center) / teacher_temp, dim=-1)


@torch.no_grad()
def sinkhorn_knopp_teacher_probs(
    teacher_out: Tensor,
    teacher_temp: float,
    n_iterations: int = 3,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """DINOv2's teacher targets: a few Sinkhorn-Knopp iterations on ``exp(teacher_out / T)``.

    The targets of a batch are made (approximately) equipartitioned over the prototypes while
    each sample keeps a sharp distribution; this replaces centering and resists collapse from
    the first step. ``all_reduce`` sums a tensor over processes (batch statistics in DDP).

    Example:
        >>> q = sinkhorn_knopp_teacher_probs(torch.randn(6, 4), 0.1)
        >>> torch.allclose(q.sum(dim=1), torch.ones(6))
        True
    """
    reduce = all_reduce or (lambda t: t)
    logits = teacher_out.float() / teacher_temp
    # exp of logits shifted by the (global) max for numerical safety; the shift cancels out
    q = torch.exp(logits - logits.max()).t()  # (K, B)
    n_prototypes = q.shape[0]
    n_samples = reduce(torch.tensor(float(q.shape[1]), device=q.device))
    q /= reduce(q.sum())
    for _ in range(n_iterations):
        q /= reduce(
            q.sum(dim=1, keepdim=True)
        )  # every prototype gets 1 / K of the mass
        q /= n_prototypes
        q /= q.sum(dim=0, keepdim=True)  # every sample gets 1 / B of the mass
        q /= n_samples
    return (q * n_samples).t()


def dino_loss(
    student_out: Tensor,
    teacher_probs: Tensor,
    student_temp: float,
    n_global_crops: int = 2,
) -> Tensor:
    """Cross-entropy between the teacher's target distribution on each global crop and the
    student's distribution on every *other* crop, averaged over the pairs.

    ``student_out`` is ``(n_crops * B, K)`` (crops in order, global ones first) and
    ``teacher_probs`` ``(n_global_crops * B, K)`` (rows summing to 1).

    Example:
        >>> t = torch.randn(2 * 4, 16)
        >>> s = torch.cat([t, torch.randn(3 * 4, 16)])
        >>> float(dino_loss(s, centered_teacher_probs(t, torch.zeros(1, 16), 0.04), 0.1)) > 0
        True
    """
    batch = len(teacher_probs) // n_global_crops
    student_logp = F.log_softmax(student_out / student_temp, dim=-1).split(batch)
    teacher_p = teacher_probs.detach().split(batch)
    total, pairs = student_out.new_zeros(()), 0
    for iq, q in enumerate(teacher_p):
        for v, logp in enumerate(student_logp):
            if v == iq:
                continue
            total = total + torch.sum(-q * logp, dim=-1).mean()
            pairs += 1
    return total / pairs


class DINOSelfDistillation(L.LightningModule):
    """DINO self-supervised training of a timm backbone, with k-NN and linear-probe evaluation.

    Training batches are ``(crops, labels)`` from a multi-crop DataModule (two global crops
    first, then local crops; labels ignored), e.g. :class:`~lightning_sparse.demo.DigitsMultiCropDataModule`.
    Validation expects two loaders of labelled ``(images, labels)``: index 0 the training split
    (the k-NN memory bank / probe training set), index 1 the validation split. At the end of
    validation it logs ``val/knn_acc`` (k-NN on cosine similarity, temperature-weighted votes)
    and ``val/linear_probe_acc`` (logistic regression on the frozen features), both computed on
    the teacher backbone's features. Training logs ``train/loss``, ``train/teacher_temp`` and
    ``train/ema_momentum``.

    Parameter names: the student's timm model is ``student.backbone`` (e.g.
    ``student.backbone.blocks.0.mlp.fc1.weight``), its head ``student.head``; the teacher mirrors
    them under ``teacher.``. Sparsity should target ``student.backbone`` only; the teacher is
    frozen (``requires_grad=False``), not in the optimizer, and updated as
    ``teacher = m * teacher + (1 - m) * student`` after each optimizer step (once the callbacks'
    ``on_train_batch_end`` hooks have run), with ``m`` rising from ``momentum_teacher`` to 1 on a
    cosine over the run.

    Args:
        model_name: timm model name (built with ``pretrained=False, num_classes=0``).
        model_kwargs: extra ``timm.create_model`` arguments; ``None`` is the tiny demo ViT for
            32-pixel global crops that accepts smaller local crops (:data:`TINY_DINO_VIT_KWARGS`).
            A ``drop_path_rate`` applies to the student only.
        out_dim, hidden_dim, bottleneck_dim, head_layers, norm_last_layer: the DINO head.
        head_bn: BatchNorm after each hidden layer of the head (DINO's ``use_bn``). It makes the
            randomly initialized teacher's outputs differ much more between images, which short
            runs need to get going (without it the tiny CPU run collapses to uniform outputs).
        centering: how the teacher targets avoid collapse: ``"ema"`` (DINO: subtract a running
            mean ``center`` of the teacher outputs) or ``"sinkhorn_knopp"`` (DINOv2: balance
            each batch's targets over the prototypes; the ``center`` buffer is then unused).
        student_temp: student softmax temperature.
        teacher_temp, warmup_teacher_temp, warmup_teacher_temp_steps: the teacher temperature
            rises linearly from ``warmup_teacher_temp`` to ``teacher_temp`` over
            ``warmup_teacher_temp_steps`` (a fraction of the run in [0, 1), or a whole number
            of steps >= 1). The default keeps it at 0.04 (DINO's default); long runs may use
            DINO's 0.04 -> 0.07 warmup, which on short CPU runs flattens the targets too much.
        center_momentum: EMA momentum of the teacher-output centre.
        momentum_teacher: EMA momentum of the teacher at the first step (cosine to 1). The
            teacher averages over about ``1 / (1 - momentum_teacher)`` steps: 0.996 (DINO) suits
            runs of many thousand steps; runs of a few hundred learn faster with 0.99.
        lr, weight_decay, warmup_steps, min_lr_ratio, betas: AdamW with warmup + cosine, as in
            :class:`~lightning_sparse.demo.ViTClassifier`.
        freeze_last_layer_steps: keep the prototype layer fixed for this many optimizer steps.
        knn_k, knn_temperature: the k-NN evaluation.
        probe_steps, probe_lr: the linear probe (full-batch Adam on standardized features).
        compile: ``torch.compile`` the student's and the teacher's backbones in place in
            ``configure_model`` (names unchanged; the heads run eagerly): ``False`` (eager),
            ``True`` (the default mode) or a mode such as ``"reduce-overhead"`` (see
            :data:`~lightning_sparse.demo.compiling.COMPILE_MODES`).

    Example:
        >>> import torch
        >>> model = DINOSelfDistillation(out_dim=128)
        >>> crops = [torch.randn(2, 3, 32, 32)] * 2 + [torch.randn(2, 3, 16, 16)] * 3
        >>> model.student(crops).shape, model.teacher(crops[:2]).shape
        (torch.Size([10, 128]), torch.Size([4, 128]))
        >>> "student.backbone.blocks.0.mlp.fc1.weight" in dict(model.named_parameters())
        True
        >>> any(p.requires_grad for p in model.teacher.parameters())
        False
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        model_kwargs: dict[str, Any] | None = None,
        out_dim: int = 1024,
        hidden_dim: int = 256,
        bottleneck_dim: int = 64,
        head_layers: int = 3,
        norm_last_layer: bool = True,
        head_bn: bool = True,
        centering: str = "ema",
        student_temp: float = 0.1,
        teacher_temp: float = 0.04,
        warmup_teacher_temp: float = 0.04,
        warmup_teacher_temp_steps: float = 0.3,
        center_momentum: float = 0.9,
        momentum_teacher: float = 0.996,
        lr: float = 1e-3,
        weight_decay: float = 0.04,
        warmup_steps: float = 0.1,
        min_lr_ratio: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        freeze_last_layer_steps: int = 0,
        knn_k: int = 20,
        knn_temperature: float = 0.07,
        probe_steps: int = 300,
        probe_lr: float = 0.1,
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("out_dim", out_dim),
            ("hidden_dim", hidden_dim),
            ("bottleneck_dim", bottleneck_dim),
        ):
            check_positive_int(name, value)
        check_positive_int("head_layers", head_layers)
        check_choice("centering", centering, ("ema", "sinkhorn_knopp"))
        for name, value in (
            ("student_temp", student_temp),
            ("teacher_temp", teacher_temp),
            ("warmup_teacher_temp", warmup_teacher_temp),
            ("knn_temperature", knn_temperature),
            ("probe_lr", probe_lr),
        ):
            check_positive_float(name, value)
        check_fraction("center_momentum", center_momentum, allow_zero=True)
        check_fraction("momentum_teacher", momentum_teacher, allow_zero=True)
        check_adamw_warmup_cosine(lr, weight_decay, warmup_steps, min_lr_ratio)
        resolve_steps("warmup_teacher_temp_steps", warmup_teacher_temp_steps, 1)
        check_non_negative_int("freeze_last_layer_steps", freeze_last_layer_steps)
        check_positive_int("knn_k", knn_k)
        check_non_negative_int("probe_steps", probe_steps)
        compile_mode(compile)
        self.save_hyperparameters()

        kwargs = dict(TINY_DINO_VIT_KWARGS if model_kwargs is None else model_kwargs)
        teacher_kwargs = {k: v for k, v in kwargs.items() if k != "drop_path_rate"}
        head_args = (
            out_dim,
            hidden_dim,
            bottleneck_dim,
            head_layers,
            norm_last_layer,
            head_bn,
        )
        student_backbone = create_timm_model(model_name, kwargs, num_classes=0)
        teacher_backbone = create_timm_model(model_name, teacher_kwargs, num_classes=0)
        self.embed_dim = int(student_backbone.num_features)
        self.student = DINONetwork(
            student_backbone, DINOHead(self.embed_dim, *head_args)
        )
        self.teacher = DINONetwork(
            teacher_backbone, DINOHead(self.embed_dim, *head_args)
        )
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)
        self.register_buffer("center", torch.zeros(1, out_dim))
        self._last_ema_step = 0
        self._eval_features: dict[int, list[Tensor]] = {}
        self._eval_labels: dict[int, list[Tensor]] = {}

    def configure_model(self) -> None:
        # the backbones hold the sparse layers; the teacher's also computes the eval features
        compile_in_place(
            compile_mode(self.hparams.compile),
            self.student.backbone,
            self.teacher.backbone,
        )

    # ----------------------------------------------------------------------------- schedules
    def _total_steps(self) -> int:
        return total_training_steps(self.trainer)

    def teacher_temperature(self, step: int) -> float:
        """The teacher softmax temperature at optimizer step ``step``."""
        hp = self.hparams
        ramp = resolve_steps(
            "warmup_teacher_temp_steps",
            hp.warmup_teacher_temp_steps,
            self._total_steps(),
        )
        return linear_ramp(step, ramp, hp.warmup_teacher_temp, hp.teacher_temp)

    def teacher_momentum(self, step: int) -> float:
        """The EMA momentum used for the teacher update after optimizer step ``step``."""
        return cosine_ramp(
            step, self._total_steps(), self.hparams.momentum_teacher, 1.0
        )

    # ------------------------------------------------------------------------------ training
    def training_step(
        self, batch: tuple[list[Tensor], Tensor], batch_idx: int
    ) -> Tensor:
        crops, _ = batch
        if not isinstance(crops, (list, tuple)) or len(crops) < 2:
            raise ValueError(
                "DINOSelfDistillation trains on multi-crop batches (crops, labels) with at least 2 "
                "global crops: use DigitsMultiCropDataModule or ImageFolderMultiCropDataModule"
            )
        with torch.no_grad():
            teacher_out = self.teacher(list(crops[:2]))
        student_out = self.student(list(crops))
        temperature = self.teacher_temperature(self.global_step)
        teacher_probs = self.teacher_targets(teacher_out, temperature)
        loss = dino_loss(student_out, teacher_probs, self.hparams.student_temp)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/teacher_temp", temperature)
        return loss

    @torch.no_grad()
    def teacher_targets(self, teacher_out: Tensor, temperature: float) -> Tensor:
        """The teacher's target distributions for ``teacher_out`` (updates the EMA centre)."""
        if self.hparams.centering == "sinkhorn_knopp":
            return sinkhorn_knopp_teacher_probs(
                teacher_out, temperature, all_reduce=self._all_reduce_sum
            )
        probs = centered_teacher_probs(teacher_out, self.center, temperature)
        self._update_center(teacher_out)
        return probs

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if self._trainer is None or self.trainer.world_size == 1:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    @torch.no_grad()
    def _update_center(self, teacher_out: Tensor) -> None:
        batch_center = teacher_out.mean(dim=0, keepdim=True)
        if self._trainer is not None and self.trainer.world_size > 1:
            batch_center = self.trainer.strategy.reduce(batch_center, reduce_op="mean")
        m = self.hparams.center_momentum
        self.center.mul_(m).add_(batch_center, alpha=1 - m)

    def on_after_backward(self) -> None:
        if self.global_step < self.hparams.freeze_last_layer_steps:
            for param in self.student.head.last_layer.parameters():
                param.grad = None

    def on_train_start(self) -> None:
        self._last_ema_step = self.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step counts optimizer steps: update once per step (gradient accumulation safe)
        if self.global_step > self._last_ema_step:
            self._last_ema_step = self.global_step
            momentum = self.teacher_momentum(self.global_step - 1)
            self.update_teacher(momentum)
            self.log("train/ema_momentum", momentum)

    @torch.no_grad()
    def update_teacher(self, momentum: float) -> None:
        """``teacher = momentum * teacher + (1 - momentum) * student`` for every parameter."""
        teacher = [p.data for p in self.teacher.parameters()]
        student = [p.data for p in self.student.parameters()]
        torch._foreach_mul_(teacher, momentum)
        torch._foreach_add_(teacher, student, alpha=1.0 - momentum)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        backbone = self.student.backbone
        no_decay = {
            f"backbone.{name}" for name in getattr(backbone, "no_weight_decay", set)()
        }
        groups = param_groups_weight_decay(
            self.student, hp.weight_decay, no_decay_names=tuple(no_decay)
        )
        return adamw_warmup_cosine(groups, hp, self._total_steps())

    # ---------------------------------------------------------------------------- evaluation
    def on_validation_epoch_start(self) -> None:
        self._eval_features, self._eval_labels = {}, {}

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        images, labels = batch
        if isinstance(images, (list, tuple)):
            raise TypeError(
                "DINOSelfDistillation validates on plain (images, labels) batches, got a list of "
                "crops: validation loaders must not use the multi-crop transform"
            )
        self._eval_features.setdefault(dataloader_idx, []).append(
            self.teacher.backbone(images).float()
        )
        self._eval_labels.setdefault(dataloader_idx, []).append(labels)

    def _gathered(self, index: int) -> tuple[Tensor, Tensor]:
        features = torch.cat(self._eval_features[index])
        labels = torch.cat(self._eval_labels[index])
        if self.trainer.world_size > 1:
            features = self.all_gather(features).flatten(0, 1)
            labels = self.all_gather(labels).flatten(0, 1)
        return features, labels

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        if sorted(self._eval_features) != [0, 1]:
            rank_zero_warn(
                "DINOSelfDistillation needs two validation loaders, [labelled train split, val split], "
                "to compute val/knn_acc and val/linear_probe_acc; skipping them"
            )
            return
        # every rank gathers all features and computes the same metrics (no further sync needed)
        metrics = self.evaluate_features(*self._gathered(0), *self._gathered(1))
        self._eval_features, self._eval_labels = {}, {}
        for name, value in metrics.items():
            self.log(f"val/{name}", value, prog_bar=name == "knn_acc")

    def evaluate_features(
        self,
        train_features: Tensor,
        train_labels: Tensor,
        val_features: Tensor,
        val_labels: Tensor,
    ) -> dict[str, Tensor]:
        """k-NN and linear-probe top-1 accuracy of ``val_features`` given labelled
        ``train_features``; returns ``{"knn_acc": ..., "linear_probe_acc": ...}``."""
        hp = self.hparams
        num_classes = int(max(train_labels.max(), val_labels.max())) + 1
        knn = knn_predict(
            train_features,
            train_labels,
            val_features,
            num_classes,
            hp.knn_k,
            hp.knn_temperature,
        )
        metrics = {
            "knn_acc": multiclass_accuracy(
                knn, val_labels, num_classes, average="micro"
            )
        }
        if hp.probe_steps > 0:
            probe = linear_probe_predict(
                train_features,
                train_labels,
                val_features,
                num_classes,
                steps=hp.probe_steps,
                lr=hp.probe_lr,
            )
            metrics["linear_probe_acc"] = multiclass_accuracy(
                probe, val_labels, num_classes, average="micro"
            )
        return metrics
