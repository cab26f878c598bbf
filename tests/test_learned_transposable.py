"""Learned 2:4 masks handed over transposable (``transposable: tiles | project``): the tile
candidates and the projection against a brute force over every transposable tile, the mask
handed to the next phase is 2:4 along rows and columns, resumes are bitwise, the next phase
runs the 2:4 kernel ops on a pretended GPU, and configuration mistakes are named."""

from __future__ import annotations

import itertools
import math
import re

import lightning as L
import pytest
import torch
from helpers import (
    RepeatedBatch,
    TinyModule,
    dense_cusparselt,
    fast_trainer,
    pretend_gpu,
)
from learned_fits import LEARN, MostLikelyAt, fit, weights
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms import MaskContext, build_algorithm
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.engine.report import plan_table
from lightning_sparse.masks import NM, is_nm, target_mask
from lightning_sparse.masks.candidates import candidate_patterns, pattern_indices
from lightning_sparse.masks.tile_candidates import (
    project_to_tiles,
    tile_indices,
    tiles_to_mask,
)
from lightning_sparse.masks.tiles import is_transposable_2to4, tile_patterns


def all_transposable_tiles() -> list[torch.Tensor]:
    """Every 4x4 0/1 tile with exactly 2 per row and per column, by enumeration."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
    found = []
    for tile in itertools.product(rows, repeat=4):
        grid = torch.tensor(tile, dtype=torch.bool)
        if bool((grid.sum(0) == 2).all()):
            found.append(grid)
    return found


def brute_force_projection(
    scores: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """Per tile, the transposable tile whose rows' pattern scores sum highest (loops)."""
    r, c = shape
    tiles = all_transposable_tiles()
    table = candidate_patterns(NM(2, 4)).tolist()
    per_group = scores.view(r, c // 4, 6)
    out = torch.zeros(shape, dtype=torch.bool)
    for i, j in itertools.product(range(r // 4), range(c // 4)):
        best = max(
            tiles,
            key=lambda tile: sum(
                float(per_group[4 * i + k, j, table.index(tile[k].tolist())])
                for k in range(4)
            ),
        )
        out[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] = best
    return out


def test_there_are_90_transposable_tiles():
    assert len(all_transposable_tiles()) == 90


@pytest.mark.parametrize("shape", [(4, 4), (8, 16), (12, 8)])
def test_the_projection_is_the_best_of_the_90_tiles(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    scores = torch.randn(shape[0] * shape[1] // 4, 6, generator=gen)  # no ties
    got = tiles_to_mask(project_to_tiles(scores, shape), shape)
    assert torch.equal(got, brute_force_projection(scores, shape))
    assert is_transposable_2to4(got)


def test_tile_indices_round_trip_and_refuse_a_row_wise_mask():
    gen = torch.Generator().manual_seed(0)
    tiles = all_transposable_tiles()
    picks = torch.randint(0, 90, (2, 3), generator=gen)
    mask = torch.cat(
        [torch.cat([tiles[int(k)] for k in row], dim=1) for row in picks], dim=0
    )
    index = tile_indices(mask)
    assert index.shape == (6,) and torch.equal(tiles_to_mask(index, mask.shape), mask)
    row_wise = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)  # 4 in columns 0, 1
    assert pattern_indices(row_wise, NM(2, 4)).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="match no transposable 2:4 tile"):
        tile_indices(row_wise)


def test_the_tile_form_learns_per_tile_and_samples_transposable_masks():
    phase = resolve_phases(
        [Phase(sparsity="2:4", algorithm="learned", transposable="tiles", hard=True)],
        total_steps=10,
    )[0]
    algo = build_algorithm(phase)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    prior = algo.initial_mask(w, NM(2, 4), MaskContext("w", 0, 0))
    # the prior is the best transposable mask by magnitude: checked against the brute force
    # over the 90 tiles with each group's kept magnitude as its patterns' scores
    kept = (w.abs().view(-1, 1, 4) * candidate_patterns(NM(2, 4))).sum(-1)  # (32, 6)
    assert torch.equal(prior, brute_force_projection(kept, (8, 16)))
    algo.begin(0, {"w": prior})
    assert algo.logits["w"].shape == (8, 90)  # 8 tiles of 16 weights, 90 logits each
    hard = algo.sample("w", training=True)
    assert hard.requires_grad and is_transposable_2to4(hard.detach() > 0.5)
    assert torch.allclose(hard.detach().sum(), torch.tensor(64.0))
    soft = build_algorithm(
        resolve_phases(
            [Phase(sparsity="2:4", algorithm="learned", transposable="tiles")], 10
        )[0]
    )
    soft.begin(0, {"w": prior})
    tiles = soft.sample("w", training=True).detach().view(2, 4, 4, 4)
    # a mix of transposable tiles keeps 2 per row and per column of every tile, on average
    assert torch.allclose(tiles.sum(3), torch.full((2, 4, 4), 2.0))
    assert torch.allclose(tiles.sum(1), torch.full((2, 4, 4), 2.0))
    assert torch.equal(
        algo.most_likely("w"), prior
    )  # the noise is too small to move it
    assert algo.statistics("w")[:2] == (0, 32)  # counted in groups of 4
    with torch.no_grad():
        algo.logits[
            "w"
        ].zero_()  # uniform over the 90 tiles: ln 90 nats a tile, 4 groups
    assert algo.statistics("w")[2] == pytest.approx(math.log(90) / 4)


@pytest.mark.parametrize("model", ["gpt", "hf"])
@pytest.mark.parametrize("form", ["tiles", "project"])
def test_the_mask_handed_over_is_2_4_along_rows_and_columns(model, form, lightning_log):
    probe = MostLikelyAt(last=3)
    learned = {**LEARN, "until": 4, "mask_lr": 0.05, "transposable": form}
    phases = [learned, {"sparsity": "2:4", "algorithm": "static"}]
    _, sparsity, _ = fit(model, phases, 6, after=(probe,))
    sp = sparsity.sparsifier
    weights_count = sum(t.param.numel() for t in sp.targets)
    if (
        form == "tiles"
    ):  # the start line: 90 fp32 logits per 16 weights, with 3 copies more
        tiles = weights_count // 16
        cost = f"{tiles} 4x4 tiles, 90 logits each ({16 * 90 * tiles / 2**20:.2f} MiB"
    else:
        cost = f"{weights_count // 4} groups of 4, 6 logits each ("
    assert f"(weights training, transposable: {form}): {cost}" in lightning_log.text
    changed = groups = 0
    for t in sp.targets:
        handed = t.layer.to_rows(probe.next[t.name])
        assert is_transposable_2to4(handed) and is_nm(handed, NM(2, 4)), t.name
        assert bool(handed.reshape(-1, 4).sum(-1).eq(2).all())
        learned_mask = t.layer.to_rows(probe.learned[t.name])
        moved = (handed != learned_mask).reshape(-1, 4).any(-1)
        changed, groups = changed + int(moved.sum()), groups + moved.numel()
        if (
            form == "tiles"
        ):  # the most likely tiles are transposable: handed as they are
            assert torch.equal(handed, learned_mask), t.name
    if form == "project":
        assert changed > 0  # the learned groups left the transposable prior
        assert sum(sp.algorithms[0].projected.values()) == changed
        line = (
            f"the projection changed {changed} of {groups} groups "
            f"({changed / groups:.1%})"
        )
        assert line in lightning_log.text
    else:
        assert changed == 0 and "projection" not in lightning_log.text


@pytest.mark.parametrize(
    ("form", "resume_step"), [("tiles", 2), ("project", 2), ("project", 4)]
)
def test_resume_is_bitwise_equal_to_the_uninterrupted_run(tmp_path, form, resume_step):
    """Inside the learned phase (its logits per tile restored) or at its end (the
    projection made from restored logits): the same weights, masks and statistics."""
    phases = [
        {**LEARN, "until": 4, "mask_lr": 0.05, "transposable": form},
        {"sparsity": "2:4", "algorithm": "static"},
    ]
    reference, ref_cb, _ = fit("gpt", phases, 6)
    fit("gpt", phases, 6, tmp_path=tmp_path / "ck", stop_at=resume_step)
    ckpt = tmp_path / "ck" / f"step={resume_step}.ckpt"
    resumed, cb, trainer = fit("gpt", phases, 6, ckpt_path=ckpt, seed=123)
    assert trainer.global_step == 6
    expected, got = weights(reference), weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert cb.sparsifier.learned_reports == ref_cb.sparsifier.learned_reports
    ref_masks, masks = ref_cb.state_dict()["masks"], cb.state_dict()["masks"]
    assert all(torch.equal(ref_masks[k], masks[k]) for k in ref_masks)
    assert all(is_transposable_2to4(m) for m in masks.values())


def kernel_fit(monkeypatch, form, lightning_log=None):
    """4 bf16 steps of a 128-wide TinyModule, 2 learned (``transposable: form``) then 2
    static, on a pretended sm90 GPU whose cuSPARSELt ops run on the CPU (a dense stand-in
    for the matmul of the packed weight): the static phase's kernel calls and classes."""
    pretend_gpu(monkeypatch, (9, 0))
    calls = dense_cusparselt(monkeypatch)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    classes: dict[int, str] = {}
    counted: dict[int, int] = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            classes[trainer.global_step] = type(pl_module.net.fc1).__name__
            counted[trainer.global_step] = len(calls)

    L.seed_everything(0, verbose=False)
    model = TinyModule(width=128, inputs=128, lr=0.05)
    learned = {**LEARN, "until": 2, "mask_lr": 0.05, "transposable": form}
    cb = SparsityCallback(
        phases=[learned, {"sparsity": "2:4", "algorithm": "static"}], verbose=False
    )
    loader = DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=128), batch_size=6)
    trainer = fast_trainer(max_steps=4, callbacks=[cb, Probe()], precision="bf16-mixed")
    trainer.fit(model, loader)
    return cb, classes, counted, calls


@pytest.mark.parametrize("form", ["project", "tiles"])
def test_the_static_phase_after_transposable_masks_runs_the_kernel_ops(
    monkeypatch, form
):
    cb, classes, counted, calls = kernel_fit(monkeypatch, form)
    sp = cb.sparsifier
    plan = plan_table(sp, cb.selection)
    for t in sp.targets:
        assert sp.backends[0, t.name].name == "masked"  # a learned phase samples
        assert sp.backends[1, t.name].name == "semi_structured", t.name
        row = next(line for line in plan.splitlines() if t.name in line)
        assert "masked/semi_structured" in row, row
    assert classes == {
        0: "MaskedLinear",
        1: "MaskedLinear",
        2: "SemiStructuredLinear",
        3: "SemiStructuredLinear",
    }
    # the static phase's matmuls (the kernel check ran its own before the first step)
    assert counted[0] == counted[1] < counted[2] < counted[3]
    assert (128, 72) in {shape for shape, _ in calls}  # 128x128 weights, packed 2:4


def test_untransposable_learned_masks_plan_the_next_phase_on_masked_math(monkeypatch):
    cb, classes, counted, _ = kernel_fit(monkeypatch, False)
    sp = cb.sparsifier
    reason = sp.backends[1, "net.fc1.weight"].reason
    assert sp.backends[1, "net.fc1.weight"].name == "masked"
    assert re.search(
        r"starts from the learned masks of phase 1, which are not transposable 2:4; give "
        r"phase 1 transposable: project \(or tiles\)",
        reason,
    )
    assert reason in plan_table(sp, cb.selection)
    assert classes[2] == "Linear" and counted[3] == counted[0]  # stored zeros


@pytest.mark.parametrize(
    ("phase", "error", "match"),
    [
        (
            {**LEARN, "transposable": "rows"},
            ValueError,
            r"phases\[0\].transposable='rows': use 'tiles' .* 'project' .* true .* false",
        ),
        (
            {**LEARN, "sparsity": "4:8", "transposable": "tiles"},
            ValueError,
            r"transposable='tiles' .* needs sparsity '2:4', not '4:8'",
        ),
        (
            {"sparsity": "2:4", "algorithm": "static", "transposable": "tiles"},
            ValueError,
            r"'transposable' is accepted by \['learned'\]",
        ),
    ],
)
def test_configuration_mistakes_are_named(phase, error, match):
    with pytest.raises(error, match=match):
        SparsityCallback(phases=[phase])


def test_true_is_the_recommended_form_and_false_the_learned_patterns():
    from lightning_sparse.algorithms.learned import RECOMMENDED_FORM

    for value, form in ((True, RECOMMENDED_FORM), (False, False), (None, False)):
        phase = resolve_phases(
            [Phase(sparsity="2:4", algorithm="learned", transposable=value)], 10
        )[0]
        assert build_algorithm(phase).transposable == form


def test_a_row_wise_prior_starts_the_tile_form_from_the_tiles_keeping_most_of_it():
    """A learned phase after another hands on row-wise 2:4 masks: learning tiles starts, per
    tile, from a transposable tile that keeps as many of them as any of the 90 does."""
    phase = resolve_phases(
        [Phase(sparsity="2:4", algorithm="learned", transposable="tiles")], 10
    )[0]
    algo = build_algorithm(phase)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    prior = target_mask(w.abs(), NM(2, 4))  # row-wise: not transposable here
    assert not is_transposable_2to4(prior)
    algo.begin(0, {"w": prior})
    start = algo.most_likely("w")
    assert is_transposable_2to4(start)
    for i, j in itertools.product(range(2), range(4)):
        block = prior[4 * i : 4 * i + 4, 4 * j : 4 * j + 4]
        best = max(int((tile & block).sum()) for tile in all_transposable_tiles())
        assert int((start[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] & block).sum()) == best


def test_a_sure_tile_sample_is_the_most_likely_mask_in_its_layout():
    """At a huge logit scale the hard sample is each tile's most likely pattern, laid out as
    the most likely mask is (a tile transposed would be transposable too, and wrong)."""
    phase = resolve_phases(
        [
            Phase(
                sparsity="2:4",
                algorithm="learned",
                transposable="tiles",
                hard=True,
                logit_scale=1e4,
                prior_strength=0,
            )
        ],
        10,
    )[0]
    algo = build_algorithm(phase)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    algo.begin(0, {"w": algo.initial_mask(w, NM(2, 4), MaskContext("w", 0, 0))})
    best = algo.logits["w"].argmax(-1)  # without a prior: the noise decides
    expected = torch.zeros(8, 16, dtype=torch.bool)
    for k, index in enumerate(best.tolist()):
        i, j = divmod(k, 4)  # tiles in row-major order: 2 rows of 4
        expected[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] = tile_patterns(True)[
            index
        ].view(4, 4)
    assert torch.equal(algo.most_likely("w"), expected)
    assert torch.equal(algo.sample("w", training=True).detach() > 0.5, expected)


@pytest.mark.parametrize("form", ["project", False])
def test_a_resume_after_transposable_masks_refuses_a_row_wise_mask(tmp_path, form):
    """A checkpoint of the static phase holds its masks: after a transposable handover they
    must be transposable; after plain learned masks, N:M groups are enough."""
    phases = [
        {**LEARN, "until": 2, "transposable": form},
        {"sparsity": "2:4", "algorithm": "static"},
    ]
    fit("gpt", phases, 5, tmp_path=tmp_path, stop_at=3)
    ckpt = torch.load(tmp_path / "step=3.ckpt", weights_only=True)
    key = next(k for k in ckpt["callbacks"] if k.startswith("SparsityCallback"))
    masks = ckpt["callbacks"][key]["masks"]
    name = next(iter(masks))
    gen = torch.Generator().manual_seed(0)
    masks[name] = target_mask(torch.rand(masks[name].shape, generator=gen), NM(2, 4))
    assert not is_transposable_2to4(masks[name])
    torch.save(ckpt, tmp_path / "row_wise.ckpt")
    if form:
        with pytest.raises(ValueError, match=r"is not transposable 2:4 \(at most 2"):
            fit("gpt", phases, 5, ckpt_path=tmp_path / "row_wise.ckpt")
    else:
        fit("gpt", phases, 5, ckpt_path=tmp_path / "row_wise.ckpt")


@pytest.mark.parametrize(
    ("form", "bytes_per_weight"),
    [("tiles", 90 * 4 * 4 / 16), ("project", 6 * 4 * 4 / 4), (False, 6 * 4 * 4 / 4)],
)
def test_plan_counts_the_logits_of_each_form(form, bytes_per_weight):
    """The plan's logits line: float32 logits, their gradient and Adam's two moments, over each
    4x4 tile's 90 transposable tiles (``tiles``) or each group's 6 patterns."""
    from lightning_sparse.cli.memory import phase_memory
    from lightning_sparse.core.selection import select_parameters
    from lightning_sparse.engine.sparsifier import Sparsifier

    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    phases = resolve_phases(
        [Phase(sparsity="2:4", algorithm="learned", transposable=form, until=5)], 10
    )
    targets = select_parameters(net, params=["0.weight", "1.weight"]).targets
    (memory,) = phase_memory(Sparsifier("g", targets, phases), shards=1)
    assert memory.logits == (64 * 32 + 32 * 16) * bytes_per_weight
