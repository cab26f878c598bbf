"""The Triton kernels of ``backends/triton_sparse24.py`` on the CPU, in Triton's interpreter: bit
for bit the torch ops they replace (the greedy mask of ``masks.tiles``, the torch-ops packer)
and the ``torch._cslt_compress`` bytes captured on an H100 (``fixtures/cusparselt_h100``);
and the cuSPARSELt ops on them: chosen only after their comparison with ``_cslt_compress``
passed, the torch-ops packer where it fails, one graph node under ``torch.compile``.

Triton reads ``TRITON_INTERPRET=1`` when a kernel is defined, so the tests marked
``interpreted`` run in a child pytest process with it set, started by
:func:`test_the_kernels_under_the_interpreter` (which needs Triton: the CPU torch build has
none, and then it skips). Shapes stay small: the interpreter runs a 128x128 block in about
0.1 s."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import bits, emulated_cusparselt
from safetensors.torch import load_file
from torch import nn

from lightning_sparse.backends import cusparselt
from lightning_sparse.backends import cusparselt_algorithms as algorithms
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.cusparselt_algorithms import AlgorithmCache
from lightning_sparse.backends.cusparselt_packer import (
    canonical_words,
    compress,
    packing,
)
from lightning_sparse.backends.kernel_check import check_kernel
from lightning_sparse.masks.tiles import transposable_2to4_mask

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="runs under TRITON_INTERPRET=1 in the child process of "
    "test_the_kernels_under_the_interpreter",
)
if HAS_TRITON:
    from lightning_sparse.backends import triton_sparse24
FIXTURES = load_file(Path(__file__).parent / "fixtures" / "cusparselt_h100.safetensors")
RANDOM_SHAPES = sorted(
    {key.split("/")[1] for key in FIXTURES if key.startswith("random/")}
)
DTYPES = [torch.bfloat16, torch.float16]
CPU = torch.device("cpu")


@pytest.mark.skipif(
    not HAS_TRITON, reason="Triton is not installed (the CPU torch build)"
)
@pytest.mark.skipif(INTERPRETING, reason="this process is the interpreter's")
def test_the_kernels_under_the_interpreter():
    """Runs this module's ``interpreted`` tests in a child process with ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20, report


