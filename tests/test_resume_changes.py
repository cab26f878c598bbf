"""Resuming with a changed schedule never lies: another schedule or other parameters than the
checkpoint's stop the resume with each difference named, or, with
``on_schedule_change="reselect"``, apply from the resume step with masks chosen afresh; a
longer run moves its boundaries and says where; masks that break their phase's pattern are
refused by parameter; unchanged schedules resume bitwise."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from helpers import RepeatedBatch, TinyModule, TinyNet, fast_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_sparse import (
    Phase,
    Sparsifier,
    SparsityAlgorithm,
    SparsityCallback,
    register_algorithm,
    select_parameters,
)
from lightning_sparse.core.schedule import resolve_phases
from lightning_sparse.masks import NM, is_nm, target_mask
from lightning_sparse.masks.tiles import is_transposable_2to4

KEY = "SparsityCallback{'name': 'sparsity'}"
STATIC_50 = [{"sparsity": 0.5}]
SCHEDULE = [
    {"sparsity": 0.5, "algorithm": "magnitude", "update_every": 2, "until": 6},
    {"sparsity": "2:4", "until": 9},
    {"sparsity": 0.0},
]


def loader() -> DataLoader:
    return DataLoader(RepeatedBatch(n=24, batch_size=6), batch_size=6)


class Record(L.Callback):
    """Placed after the SparsityCallback: target and actual sparsity at every step."""

    def __init__(self, cb: SparsityCallback) -> None:
        self.cb = cb
        self.sparsity: dict[int, tuple[float, float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sp = self.cb.sparsifier
        step = trainer.global_step
        self.sparsity[step] = (sp.target_sparsity(step), sp.actual_sparsity())


def fit(
    out,
    phases,
    max_steps,
    ckpt_path=None,
    save_at=None,
    seed=0,
    logger=False,
    model=None,
    **cb_kwargs,
):
    L.seed_everything(seed, verbose=False)
    model = model or TinyModule(lr=0.05, weight_decay=0.1)
    cb = SparsityCallback(phases=phases, verbose=False, **cb_kwargs)
    record = Record(cb)
    callbacks = [cb, record]
    if save_at:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out,
                every_n_train_steps=save_at,
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = fast_trainer(
        max_steps=max_steps,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(save_at),
        logger=logger,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, cb, record


@pytest.fixture(scope="module")
def static_50(tmp_path_factory):
    """A checkpoint after 4 steps of 50% static sparsity on fc1 and fc2."""
    out = tmp_path_factory.mktemp("static_50")
    fit(out, STATIC_50, max_steps=4, save_at=4)
    return out / "step=4.ckpt"


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("phases", "cb_kwargs", "difference"),
    [
        (
            [{"sparsity": 0.8, "until": 0.5}, {"sparsity": 0.0}],
            {},
            (
                r"phases\[0\].sparsity: 0.5 in the checkpoint, 0.8 now; phases\[0\].until: "
                r"unset in the checkpoint, 0.5 now; phases\[1\] \(sparsity: 0.0\) is new"
            ),
        ),
        (
            [{"sparsity": "2:4", "algorithm": "static"}],
            {},
            r"phases\[0\].sparsity: 0.5 in the checkpoint, 2:4 now",
        ),
        (
            [{"sparsity": 0.5, "algorithm": "magnitude"}],
            {},
            r"phases\[0\].algorithm: static in the checkpoint, magnitude now",
        ),
        (
            STATIC_50,
            {"params": ["net.fc1.weight"]},
            (
                r"the checkpoint has masks for parameters this group does not select: "
                r"\['net.fc2.weight'\]"
            ),
        ),
    ],
    ids=["sparsity", "2:4", "algorithm", "params"],
)
def test_a_changed_schedule_stops_the_resume_naming_each_difference(
    tmp_path, static_50, phases, cb_kwargs, difference
):
    model = TinyModule(lr=0.05, weight_decay=0.1)
    with pytest.raises(ValueError, match=difference) as err:
        fit(tmp_path, phases, 12, ckpt_path=static_50, model=model, **cb_kwargs)
    saved = torch.load(static_50, weights_only=True)["state_dict"]
    for key, value in weights(model).items():  # stopped before the first step
        assert torch.equal(value, saved[key]), key
    message = str(err.value)
    assert message.startswith(
        "[sparsity] the checkpoint was trained with another schedule"
    )
    assert (
        "Resume with the phases it was trained with ([{sparsity: 0.5, algorithm: static}])"
        in message
    )
    assert (
        "pass on_schedule_change='reselect' to apply this schedule from the resume step (4)"
        in message
    )


FC1, BOTH = ["net.fc1.weight"], ["net.fc1.weight", "net.fc2.weight"]
DENSE_THEN_SPARSE = [{"sparsity": 0.0, "until": 4}, {"sparsity": 0.5}]


@pytest.fixture(scope="module")
def by_selection(tmp_path_factory):
    """Checkpoints of DENSE_THEN_SPARSE selecting fc1, or fc1 and fc2: ``step=2.ckpt`` in the
    dense phase, ``step=6.ckpt`` in the sparse one."""
    folders = {}
    for name, params in (("fc1", FC1), ("both", BOTH)):
        folders[name] = tmp_path_factory.mktemp(name)
        fit(folders[name], DENSE_THEN_SPARSE, 6, save_at=2, params=params)
    return folders


WIDENED = r"this group selects parameters \['net.fc2.weight'\]; the checkpoint {}"
NARROWED = (
    r"the checkpoint {} parameters this group does not select: \['net.fc2.weight'\]"
)


@pytest.mark.parametrize(
    ("saved", "now", "step", "difference"),
    [
        ("fc1", BOTH, 2, WIDENED.format("was not saved for them")),
        ("fc1", BOTH, 6, WIDENED.format("has no mask for them")),
        ("both", FC1, 2, NARROWED.format("was saved for")),
        ("both", FC1, 6, NARROWED.format("has masks for")),
    ],
    ids=["widened, dense", "widened, sparse", "narrowed, dense", "narrowed, sparse"],
)
def test_a_changed_selection_stops_the_resume_or_applies_with_the_opt_in(
    tmp_path, by_selection, saved, now, step, difference
):
    ckpt = by_selection[saved] / f"step={step}.ckpt"
    with pytest.raises(ValueError, match=r"another schedule: " + difference):
        fit(tmp_path, DENSE_THEN_SPARSE, 8, ckpt_path=ckpt, params=now)
    model, cb, _ = fit(
        tmp_path,
        DENSE_THEN_SPARSE,
        8,
        ckpt_path=ckpt,
        params=now,
        on_schedule_change="reselect",
    )
    assert [t.name for t in cb.sparsifier.targets] == now
    assert sorted(cb.sparsifier.masks) == now
    for name in now:  # 50% static: the pruned weights are stored as zeros
        zeros = float((model.get_parameter(name) == 0).float().mean())
        assert zeros == 0.5, name


def test_the_opt_in_applies_the_new_schedule_at_the_resume_step(
    tmp_path, static_50, lightning_log
):
    phases = [{"sparsity": 0.8, "until": 0.5}, {"sparsity": 0.0}]
    _, cb, record = fit(
        tmp_path,
        phases,
        max_steps=12,
        ckpt_path=static_50,
        on_schedule_change="reselect",
        logger=CSVLogger(tmp_path, name="logs"),
    )
    assert cb.sparsifier.history == [(4, 0), (6, 1)]
    for step in (4, 5):  # 80% in fc1 (16x8) and fc2 (16x16): 102 + 205 of 384 zeros
        target, actual = record.sparsity[step]
        assert target == 0.8 and actual == pytest.approx(307 / 384)
    assert record.sparsity[6][0] == 0.0
    text = lightning_log.text
    assert "[sparsity] step 4: the schedule differs from the checkpoint's" in text
    assert "masks chosen afresh (on_schedule_change='reselect')" in text
    assert "[sparsity] step 4: phase 1/2 begins: 80% static" in text
    # the loggers see the phase change at the resume step, target and actual agreeing
    path = next(tmp_path.glob("logs/*/metrics.csv"))
    rows = [r for r in csv.DictReader(path.open()) if r["sparsity/sparsity/target"]]
    at_resume = next(r for r in rows if r["step"] == "4")
    assert float(at_resume["sparsity/sparsity/target"]) == 0.8
    assert float(at_resume["sparsity/sparsity/actual"]) == pytest.approx(307 / 384)


def test_the_opt_in_to_2_4_chooses_transposable_2_4_masks(tmp_path, static_50):
    phases = [{"sparsity": "2:4", "algorithm": "static"}]
    _, cb, _ = fit(
        tmp_path,
        phases,
        max_steps=6,
        ckpt_path=static_50,
        on_schedule_change="reselect",
    )
    assert cb.sparsifier.history == [(4, 0)]
    for t in cb.sparsifier.targets:
        mask = cb.sparsifier.masks[t.name]
        assert is_nm(mask, NM(2, 4)) and is_transposable_2to4(mask), t.name
        assert int(mask.sum()) == mask.numel() // 2
        assert bool((t.param.detach()[~mask] == 0).all()), t.name


def test_a_longer_run_moves_the_boundaries_and_says_where(tmp_path, lightning_log):
    phases = [{"sparsity": 0.5, "until": 0.5}, {"sparsity": 0.0}]
    fit(tmp_path, phases, max_steps=4, save_at=4)
    _, cb, record = fit(
        tmp_path, phases, max_steps=12, ckpt_path=tmp_path / "step=4.ckpt"
    )
    # the first phase now ends at step 6, so it begins again at the resume step
    assert cb.sparsifier.history == [(0, 0), (2, 1), (4, 0), (6, 1)]
    assert record.sparsity[4] == (0.5, 0.5)
    assert "the phases span steps 0-5, 6-11 (before: 0-1, 2-3)" in lightning_log.text
    assert "[sparsity] step 4: phase 1/2 begins: 50% static" in lightning_log.text


@pytest.mark.parametrize("how", ["reselect", "unrecorded"])
def test_an_unchanged_schedule_resumes_bitwise(tmp_path, how):
    reference, ref_cb, _ = fit(tmp_path / "ref", SCHEDULE, max_steps=12)
    fit(tmp_path / "ck", SCHEDULE, max_steps=12, save_at=5)
    ckpt = tmp_path / "ck" / "step=5.ckpt"
    cb_kwargs = {}
    if how == "reselect":  # the opt-in changes nothing when nothing changed
        cb_kwargs["on_schedule_change"] = "reselect"
    else:  # a state without a schedule record is restored as saved
        state = torch.load(ckpt, weights_only=True)
        del state["callbacks"][KEY]["schedule"]
        torch.save(state, ckpt)
    resumed, cb, _ = fit(tmp_path, SCHEDULE, 12, ckpt_path=ckpt, seed=7, **cb_kwargs)
    expected = weights(reference)
    for key, value in weights(resumed).items():
        assert torch.equal(value, expected[key]), key
    assert cb.sparsifier.history == ref_cb.sparsifier.history


@pytest.fixture(scope="module")
def static_24(tmp_path_factory):
    """A checkpoint after 2 steps of 2:4 static sparsity."""
    out = tmp_path_factory.mktemp("static_24")
    fit(out, [{"sparsity": "2:4", "algorithm": "static"}], max_steps=2, save_at=2)
    return out / "step=2.ckpt"


def rowwise_24(shape) -> torch.Tensor:
    """2:4 along every row (the first two of every four), so 4 per column of a 4x4 tile."""
    return torch.tensor([True, True, False, False]).repeat(shape[0], shape[1] // 4)


@pytest.mark.parametrize(
    ("mask", "problem"),
    [
        (
            lambda shape: (
                torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.5
            ),
            r"is not 2:4 \(at most 2 kept of every 4 along its inputs\)",
        ),
        (
            rowwise_24,
            (
                r"is not transposable 2:4 \(at most 2 kept per row and per column of each "
                r"4x4 tile\)"
            ),
        ),
    ],
    ids=["unstructured", "row-wise"],
)
def test_a_mask_that_breaks_its_phase_pattern_is_refused_by_parameter(
    tmp_path, static_24, mask, problem
):
    state = torch.load(static_24, weights_only=True)
    masks = state["callbacks"][KEY]["masks"]
    masks["net.fc2.weight_mask"] = mask(tuple(masks["net.fc2.weight_mask"].shape))
    torch.save(state, tmp_path / "bad.ckpt")
    with pytest.raises(
        ValueError,
        match=r"\[sparsity\] the checkpoint's mask for parameter 'net.fc2.weight' "
        + problem
        + r", which phase 1 \(2:4 static\) keeps",
    ):
        fit(
            tmp_path,
            [{"sparsity": "2:4", "algorithm": "static"}],
            max_steps=4,
            ckpt_path=tmp_path / "bad.ckpt",
        )


def test_on_schedule_change_is_checked_when_the_callback_is_built():
    with pytest.raises(
        ValueError, match=r"on_schedule_change='keep': use 'error' .* or 'reselect'"
    ):
        SparsityCallback(sparsity=0.5, on_schedule_change="keep")


@pytest.fixture(scope="module")
def saved_state(static_50):
    return torch.load(static_50, weights_only=True)["callbacks"][KEY]


@settings(max_examples=100, deadline=None, database=None)
@given(
    record=st.none()
    | st.integers()
    | st.text(max_size=3)
    | st.dictionaries(
        st.sampled_from(["phases", "params", "other"]),
        st.none()
        | st.lists(st.integers() | st.text(max_size=3), max_size=2)
        | st.lists(
            st.fixed_dictionaries(
                {
                    "spec": st.dictionaries(
                        st.text(max_size=2), st.integers(), max_size=1
                    ),
                    "steps": st.lists(st.integers(), max_size=3),
                }
            ),
            max_size=2,
        ),
    )
)
def test_a_damaged_schedule_record_is_a_value_error(saved_state, record):
    net = TinyNet()
    sparsifier = Sparsifier(
        "sparsity",
        select_parameters(net).targets,
        resolve_phases([Phase(sparsity=0.5)], total_steps=4),
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        sparsifier.load_state_dict({**saved_state, "schedule": record}, [optimizer])
    except ValueError as err:
        assert str(err).startswith("[sparsity] the checkpoint")
    else:
        assert record is None  # not recorded: restored as saved


def test_the_engine_applies_a_changed_schedule_at_the_step_it_is_given(saved_state):
    torch.manual_seed(0)
    net = TinyNet()
    targets = select_parameters(net).targets
    phases = resolve_phases([Phase(sparsity=0.8)], total_steps=12)
    sparsifier = Sparsifier("sparsity", targets, phases)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"pass step=<the optimizer step training"):
        sparsifier.load_state_dict(
            saved_state, [optimizer], on_schedule_change="reselect"
        )
    change = sparsifier.load_state_dict(
        saved_state, [optimizer], step=4, on_schedule_change="reselect"
    )
    assert (change.step, change.new.index) == (4, 0)
    assert sparsifier.history == [(4, 0)] and sparsifier.last_update_step == 4
    assert sparsifier.actual_sparsity() == pytest.approx(307 / 384)


@register_algorithm("rowwise_24_resume_test")
class RowWise(SparsityAlgorithm):
    """A custom rule: N of every M by magnitude along each row, never transposable tiles."""

    straight_through = True
    dynamic = True

    def update_mask(self, weight, mask, target, ctx):
        return target_mask(weight.abs(), target)


def test_a_custom_algorithm_is_held_to_its_phase_groups_only(tmp_path):
    phases = [
        {"sparsity": "2:4", "algorithm": "rowwise_24_resume_test", "update_every": 1},
    ]
    reference, _, _ = fit(tmp_path / "ref", phases, max_steps=6)
    fit(tmp_path / "ck", phases, max_steps=6, save_at=3)
    state = torch.load(tmp_path / "ck" / "step=3.ckpt", weights_only=True)
    mask = state["callbacks"][KEY]["masks"]["net.fc2.weight_mask"]
    assert is_nm(mask, NM(2, 4)) and not is_transposable_2to4(mask)
    resumed, _, _ = fit(tmp_path, phases, 6, ckpt_path=tmp_path / "ck" / "step=3.ckpt")
    expected = weights(reference)
    for key, value in weights(resumed).items():
        assert torch.equal(value, expected[key]), key
