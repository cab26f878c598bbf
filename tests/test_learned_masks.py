"""Learned N:M masks (``algorithm: learned``) on the demo GPT and a tiny Hugging Face GPT-2:
the forward is differentiable in the logits, the most likely pattern is always a valid N:M
mask, the temperature follows its schedule, the next phase starts from the learned pattern,
a resume is bitwise, checkpoints and exports hold the learned masks, and configuration
mistakes are named. (Ranks agreeing under DDP and FSDP2: ``test_distributed.py``; on a GPU:
``test_learned_masks_gpu.py``.)"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from helpers import MetricsLog, SameTokens, fast_trainer, resumable_fit
from hypothesis import given, settings
from hypothesis import strategies as st
from learned_fits import (
    LEARN,
    MODELS,
    MostLikelyAt,
    build,
    fit,
    learner,
    sparsifier_of,
    weights,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_sparse import Phase, Sparsifier, SparsityCallback, export_state_dict
from lightning_sparse.algorithms import Learned, build_algorithm
from lightning_sparse.core.schedule import resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.demo import GPTLanguageModel
from lightning_sparse.engine.learning import overall, summarize
from lightning_sparse.engine.report import plan_table
from lightning_sparse.masks import NM, is_nm, nm_groups
from lightning_sparse.masks.candidates import candidate_patterns, pattern_indices


class Gradients(L.Callback):
    """Before the SparsityCallback: the logits' gradients as each optimizer step finds them."""

    def __init__(self) -> None:
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads[trainer.global_step] = {
            name: logits.grad.clone()
            for name, logits in learner(trainer).logits.items()
        }


