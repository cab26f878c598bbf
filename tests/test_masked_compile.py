"""The masked backend's runtime 2:4 forward under ``torch.compile``.

Where torch's tile kernel chooses the mask (a CUDA weight in a float16/bfloat16 matmul, both
dimensions multiples of 128), the projection is one custom op, ``lightning_sparse::tile_kernel_mask``,
traced into the graph: no graph break, so ``mode="reduce-overhead"`` keeps the step's CUDA graphs
whole. Everywhere else the projection runs eagerly between graphs. Checked here on fake CUDA
tensors (shapes and graphs, no numbers) and on the CPU; the kernel's numbers under CUDA graphs are
``tests/test_semi_structured_gpu.py``'s.
"""

from __future__ import annotations

import pytest
import torch
from helpers import install_runtime
from torch import nn
from torch._dynamo.backends.debugging import ExplainOutput
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sparse.backends import masked
from lightning_sparse.masks import tiles
from lightning_sparse.masks.tiles import greedy_2to4_mask, transposable_2to4_mask

TILE_MASK = torch.ops.lightning_sparse.tile_kernel_mask.default


class Layers(nn.Module):
    """A Linear, optionally a Hugging Face ``Conv1D`` (weight ``(in, out)``: projected through its
    transpose) and attention, whose weights ``nn.MultiheadAttention`` reads itself (the
    attribute path)."""

    def __init__(self, hidden: int, conv1d: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(128, hidden)
        if conv1d:
            hf = pytest.importorskip("transformers.pytorch_utils")
            self.conv1d = hf.Conv1D(128, hidden)  # weight (hidden, 128): hidden inputs
        else:
            self.conv1d = nn.Linear(hidden, 128)
        self.attn = nn.MultiheadAttention(128, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1d(self.fc(x))
        return self.attn(h, h, h, need_weights=False)[0]


PARAMS = ["fc.weight", "conv1d.weight", "attn.in_proj_weight", "attn.out_proj.weight"]


def layers(
    hidden: int, dtype: torch.dtype, device: str, conv1d: bool, sparsity: str = "2:4"
) -> Layers:
    """:class:`Layers` built in ``dtype`` on ``device`` with the runtime forward installed."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = Layers(hidden, conv1d)
    finally:
        torch.set_default_dtype(default)
    install_runtime(net, PARAMS, sparsity)
    return net


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake CUDA tensors; the reference mask (which needs data) replaced by one of its shape."""
    monkeypatch.setattr(
        tiles, "transposable_2to4_mask", lambda w: torch.ones_like(w, dtype=torch.bool)
    )
    with FakeTensorMode() as mode:
        yield mode


def tile_masks(explained: ExplainOutput) -> set[tuple[int, ...]]:
    """The shapes of the weights whose masks the tile kernel op chooses in the graphs."""
    return {
        tuple(node.args[0].meta["example_value"].shape)
        for gm in explained.graphs
        for node in gm.graph.nodes
        if node.target is TILE_MASK
    }


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "conv1d_rows"])
def test_the_tile_kernel_op_passes_opcheck(monkeypatch, transposed):
    """With a CPU stand-in for torch's CUDA-only tile kernel (the reference mask), which like
    the kernel reads row-major weights only."""

    def tile(dense, algorithm, use_cutlass):
        assert dense.stride(1) == 1 and algorithm == "largest_abs_values_greedy"
        return (dense,) * 4 + (transposable_2to4_mask(dense),)

    monkeypatch.setattr(torch, "_sparse_semi_structured_tile", tile)
    monkeypatch.setattr(
        torch, "_sparse_semi_structured_apply_dense", lambda dense, keep: dense * keep
    )
    torch.manual_seed(0)
    weight = torch.randn(256, 128, dtype=torch.bfloat16)
    weight = weight.t() if transposed else weight
    torch.library.opcheck(TILE_MASK, (weight,))
    assert torch.equal(TILE_MASK(weight), transposable_2to4_mask(weight))


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "conv1d_rows"])
def test_the_fake_tile_kernel_op_gives_a_row_major_bool_mask(fake_cuda, transposed):
    weight = torch.empty(256, 128, device="cuda", dtype=torch.float16)
    weight = weight.t() if transposed else weight
    mask = greedy_2to4_mask(weight)  # the tile kernel takes it: the op's fake runs
    assert (mask.shape, mask.dtype, mask.device) == (
        weight.shape,
        torch.bool,
        weight.device,
    )
    assert mask.is_contiguous()


# fc, conv1d (in rows, a Conv1D's transpose), attention's in_proj_weight and out_proj.weight
WEIGHTS = {(256, 128), (128, 256), (384, 128), (128, 128)}
ATTENTION = {(384, 128), (128, 128)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_runtime_24_compiles_into_one_graph_with_the_tile_kernel(
    fake_cuda, dtype, conv1d
):
    net = layers(256, dtype, "cuda", conv1d)
    x = torch.randn(2, 5, 128, device="cuda", dtype=dtype)
    explained = torch._dynamo.explain(net)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert tile_masks(explained) == WEIGHTS
    out = torch.compile(net, backend="eager", fullgraph=True)(x)  # a break would raise
    assert (out.shape, out.dtype) == ((2, 5, 128), dtype)


@pytest.fixture
def eager_projections(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the weights projected by ``project_eagerly`` (outside the graphs)."""
    shapes = []
    original = masked.project_eagerly

    @torch.compiler.disable
    def record(project, weight, dtype):
        shapes.append(tuple(weight.shape))
        return original(project, weight, dtype)

    monkeypatch.setattr(masked, "project_eagerly", record)
    return shapes


@pytest.mark.parametrize(
    "hidden, dtype, sparsity, eager, traced",
    [
        # fc and conv1d are not multiples of 128; attention's weights are
        (136, torch.bfloat16, "2:4", {(136, 128), (128, 136)}, ATTENTION),
        (256, torch.float32, "2:4", WEIGHTS, set()),  # a float32 matmul
        (256, torch.bfloat16, "4:8", WEIGHTS, set()),  # not 2:4
    ],
    ids=["136x128", "float32", "4:8"],
)
def test_projections_the_tile_kernel_cannot_run_stay_eager(
    fake_cuda, eager_projections, hidden, dtype, sparsity, eager, traced
):
    net = layers(hidden, dtype, "cuda", conv1d=False, sparsity=sparsity)
    explained = torch._dynamo.explain(net)(
        torch.randn(2, 5, 128, device="cuda", dtype=dtype)
    )
    assert explained.graph_break_count > 0
    assert set(eager_projections) == eager
    assert tile_masks(explained) == traced


def test_on_the_cpu_every_projection_stays_eager(eager_projections):
    net = layers(256, torch.bfloat16, "cpu", conv1d=False)  # 16-bit, but not on CUDA
    explained = torch._dynamo.explain(net)(torch.randn(2, 5, 128, dtype=torch.bfloat16))
    assert explained.graph_break_count > 0 and not tile_masks(explained)
    assert set(eager_projections) == WEIGHTS
