"""The kernel check on the CPU, with injected kernels (right, wrong, raising): its decisions at
fit start, in verify_speed, in to_semi_structured and across a resume, and that no entry point
runs a kernel that has not passed it in this process."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import RepeatedBatch, StopAt, TinyModule, fast_trainer, pretend_gpu
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import DataLoader

from lightning_sparse import SparsityCallback, to_semi_structured
from lightning_sparse.backends import choose_backend, cusparselt, kernel_check, speed
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.kernel_check import (
    KernelCheckError,
    check_kernel,
    forget_verdicts,
)
from lightning_sparse.backends.masked import project_eagerly, straight_through_mask
from lightning_sparse.cli.main import SparseCLI
from lightning_sparse.masks import NM
from lightning_sparse.masks.tiles import (
    greedy_2to4_mask,
    tile_kernel_takes,
    transposable_2to4_mask,
)

WIDTH = 128  # TinyNet's fc1 and fc2 become 128x128: cuSPARSELt's shapes


def right(x, weight, bias, mask, packing=None):
    weight = weight.to(x.dtype)  # a kernel is given the weight as stored
    if mask is None:
        mask = transposable_2to4_mask(weight.detach())
    return F.linear(x, straight_through_mask(weight, mask), bias)


def wrong(x, weight, bias, mask, packing=None):
    """A scrambled map, as a packed layout the library misreads gives."""
    return right(x, weight.flip(1), bias, mask)


def wrong_input_gradient(x, weight, bias, mask, packing=None):
    """The right output and weight gradient, but the input gradient through a scrambled
    ``W24.T``, as a stale or misread packing of the transposed weight gives."""
    out = right(x.detach(), weight, bias, mask)
    if mask is None:
        mask = transposable_2to4_mask(weight.detach())
    scrambled = x @ (weight * mask).detach().flip(1).T
    # adds exact zeros to the output, and the scrambled map to the input gradient
    return out + (scrambled - scrambled.detach())


def wrong_weight_gradient(x, weight, bias, mask, packing=None):
    """The right output and input gradient, but the weight gradient of a scrambled map."""
    out = right(x, weight.detach(), bias, mask)
    scrambled = right(x.detach(), weight.flip(1), None, mask)
    return out + (scrambled - scrambled.detach())


def right_in_bfloat16_only(x, weight, bias, mask, packing=None):
    return (right if x.dtype == torch.bfloat16 else wrong)(x, weight, bias, mask)


def raising(x, weight, bias, mask, packing=None):
    raise RuntimeError("cuSPARSELt: CUSPARSE_STATUS_NOT_SUPPORTED")


def wrong_at_128_inputs(x, weight, bias, mask, packing=None):
    """Right at the kernel check's shape, wrong where a layer has 128 inputs."""
    return (wrong if weight.shape[1] == 128 else right)(x, weight, bias, mask)


@pytest.fixture
def inject(monkeypatch):
    """``inject(linear)``: a pretend sm90 GPU whose cuSPARSELt kernel is ``linear`` (run on the
    CPU). Returns the calls: for each, whether the kernel check was running or had passed."""
    pretend_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    calls: list[str] = []

    def install(linear):
        def recorded(x, weight, bias, mask, packing=None):
            key = ("cusparselt", x.dtype, weight.device)
            verdict = kernel_check._VERDICTS.get(key)
            checking = key in kernel_check._RUNNING
            calls.append("check" if checking else "passed" if verdict else "unchecked")
            return linear(x, weight, bias, mask)

        monkeypatch.setitem(ss.KERNELS, "cusparselt", recorded)
        return calls

    return install


def loader() -> DataLoader:
    return DataLoader(RepeatedBatch(n=24, batch_size=6, inputs=WIDTH), batch_size=6)


