"""A shape and dispatch contract of the 2:4 kernel path, on fake CUDA tensors (no GPU needed).

Under ``FakeTensorMode`` a ``device="cuda"`` tensor carries shape, dtype, strides and device but
no data, so the whole kernel path runs on a CPU-only machine: the tile op, the construction of
torch's semi-structured tensor subclasses, their matmul dispatch (``linear``, ``t``, ``mm``,
``addmm``, down to torch's meta functions of ``_cslt_sparse_mm`` and the CUTLASS matmuls), the
straight-through backward and ``torch.compile``'s tracing of the cuSPARSELt layer. That catches
wrong constructor arguments, wrong transposes, shape and dtype errors and dispatch errors on
whatever torch is installed. It checks no number: not which weights the kernel keeps, not the
matmul results, not the speed (that is ``tests/test_semi_structured_gpu.py``, on a GPU).

torch has no fake implementation of ``aten._sparse_semi_structured_tile``; :func:`tile_fake`
is one, registered only inside these tests. Its output shapes, dtypes and strides follow the
CUDA kernel, read from torch's source:

- ``aten/src/ATen/native/sparse/cuda/SparseSemiStructuredTile.cu``: the checks of
  ``sparse_semi_structured_tile_typed`` (2-D, ``stride(1) == 1``, columns a multiple of 32,
  float16/bfloat16, a known algorithm), the outputs ``(compressed, meta, compressed_trans,
  meta_trans, threads_masks)``, and ``create_compressed_representation`` of
  ``MetadataCuSparseLt`` (one 1-D buffer of ``rows * ceil(cols / 2)`` values followed by
  ``rows * cols / 16`` metadata values, the metadata a ``(rows / 128, cols / 32, 256)`` view
  into it, in the input's dtype; both dimensions multiples of 128, from ``getMetadataSize``)
  and of ``MetadataCutlass`` (``packed`` of ``(round_up(rows, 32), round_up(cols, 64) / 2)``;
  int16 metadata allocated as ``(round_up(cols, 64) / 32, round_up(rows, 32), 2)`` and
  permuted to ``(rows', 2, cols' / 32)``);
- ``aten/src/ATen/native/sparse/cuda/SparseSemiStructuredPack.h``: ``threads_masks`` is
  ``(getBlocksGrid().x * getThreadsGrid().x, getBlocksGrid().y * getThreadsGrid().y, 8)``
  bytes, i.e. ``(ceil(rows / 32) * 4, ceil(cols / 64) * 8, 8)`` uint8 (warps of 32x64, threads
  of 8x8);
- ``aten/src/ATen/native/sparse/cuda/ComputeSparseTile.h``: ``named_algorithms``;
- ``aten/src/ATen/native/native_functions.yaml``: the schema ``_sparse_semi_structured_tile(
  Tensor input, str algorithm="", bool use_cutlass=True) -> (Tensor, Tensor, Tensor, Tensor,
  Tensor)``, with a CUDA kernel only (hence no meta function).

The autograd engine cannot run a backward over fake CUDA tensors without a GPU (it stashes
the current CUDA streams and asks the driver for device 0), so :func:`grad_without_engine`
calls the recorded backward nodes one by one, with the engine's checks on each gradient; and
for the same reason ``torch.compile`` is traced here for inference only (forward graph).
Autocast is not covered: it disables itself for CUDA on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import get_gradient_edge
from torch.sparse import SparseSemiStructuredTensor, SparseSemiStructuredTensorCUTLASS

from lightning_sparse.backends import cusparselt, cutlass
from lightning_sparse.backends import semi_structured as ss
from lightning_sparse.backends.capability import CUSPARSELT_MULTIPLE, CUTLASS_MULTIPLE

pytestmark = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of SparseSemiStructuredTensor is in prototype stage"
)

TILE_OP = "aten::_sparse_semi_structured_tile"
ALGORITHMS = ("largest_values_greedy", "causal1122", "largest_abs_values_greedy", "")
# (out_features, in_features): shapes the capability rules send to each kernel
SHAPES = {"cusparselt": [(128, 128), (256, 512), (384, 128)]}
SHAPES["cutlass"] = [(64, 64), (192, 64), (64, 320)]
CASES = [
    (kernel, dtype, shape)
    for kernel, shapes in SHAPES.items()
    for dtype in (torch.float16, torch.bfloat16)
    for shape in shapes
]
TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])


def needs_cutlass_meta(kernel: str) -> None:
    """Before torch 2.14, the meta function of ``aten._sparse_semi_structured_mm`` rejects the
    3-D metadata that the tile op gives CUTLASS tensors ("mat1_meta must be 2D"), so a fake
    tensor cannot run a CUTLASS matmul there: the contract cannot be checked on that torch."""
    if kernel == "cutlass" and TORCH < (2, 14):
        pytest.xfail("this torch's meta function rejects CUTLASS's 3-D metadata")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _compressed(input: torch.Tensor, rows: int, cols: int, use_cutlass: bool):
    """``(compressed, meta)`` of ``create_compressed_representation(rows, cols, input)``."""
    if use_cutlass:
        rows_, cols_ = _ceil_div(rows, 32) * 32, _ceil_div(cols, 64) * 64
        packed = input.new_empty((rows_, _ceil_div(cols_, 2)))
        meta = input.new_empty((rows_ * cols_ // 16,), dtype=torch.int16)
        return packed, meta.view(cols_ // 32, rows_, 2).permute(1, 2, 0)
    if rows % 128 or cols % 128:
        raise RuntimeError("Only supports rows/cols multiples of 128")
    data = rows * _ceil_div(cols, 2)
    storage = input.new_empty((data + rows * cols // 16,))
    return storage, storage[data:].view(rows // 128, cols // 32, 256)


def tile_fake(input: torch.Tensor, algorithm: str = "", use_cutlass: bool = True):
    """``torch._sparse_semi_structured_tile`` on tensors without data: the CUDA kernel's
    checks and output layout (see the module docstring for the sources)."""
    if input.dim() != 2:
        raise RuntimeError("Can only sparsify 2d tensors")
    if input.stride(1) != 1:
        raise RuntimeError("Can only sparsify contiguous tensors.")
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"{input.dtype}")
    rows, cols = input.shape
    packed, meta = _compressed(input, rows, cols, use_cutlass)
    packed_t, meta_t = _compressed(input, cols, rows, use_cutlass)
    if cols % 32:
        raise RuntimeError("Number of cols should be multiple of 32")
    if algorithm not in ALGORITHMS:
        raise RuntimeError(f'Unknown algorithm "{algorithm}"')
    masks = (_ceil_div(rows, 32) * 4, _ceil_div(cols, 64) * 8, 8)
    return packed, meta, packed_t, meta_t, input.new_empty(masks, dtype=torch.uint8)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A ``FakeTensorMode`` in which the tile op has :func:`tile_fake`, for this test only.
    The kernel check (which runs real numbers) counts as passed: a contract has no numbers."""
    for module in (ss, cusparselt, cutlass):
        monkeypatch.setattr(
            module, "require_kernel", lambda kernel, dtype, device: None
        )
    torch._dynamo.reset()
    with torch.library._scoped_library("aten", "FRAGMENT") as lib:
        torch.library.register_fake(TILE_OP, tile_fake, lib=lib)
        with FakeTensorMode() as mode:
            yield mode
    torch._dynamo.reset()
    registered = torch._library.simple_registry.singleton.find(TILE_OP)
    assert registered.fake_impl.kernel is None, (
        "the fake tile op leaked out of the test"
    )


