"""The 2:4 kernels on a GPU (sm80+): kernel vs emulation, training through a phase switch,
resume, torch.compile and verify_speed. Skipped without a CUDA GPU of capability 8.0+."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import install_runtime, kernel_fit
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

from lightning_sparse.backends import capability as cap
from lightning_sparse.backends import cusparselt
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.kernel_check import (
    KernelCheckError,
    check_kernel,
    known_values,
    register_kernel,
)
from lightning_sparse.backends.masked import install_masked_forward, uninstall_forward
from lightning_sparse.backends.semi_structured import (
    install_semi_structured_forward,
    semi_structured_linear,
)
from lightning_sparse.backends.speed import measure_speedup
from lightning_sparse.masks.tiles import (
    greedy_2to4_mask,
    tile_kernel_takes,
    transposable_2to4_mask,
)

SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not SM80, reason="needs a CUDA GPU with compute capability 8.0+"
    ),
]
BF16 = {"rtol": 2e-2, "atol": 2e-2}
# Two bf16 runs that differ only in rounding (or in a tie-broken mask entry) drift apart: Adam
# moves a weight by at most ~lr per step either way, so 8 steps at lr=1e-3 stay within 2e-2.
DRIFT = {"rtol": 0, "atol": 2e-2}


def kernels() -> list[str]:
    if not SM80:
        return []
    found = ["cusparselt"] if cap.cusparselt_available() else []
    return [*found, "cutlass"] if torch.cuda.get_device_capability()[0] == 8 else found


def tie_free(rows: int, cols: int) -> torch.Tensor:
    """Weights whose ``|w|`` are distinct within every 4x4 tile, exact in bfloat16, so the
    kernel's and the emulation's greedy choices cannot differ by tie-breaking."""
    return known_values(rows, cols).cuda()


@pytest.mark.parametrize("kernel", kernels())
def test_kernel_chooses_the_greedy_mask_on_tie_free_weights(kernel):
    w = tie_free(256, 512).bfloat16()
    eye = torch.eye(512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        w24 = semi_structured_linear(eye, w, None, kernel).t()  # eye @ W24.T = W24.T
    assert torch.equal(w24 != 0, transposable_2to4_mask(w))
    assert torch.equal(w24, w * transposable_2to4_mask(w))


@pytest.mark.parametrize("kernel", kernels())
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("stored", [False, True], ids=["runtime", "stored_mask"])
def test_kernel_matches_emulation_outputs_and_gradients(kernel, autocast, stored):
    # a stored mask other than the weight's own greedy one, so that it is the one used
    mask = (
        transposable_2to4_mask(known_values(256, 512, seed=1)).cuda()
        if stored
        else None
    )

    def layer(kind):
        module = nn.Linear(512, 256).cuda()
        with torch.no_grad():
            module.weight.copy_(tie_free(256, 512))
        if not autocast:
            module.bfloat16()
        install_semi_structured_forward(module, kind, mask)
        return module

    sparse, emulated = layer(kernel), layer("emulated")
    if stored and kernel == "cusparselt":  # packed at the mask's positions
        assert sparse._ls_packing is not None
    x = torch.randn(3, 100, 512, device="cuda")  # 300 tokens: not a multiple of 8 or 16
    x = x if autocast else x.bfloat16()
    xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out, ref = sparse(xs), emulated(xe)
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == (3, 100, 256)
    torch.testing.assert_close(out, ref, **BF16)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(xs.grad, xe.grad, **BF16)
    for p, q in zip(sparse.parameters(), emulated.parameters()):
        assert p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad, q.grad, **BF16)


def test_training_switches_phases_on_the_gpu_like_masked(tmp_path):
    model, cb, probe = kernel_fit(tmp_path)
    assert cb.sparsifier.backends[0, "net.fc1.weight"].name == "semi_structured"
    assert probe.classes[0] == probe.classes[4] == "SemiStructuredLinear"
    assert probe.classes[7] == "Linear"
    masked, _, _ = kernel_fit(tmp_path, backend="masked")
    for p, q in zip(model.parameters(), masked.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, **DRIFT)


def test_resume_on_the_gpu(tmp_path):
    reference, ref_cb, _ = kernel_fit(tmp_path / "ref")
    kernel_fit(tmp_path / "ck", stop=4)  # inside the magnitude phase
    resumed, cb, probe = kernel_fit(
        tmp_path / "res", ckpt_path=tmp_path / "ck" / "step=4.ckpt"
    )
    assert cb.sparsifier.history == ref_cb.sparsifier.history
    assert probe.classes[4] == "SemiStructuredLinear"  # the kernel forward is back
    for p, q in zip(resumed.parameters(), reference.parameters()):
        # the same kernels on the same inputs: equal up to GPU nondeterminism
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3)


@pytest.mark.compiles
def test_compiled_training_on_the_gpu(tmp_path):
    eager, _, _ = kernel_fit(tmp_path)
    compiled, _, probe = kernel_fit(tmp_path, compile=True)
    assert probe.classes[0] == "SemiStructuredLinear" and probe.classes[7] == "Linear"
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **DRIFT)


@pytest.mark.compiles
def test_compiled_layer_after_a_swap_back_is_dense():
    layer = nn.Linear(256, 256).cuda().bfloat16()
    install_semi_structured_forward(layer, kernels()[0])
    compiled = torch.compile(layer)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    sparse = layer(x)
    torch.testing.assert_close(compiled(x), sparse, **BF16)
    uninstall_forward(layer)
    dense = compiled(x)
    torch.testing.assert_close(dense, layer(x), **BF16)
    assert not torch.allclose(dense, sparse, **BF16)  # not a stale sparse graph


@pytest.mark.parametrize("kernel", kernels())
@pytest.mark.parametrize("timing", ["eager", "cuda_graphs"])
@pytest.mark.parametrize("stored", [False, True], ids=["projected", "stored_mask"])
def test_verify_speed_measures_a_ratio(kernel, timing, stored):
    measured = measure_speedup(
        (1024, 1024), torch.bfloat16, kernel, torch.device("cuda"), 2048, timing, stored
    )
    assert 0.05 < measured.ratio < 20 and measured.error < 0.02
    if timing == "eager":
        assert measured.timing == "eager"
    elif (
        kernel == "cusparselt"
    ):  # its custom ops capture (CUTLASS's may not: then it says so)
        assert measured.timing == "as CUDA graphs"


@pytest.mark.parametrize("kernel", kernels())
def test_the_kernels_training_runs_pass_the_kernel_check(kernel):
    verdict = check_kernel(kernel, torch.bfloat16, torch.device("cuda"))
    assert verdict.passed, verdict.reason
    assert verdict.error < 0.01  # bf16 rounding, not a layout


@pytest.mark.skipif(not cap.cusparselt_available(), reason="no cuSPARSELt")
def test_the_kernel_check_catches_the_tile_ops_cusparselt_packing_where_it_is_wrong():
    """torch's tile op packs a cuSPARSELt layout that some releases do not read (sm90,
    cuSPARSELt 0.8): the check must fail it there. Skipped where the layout happens to be
    right."""

    def tile_packed(x, weight, bias):
        packed, meta, packed_t, meta_t, bitmask = torch._sparse_semi_structured_tile(
            weight, algorithm="largest_abs_values_greedy", use_cutlass=False
        )
        rows, cols = weight.shape
        sparse = SparseSemiStructuredTensorCUSPARSELT(
            weight.shape,
            packed=packed.view(rows, -1),
            meta=meta,
            packed_t=packed_t.view(cols, -1),
            meta_t=meta_t,
            compressed_swizzled_bitmask=bitmask,
            fuse_transpose_cusparselt=True,
            requires_grad=False,
        )
        return F.linear(x, sparse, bias)

    register_kernel(
        "tile-op cuSPARSELt", tile_packed, label="the tile op's packing", trains=False
    )
    verdict = check_kernel("tile-op cuSPARSELt", torch.bfloat16, torch.device("cuda"))
    if verdict.passed:
        pytest.skip(f"the tile op's cuSPARSELt packing is right here: {verdict.reason}")
    assert "in the kernel check" in verdict.reason


@pytest.mark.skipif(not cap.cusparselt_available(), reason="no cuSPARSELt")
def test_a_failed_check_keeps_every_entry_point_off_the_kernel(monkeypatch):
    monkeypatch.setitem(
        ss.KERNELS, "cusparselt", lambda x, w, b, mask, packing: -x @ w.T
    )
    with pytest.warns(RuntimeWarning, match="wrong results"):
        verdict = check_kernel("cusparselt", torch.bfloat16, torch.device("cuda"))
    assert not verdict.passed
    w = tie_free(128, 256).bfloat16()
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelCheckError):
        semi_structured_linear(x, w, None, "cusparselt")
    with pytest.raises(KernelCheckError):  # the custom ops refuse too
        cusparselt.linear_24(x, w * transposable_2to4_mask(w), None)


@pytest.mark.parametrize("shape", [(128, 128), (256, 512), (4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_tile_kernel_mask_is_the_reference_on_tie_free_weights(shape, dtype):
    w = tie_free(*shape).to(dtype)
    assert tile_kernel_takes(w)
    assert torch.equal(greedy_2to4_mask(w), transposable_2to4_mask(w))


def test_masked_runtime_on_cuda_projects_in_the_matmul_dtype():
    seen = []

    def spy(weight):
        seen.append((weight.dtype, tile_kernel_takes(weight)))
        return greedy_2to4_mask(weight)

    layer = nn.Linear(256, 128).cuda()  # float32 weights, bf16 autocast
    install_masked_forward(layer, project=spy)
    with torch.autocast("cuda", torch.bfloat16):
        layer(torch.randn(4, 256, device="cuda"))
    assert seen == [(torch.bfloat16, True)]


@pytest.mark.compiles
def test_compiled_masked_runtime_is_one_cuda_graph_that_computes_as_eager():
    """The runtime 2:4 projection traced into the graph (the tile kernel as one custom op):
    ``reduce-overhead`` captures both layers without a break (``fullgraph``), projects the
    current weights at every replay, and computes what eager computes."""

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
        install_runtime(net, ["0.weight", "2.weight"])
        return net

    eager, compiled = mlp(), mlp()
    step = torch.compile(compiled, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, capture, then replays
        with torch.no_grad():  # new weights, the same in both: the masks must follow
            for p, q in zip(compiled.parameters(), eager.parameters()):
                p.copy_(torch.randn_like(p) * 0.05)
                q.copy_(p)
        x = torch.randn(64, 256, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", torch.bfloat16):
            out, ref = step(x), eager(x)
        torch.testing.assert_close(out, ref, **BF16)
        out.float().sum().backward()
        ref.float().sum().backward()
        for p, q in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **BF16)
            p.grad = q.grad = None