def fit(steps=4, ckpt_path=None, callbacks=(), **kwargs):
    L.seed_everything(0, verbose=False)
    model = TinyModule(width=WIDTH, inputs=WIDTH, lr=0.05)
    cb = SparsityCallback(
        phases=[{"sparsity": "2:4", "until": 0.5}, {"sparsity": 0.0}], **kwargs
    )
    trainer = fast_trainer(
        max_steps=steps,
        callbacks=[cb, *callbacks],
        precision="bf16-mixed",
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, cb


def choice(cb, param="net.fc1.weight"):
    return cb.sparsifier.backends[0, param]


def test_verdicts_of_a_right_a_wrong_and_a_raising_kernel(inject):
    cpu = torch.device("cpu")
    inject(right)
    good = check_kernel("cusparselt", torch.bfloat16, cpu)
    assert good.passed and good.error < kernel_check.TOLERANCE
    forget_verdicts()
    inject(wrong)
    with pytest.warns(RuntimeWarning, match=r"sm90 \(torch [\d.]+.*wrong results"):
        bad = check_kernel("cusparselt", torch.bfloat16, cpu)
    assert not bad.passed and bad.error > 0.5
    assert bad.reason.startswith("cuSPARSELt on sm90 (torch ")
    assert "gave wrong results in the kernel check (relative error" in bad.reason
    forget_verdicts()
    inject(raising)
    with pytest.warns(RuntimeWarning, match="CUSPARSE_STATUS_NOT_SUPPORTED"):
        broken = check_kernel("cusparselt", torch.bfloat16, cpu)
    assert not broken.passed and broken.error is None
    assert (
        "raised RuntimeError in the kernel check (cuSPARSELt: CUSPARSE" in broken.reason
    )


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_right_kernel_passes_the_check_first_reached_without_gradients(
    inject, context
):
    """verify_speed and inference reach the check under no_grad or inference_mode."""
    inject(right)
    with context():
        verdict = check_kernel("cusparselt", torch.bfloat16, torch.device("cpu"))
    assert verdict.passed, verdict.reason


def test_a_float16_check_inside_a_bfloat16_autocast_region_computes_in_float16(inject):
    computed = []

    def recording(x, weight, bias, mask, packing=None):
        out = right(x, weight, bias, mask)
        computed.append(out.dtype)
        return out

    inject(recording)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        verdict = check_kernel("cusparselt", torch.float16, torch.device("cpu"))
    assert verdict.passed and computed == [torch.float16, torch.float16]


def test_verify_speed_measures_under_a_callers_no_grad():
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        measured = speed.measure_speedup(
            (128, 256), torch.float32, "emulated", torch.device("cpu"), tokens=16
        )
    assert measured.ratio > 0 and measured.error < 1e-6


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    ],
    ids=["out of memory", "CUDA error"],
)
def test_an_interrupted_check_is_raised_and_no_verdict_is_kept(inject, error):
    def interrupted(*args, **kwargs):
        raise error

    inject(interrupted)
    cpu = torch.device("cpu")
    with pytest.raises(type(error)) as raised:
        check_kernel("cusparselt", torch.bfloat16, cpu)
    message = str(raised.value)
    assert message.startswith(
        f"{type(error).__name__} in the kernel check of cuSPARSELt"
    )
    assert str(error) in message and "no verdict is kept" in message
    inject(right)  # the next use checks again
    assert check_kernel("cusparselt", torch.bfloat16, cpu).passed


@pytest.mark.parametrize(
    ("error", "fix", "other_fix"),
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
            "free GPU memory (a smaller batch, fewer processes on this GPU) and run again",
            "restart",
        ),
        (
            torch.AcceleratorError(
                "CUDA error: an illegal memory access was encountered"
            ),
            "a CUDA error leaves the process unusable: restart it",
            "free GPU memory",
        ),
    ],
    ids=["out of memory", "CUDA error"],
)
def test_an_interrupted_check_stops_the_fit_with_the_fix_for_its_error(
    inject, error, fix, other_fix
):
    """What the user reads when the GPU's state interrupts the kernel check at fit start: the
    error it was, that the kernel is not to blame, and the fix for that error only."""

    def interrupted(*args, **kwargs):
        raise error

    inject(interrupted)
    with pytest.raises(RuntimeError) as raised:
        fit()
    message = str(raised.value)
    assert str(error) in message and "says nothing about the kernel" in message
    assert fix in message and other_fix not in message