def grad_without_engine(output: torch.Tensor, inputs: list[torch.Tensor]):
    """``torch.autograd.grad(output, inputs, torch.ones_like(output))``, computed by calling
    the backward nodes in reverse topological order instead of through the autograd engine,
    with the engine's checks: each gradient is summed to its input's shape and must have its
    dtype and device."""
    order, seen = [], set()

    def visit(node):
        if node is not None and node not in seen:
            seen.add(node)
            for child, _ in node.next_functions:
                visit(child)
            order.append(node)

    pending: dict = {}

    def deliver(node, nr: int, grad: torch.Tensor) -> None:
        meta = node._input_metadata[nr]
        if list(grad.shape) != list(meta.shape):
            grad = grad.sum_to_size(meta.shape)
        assert (grad.dtype, grad.device) == (meta.dtype, meta.device), node.name()
        slot = pending.setdefault(node, [None] * len(node._input_metadata))
        slot[nr] = grad if slot[nr] is None else slot[nr] + grad

    visit(output.grad_fn)
    deliver(output.grad_fn, output.output_nr, torch.ones_like(output))
    wanted = {}
    for k, input in enumerate(inputs):
        edge = get_gradient_edge(input)
        wanted[edge.node, edge.output_nr] = k
    grads: list = [None] * len(inputs)
    for node in reversed(order):
        incoming = pending.pop(node, None)
        if incoming is None:
            continue
        for nr, grad in enumerate(incoming):
            if (node, nr) in wanted:
                grads[wanted[node, nr]] = grad
        if node.name() == "torch::autograd::AccumulateGrad":
            continue
        call = node.apply if isinstance(node, BackwardCFunction) else node
        outgoing = call(*incoming)
        if isinstance(outgoing, torch.Tensor):
            outgoing = (outgoing,)
        for (child, nr), grad in zip(node.next_functions, outgoing):
            if child is not None and grad is not None:
                deliver(child, nr, grad)
    return grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES["cutlass"])