def weights(
    shape: tuple[int, int], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Weights whose greedy masks and packings exercise every rule: Gaussian; small integers
    (ties within tiles, exact zeros); signed zeros (``-0.0`` kept and pruned, groups keeping
    fewer than 2)."""
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(shape, generator=gen)
    ties = torch.randint(-2, 3, shape, generator=gen).float()
    signed = gaussian.clone()
    signed[torch.rand(shape, generator=gen) < 0.4] = -0.0
    signed[torch.rand(shape, generator=gen) < 0.2] = 0.0
    found = {"gaussian": gaussian, "ties": ties, "signed zeros": signed}
    return {name: w.to(dtype) for name, w in found.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- the kernels against the torch ops -----------------------------------------------------------
@interpreted
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((128, 128), torch.bfloat16),
        ((128, 128), torch.float16),
        ((256, 384), torch.bfloat16),
    ],
)
def test_mask_and_pack_is_the_greedy_mask_and_the_torch_packers_bytes(shape, dtype):
    for name, w in weights(shape, dtype, seed=sum(shape)).items():
        keep = torch.zeros(shape, dtype=torch.bool)
        packed, packed_t = triton_sparse24.mask_and_pack(w, keep)
        mask = transposable_2to4_mask(w)
        assert torch.equal(keep, mask), name
        w24 = w * mask
        assert same_bits(packed, compress(w24)), name
        assert same_bits(packed_t, compress(w24.t().contiguous())), name


@interpreted
def test_nans_rank_equal_and_above_everything_as_in_the_reference():
    w = weights((128, 128), torch.bfloat16, seed=5)["ties"]
    words = w.view(torch.int16)  # NaNs of either sign and several payloads
    words[3, :6] = torch.tensor([0x7FC0, 0x7F81, -1, 0x7FFF, -0x40, 0x7F90])
    words[:5, 9] = torch.tensor([0x7F90, 0x7FC0, -0x7F, 0x7F81, -1])
    assert w.isnan().sum() == 11
    keep = torch.zeros(w.shape, dtype=torch.bool)
    triton_sparse24.mask_and_pack(w, keep)
    assert torch.equal(keep, transposable_2to4_mask(w))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_is_the_stored_mask_packing_zeros_included(dtype):
    shape = (256, 128)
    gen = torch.Generator().manual_seed(3)
    mask = transposable_2to4_mask(torch.randn(shape, generator=gen))
    for name, w in weights(shape, dtype, seed=4).items():
        packed, packed_t = triton_sparse24.pack(w, mask)
        assert same_bits(packed, packing(mask).compress(w)), name
        mask_t, w_t = mask.t().contiguous(), w.t().contiguous()
        assert same_bits(packed_t, packing(mask_t).compress(w_t)), name


@interpreted
def test_each_packing_alone_and_either_block_size_write_the_same_bytes():
    w = weights((128, 256), torch.bfloat16, seed=6)["signed zeros"]
    mask = transposable_2to4_mask(w)
    both = triton_sparse24.mask_and_pack(w)
    assert same_bits(triton_sparse24.mask_and_pack(w, columns=False)[0], both[0])
    assert triton_sparse24.mask_and_pack(w, columns=False)[1] is None
    assert same_bits(triton_sparse24.mask_and_pack(w, rows=False)[1], both[1])
    small = triton_sparse24.mask_and_pack(w, block=64, warps=4)
    assert same_bits(small[0], both[0]) and same_bits(small[1], both[1])
    stored = triton_sparse24.pack(w, mask)
    assert same_bits(triton_sparse24.pack(w, mask, block=64)[1], stored[1])
    assert same_bits(triton_sparse24.pack(w, mask, rows=False)[1], stored[1])


# -- the kernels against the captured H100 bytes -------------------------------------------------
@interpreted
@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_both_kernels_write_the_captured_cslt_compress_bytes(shape):
    w24 = FIXTURES[f"random/{shape}/w24"]
    captured = [FIXTURES[f"random/{shape}/compressed{s}"] for s in ("", "_t")]
    for packed in (
        triton_sparse24.mask_and_pack(w24),
        triton_sparse24.pack(w24, w24 != 0),
    ):
        for ours, theirs in zip(packed, captured):
            assert ours.shape == theirs.shape
            assert torch.equal(canonical_words(ours), canonical_words(theirs))


def probe_base() -> torch.Tensor:
    """The 128x128 probe weight: ones at positions 0 and 1 of every group of 4, as groups."""
    w = torch.zeros(128 * 32, 4, dtype=torch.bfloat16)
    w[:, :2] = 1
    return w


def patched(changes: list[torch.Tensor]) -> torch.Tensor:
    """The captured base bytes with every ``(word index, word)`` change of ``changes`` made
    (each group's changes touch its own bits, so they combine by xor)."""
    base = FIXTURES["probes/base"]
    out = base.clone()
    for change in changes:
        at = change[:, 0].long()
        out[at] ^= base[at] ^ change[:, 1].to(torch.int16)
    return out


def packed_rows(w: torch.Tensor) -> torch.Tensor:
    """The kernel's packing of the 128x128 weight ``w`` at its non-zeros, as 16-bit words."""
    w = w.view(128, 128)
    return bits(triton_sparse24.pack(w, w != 0, columns=False)[0])


@interpreted
def test_padding_of_groups_keeping_fewer_than_two_is_as_captured():
    groups = sorted({k.split("/")[1] for k in FIXTURES if k.startswith("probes/group")})
    cases = {f"pattern{a}{b}": (a, b) for a in range(4) for b in range(a + 1, 4)}
    cases.update({f"single{a}": (a,) for a in range(4)}, empty=())
    assert torch.equal(packed_rows(probe_base()), FIXTURES["probes/base"])
    for case, positions in cases.items():  # every probed group at once
        w = probe_base()
        rows = [int(group.removeprefix("group")) for group in groups]
        w[rows] = 0
        w[torch.tensor(rows)[:, None], list(positions)] = 1
        expected = patched([FIXTURES[f"probes/{group}/{case}"] for group in groups])
        assert torch.equal(packed_rows(w), expected), case


@interpreted
def test_every_groups_metadata_nibble_sits_where_captured():
    """Flipping the groups whose index has bit ``b`` set, for each of the 12 bits of the 4096
    group indices: each group's nibble is found by its 12 answers."""
    flips = FIXTURES["probes/flip_to_23"]
    for b in range(12):
        flipped = (torch.arange(128 * 32) >> b & 1).bool()
        w = probe_base()
        w[flipped] = torch.tensor([0, 0, 1, 1], dtype=w.dtype)
        expected = patched([flips[g : g + 1] for g in flipped.nonzero().view(-1)])
        assert torch.equal(packed_rows(w), expected), b


# -- the wrappers' refusals ---------------------------------------------------------------------
@pytest.mark.skipif(
    not HAS_TRITON, reason="Triton is not installed (the CPU torch build)"
)
@pytest.mark.parametrize(
    "w, message",
    [
        (torch.zeros(64, 128, dtype=torch.bfloat16), "multiples of 128"),
        (torch.zeros(128, 128), "multiples of 128"),
        (torch.zeros(128, 128, 4, dtype=torch.bfloat16), "2-D"),
    ],
)
def test_the_wrappers_refuse_weights_the_layout_is_not_known_for(w, message):
    for call in (triton_sparse24.mask_and_pack, triton_sparse24.pack):
        args = (w,) if call is triton_sparse24.mask_and_pack else (w, w != 0)
        with pytest.raises(ValueError, match=message) as error:
            call(*args)
        assert "torch._cslt_compress" in str(error.value)


@pytest.mark.skipif(
    not HAS_TRITON, reason="Triton is not installed (the CPU torch build)"
)
def test_the_wrappers_name_the_fix_for_a_wrong_block_device_or_mask():
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"block=32; use one of \(64, 128\)"):
        triton_sparse24.mask_and_pack(w, block=32)
    if not INTERPRETING:
        with pytest.raises(ValueError, match="take CUDA tensors"):
            triton_sparse24.mask_and_pack(w)
        return
    with pytest.raises(ValueError, match=r"pass weight.contiguous\(\)"):
        triton_sparse24.mask_and_pack(torch.zeros(256, 128, dtype=w.dtype).t())
    with pytest.raises(ValueError, match="pass a bool tensor shaped like the weight"):
        triton_sparse24.pack(w, torch.ones(128, 128))
    with pytest.raises(ValueError, match="pass a bool tensor shaped like the weight"):
        triton_sparse24.mask_and_pack(w, torch.ones(128, 256, dtype=torch.bool))


# -- the packer choice ---------------------------------------------------------------------------
@pytest.fixture
def emulated(monkeypatch):
    """``torch._cslt_compress`` and ``_cslt_sparse_mm`` on the CPU in the captured layout (its
    algorithm 0, no search), the cuSPARSELt ops let run on CPU tensors, no packer chosen yet."""
    emulated_cusparselt(monkeypatch)
    cache = AlgorithmCache(search=lambda *args: algorithms.DEFAULT)
    monkeypatch.setattr(cusparselt, "ALGORITHMS", cache)
    monkeypatch.setattr(ss, "kernel_runs", lambda weight, dtype: True)
    monkeypatch.setattr(cusparselt, "_PACKERS", {})


def test_off_the_interpreter_the_cpu_packs_with_the_torch_ops(emulated):
    if INTERPRETING:
        pytest.skip("under the interpreter the kernels take CPU tensors")
    reason = (
        "Triton is not installed"
        if not HAS_TRITON
        else "the Triton kernels do not run on cpu tensors here"
    )
    assert cusparselt.packer(torch.bfloat16, CPU) == cusparselt.Packer("torch", reason)


def test_without_triton_the_package_imports_and_packs_with_the_torch_ops():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from lightning_sparse.backends import cusparselt\n"
        "assert cusparselt.triton_sparse24 is None\n"
        "print(cusparselt._triton_differs(None, None))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "Triton is not installed"


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_are_chosen_where_they_write_cslt_compress_bytes(emulated, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no packer warns
        chosen = cusparselt.packer(dtype, CPU)
    assert chosen == cusparselt.Packer("triton")
    assert chosen.note() == "packed by lightning_sparse's Triton kernels"


def corrupted(pack):
    """``pack`` writing one wrong metadata word into each packing of ``W``."""

    def wrong(*args, **kwargs):
        packed, packed_t = pack(*args, **kwargs)
        if packed is not None:
            packed.view(-1).view(torch.int16)[-1] ^= 1
        return packed, packed_t

    return wrong


@interpreted
def test_kernels_that_write_other_bytes_fall_back_to_the_torch_packer(
    emulated, monkeypatch
):
    for name in ("mask_and_pack", "pack"):
        monkeypatch.setattr(cusparselt, "_PACKERS", {})
        with monkeypatch.context() as patch:
            patch.setattr(
                triton_sparse24, name, corrupted(getattr(triton_sparse24, name))
            )
            with pytest.warns(
                RuntimeWarning, match="write other bytes.*torch-ops packer"
            ):
                chosen = cusparselt.packer(torch.bfloat16, CPU)
        why = "the Triton kernels write other bytes than torch._cslt_compress"
        assert chosen == cusparselt.Packer("torch", why), name
        assert chosen.note() == f"packed by lightning_sparse ({why})"


@interpreted
def test_kernels_that_raise_fall_back_to_the_torch_packer(emulated, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(triton_sparse24, "pack", broken)
    with pytest.warns(RuntimeWarning, match="raised RuntimeError"):
        chosen = cusparselt.packer(torch.bfloat16, CPU)
    assert chosen.name == "torch" and "no kernel image for this GPU" in chosen.why


@interpreted
def test_a_gpu_state_error_in_the_comparison_is_raised_and_no_choice_is_kept(
    emulated, monkeypatch
):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(triton_sparse24, "mask_and_pack", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        cusparselt.packer(torch.bfloat16, CPU)
    assert cusparselt._PACKERS == {}


# -- the cuSPARSELt ops on the kernels -----------------------------------------------------------
@pytest.fixture
def launches(emulated, monkeypatch):
    """Every launch of a Triton kernel, as ``(kernel, when)``: ``"comparing"`` inside the
    packer comparison, ``"chosen"`` after it chose the Triton kernels, else ``"unchecked"``."""
    found: list[tuple[str, str]] = []
    comparing = []
    compare = cusparselt._triton_differs

    def recorded_compare(dtype, device):
        comparing.append(True)
        try:
            return compare(dtype, device)
        finally:
            comparing.pop()

    def recorded(name):
        launch = getattr(triton_sparse24, name)

        def run(weight, *args, **kwargs):
            chosen = cusparselt._PACKERS.get((weight.dtype, weight.device))
            when = (
                "comparing"
                if comparing
                else "chosen"
                if chosen == cusparselt.Packer("triton")
                else "unchecked"
            )
            found.append((name, when))
            return launch(weight, *args, **kwargs)

        return run

    monkeypatch.setattr(cusparselt, "_triton_differs", recorded_compare)
    for name in ("mask_and_pack", "pack"):
        monkeypatch.setattr(triton_sparse24, name, recorded(name))
    return found


def stored_and_runtime_layers(
    seed: int = 0,
) -> tuple[nn.Linear, nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    runtime = nn.Linear(256, 128).to(torch.bfloat16)
    stored = nn.Linear(256, 128).to(torch.bfloat16)
    mask = transposable_2to4_mask(stored.weight.detach())
    ss.install_semi_structured_forward(runtime, "cusparselt")
    ss.install_semi_structured_forward(stored, "cusparselt", mask)
    return runtime, stored, mask


@interpreted
def test_no_kernel_runs_before_its_comparison_and_the_kernel_check_passed(launches):
    """On a GPU, the Triton kernels run first inside their comparison with
    ``torch._cslt_compress`` (which the kernel check's first packing makes), then only where
    it chose them: here the CPU stands in for the GPU."""
    runtime, stored, _ = stored_and_runtime_layers()
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    for layer in (runtime, stored):
        layer(x).sum().backward()
    verdict = check_kernel("cusparselt", torch.bfloat16, CPU)
    assert verdict.passed and verdict.note == ""  # no GPU: no packer note
    assert launches[:2] == [("mask_and_pack", "comparing"), ("pack", "comparing")]
    later = launches[2:]
    assert {when for _, when in later} == {"chosen"}
    # the check's runtime and stored paths, then each layer's: a forward and a backward each
    # (the runtime one chooses its mask again in the backward, for W24.T)
    assert [name for name, _ in later] == (["mask_and_pack"] * 2 + ["pack"] * 2) * 2


@interpreted
def test_a_failed_comparison_leaves_the_kernels_unlaunched(launches, monkeypatch):
    monkeypatch.setattr(
        triton_sparse24, "pack", corrupted(triton_sparse24.pack)
    )  # recorded, then wrong
    runtime, stored, _ = stored_and_runtime_layers()
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="write other bytes"):
        runtime(x).sum().backward()
    stored(x).sum().backward()
    assert {when for _, when in launches} == {"comparing"}
    assert cusparselt.packer(torch.bfloat16, CPU).name == "torch"


def packs_seen(monkeypatch) -> list[torch.Tensor]:
    """Every packed weight the cuSPARSELt matmul is given (the emulated matmul runs on)."""
    seen: list[torch.Tensor] = []
    matmul = cusparselt._sparse_mm

    def recorded(packed, out_features, dense, bias):
        seen.append(packed.clone())
        return matmul(packed, out_features, dense, bias)

    monkeypatch.setattr(cusparselt, "_sparse_mm", recorded)
    return seen


@interpreted
@pytest.mark.parametrize("stored", [False, True], ids=["runtime", "stored mask"])
def test_the_layers_pack_what_the_torch_path_packs_and_compute_the_same(
    launches, monkeypatch, stored
):
    """The same bytes into every matmul as with the torch-ops packer, so the same outputs and
    gradients, bit for bit (here the matmul is dense math on the bytes it is given)."""
    assert check_kernel("cusparselt", torch.bfloat16, CPU).passed
    seen = packs_seen(monkeypatch)
    runs = {}
    for fused in (True, False):
        del seen[:], launches[:]
        runtime, stored_layer, mask = stored_and_runtime_layers()
        layer = stored_layer if stored else runtime
        x = torch.randn(20, 256, dtype=torch.bfloat16, requires_grad=True)
        with cusparselt.fused_kernels(fused):
            out = layer(x)
            out.backward(torch.ones_like(out))
        runs[fused] = [out, x.grad, layer.weight.grad, *seen]
        assert len(launches) == 2 * fused  # forward, backward; the torch path: none
    assert cusparselt.packer(torch.bfloat16, CPU).name == "triton"
    for a, b in zip(*runs.values(), strict=True):
        assert same_bits(a, b)
    w = layer.weight.detach()
    w24 = w * (mask if stored else transposable_2to4_mask(w))
    if stored:
        expected = [packing(mask).compress(w)]
        expected.append(packing(mask.t().contiguous()).compress(w.t().contiguous()))
    else:
        expected = [compress(w24), compress(w24.t().contiguous())]
    packed = runs[True][3:]
    assert len(packed) == 2 and all(map(same_bits, packed, expected))
    torch.testing.assert_close(runs[True][0], F.linear(x.detach(), w24, layer.bias))


@interpreted
def test_a_compiled_layer_runs_the_kernels_in_one_graph_node(emulated, monkeypatch):
    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    assert check_kernel("cusparselt", torch.bfloat16, CPU).passed
    seen = packs_seen(monkeypatch)
    runtime, _, _ = stored_and_runtime_layers()
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    eager = runtime(x)
    compiled = torch.compile(runtime, backend=recording, fullgraph=True)
    assert same_bits(compiled(x), eager)
    (graph,) = graphs
    assert graph.count("lightning_sparse.linear_24_projected") == 1
    assert same_bits(
        seen[-1], seen[0]
    )  # the kernels packed the same bytes inside the graph
    torch._dynamo.reset()
