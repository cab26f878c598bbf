"""Checkpoints from elsewhere: read with ``weights_only=True`` unless the caller opts in (a
crafted pickle runs nothing), and a malformed sparsity state raises a ValueError naming the
parameter, through export and through resume (a hypothesis fuzz of both)."""

import pathlib
import pickle

import lightning as L
import pytest
import torch
from helpers import TinyModule, TinyNet, fast_trainer, random_loader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sparse import (
    Phase,
    Sparsifier,
    SparsityCallback,
    export_state_dict,
    save_compressed,
    select_parameters,
)
from lightning_sparse.core.schedule import resolve_phases

KEY = "SparsityCallback{'name': 'sparsity'}"
PHASES = [{"sparsity": 0.5, "algorithm": "magnitude", "update_every": 2}]


class WithHyperparameters(TinyModule):
    def __init__(self, lr: float = 0.01, phases: list | None = None) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def train(tmp_path, ckpt_path=None, max_steps=4, **fit):
    L.seed_everything(0, verbose=False)
    trainer = fast_trainer(
        max_steps=max_steps,
        callbacks=[
            SparsityCallback(phases=PHASES, verbose=False),
            ModelCheckpoint(dirpath=tmp_path, filename="last"),
        ],
        enable_checkpointing=True,
    )
    model = WithHyperparameters(phases=PHASES)
    trainer.fit(model, random_loader(), ckpt_path=ckpt_path, **fit)
    return trainer, tmp_path / "last.ckpt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint written by Trainer.fit with a SparsityCallback (hyper-parameters saved)."""
    return train(tmp_path_factory.mktemp("fit"))[1]