def test_cutlass_packed_weight_is_the_subclass_of_the_weights_shape(
    fake_cuda, dtype, shape
):
    weight = torch.randn(shape, device="cuda", dtype=dtype)
    packed = cutlass.pack_cutlass(weight)
    assert type(packed) is SparseSemiStructuredTensorCUTLASS
    assert (packed.shape, packed.dtype, packed.device) == (shape, dtype, weight.device)
    assert packed.t().shape == shape[::-1]


@pytest.mark.parametrize("masked", [False, True], ids=["runtime", "stored_mask"])
@pytest.mark.parametrize("kernel, dtype, shape", CASES)
def test_linear_forward_and_backward_shapes(fake_cuda, kernel, dtype, shape, masked):
    needs_cutlass_meta(kernel)
    out_features, in_features = shape
    weight = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(out_features, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.ones(shape, device="cuda", dtype=torch.bool) if masked else None
    # a stored mask on cuSPARSELt runs with its packing, made as install makes it
    packing = (
        cusparselt.mask_packing(mask, mask)
        if masked and kernel == "cusparselt" and cusparselt.packs_stored_masks(shape)
        else None
    )
    x = torch.randn(3, 100, in_features, device="cuda", dtype=dtype, requires_grad=True)
    out = ss.semi_structured_linear(
        x, weight, bias, kernel, mask, packing
    )  # 300 tokens
    assert (out.shape, out.dtype, out.device) == (
        (3, 100, out_features),
        dtype,
        x.device,
    )
    grads = grad_without_engine(out, [x, weight, bias])
    for grad, input in zip(grads, (x, weight, bias)):
        assert (grad.shape, grad.dtype, grad.device) == (
            input.shape,
            dtype,
            input.device,
        )
        assert not isinstance(grad, SparseSemiStructuredTensor)  # dense gradients


@pytest.mark.parametrize("kernel", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_installed_module_runs_forward_and_backward(fake_cuda, kernel, dtype):
    needs_cutlass_meta(kernel)
    layer = nn.Linear(256, 128, device="cuda", dtype=dtype)
    ss.install_semi_structured_forward(layer, kernel)
    assert type(layer) is ss.SemiStructuredLinear
    x = torch.randn(2, 5, 256, device="cuda", dtype=dtype, requires_grad=True)
    out = layer(x)
    assert (out.shape, out.dtype) == ((2, 5, 128), dtype)
    grad_x, grad_w, grad_b = grad_without_engine(out, [x, layer.weight, layer.bias])
    assert (grad_x.shape, grad_w.shape, grad_b.shape) == (
        (2, 5, 256),
        (128, 256),
        (128,),
    )


@pytest.mark.parametrize("stored", [False, True], ids=["runtime", "stored_mask"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compile_traces_the_cusparselt_layer(fake_cuda, monkeypatch, dtype, stored):
    monkeypatch.setattr(ss, "is_transposable_2to4", lambda mask: True)  # no data here
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    layer = nn.Linear(512, 256, device="cuda", dtype=dtype).requires_grad_(False)
    mask = torch.ones(256, 512, device="cuda", dtype=torch.bool) if stored else None
    ss.install_semi_structured_forward(layer, "cusparselt", mask)
    compiled = torch.compile(
        layer, backend=aot_autograd(fw_compiler=keep), fullgraph=True
    )
    out = compiled(torch.randn(4, 7, 512, device="cuda", dtype=dtype))
    assert (out.shape, out.dtype) == ((4, 7, 256), dtype)
    (code,) = graphs  # one graph: one node that packs and multiplies, no break
    op = "linear_24_stored" if stored else "linear_24_projected"
    assert code.count("torch.ops.lightning_sparse.") == 1
    assert f"torch.ops.lightning_sparse.{op}.default" in code


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_cutlass_layer_runs_eagerly(fake_cuda, dtype):
    needs_cutlass_meta("cutlass")
    layer = nn.Linear(128, 64, device="cuda", dtype=dtype).requires_grad_(False)
    ss.install_semi_structured_forward(layer, "cutlass")
    out = torch.compile(layer, backend="aot_eager")(
        torch.randn(9, 128, device="cuda", dtype=dtype)
    )
    assert (out.shape, out.dtype) == ((9, 64), dtype)


@pytest.mark.parametrize("shape", [(128, 192), (192, 128), (64, 128)])
def test_tile_op_refuses_what_the_capability_rules_send_elsewhere(fake_cuda, shape):
    """The tile op's cuSPARSELt format needs multiples of CUSPARSELT_MULTIPLE (so the GPU
    greedy mask runs on those shapes only); CUTLASS takes multiples of CUTLASS_MULTIPLE."""
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert any(size % CUSPARSELT_MULTIPLE for size in shape)
    with pytest.raises(RuntimeError, match="multiples of 128"):
        torch._sparse_semi_structured_tile(weight, use_cutlass=False)
    if all(size % CUTLASS_MULTIPLE == 0 for size in shape):
        assert cutlass.pack_cutlass(weight).shape == shape