def test_no_op_packs_or_searches_before_the_kernel_check_passed(inject, monkeypatch):
    """Every cuSPARSELt op asks for the check first: a failed kernel never packs, compares
    packers or searches (on a GPU: no cuSPARSELt work, and nothing in a capture)."""
    inject(wrong)
    work = []
    for name in ("pack", "_project_and_pack", "_pack_stored", "_sparse_mm"):
        monkeypatch.setattr(
            cusparselt, name, lambda *args, name=name: work.append(name)
        )
    torch.manual_seed(0)
    x, grad = torch.randn(8, 256).bfloat16(), torch.randn(8, 128).bfloat16()
    weight = torch.randn(128, 256).bfloat16()
    mask = transposable_2to4_mask(weight)
    w24 = weight * mask
    packing = ss.stored_mask_packing("cusparselt", mask, mask)
    stored = packing.op_arguments()
    calls = [
        lambda: cusparselt.linear_24_projected(x, weight, None),
        lambda: cusparselt.linear_24_projected_input_grad(grad, weight),
        lambda: cusparselt.linear_24(x, w24, None),
        lambda: cusparselt.linear_24(x, weight, None, mask),
        lambda: cusparselt.linear_24_input_grad(grad, w24),
        lambda: cusparselt.linear_24_stored(x, weight, None, *stored),
        lambda: cusparselt.linear_24_stored_input_grad(grad, weight, *stored),
    ]
    with pytest.warns(RuntimeWarning, match="wrong results"):
        kernel_check.check_kernel("cusparselt", torch.bfloat16, torch.device("cpu"))
    for call in calls:
        with pytest.raises(KernelCheckError, match="wrong results"):
            call()
    assert work == []


@pytest.mark.parametrize(
    "kernel",
    [wrong_input_gradient, wrong_weight_gradient],
    ids=["input gradient", "weight gradient"],
)
def test_a_kernel_with_a_right_output_and_a_wrong_gradient_fails_the_check(
    inject, kernel
):
    torch.manual_seed(0)
    x, weight = torch.randn(4, 256, requires_grad=True), torch.randn(128, 256)
    assert torch.equal(kernel(x, weight, None, None), right(x, weight, None, None))
    inject(kernel)
    with pytest.warns(RuntimeWarning, match="wrong results.*not used in this process"):
        verdict = check_kernel("cusparselt", torch.bfloat16, torch.device("cpu"))
    assert not verdict.passed and verdict.error > 0.5


def test_each_dtype_is_checked_and_a_kernel_wrong_in_one_runs_only_in_the_other(
    inject,
):
    calls = inject(right_in_bfloat16_only)
    layer = nn.Linear(256, 128)
    owners = [("fc", layer, "weight")]
    bf16 = choose_backend("auto", NM(2, 4), layer.weight, owners, torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=", float16 gave wrong results"):
        fp16 = choose_backend("auto", NM(2, 4), layer.weight, owners, torch.float16)
    assert bf16.name == "semi_structured" and bf16.kernel == "cusparselt"
    assert fp16.name == "masked"
    assert ", float16 gave wrong results in the kernel check" in fp16.reason
    assert len(calls) == 4  # both code paths, once in each dtype
    x, weight = torch.randn(4, 256), layer.weight.detach()
    ss.semi_structured_linear(x.bfloat16(), weight.bfloat16(), None, "cusparselt")
    with pytest.raises(KernelCheckError, match=", float16 gave wrong results"):
        ss.semi_structured_linear(x.half(), weight.half(), None, "cusparselt")
    assert len(calls) == 5  # the bfloat16 matmul ran, the float16 one did not