@pytest.mark.parametrize("model", MODELS)
def test_every_logit_gets_a_gradient_from_the_loss(model):
    grads = Gradients()
    _, sparsity, _ = fit(model, [LEARN], 2, before=(grads,))
    assert sorted(grads.grads) == [0, 1]
    targets = sparsity.sparsifier.targets
    assert sorted(grads.grads[0]) == sorted(t.name for t in targets)
    for t in targets:
        grad = grads.grads[0][t.name]
        assert grad.shape == (t.param.numel() // 4, 6)
        assert bool(grad.isfinite().all()), t.name
        assert float((grad != 0).float().mean()) > 0.9, t.name


class LogitSteps(L.Callback):
    """Before the SparsityCallback: per training step (the step its forwards belong to), the
    logits and their gradients as its first optimizer step finds them; after it, the logits
    and the step count of each of their Adam states."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.after: dict[int, tuple[dict[str, torch.Tensor], list[int]]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        algo = learner(trainer)
        if algo.step not in self.before:
            self.before[algo.step] = {
                name: (logits.detach().clone(), logits.grad.clone())
                for name, logits in algo.logits.items()
            }

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        algo = learner(trainer)
        assert algo.optimizer is not None
        adam = algo.optimizer.state_dict()["state"].values()
        self.after[algo.step] = (
            {name: logits.detach().clone() for name, logits in algo.logits.items()},
            [int(state["step"]) for state in adam],
        )


def assert_adam_steps(steps: LogitSteps, mask_lr: float) -> None:
    """Each training step moved the logits exactly as one step of a separate
    ``Adam(lr=mask_lr)`` on copies of them given the same gradients, and counted one step."""
    first = steps.before[min(steps.before)]
    copies = {
        name: value.clone().requires_grad_(True) for name, (value, _) in first.items()
    }
    adam = torch.optim.Adam(list(copies.values()), lr=mask_lr)
    for count, step in enumerate(sorted(steps.before), start=1):
        for name, (_, grad) in steps.before[step].items():
            copies[name].grad = grad.clone()
        adam.step()
        logits, counts = steps.after[step]
        assert counts == [count] * len(copies), step
        for name, copy in copies.items():
            assert torch.equal(logits[name], copy.detach()), (step, name)


def test_each_step_moves_the_logits_as_one_adam_step_with_their_gradients():
    steps = LogitSteps()
    # no regulariser: the gradients Adam is given are the loss's, as recorded
    phase = {**LEARN, "mask_lr": 0.01, "weight_reg": 0.0}
    fit("gpt", [phase], 3, before=(steps,))
    assert sorted(steps.before) == sorted(steps.after) == [0, 1, 2]
    assert_adam_steps(steps, 0.01)


class TwoOptimizers(GPTLanguageModel):
    """The demo GPT trained by two optimizers (the blocks', then the embeddings'), both
    stepped in every training step (manual optimization: Lightning's way to have two)."""

    def __init__(self) -> None:
        super().__init__(n_layer=1, n_embd=32, block_size=16, warmup_steps=0)
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        named = list(self.named_parameters())
        blocks = [p for n, p in named if ".h." in n]
        rest = [p for n, p in named if ".h." not in n]
        return [torch.optim.AdamW(blocks, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(*batch)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        return loss


def test_with_two_optimizers_the_logits_still_step_once_per_training_step():
    """Each optimizer step counts as a step of the run (``trainer.global_step``), so a
    training step of two optimizers is two; the logits learn from its forwards once (a
    second Adam step would apply the sparse-weight regulariser's gradient again)."""
    steps = LogitSteps()
    sparsity = SparsityCallback(phases=[{**LEARN, "weight_reg": 1e-3}], verbose=False)
    model = resumable_fit(
        None,
        [steps, sparsity],
        6,
        model=TwoOptimizers,
        loader=DataLoader(SameTokens(), batch_size=4),
    )
    assert model.trainer.global_step == 6
    assert sorted(steps.before) == sorted(steps.after) == [0, 2, 4]
    assert [counts for _, counts in steps.after.values()] == [[1] * 4, [2] * 4, [3] * 4]


def test_the_soft_sample_is_differentiable_in_the_logits():
    """``torch.autograd.gradcheck`` (float64) of a training sample against the logits, soft
    and straight-through (whose gradient is the soft sample's)."""
    phase = resolve_phases([Phase(**LEARN)], total_steps=10)[0]
    algo = build_algorithm(phase)
    weight = torch.randn(4, 8)
    algo.begin(3, {"w": algo.initial_mask(weight, phase.target, None)})
    logits = algo.logits["w"].detach().double().requires_grad_(True)

    def sample(value: torch.Tensor) -> torch.Tensor:
        algo.logits["w"] = value
        return algo.sample("w", training=True)

    assert torch.autograd.gradcheck(sample, (logits,))
    soft = sample(logits)
    algo.hard = True
    hard = sample(logits)
    assert bool(((hard == 0) | (hard == 1)).all())  # the sampled pattern itself
    (g_soft,) = torch.autograd.grad(soft.sum() + (soft * weight).sum(), logits)
    (g_hard,) = torch.autograd.grad(hard.sum() + (hard * weight).sum(), logits)
    assert torch.allclose(
        g_soft, g_hard
    )  # straight-through: the soft sample's gradient


@settings(max_examples=25, deadline=None)
@given(
    pattern=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (4, 8)]),
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    step=st.integers(0, 9),
)
def test_the_most_likely_and_the_hard_patterns_are_valid_nm(
    pattern, rows, groups, seed, step
):
    target = NM(*pattern)
    phase = resolve_phases(
        [Phase(sparsity=str(target), algorithm="learned", hard=True, seed=seed)], 10
    )[0]
    algo = build_algorithm(phase)
    weight = torch.randn(
        rows, groups * target.m, generator=torch.Generator().manual_seed(seed)
    )
    algo.begin(step, {"w": algo.initial_mask(weight, target, None)})
    algo.logits["w"] = torch.randn(algo.logits["w"].shape) * 10  # anywhere at all
    algo._likely.clear()
    for mask in (algo.most_likely("w"), algo.sample("w", training=True).detach() > 0.5):
        assert mask.dtype == torch.bool and mask.shape == weight.shape
        assert bool((nm_groups(mask, target.m).sum(-1) == target.n).all())


@pytest.mark.parametrize("model", MODELS)
def test_checkpointed_and_exported_masks_are_the_most_likely_patterns(model, tmp_path):
    """After a learned run: the saved masks are exactly N:M (groups along the layer's
    inputs, also for Conv1D) and equal each layer's most likely pattern; the export folds
    them in, and evaluation forwards compute exactly the exported model."""
    trained, sparsity, trainer = fit(model, [{**LEARN, "mask_lr": 0.05}], 3)
    sp = sparsity.sparsifier
    state = sp.state_dict()
    exported = export_state_dict(trainer)
    algo = learner(trainer)
    changed = 0
    for t in sp.targets:
        mask = state["masks"][f"{t.name}_mask"]
        rows = t.layer.to_rows(mask)
        assert is_nm(rows, NM(2, 4)) and int(mask.sum()) * 2 == mask.numel(), t.name
        assert torch.equal(rows, algo.most_likely(t.name)), t.name
        assert torch.equal(exported[t.name], t.param.detach() * mask), t.name
        changed += algo.statistics(t.name)[0]
    assert changed > 0  # the masks moved away from the magnitude prior
    dense = build(model)
    dense.load_state_dict(exported)
    x = SameTokens()[0][0].unsqueeze(0)
    trained.eval(), dense.eval()
    with torch.no_grad():
        assert torch.equal(trained(x), dense(x))


class Schedule(L.Callback):
    """After the SparsityCallback: the step, temperature and logit scale the learned forwards
    of each step use."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        algo = learner(trainer)
        self.seen.append(
            (
                trainer.global_step,
                algo.step,
                algo.temperature_at(algo.step),
                algo.logit_scale_at(algo.step),
            )
        )


def test_the_temperature_and_logit_scale_follow_the_schedule():
    schedule = Schedule()
    phase = {**LEARN, "temperature": [2.0, 0.1], "logit_scale": 50}
    fit("gpt", [phase], 5, after=(schedule,))
    assert [(step, seen) for step, seen, _, _ in schedule.seen] == [
        (s, s) for s in range(5)
    ]
    for step, _, temperature, scale in schedule.seen:
        assert temperature == pytest.approx(2.0 + (0.1 - 2.0) * step / 5)
        assert scale == 50.0
    defaults = build_algorithm(resolve_phases([Phase(**LEARN)], total_steps=100)[0])
    assert (defaults.temperature_at(0), defaults.temperature_at(100)) == (4.0, 0.05)
    assert (defaults.logit_scale_at(0), defaults.logit_scale_at(50)) == (100.0, 300.0)
    assert defaults.weight_reg_at(0) == 1e-5 and defaults.weight_reg_at(100) == 0.0


def test_samples_harden_as_the_temperature_falls():
    """The same logits give fractional soft masks at the phase start and (nearly) 0/1 ones at
    its end, where the temperature is lowest and the logit scale highest. At the end only the
    groups whose two best patterns nearly tie stay soft: over 200 weight seeds the mean
    distance from 0/1 is 0.0005-0.0024 there and at least 98% of the entries are within
    0.001 of 0 or 1; at the start it is 0.37 and none is."""
    phase = resolve_phases([Phase(**LEARN)], total_steps=100)[0]
    algo = build_algorithm(phase)
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    algo.begin(0, {"w": algo.initial_mask(weight, phase.target, None)})

    def distance(step: int) -> torch.Tensor:  # how far each soft mask entry is from 0/1
        algo.step = step
        soft = algo.sample("w", training=True).detach()
        return torch.minimum(soft, 1 - soft)

    start, end = distance(0), distance(99)
    assert float(start.mean()) > 0.3 and float((start < 1e-3).float().mean()) == 0.0
    assert float(end.mean()) < 0.01 and float((end < 1e-3).float().mean()) > 0.95


def test_the_gumbel_noise_is_new_each_step_and_the_same_within_one_and_after_a_resume():
    """With a constant temperature and logit scale only the noise tells the steps apart: the
    forwards of one step (its micro-batches, and a resumed run's first step) multiply by the
    same sample, the next step's by another."""
    spec = Phase(**LEARN, temperature=1.0, logit_scale=1.0)
    phase = resolve_phases([spec], total_steps=10)[0]
    algo = build_algorithm(phase)
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    algo.begin(0, {"w": algo.initial_mask(weight, phase.target, None)})

    def sample(learned: Learned, step: int) -> torch.Tensor:
        learned.step = step
        return learned.sample("w", training=True).detach()

    at_3 = sample(algo, 3)
    assert torch.equal(sample(algo, 3), at_3)  # another micro-batch of step 3
    assert not torch.equal(sample(algo, 4), at_3)
    resumed = build_algorithm(phase)
    checked = resumed.check_state(
        algo.state_dict(), {"w": weight.shape}, {"w": torch.device("cpu")}
    )
    resumed.restore(checked, 3)
    assert torch.equal(resumed.sample("w", training=True).detach(), at_3)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("after", ["static", "magnitude", "runtime", "dense"])
def test_the_next_phase_starts_from_the_learned_patterns(model, after):
    probe = MostLikelyAt(last=3)
    nxt = (
        {"sparsity": 0.0}
        if after == "dense"
        else {"sparsity": "2:4", "algorithm": after}
    )
    learned = {**LEARN, "until": 4, "mask_lr": 0.05}
    _, sparsity, _ = fit(model, [learned, nxt], 6, after=(probe,))
    sp = sparsity.sparsifier
    assert sp.history == [(0, 0), (4, 1)]
    assert sp.learned_reports[0] and sum(
        c for c, _, _ in sp.learned_reports[0].values()
    )
    assert set(probe.learned) == {t.name for t in sp.targets}
    for t in sp.targets:
        learned_mask, next_mask = probe.learned[t.name], probe.next.get(t.name)
        if after == "dense":
            assert next_mask is None
        elif after == "runtime":  # re-derived from the weights at every forward
            assert is_nm(t.layer.to_rows(next_mask), NM(2, 4))
        else:
            assert torch.equal(next_mask, learned_mask), t.name
    if after == "static":  # pruned weights stored as zeros, and the masks stay fixed
        final = sp.state_dict()["masks"]
        for t in sp.targets:
            mask = probe.learned[t.name]
            assert bool((probe.weights[t.name][~mask] == 0).all()), t.name
            assert torch.equal(final[f"{t.name}_mask"], mask), t.name
    if after == "dense":
        assert sp.algorithms[0].logits == {}  # the logits are freed


@pytest.mark.parametrize(
    ("model", "resume_step", "train_weights"),
    [("gpt", 2, True), ("gpt", 4, False), ("hf", 2, True)],
)
def test_resume_is_bitwise_equal_to_the_uninterrupted_run(
    tmp_path, model, resume_step, train_weights
):
    """Resumed inside the learned phase (its logits and their Adam state restored) or at its
    end (the handover made from restored logits): the same weights, masks and statistics."""
    phases = [
        {**LEARN, "until": 4, "mask_lr": 0.05, "train_weights": train_weights},
        {"sparsity": "2:4", "algorithm": "static"},
    ]
    reference, ref_cb, _ = fit(model, phases, 6)
    fit(model, phases, 6, tmp_path=tmp_path / "ck", stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    saved = torch.load(ckpt, weights_only=True)["callbacks"][ref_cb.state_key]
    assert sorted(saved["learned"]["logits"]) == sorted(
        t.name for t in ref_cb.sparsifier.targets
    )
    resumed, cb, trainer = fit(model, phases, 6, ckpt_path=ckpt, seed=123)
    assert trainer.global_step == 6
    expected, got = weights(reference), weights(resumed)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert cb.sparsifier.history == ref_cb.sparsifier.history
    assert cb.sparsifier.learned_reports == ref_cb.sparsifier.learned_reports
    ref_masks, masks = ref_cb.state_dict()["masks"], cb.state_dict()["masks"]
    assert all(torch.equal(ref_masks[k], masks[k]) for k in ref_masks)


class Frozen(L.Callback):
    """After the SparsityCallback: the selected weights before and after each step."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.changed: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = {
            t.name: t.param.detach().clone() for t in sparsifier_of(trainer).targets
        }

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        sp = sparsifier_of(trainer)
        self.changed[trainer.global_step - 1] = any(
            not torch.equal(t.param.detach(), self.before[t.name]) for t in sp.targets
        )


def test_train_weights_false_leaves_the_selected_weights_as_they_are():
    frozen = Frozen()
    phases = [{**LEARN, "until": 3, "train_weights": False}, {"sparsity": 0.0}]
    start = build("gpt")
    model, sparsity, _ = fit("gpt", phases, 5, after=(frozen,))
    assert frozen.changed == {0: False, 1: False, 2: False, 3: True, 4: True}
    names = {t.name for t in sparsity.sparsifier.targets}
    moved = [
        k for k, v in weights(start).items() if not torch.equal(v, weights(model)[k])
    ]
    assert set(moved) - names  # the rest of the model trained


@pytest.mark.parametrize("train_weights", [True, "dense"])
def test_the_weights_learn_from_the_masked_or_the_dense_gradient(train_weights):
    """``train_weights: true``: the weight's gradient is the product's, the gradient of the
    masked weight times the sampled mask; ``"dense"``: that gradient unmasked
    (straight-through), so the weights the mask leaves out keep learning."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    targets = select_parameters(net, params=["0.weight"]).targets
    phase = Phase(**LEARN, train_weights=train_weights)
    sp = Sparsifier("g", targets, resolve_phases([phase], 10))
    sp.on_step_start(0, [])
    sp.on_step_start(9, [])  # the last step: samples close to the most likely patterns
    x = torch.randn(5, 16)
    net(x).square().sum().backward()
    algo = sp.algorithm
    soft = algo.sample("0.weight", training=True).detach()  # the same sample: same step
    masked = (net[0].weight * soft).detach().requires_grad_(True)
    net[2](torch.tanh(x @ masked.T + net[0].bias)).square().sum().backward()
    expected = masked.grad if train_weights == "dense" else masked.grad * soft
    assert torch.allclose(net[0].weight.grad, expected, atol=1e-6)
    left_out = soft < 1e-6  # (nearly) every weight the sample drops
    assert bool((net[0].weight.grad[left_out].abs() > 1e-4).any()) == (
        train_weights == "dense"
    )


def test_the_regulariser_favours_patterns_that_keep_large_weights():
    """With only the sparse-weight regulariser (no loss), every group's most likely pattern
    becomes the one that keeps its two largest weights."""
    phase = resolve_phases(
        [Phase(**LEARN, weight_reg=1.0, prior_strength=3.0, mask_lr=0.05)], 1000
    )[0]
    algo = build_algorithm(phase)
    gen = torch.Generator().manual_seed(0)
    # every group holds 1.0, 0.9, 0.2 and 0.1 in a random order, with random signs
    order = torch.rand(32, 4, generator=gen).argsort(-1)
    signs = torch.randint(0, 2, (32, 4), generator=gen) * 2 - 1
    weight = (torch.tensor([1.0, 0.9, 0.2, 0.1])[order] * signs).reshape(8, 16)
    prior = algo.initial_mask(-weight.abs(), phase.target, None)  # the worst pattern
    algo.begin(0, {"w": prior})
    for step in range(100):
        algo.step = step
        algo.learn(step, {"w": weight})
    top2 = algo.initial_mask(weight.abs(), phase.target, None)
    assert torch.equal(algo.most_likely("w"), top2)


def test_convolutions_learn_nm_masks_along_input_channels():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    targets = select_parameters(net, params=["0.weight", "2.weight"]).targets
    phase = Phase(**LEARN, mask_lr=0.1)
    sp = Sparsifier("conv", targets, resolve_phases([phase], 4))
    for step in range(4):
        sp.on_step_start(step, [opt])
        if step == 0:
            start = {t.name: sp.current_mask(t).clone() for t in targets}
        net(torch.randn(2, 4, 6, 6)).square().mean().backward()
        sp.before_optimizer_step(step, opt, [opt])
        opt.step()
        opt.zero_grad()
    for t in targets:
        mask = sp.current_mask(t)
        assert mask.shape == t.param.shape
        assert is_nm(
            mask.movedim(1, -1), NM(2, 4)
        )  # (out, *kernel, in): along channels
        assert not torch.equal(mask, start[t.name]), t.name  # the steps moved it


def test_logged_statistics_the_start_and_end_lines_and_the_tables(lightning_log):
    log = MetricsLog()
    L.seed_everything(0, verbose=False)
    cb = SparsityCallback(phases=[{**LEARN, "until": 2}, {"sparsity": 0.0}])
    trainer = fast_trainer(max_steps=3, callbacks=[cb], logger=log, log_every_n_steps=1)
    trainer.fit(build("gpt"), DataLoader(SameTokens(), batch_size=4))
    entropy = log.series("sparsity/sparsity/pattern_entropy")
    changed = log.series("sparsity/sparsity/changed_from_prior")
    # the learned steps: 0 at the start, then after each step (the dense phase logs none)
    assert sorted(entropy) == sorted(changed) == [0, 1, 2]
    # the prior's noise moves about 6% of the groups, and two steps at the default mask_lr
    # hardly more; at a prior strength of 3 a group's logits are its prior's + 6, four at + 3
    # and one at 0 (in units of the noise): 0.69 nats without the noise, far from uniform
    assert all(0.03 < c < 0.09 for c in changed.values())
    assert 0.5 < entropy[0] < 1.0 < math.log(6)
    # the last step's forwards (step 1 of 2) see the logit scale at 300, not 100: surer
    assert entropy[2] < entropy[0] / 2
    text = lightning_log.text
    # the fit-start table's cost line, then per layer where the logits start and end
    assert "learns 2:4 masks: 6 fp32 logits per group of 4" in text
    assert "a learned mask is a differentiable sample" in text
    assert "step 0: phase 1 learns 2:4 masks of 4 parameters (weights training)" in text
    assert "step 2: phase 1 learned its masks" in text
    for t in cb.sparsifier.targets:  # at the start, and in the summary
        assert (
            text.count(f"{t.name}: ") >= 2 and "groups changed from the prior" in text
        )
    assert "phase 1 learned masks:" in text
    assert plan_table(cb.sparsifier, cb.selection) in text


@pytest.mark.parametrize(
    ("phase", "error", "match"),
    [
        (
            {"sparsity": 0.5},
            TypeError,
            r"algorithm 'learned' learns which N of every M",
        ),
        (
            {"sparsity": "2:16"},
            ValueError,
            r"C\(16, 2\) = 120 candidate patterns.*M <= 8",
        ),
        ({"sparsity": "2:4", "temperature": [4.0]}, ValueError, r"temperature=\[4.0\]"),
        (
            {"sparsity": "2:4", "temperature": 0},
            ValueError,
            r"temperature=0: use a finite",
        ),
        (
            {"sparsity": "2:4", "mask_lr": "fast"},
            ValueError,
            r"mask_lr='fast' is not a number",
        ),
        ({"sparsity": "2:4", "hard": "yes"}, TypeError, r"hard='yes' has type str"),
        (
            {"sparsity": "2:4", "train_weights": "sparse"},
            TypeError,
            r"train_weights='sparse'.*use true or false, or 'dense'",
        ),
        (
            {"sparsity": "2:4", "decay": 2e-4},
            ValueError,
            r"option 'decay' does nothing",
        ),
    ],
)
def test_configuration_mistakes_are_named(phase, error, match):
    with pytest.raises(error, match=match):
        SparsityCallback(phases=[{"algorithm": "learned", **phase}])


def test_learned_options_elsewhere_and_init_after_a_learned_phase_are_refused():
    with pytest.raises(ValueError, match=r"'temperature' is accepted by \['learned'\]"):
        SparsityCallback(phases=[{"sparsity": "2:4", "temperature": 1.0}])
    with pytest.raises(ValueError, match=r"phases\[1\]: init='wanda' does nothing"):
        SparsityCallback(
            phases=[
                {**LEARN, "until": 0.3},
                {"sparsity": "2:4", "algorithm": "static", "init": "wanda"},
            ]
        )
    # another target: the next phase chooses its own first mask, so init is its to give
    SparsityCallback(
        phases=[{**LEARN, "until": 0.3}, {"sparsity": 0.5, "init": "random"}]
    )


def test_a_damaged_learned_state_is_named_before_anything_changes(tmp_path):
    phases = [{**LEARN, "until": 5}, {"sparsity": 0.0}]
    fit("gpt", phases, 8, tmp_path=tmp_path, stop_at=2)
    ckpt = torch.load(tmp_path / "step=2.ckpt", weights_only=True)
    key = next(k for k in ckpt["callbacks"] if k.startswith("SparsityCallback"))
    state = ckpt["callbacks"][key]
    name = next(iter(state["learned"]["logits"]))
    state["learned"]["logits"][name] = state["learned"]["logits"][name][:-1]
    torch.save(ckpt, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=rf"the learned logits of '{name}' are not"):
        fit("gpt", phases, 8, ckpt_path=tmp_path / "bad.ckpt")
    del state["learned"]
    torch.save(ckpt, tmp_path / "none.ckpt")
    with pytest.raises(
        ValueError, match=r"saved in phase 1 \(algorithm 'learned'\).*no learned"
    ):
        fit("gpt", phases, 8, ckpt_path=tmp_path / "none.ckpt")


def test_a_learned_phase_needs_an_end():
    phases = resolve_phases([Phase(**LEARN)])  # run length unknown: no end
    with pytest.raises(
        ValueError, match=r"anneals its temperature.*give the phase an 'until'"
    ):
        build_algorithm(phases[0])


def test_the_pattern_table():
    table = candidate_patterns(NM(2, 4))
    assert table.shape == (6, 4) and bool((table.sum(-1) == 2).all())
    assert len({tuple(row.tolist()) for row in table}) == 6


def test_the_overall_statistics_weight_each_layer_by_its_groups():
    """A layer of 10 groups at entropy 1.0 and one of 30 at 0.0: 0.25 nats over the 40, as
    the end-of-phase line, the logged metric and the summary report it (not 0.5, the mean
    of the layers)."""
    report = {"a.weight": (1, 10, 1.0), "b.weight": (0, 30, 0.0)}
    assert overall(report) == (1, 40, 0.25)
    assert summarize("sparsity", 0, report, 7) == (
        "[sparsity] step 7: phase 1 learned its masks: 2.5% of 40 groups changed from the "
        "prior, mean pattern entropy 0.25 nats"
    )


def test_a_prior_that_is_not_nm_is_refused_by_the_lookup_and_the_learned_phase():
    # the first group keeps 3 of 4
    prior = torch.tensor([[True, True, True, False, True, False, False, True]])
    message = r"shape \(1, 8\) has groups of 4 that do not keep exactly 2"
    with pytest.raises(ValueError, match=message):
        pattern_indices(prior, NM(2, 4))
    algo = build_algorithm(resolve_phases([Phase(**LEARN)], total_steps=10)[0])
    with pytest.raises(ValueError, match=message):
        algo.begin(0, {"w": prior})
    assert algo.logits == {}  # nothing to learn from