class Payload:
    """Unpickling it writes ``marker``: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return pathlib.Path.write_text, (self.marker, "ran")


def test_a_checkpoint_of_fit_needs_no_extra_safe_globals(tmp_path, checkpoint):
    loaded = torch.load(checkpoint, weights_only=True)  # nothing registered
    assert loaded["hyper_parameters"]["phases"] == PHASES
    assert loaded["callbacks"][KEY]["masks"]
    safe, full = (
        export_state_dict(checkpoint),
        export_state_dict(checkpoint, trusted=True),
    )
    assert safe.keys() == full.keys()
    assert all(torch.equal(safe[k], full[k]) for k in safe)
    assert int((safe["net.fc1.weight"] == 0).sum()) >= 64
    # Lightning's own resume reads it with weights_only=True too (torch's default since 2.6)
    trainer, _ = train(tmp_path, ckpt_path=checkpoint, max_steps=6, weights_only=True)
    assert trainer.global_step == 6


@pytest.mark.parametrize("writer", ["torch.save", "legacy torch.save", "pickle.dump"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # of a bare pickle
def test_a_crafted_pickle_runs_only_with_the_opt_in(tmp_path, writer):
    marker = tmp_path / "marker"
    path = tmp_path / "crafted.ckpt"
    crafted = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": Payload(marker)}
    if writer == "pickle.dump":
        path.write_bytes(pickle.dumps(crafted))
    else:
        torch.save(crafted, path, _use_new_zipfile_serialization=writer == "torch.save")
    assert not marker.exists()
    message = (
        r"holds more than tensors, containers and plain values, so it was not loaded "
        r"\(torch.load\(weights_only=True\): Unsupported (global: GLOBAL getattr|operand)"
        r".*add_safe_globals.*pass trusted=True, which unpickles it in full"
    )
    with pytest.raises(ValueError, match=message):
        export_state_dict(path)
    with pytest.raises(ValueError, match=message):
        save_compressed(path, tmp_path / "out.safetensors", verbose=False)
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()
    # the opt-in does what the message says it does (a bare pickle is no torch.save file, but
    # unpickling it runs the payload before torch finds out)
    if writer == "pickle.dump":
        with pytest.raises(ValueError, match=r"not a readable PyTorch checkpoint"):
            export_state_dict(path, trusted=True)
    else:
        assert export_state_dict(path, trusted=True)["w"].tolist() == [1.0, 1.0]
    assert marker.read_text() == "ran"


def test_a_torch_with_known_loader_bypasses_needs_the_opt_in(monkeypatch, checkpoint):
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.raises(
        ValueError,
        match=r"torch 2.9.1 cannot be relied on .*CVE-2026-24747\). Upgrade torch .*trusted=True",
    ):
        export_state_dict(checkpoint)
    assert "net.fc1.weight" in export_state_dict(checkpoint, trusted=True)


def test_damaged_and_foreign_files_are_named(tmp_path, checkpoint):
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(
        ValueError, match=r"damaged.ckpt'\): not a readable PyTorch checkpoint"
    ):
        export_state_dict(damaged)
    with pytest.raises(FileNotFoundError):
        export_state_dict(tmp_path / "nowhere.ckpt")
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    with pytest.raises(KeyError, match=r"needs a Lightning checkpoint .* got a Tensor"):
        export_state_dict(tmp_path / "tensor.pt")


def test_a_malformed_state_stops_lightning_resume_with_the_parameter_named(
    tmp_path, checkpoint
):
    ckpt = torch.load(checkpoint, weights_only=True)
    masks = ckpt["callbacks"][KEY]["masks"]
    cases = {
        r"mask for parameter 'net.fc2.weight' is a torch.float32 torch.strided tensor, not a "
        r"dense bool tensor": {
            "net.fc2.weight_mask": masks["net.fc2.weight_mask"].float()
        },
        r"has masks for parameters this group does not select: \['net.head.weight_mask'\]: "
        r"resume with the same params/exclude": {
            "net.head.weight_mask": torch.ones(4, 16, dtype=torch.bool)
        },
    }
    for i, (message, change) in enumerate(cases.items()):
        ckpt["callbacks"][KEY]["masks"] = {**masks, **change}
        torch.save(ckpt, tmp_path / f"{i}.ckpt")
        with pytest.raises(ValueError, match=message):
            train(tmp_path / str(i), ckpt_path=tmp_path / f"{i}.ckpt", max_steps=6)


# -- fuzz: malformed sparsity state through export and through the sparsifier -------------------

_VALUE = (
    st.none()
    | st.integers()
    | st.text(max_size=3)
    | st.lists(st.integers(), max_size=2)
)
_FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return torch.load(checkpoint, weights_only=True)


def fresh(ckpt):
    """A copy of the checkpoint whose callback states (not tensors) can be changed."""
    callbacks = {k: dict(v) for k, v in ckpt["callbacks"].items()}
    return {**ckpt, "callbacks": callbacks}


@st.composite
def bad_masks(draw, masks, shapes):
    """(masks, the parameter named in the error): one mask missing, mis-shaped, not bool, not a
    tensor, or an extra mask for a weight the model lacks."""
    masks = dict(masks)
    key = draw(st.sampled_from(sorted(masks)))
    name = key.removesuffix("_mask")
    kind = draw(st.sampled_from(["shape", "dtype", "not_tensor", "extra", "missing"]))
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 20), max_size=3).map(tuple))
        if shape == shapes[name]:
            shape = (*shape, 1)
        masks[key] = torch.ones(shape, dtype=torch.bool)
    elif kind == "dtype":
        dtype = draw(
            st.sampled_from([torch.float32, torch.uint8, torch.int64, torch.float16])
        )
        masks[key] = masks[key].to(dtype)
    elif kind == "not_tensor":
        masks[key] = draw(_VALUE)
    elif kind == "extra":
        name = draw(st.sampled_from(["ghost.weight", "net.fc3.weight", "w"]))
        key = f"{name}_mask"
        masks[key] = torch.ones(2, 2, dtype=torch.bool)
    else:
        del masks[key]
    return kind, name, key, masks


@_FUZZ
@given(data=st.data())
def test_fuzzed_sparsity_state_through_export_names_the_mask(loaded, data):
    ckpt = fresh(loaded)
    state = ckpt["callbacks"][KEY]
    shapes = {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()}
    kind, name, key, masks = data.draw(bad_masks(state["masks"], shapes))
    ckpt["callbacks"][KEY] = {**state, "masks": masks}
    if (
        kind == "missing"
    ):  # the state does not list the group's parameters: see the docs
        assert name in export_state_dict(ckpt)
        return
    with pytest.raises(ValueError, match=rf"mask '{key}'") as err:
        export_state_dict(ckpt)
    assert name in str(err.value)


@_FUZZ
@given(data=st.data())
def test_fuzzed_callback_state_through_export_is_a_value_error(loaded, data):
    ckpt = fresh(loaded)
    state = ckpt["callbacks"][KEY]
    field = data.draw(
        st.sampled_from(["state", "masks", "version", "callbacks", "twice"])
    )
    if field == "state":
        ckpt["callbacks"][KEY] = data.draw(_VALUE.filter(lambda v: v is not None))
    elif field == "masks":
        state["masks"] = data.draw(_VALUE)
    elif field == "version":
        state["version"] = data.draw(
            (_VALUE | st.booleans()).filter(lambda v: v not in (1, True))
        )
    elif field == "callbacks":
        ckpt["callbacks"] = data.draw(_VALUE)
    else:  # a second group claims the same masks
        ckpt["callbacks"]["SparsityCallback{'name': 'other'}"] = state
    with pytest.raises(ValueError, match=r"the checkpoint"):
        export_state_dict(ckpt)


def sparsifier():
    torch.manual_seed(0)
    net = TinyNet()
    targets = select_parameters(net).targets
    phases = resolve_phases([Phase(sparsity=0.5, algorithm="static")], total_steps=10)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    return Sparsifier("sparsity", targets, phases), optimizer


@pytest.fixture(scope="module")
def saved_state():
    sp, optimizer = sparsifier()
    sp.on_step_start(0, [optimizer])
    return sp.state_dict()


@_FUZZ
@given(data=st.data())
def test_fuzzed_state_through_resume_names_the_parameter_and_changes_nothing(
    saved_state, data
):
    shapes = {
        k.removesuffix("_mask"): tuple(m.shape) for k, m in saved_state["masks"].items()
    }
    kind, name, key, masks = data.draw(bad_masks(saved_state["masks"], shapes))
    sp, optimizer = sparsifier()
    before = {t.name: t.param.detach().clone() for t in sp.targets}
    with pytest.raises(ValueError, match=r"\[sparsity\] the checkpoint") as err:
        sp.load_state_dict({**saved_state, "masks": masks}, [optimizer])
    assert (key if kind == "extra" else repr(name)) in str(err.value)
    assert sp.current is None and not sp.masks
    assert all(torch.equal(t.param, before[t.name]) for t in sp.targets)


@_FUZZ
@given(
    field=st.sampled_from(["version", "phase", "last_update_step", "history", "masks"]),
    value=_VALUE | st.booleans() | st.floats(allow_nan=False),
)
def test_fuzzed_state_fields_through_resume_are_value_errors(saved_state, field, value):
    state = {**saved_state, field: value}
    sp, optimizer = sparsifier()
    try:
        sp.load_state_dict(state, [optimizer])
    except ValueError as err:
        assert "[sparsity] the checkpoint" in str(err)
        return
    # what still loads is a value the field may hold
    assert (field == "history" and value == []) or (
        type(value) is int
        and (
            (field == "last_update_step" and value >= -1)
            or (field, value) in {("version", 1), ("phase", 0)}
        )
    )
    sp2, optimizer = sparsifier()
    sp2.load_state_dict(saved_state, [optimizer])  # the valid state still loads


def test_a_valid_state_resumes_through_the_sparsifier(saved_state):
    sp, optimizer = sparsifier()
    sp.load_state_dict(saved_state, [optimizer])
    assert sp.current is not None
    for t in sp.targets:
        assert torch.equal(sp.current_mask(t), saved_state["masks"][f"{t.name}_mask"])
