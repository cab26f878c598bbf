"""Which layers run on 2:4 sparse tensor cores, and why not: capability, dtype and shape rules
with the GPU monkeypatched, the per-layer choice, verify_speed and backend validation."""

from __future__ import annotations

import pytest
import torch
from helpers import pretend_gpu
from torch import nn

from lightning_sparse.backends import (
    BackendChoice,
    choose_backend,
    require_semi_structured,
    speed,
    validate_backend,
)
from lightning_sparse.backends import capability as cap
from lightning_sparse.backends.gpus import GpuTarget, parse_gpu
from lightning_sparse.backends.speed import SpeedMeasurement
from lightning_sparse.masks import NM


@pytest.fixture
def gpu(monkeypatch):
    """Pretend every parameter sits on a GPU of a chosen capability (default: an A100)."""

    def use(capability=(8, 0), cusparselt=True):
        pretend_gpu(monkeypatch, capability, cusparselt)

    use()
    return use


def kernel_for(layer: nn.Module, compute_dtype=None) -> tuple[str | None, str]:
    return cap.semi_structured_kernel(
        layer.weight, [("layer", layer, "weight")], compute_dtype
    )


def test_this_machine_has_no_cuda_gpu_even_though_cusparselt_is_built_in():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer")
    layer = nn.Linear(256, 256)
    assert kernel_for(layer, torch.bfloat16) == (None, "no CUDA GPU")


def test_eligible_layers_get_cusparselt_on_ampere_and_hopper(gpu):
    layer = nn.Linear(1024, 4096)
    assert kernel_for(layer, torch.bfloat16) == (
        "cusparselt",
        "cuSPARSELt, sm80, bfloat16",
    )
    assert kernel_for(layer.half()) == ("cusparselt", "cuSPARSELt, sm80, float16")
    gpu((9, 0))
    assert kernel_for(layer, torch.bfloat16)[0] == "cusparselt"


@pytest.mark.parametrize(
    ("capability", "cusparselt", "shape", "expected"),
    [
        ((8, 0), True, (192, 256), "cutlass"),  # not 128-aligned: CUTLASS on sm8x
        ((8, 6), False, (256, 256), "cutlass"),  # a build without cuSPARSELt
        ((9, 0), True, (192, 256), None),  # CUTLASS 2:4 kernels are sm8x only
        ((8, 0), True, (96, 256), None),  # neither: 96 is not a multiple of 64
        ((8, 0), True, (256, 100), None),
    ],
)
def test_shape_rules(gpu, capability, cusparselt, shape, expected):
    gpu(capability, cusparselt)
    layer = nn.Linear(shape[1], shape[0])
    kernel, why = kernel_for(layer, torch.bfloat16)
    assert kernel == expected
    if expected is None:
        assert why.startswith(f"no 2:4 kernel for shape {shape[0]}x{shape[1]}")


def test_reasons_for_ineligible_layers(gpu):
    gpu((7, 5))
    assert kernel_for(nn.Linear(256, 256), torch.bfloat16) == (
        None,
        "compute capability 7.5: 2:4 sparse tensor cores need 8.0 (Ampere) or newer",
    )
    gpu((8, 0))
    kernel, why = kernel_for(nn.Linear(256, 256))  # float32, no autocast
    assert kernel is None and why.startswith("matmuls in float32")
    layer = nn.Linear(256, 256).bfloat16()
    layer.bias.data = layer.bias.data.float()
    assert kernel_for(layer) == (None, "bias is float32 but the weight is bfloat16")
    assert (
        kernel_for(layer, torch.bfloat16)[0] == "cusparselt"
    )  # autocast casts the bias

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert kernel_for(Custom(256, 256), torch.bfloat16) == (
        None,
        "Custom overrides forward(), so a sparse forward would bypass it",
    )
    conv = nn.Conv2d(256, 256, 1)
    assert kernel_for(conv, torch.bfloat16) == (
        None,
        "Conv2d is not a Linear or Conv1D layer",
    )
    a, b = nn.Linear(256, 256), nn.Linear(256, 256)
    b.weight = a.weight
    assert cap.semi_structured_kernel(
        a.weight, [("a", a, "weight"), ("b", b, "weight")], torch.bfloat16
    ) == (None, "shared by several modules (tied weights)")


def test_autocast_dtype_from_lightning_precision():
    assert cap.autocast_dtype("bf16-mixed") is torch.bfloat16
    assert cap.autocast_dtype("16-mixed") is torch.float16
    assert cap.autocast_dtype("32-true") is None
    assert (
        cap.autocast_dtype("bf16-true") is None
    )  # the weights themselves are bfloat16


def test_choose_backend_per_layer(gpu):
    layer = nn.Linear(1024, 4096)
    owners = [("fc", layer, "weight")]
    bf16 = torch.bfloat16
    assert choose_backend("masked", NM(2, 4), layer.weight, owners, bf16) == (
        BackendChoice("masked", "requested")
    )
    assert choose_backend("auto", 0.5, layer.weight, owners, bf16) == BackendChoice(
        "masked", "50% has no sparse kernel"
    )
    assert choose_backend("auto", NM(1, 4), layer.weight, owners, bf16).name == "masked"
    assert choose_backend("auto", NM(2, 4), layer.weight, owners, bf16) == (
        BackendChoice("semi_structured", "cuSPARSELt, sm80, bfloat16", "cusparselt")
    )