def test_the_check_runs_once_per_process_and_its_verdict_is_kept(inject):
    calls = inject(right)
    for _ in range(3):
        check_kernel("cusparselt", torch.bfloat16, torch.device("cpu"))
    assert calls == ["check", "check"]  # the projected and the stored-mask paths, once


def test_a_kernel_wrong_only_with_a_stored_mask_fails_the_check(inject):
    """Stored-mask phases pack at the mask's positions (another code path): checked too."""
    calls = inject(
        lambda x, w, b, mask, packing=None: (right if mask is None else wrong)(
            x, w, b, mask, packing
        )
    )
    with pytest.warns(RuntimeWarning, match="wrong results"):
        verdict = check_kernel("cusparselt", torch.bfloat16, torch.device("cpu"))
    assert not verdict.passed and calls == ["check", "check"]


@pytest.mark.parametrize(
    "kernel",
    [wrong, raising, wrong_input_gradient],
    ids=["wrong", "raising", "wrong input gradient"],
)
def test_a_failing_kernel_runs_masked_from_fit_start_and_says_why(
    inject, lightning_log, kernel
):
    calls = inject(kernel)
    with pytest.warns(RuntimeWarning, match="not used in this process"):
        _, cb = fit()
    assert set(calls) == {"check"}  # never run outside the check
    for param in ("net.fc1.weight", "net.fc2.weight"):
        assert choice(cb, param).name == "masked"
        assert "in the kernel check" in choice(cb, param).reason
        assert choice(cb, param).reason.endswith(": running masked math")
    table = "\n".join(r.getMessage() for r in lightning_log.records)
    assert "cuSPARSELt on sm90 (torch" in table and "running masked math" in table


def test_a_failing_kernel_refuses_a_run_that_requires_it(inject):
    inject(wrong)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError) as info:
        fit(backend="semi_structured")
    assert "gave wrong results in the kernel check" in str(info.value)
    assert "backend='auto'" in str(info.value)


def test_a_right_kernel_runs_only_after_passing_the_check(inject):
    calls = inject(right)
    _, cb = fit()
    assert choice(cb).name == "semi_structured" and choice(cb).kernel == "cusparselt"
    assert calls[:2] == ["check", "check"]  # both code paths, before any training step
    assert set(calls[2:]) == {"passed"} and len(calls) > 2


def test_no_kernel_runs_before_its_check_and_none_after_it_failed(inject):
    inject(wrong)
    x, weight = torch.randn(4, 256), torch.randn(128, 256)
    with pytest.warns(RuntimeWarning), pytest.raises(KernelCheckError, match="wrong"):
        ss.semi_structured_linear(x, weight, None, "cusparselt")
    with pytest.raises(
        KernelCheckError, match="wrong"
    ):  # the verdict is kept, no warning
        ss.semi_structured_linear(x, weight, None, "cusparselt")


def test_verify_speed_skips_a_kernel_that_failed_the_check(inject, monkeypatch):
    inject(wrong)
    measured = []
    monkeypatch.setattr(
        "lightning_sparse.backends.speed.measure_speedup",
        lambda *args: measured.append(args),
    )
    with pytest.warns(RuntimeWarning):
        _, cb = fit(verify_speed=True)
    assert measured == [] and choice(cb).name == "masked"


def test_verify_speed_catches_a_kernel_wrong_only_at_some_shapes(inject):
    calls = inject(wrong_at_128_inputs)
    _, cb = fit(verify_speed=True)
    assert calls[0] == "check"  # the check's shape (256 inputs) passes
    reason = choice(cb).reason
    assert choice(cb).name == "masked"
    assert "wrong results at shape 128x128 in verify_speed (relative error" in reason


