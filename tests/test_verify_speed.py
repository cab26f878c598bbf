"""``verify_speed``'s default and token count: on by default with ``backend="auto"`` (timing
weights on a GPU), ``verify_speed_tokens`` sets the rows it times, and the fit-start table and
``plan`` say whether it is on and at which count."""

from __future__ import annotations

import pytest
import torch
from helpers import kernel_fit, pretend_gpu, slow_kernels
from test_semi_structured import fit
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sparse import SparsityCallback
from lightning_sparse.algorithms import RunLength
from lightning_sparse.backends import speed
from lightning_sparse.backends.gpus import parse_gpu
from lightning_sparse.cli.plan import verify_speed_line
from lightning_sparse.engine.report import plan_table

RUN = RunLength(total_steps=10)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 2))


def built(**kwargs):
    cb = SparsityCallback(sparsity="2:4", params=["0.weight"], verbose=False, **kwargs)
    return cb.build(mlp(), RUN, torch.bfloat16, gpu=parse_gpu("h100"))[0]


@pytest.fixture
def measured(monkeypatch):
    """``measure_speedup`` recorded: each call's token count; every shape 1.2x dense."""
    calls = []

    def measure(shape, dtype, kernel, device, tokens, timing, stored):
        calls.append(tokens)
        return speed.SpeedMeasurement(1.2, 0.0, timing=timing, tokens=tokens)

    monkeypatch.setattr(speed, "measure_speedup", measure)
    return calls


def test_verify_speed_is_on_by_default_with_auto_only():
    default = built().forwards.speed_check
    assert default is not None and default.gpu_only and default.tokens == 8192
    assert built(verify_speed=True).forwards.speed_check.gpu_only is False
    assert built(verify_speed=False).forwards.speed_check is None
    assert built(backend="masked").forwards.speed_check is None
    assert built(backend="semi_structured").forwards.speed_check is None


def test_the_default_times_weights_on_a_gpu_only(measured):
    check = speed.SpeedCheck(gpu_only=True)
    assert check(torch.zeros(128, 128), "cusparselt", torch.bfloat16) is None
    with FakeTensorMode():
        on_gpu = torch.empty(128, 128, device="cuda")
    assert check(on_gpu, "cusparselt", torch.bfloat16).ratio == 1.2
    assert measured == [8192]


def test_a_default_run_on_a_pretend_gpu_runs_its_kernel_untimed(monkeypatch, measured):
    """The CPU weights of a pretend GPU run the emulation: nothing to time by default."""
    pretend_gpu(monkeypatch)
    _, cb, _ = fit("auto")
    assert cb.sparsifier.backends[0, "net.fc1.weight"].name == "semi_structured"
    assert measured == []


@pytest.mark.parametrize("tokens", [None, 64])
def test_the_table_names_the_token_count_it_timed(monkeypatch, measured, tokens):
    pretend_gpu(monkeypatch)
    _, cb, _ = fit("auto", verify_speed=True, verify_speed_tokens=tokens)
    count = tokens or 8192
    assert measured == [count]
    reason = cb.sparsifier.backends[0, "net.fc1.weight"].reason
    assert reason.endswith(f"1.20x dense (eager, {count} tokens)")
    table = plan_table(cb.sparsifier, cb.selection)  # what fit start prints
    line = next(line for line in table.splitlines() if "verify_speed:" in line)
    assert f"timed at fit start, eagerly, at {count} tokens" in line
    assert ("the default: set verify_speed_tokens" in line) == (tokens is None)


def test_plan_says_whether_verify_speed_is_on_and_at_which_count():
    assert verify_speed_line(built()).startswith(
        "verify_speed: on: each layer shape on a 2:4 kernel timed at fit start, eagerly, "
        "at 8192 tokens (the default"
    )
    assert "at 12288 tokens; slower ones keep dense math" in verify_speed_line(
        built(verify_speed_tokens=12288)
    )
    assert verify_speed_line(built(verify_speed=False)).startswith(
        "verify_speed: off: every layer above on a 2:4 kernel runs it"
    )
    assert verify_speed_line(built(backend="masked")) == ""  # no layer on a kernel


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"verify_speed_tokens": 0}, "verify_speed_tokens=0: give the rows"),
        ({"verify_speed_tokens": True}, "verify_speed_tokens=True: give the rows"),
        ({"verify_speed_tokens": "12288"}, "verify_speed_tokens='12288': give"),
        (
            {"verify_speed_tokens": 12288, "verify_speed": False},
            r"which is off here \(backend='auto', verify_speed=False\)",
        ),
        (
            {"verify_speed_tokens": 12288, "backend": "masked"},
            r"use backend='auto' with verify_speed left on, or drop verify_speed_tokens",
        ),
    ],
)
def test_a_wrong_token_count_is_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparsityCallback(sparsity="2:4", **kwargs)


def test_the_kernel_path_fits_keep_their_kernels_where_verify_speed_would_not(
    monkeypatch, tmp_path
):
    """The GPU tests of the kernel path train on the kernels whatever verify_speed would
    decide at their shapes (on a GPU where eager 2:4 is 0.12x dense: masked math, so these
    tests would not test the kernels), and that decision is what verify_speed's default
    makes."""
    pretend_gpu(monkeypatch, (9, 0))
    slow_kernels(monkeypatch)
    _, cb, probe = kernel_fit(tmp_path, accelerator="cpu")
    assert cb.sparsifier.backends[0, "net.fc1.weight"].name == "semi_structured"
    assert probe.classes[0] == probe.classes[4] == "SemiStructuredLinear"
    decided = SparsityCallback(
        sparsity="2:4", params=["0.weight"], verbose=False
    ).build(nn.Sequential(nn.Linear(256, 256)), RUN, torch.bfloat16)[0]
    choice = decided.backends[0, "0.weight"]
    assert choice.name == "masked"
    assert "sparse 0.12x dense (eager, 8192 tokens), so kept dense (verify_speed)" in (
        choice.reason
    )