def test_verify_speed_keeps_slower_layers_dense(gpu):
    layer = nn.Linear(1024, 4096)
    owners = [("fc", layer, "weight")]
    calls = []

    def speedup(ratio):
        def measure(weight, kernel, dtype):
            calls.append((tuple(weight.shape), kernel, dtype))
            return SpeedMeasurement(ratio, error=0.0)

        return measure

    slow = choose_backend(
        "auto", NM(2, 4), layer.weight, owners, torch.bfloat16, speedup(0.9)
    )
    assert slow.name == "masked"
    assert "sparse 0.90x dense (eager, 8192 tokens), so kept dense" in slow.reason
    fast = choose_backend(
        "auto", NM(2, 4), layer.weight, owners, torch.bfloat16, speedup(1.3)
    )
    assert fast == BackendChoice(
        "semi_structured",
        "cuSPARSELt, sm80, bfloat16, 1.30x dense (eager, 8192 tokens)",
        "cusparselt",
    )
    assert calls == [((4096, 1024), "cusparselt", torch.bfloat16)] * 2


@pytest.mark.parametrize(
    ("dense_s", "sparse_s", "choice", "reason"),
    [
        (1.0, 2.0, "masked", "sparse 0.50x dense (eager, 8 tokens), so kept dense"),
        (
            2.0,
            1.0,
            "semi_structured",
            "cuSPARSELt, sm80, bfloat16, 2.00x dense (eager, 8 tokens)",
        ),
    ],
    ids=["sparse slower", "sparse faster"],
)
def test_verify_speed_divides_dense_time_by_sparse_time(
    gpu, monkeypatch, dense_s, sparse_s, choice, reason
):
    """The real SpeedCheck and measure_speedup; only the timing (``_seconds``) is stubbed."""
    seconds = {"dense": dense_s, "sparse": sparse_s}
    monkeypatch.setattr(speed, "_seconds", lambda step, device: seconds[step.__name__])
    layer = nn.Linear(256, 256)
    owners = [("fc", layer, "weight")]
    check = speed.SpeedCheck(tokens=8)
    picked = choose_backend(
        "auto", NM(2, 4), layer.weight, owners, torch.bfloat16, check
    )
    assert picked.name == choice and reason in picked.reason
    assert [m.ratio for m in check.results.values()] == [dense_s / sparse_s]


def test_validate_backend_and_the_semi_structured_error():
    assert validate_backend("semi_structured") == "semi_structured"
    assert validate_backend("auto", verify_speed=True) == "auto"
    assert validate_backend("auto", verify_speed="cuda_graphs") == "auto"
    with pytest.raises(ValueError, match=r"verify_speed=True .* use backend='auto'"):
        validate_backend("masked", verify_speed=True)
    with pytest.raises(ValueError, match=r"verify_speed='eager' .* use backend='auto'"):
        validate_backend("semi_structured", verify_speed="eager")
    with pytest.raises(
        TypeError, match=r"verify_speed='yes'; use True .*'eager' or 'cuda_graphs'"
    ):
        validate_backend("auto", verify_speed="yes")
    with pytest.raises(ValueError, match=r"backend='gpu'; use one of"):
        validate_backend("gpu")
    require_semi_structured([])
    with pytest.raises(
        ValueError,
        match=r"cannot run these layers .*\n  phase 1 a.weight: no CUDA GPU\n"
        r"  phase 1 b.weight: 70% .*\nUse backend='auto'",
    ):
        require_semi_structured(
            [("phase 1 a.weight", "no CUDA GPU"), ("phase 1 b.weight", "70% ...")]
        )


@pytest.mark.parametrize(
    ("capability", "shape"),
    [
        ((8, 0), (192, 256)),
        ((9, 0), (192, 256)),
        ((8, 0), (4096, 1024)),
        ((7, 5), (256, 256)),
    ],
)
def test_a_plan_for_a_gpu_applies_the_rules_of_that_gpu(gpu, capability, shape):
    """One source of truth: predicting for a GPU gives what fit start decides on that GPU."""
    layer = nn.Linear(shape[1], shape[0])
    predicted = cap.semi_structured_kernel(
        layer.weight,
        [("fc", layer, "weight")],
        torch.bfloat16,
        GpuTarget("x", capability),
    )
    gpu(capability)
    assert predicted == kernel_for(layer, torch.bfloat16)


def test_a_torch_without_the_2to4_ops_says_what_it_lacks(gpu, monkeypatch):
    monkeypatch.delattr(torch, "_sparse_semi_structured_tile")
    layer = nn.Linear(1024, 4096)
    kernel, why = kernel_for(layer, torch.bfloat16)
    assert kernel is None and "lacks torch._sparse_semi_structured_tile" in why
    assert f"this torch ({torch.__version__})" in why


@pytest.mark.parametrize(
    ("name", "capability"),
    [
        ("H100", (9, 0)),
        ("a100", (8, 0)),
        ("L4", (8, 9)),
        ("sm_90", (9, 0)),
        ("8.6", (8, 6)),
    ],
)
def test_gpu_names_and_capabilities(name, capability):
    assert parse_gpu(name).capability == capability


def test_an_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match="neither a GPU this plan knows.*'b200'"):
        parse_gpu("rtx9090")