def test_to_semi_structured_converts_only_after_the_check(monkeypatch):
    pretend_gpu(monkeypatch, (9, 0))
    packed = []

    def pack(kind):
        def to_sparse(w24):
            packed.append(kind)
            return {"right": w24, "wrong": w24.flip(1)}[kind]

        return to_sparse

    def model():
        torch.manual_seed(0)
        layer = nn.Linear(256, 128)
        with torch.no_grad():
            layer.weight.mul_(transposable_2to4_mask(layer.weight))
        return nn.Sequential(layer)

    monkeypatch.setattr(ss, "to_sparse_semi_structured", pack("wrong"))
    net = model()
    before = net[0].weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="SparseSemiStructuredTensor"):
        report = to_semi_structured(net)
    assert report["0.weight"].endswith(
        "in the kernel check (relative error 1.4): left dense"
    )
    assert torch.equal(net[0].weight, before) and packed == ["wrong"]  # the check only

    forget_verdicts()
    monkeypatch.setattr(ss, "to_sparse_semi_structured", pack("right"))
    net = model()
    assert to_semi_structured(net) == {"0.weight": "converted"}
    assert packed == ["wrong", "right", "right"]  # the check's, then the layer's


def test_a_resume_checks_again_in_the_new_process(inject, tmp_path):
    calls = inject(wrong)
    saving = [StopAt(2), ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2)]
    with pytest.warns(RuntimeWarning):
        _, cb = fit(steps=8, callbacks=saving)
    assert choice(cb).name == "masked" and set(calls) == {"check"}

    forget_verdicts()  # a new process, on a GPU where the kernel is right
    calls.clear()
    inject(right)
    _, resumed = fit(steps=8, ckpt_path=tmp_path / "step=2.ckpt")
    assert choice(resumed).name == "semi_structured"
    assert calls[:2] == ["check", "check"] and set(calls[2:]) == {"passed"}


def test_the_tile_kernel_chooses_masks_only_for_cuda_16_bit_multiples_of_128():
    with FakeTensorMode():

        def cuda(shape, dtype=torch.bfloat16):
            return torch.empty(shape, device="cuda", dtype=dtype)

        assert tile_kernel_takes(cuda((128, 256)))
        assert tile_kernel_takes(cuda((256, 128), torch.float16))
        assert not tile_kernel_takes(cuda((128, 256), torch.float32))
        assert not tile_kernel_takes(cuda((128, 100)))
        assert not tile_kernel_takes(cuda((64, 128)))
        assert not tile_kernel_takes(cuda((2, 128, 128)))
    assert not tile_kernel_takes(torch.zeros(128, 256, dtype=torch.bfloat16))


def test_on_the_cpu_the_greedy_mask_is_the_reference_bit_for_bit():
    torch.manual_seed(0)
    w = torch.randn(128, 256).bfloat16()
    assert torch.equal(greedy_2to4_mask(w), transposable_2to4_mask(w))


def test_projections_see_the_matmul_dtype_on_a_gpu_and_the_stored_weight_on_the_cpu():
    seen = []

    def project(weight):
        seen.append((weight.device.type, weight.dtype))
        return torch.ones_like(weight, dtype=torch.bool)

    project_eagerly(project, torch.zeros(8, 8), torch.bfloat16)
    with FakeTensorMode():
        weight = torch.empty(128, 128, device="cuda")
        project_eagerly(project, weight, torch.bfloat16)
        project_eagerly(project, weight, torch.float32)
    assert seen == [
        ("cpu", torch.float32),
        ("cuda", torch.bfloat16),
        ("cuda", torch.float32),
    ]


def test_plan_predicts_without_running_a_kernel_or_its_check(
    inject, monkeypatch, tmp_path
):
    calls = inject(right)
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    recipe = Path(__file__).parents[1] / "recipes" / "gpt" / "gpt2_24_70pct.yaml"
    args = ["plan", f"--config={recipe}", f"--plot_path={tmp_path / 'plan.png'}"]
    with torch.device("meta"):  # as the CLI builds full-scale recipes
        SparseCLI(args=args)
    assert calls == [] and kernel_check._VERDICTS == {}
