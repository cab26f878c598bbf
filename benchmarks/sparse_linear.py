"""Benchmark: the 2:4 linear layer against dense on a GPU (bf16, CUDA sm80+), in four stages.

    PYTHONPATH=. python benchmarks/sparse_linear.py [--stages mask packing fused layers]
        [--shapes ViT-L Llama] [--variants dense searched] [--compiled all]
        [--repeats 10] [--json out.json]
    PYTHONPATH=. python benchmarks/sparse_linear.py --cpu-smoke   # checks the script on the CPU

- ``mask``: the mask step of the masked runtime 2:4 layer on a bf16 weight (4096x1024,
  11008x4096): ``greedy_2to4_mask`` (torch's tile kernel on CUDA), as the layer runs it at
  every forward (``project_eagerly``), against the torch-ops reference
  ``transposable_2to4_mask``; eager and replayed as a CUDA graph, and the fraction of entries on
  which the two masks agree (they may differ only where ``|w|`` ties within a tile).
- ``packing``: cuSPARSELt's compressed form of a greedy 2:4 weight ``W`` and of ``W.T`` (what a
  training step packs, for the forward and the input gradient; ``W.T`` includes the copy that
  makes it row-major) by our packer (``cusparselt_packer.compress``, what runtime masks use),
  by our packer at a stored mask (values gathered at positions packed at the last mask update,
  ``cusparselt.mask_packing``) and by ``torch._cslt_compress``, at the same shapes; eager and
  as a CUDA graph (how it runs inside a compiled step); which of them training uses here.
- ``fused``: a training step's whole packing job at 4096x1024, 1024x4096 (the ViT-L MLP) and
  11008x4096: the greedy mask and ``W`` and ``W.T`` packed (runtime masks), and ``W`` and
  ``W.T`` packed at a stored mask, by the Triton kernels (one pass; timed only where they
  passed their comparison with ``torch._cslt_compress`` in this process), by the torch ops
  (the tile kernel's mask, our packer) and with ``torch._cslt_compress``, and the tile
  kernel's mask alone; eager and as a CUDA graph, each as a multiple of its job's
  memory-bound time (bytes it must read and write at the bandwidth of a copy kernel measured
  in the same run).
- ``layers``: forward + backward (input, weight and bias gradients) of bf16 ``nn.Linear``
  layers at ViT-L MLP shapes (13008 and 32896 tokens), ViT-B (25216 tokens = 128 x 197),
  GPT-2 small (8192 tokens) and Llama-7B MLP up/down (16384 tokens): dense; the runtime 2:4
  layer (pruned and packed at every step, ``install_semi_structured_forward``) on cuSPARSELt
  with algorithm 0 and with the algorithm cuSPARSELt's search picks (CUTLASS too on sm8x); the
  2:4 layer with a stored mask (``static``/``magnitude`` phases: packed ahead, values gathered
  per step); the runtime 2:4 layer with our torch-ops packer where the Triton kernels would
  pack (the same layer without them); the masked runtime 2:4 layer (dense math on the greedy
  2:4 weight, the projection a runtime phase installs). Each eagerly, and compiled
  with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) for the ``--compiled`` shapes
  (by default the two of the acceptance targets: each compiled variant costs a compilation).

``--variants`` keeps the layer variants whose name contains one of its words (dense is always
timed: the ratios' baseline). Ratios are against dense measured in the same run (same shape and
mode). The kernel checks this
process ran are printed last. ``--json`` writes every measurement as a record (for
``gpu_acceptance.py``); ``--time-limit`` skips what would start after it and says so. Without a
CUDA GPU of capability 8.0+ it says so and exits 0. ``--cpu-smoke`` runs tiny shapes through
the same code on the CPU (the 2:4 layers on their emulation, compiled with ``aot_eager``; no
``torch._cslt_compress``, no CUDA graphs); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from common import (
    COMPILED_WARMUP,
    Deadline,
    Records,
    Timer,
    available_kernels,
    benchmark_device,
    compile_options,
    kernel_check_table,
    markdown_table,
    new_step,
)

from lightning_sparse.algorithms import build_algorithm
from lightning_sparse.backends import capability, cusparselt
from lightning_sparse.backends.cuda_graphs import cuda_graphed
from lightning_sparse.backends.cusparselt import fused_kernels, mask_packing, packer
from lightning_sparse.backends.cusparselt_algorithms import DEFAULT, AlgorithmCache
from lightning_sparse.backends.cusparselt_packer import (
    compress,
    packing,
    positive_zeros,
)
from lightning_sparse.backends.masked import (
    install_masked_forward,
    project_eagerly,
    uninstall_forward,
)
from lightning_sparse.backends.semi_structured import (
    LABELS,
    install_semi_structured_forward,
)
from lightning_sparse.core.layers import LINEAR
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.engine.forwards import Projection
from lightning_sparse.masks.tiles import greedy_2to4_mask, transposable_2to4_mask

STAGES = ("mask", "packing", "fused", "layers")
# (label, tokens, in_features, out_features)
LINEARS = [
    ("ViT-L MLP fc1", 13008, 1024, 4096),
    ("ViT-L MLP fc2", 13008, 4096, 1024),
    ("ViT-L MLP fc1", 32896, 1024, 4096),
    ("ViT-L MLP fc2", 32896, 4096, 1024),
    ("ViT-B MLP fc1", 25216, 768, 3072),
    ("ViT-B MLP fc2", 25216, 3072, 768),
    ("GPT-2 small c_fc", 8192, 768, 3072),
    ("GPT-2 small c_proj", 8192, 3072, 768),
    ("Llama-7B MLP up", 16384, 4096, 11008),
    ("Llama-7B MLP down", 16384, 11008, 4096),
]
SMOKE_LINEARS = [("smoke", 64, 128, 256)]
COMPILED = [
    "16384x4096 -> 11008",
    "32896x1024 -> 4096",
]  # the acceptance targets' shapes
WEIGHTS = [(4096, 1024), (11008, 4096)]  # (out, in): ViT-L fc1, Llama-7B down
FUSED_WEIGHTS = [
    (4096, 1024),
    (1024, 4096),
    (11008, 4096),
]  # ViT-L fc1 and fc2, Llama-7B down
SMOKE_WEIGHTS = [(256, 128)]
TRITON_MASK_AND_PACK = "Triton: mask + W, W.T, one pass"
"""The fused stage's row of the Triton kernels on a runtime mask (a GPU acceptance target)."""
ALGORITHM_0 = AlgorithmCache(search=lambda *args: DEFAULT)


@dataclass(frozen=True)
class Variant:
    """A way to run a layer: ``install`` gives it its forward (none: dense); ``algorithms``
    replaces cuSPARSELt's algorithm cache while it runs (none: the process's, searched)."""

    name: str
    install: Callable[[nn.Module], None] | None = None
    kernel: str = ""
    algorithms: AlgorithmCache | None = None
    fused: bool = True
    """Whether the cuSPARSELt ops may use the Triton kernels (where they were chosen)."""


def layer_variants(device: torch.device, names: list[str]) -> list[Variant]:
    """The variants whose name contains one of ``names`` (all without), dense first."""
    return [
        variant
        for variant in all_variants(device)
        if variant.name == "dense" or not names or any(n in variant.name for n in names)
    ]


def all_variants(device: torch.device) -> list[Variant]:
    variants = [Variant("dense")]
    for kernel in available_kernels(device):
        install = functools.partial(install_semi_structured_forward, kernel=kernel)
        label = f"2:4 {LABELS.get(kernel, kernel)}"
        if kernel == "cutlass":
            variants.append(Variant(label, install, kernel))
        else:  # cuSPARSELt, or on the CPU its emulation (which reads no algorithm)
            variants.append(Variant(f"{label}, alg 0", install, kernel, ALGORITHM_0))
            variants.append(Variant(f"{label}, searched", install, kernel))
            stored = functools.partial(install_stored_mask, kernel=kernel)
            variants.append(Variant(f"{label}, stored mask, searched", stored, kernel))
            name = f"{label}, searched, torch-ops packer"
            variants.append(Variant(name, install, kernel, fused=False))
    # the projection a runtime 2:4 phase installs (traced into compiled graphs where it can)
    runtime = build_algorithm(resolve_phases([Phase(sparsity="2:4")], total_steps=1)[0])
    masked = functools.partial(
        install_masked_forward, project=Projection(runtime, LINEAR)
    )
    variants.append(Variant("2:4 masked runtime", masked, "masked"))
    return variants


def install_stored_mask(layer: nn.Linear, kernel: str) -> None:
    """The forward a ``static`` or ``magnitude`` 2:4 phase installs: the layer's transposable
    2:4 mask stored (on cuSPARSELt, packed ahead of the steps)."""
    mask = transposable_2to4_mask(layer.weight.detach())
    install_semi_structured_forward(layer, kernel, mask)


@contextlib.contextmanager
def algorithms(cache: AlgorithmCache | None) -> Iterator[None]:
    """cuSPARSELt's matmuls choose their algorithm from ``cache`` inside this block."""
    if cache is None:
        yield
        return
    saved, cusparselt.ALGORITHMS = cusparselt.ALGORITHMS, cache
    try:
        yield
    finally:
        cusparselt.ALGORITHMS = saved


def time_layer(
    layer: nn.Linear,
    x: torch.Tensor,
    grad: torch.Tensor,
    variant: Variant,
    compiled: bool,
    timer: Timer,
) -> float:
    """Median ms of ``layer(x).backward(grad)`` run as ``variant``, eager or compiled."""
    device = x.device
    if variant.install is not None:
        variant.install(layer)
    try:
        with algorithms(variant.algorithms), fused_kernels(variant.fused):
            run = torch.compile(layer, **compile_options(device)) if compiled else layer

            def step() -> None:
                if compiled:
                    new_step(device)
                run(x).backward(grad)
                layer.weight.grad = layer.bias.grad = x.grad = None

            return timer(step, COMPILED_WARMUP if compiled else None)
    finally:
        if variant.install is not None:
            uninstall_forward(layer)
        if compiled:  # a fresh compilation (and CUDA graphs) for the next variant
            torch._dynamo.reset()


def algorithm_of(variant: Variant) -> str:
    """``"0"`` or ``"searched"`` for a variant on cuSPARSELt (or its emulation), else ``""``."""
    if variant.kernel in ("", "masked", "cutlass"):
        return ""
    return "0" if variant.algorithms is ALGORITHM_0 else "searched"


def searched(out_features: int, in_features: int) -> str:
    """The algorithms the search chose for a layer: forward, input gradient (``W.T``)."""
    found = [
        cusparselt.ALGORITHMS.describe(*shape)
        for shape in ((out_features, in_features), (in_features, out_features))
    ]
    return f" ({found[0]} / {found[1]})" if all(found) else ""


def layer_rows(
    args: argparse.Namespace, device: torch.device, timer: Timer, records: Records
) -> list[list[str]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for label, tokens, fan_in, fan_out in args.linears:
        workload = f"{label}: {tokens}x{fan_in} -> {fan_out}"
        if args.deadline.passed(workload):
            continue
        modes = ["eager"]
        if "all" in args.compiled or any(s in workload for s in args.compiled):
            modes.append("compiled")
        x = torch.randn(tokens, fan_in, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, fan_out, device=device, dtype=dtype)
        layer = nn.Linear(fan_in, fan_out, device=device, dtype=dtype)
        owners = [("layer", layer, "weight")]
        kernel_takes = (
            device.type != "cuda"
            or capability.semi_structured_kernel(layer.weight, owners, dtype)[0]
        )
        dense: dict[str, float] = {}
        for variant in layer_variants(device, args.variants):
            cells = []
            for mode in modes:
                if variant.kernel not in ("", "masked") and not kernel_takes:
                    cells += ["n/a (no kernel for this shape)", "-"]
                    continue
                if args.deadline.passed(f"{workload} {variant.name} {mode}"):
                    cells += ["not run (time limit)", "-"]
                    continue
                ms = time_layer(layer, x, grad, variant, mode == "compiled", timer)
                dense.setdefault(mode, ms)
                ratio = dense[mode] / ms
                cells += [f"{ms:.3f}", f"{ratio:.2f}x"]
                records.add(
                    table="layers", label=label, tokens=tokens, in_features=fan_in,
                    out_features=fan_out, variant=variant.name, kernel=variant.kernel,
                    algorithm=algorithm_of(variant), stored="stored mask" in variant.name,
                    fused=variant.fused, mode=mode, ms=ms, ratio=ratio,
                )  # fmt: skip
            name = variant.name
            if variant.kernel and variant.algorithms is None and kernel_takes:
                name += searched(fan_out, fan_in)
            rows.append([workload, name, *cells, *["-", "-"] * (2 - len(modes))])
        del x, grad, layer
    return rows


def mask_rows(
    args: argparse.Namespace, device: torch.device, timer: Timer, records: Records
) -> list[list[str]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    masks = [
        ("greedy_2to4_mask (the masked runtime step)", greedy_2to4_mask),
        ("transposable_2to4_mask (torch-ops reference)", transposable_2to4_mask),
    ]
    rows = []
    for shape in args.weights:
        weight = f"{shape[0]}x{shape[1]}"
        if args.deadline.passed(f"mask {weight}"):
            continue
        w = torch.randn(shape, device=device, dtype=dtype)
        chosen = [project_eagerly(mask, w, dtype) for _, mask in masks]
        agree = (chosen[0] == chosen[1]).float().mean().item()
        for name, mask in masks:
            step = functools.partial(project_eagerly, mask, w, dtype)
            eager = timer(step)
            graphed = graph_ms(step, timer, device)
            rows.append([weight, name, f"{eager:.3f}", graphed, f"{agree:.4%}"])
            records.add(
                table="mask", weight=weight, function=mask.__name__, eager_ms=eager,
                graphed_ms=_number(graphed), agree=agree,
            )  # fmt: skip
    return rows


def packing_rows(
    args: argparse.Namespace, device: torch.device, timer: Timer, records: Records
) -> list[list[str]]:
    dtype, cuda = torch.bfloat16, device.type == "cuda"
    chosen = packer(dtype, device).name if cuda else ""
    ours = chosen == cusparselt.TORCH_OPS  # else the Triton kernels or _cslt_compress
    rows = []
    for shape in args.weights:
        weight = f"{shape[0]}x{shape[1]}"
        if args.deadline.passed(f"packing {weight}"):
            continue
        w = torch.randn(shape, device=device, dtype=dtype)
        keep = greedy_2to4_mask(w)
        w24, stored = w * keep, mask_packing(keep, keep)
        packers = [  # name, packer of W, of W.T, what it packs, what training uses it for
            ("lightning_sparse compress", compress, compress, w24,
             "runtime masks" if ours else "no"),
            ("lightning_sparse at a stored mask", stored.rows.compress,
             stored.columns.compress, w, "stored masks" if ours else "no"),
            ("torch._cslt_compress", torch._cslt_compress, torch._cslt_compress, w24,
             "all masks" if chosen == cusparselt.CSLT else "no"),
        ]  # fmt: skip
        for name, pack, pack_t, source, used in packers:
            if not cuda and name.startswith("torch."):
                rows.append([weight, name, "-", "n/a (CUDA only)", *["-"] * 5])
                continue
            steps = packing_steps(pack, pack_t, source)
            eager = [timer(step) for step in steps]
            graphed = [graph_ms(step, timer, device) for step in steps]
            rows.append(
                [weight, name, used if cuda else "-"]
                + [f"{ms:.3f}" for ms in eager]
                + graphed
            )
            table = "packing_stored" if "stored" in name else "packing"
            for what, ms, graph in zip(("W", "W.T", "W and W.T"), eager, graphed):
                records.add(
                    table=table, weight=weight, packer=name, in_use=used != "no",
                    what=what, eager_ms=ms, graphed_ms=_number(graph),
                )  # fmt: skip
    return rows


@dataclass(frozen=True)
class Job:
    """A packing job of a training step and the bytes per weight it must read and write."""

    name: str
    bytes_per_weight: float


# the weight (2 bytes) read; W and W.T packed written (2 x 9/16 x 2 bytes); a bool mask read
RUNTIME = Job("mask + W, W.T", 2 + 2.25)
STORED = Job("W, W.T at a stored mask", 2 + 1 + 2.25)
MASK = Job("mask", 2 + 1)


def fused_rows(
    args: argparse.Namespace, device: torch.device, timer: Timer, records: Records
) -> tuple[str, list[list[str]]]:
    """The ``fused`` stage: each packing job by each method, against its memory bound."""
    dtype, cuda = torch.bfloat16, device.type == "cuda"
    chosen = packer(dtype, device) if cuda else None
    bandwidth = copy_bandwidth(device, timer)  # GB/s
    header = (
        f"Copy bandwidth {bandwidth:.0f} GB/s (`dst.copy_(src)`, read + write, this run); "
        f"packer in use: {chosen.note() if chosen else '- (no GPU)'}"
    )
    rows = []
    for shape in args.fused_weights:
        weight = f"{shape[0]}x{shape[1]}"
        if args.deadline.passed(f"fused {weight}"):
            continue
        w = torch.randn(shape, device=device, dtype=dtype)
        keep = greedy_2to4_mask(w)
        for job, method, step, why_not in fused_methods(w, keep, chosen):
            limit = w.numel() * job.bytes_per_weight / (bandwidth * 1e6)  # ms
            if why_not:
                rows.append([weight, job.name, method, why_not, *["-"] * 4])
                continue
            eager = timer(step)
            graphed = graph_ms(step, timer, device)
            best = _number(graphed) or eager
            used = chosen is not None and in_use(method, chosen.name)
            uses = "-" if chosen is None else "yes" if used else "no"
            rows.append(
                [weight, job.name, method, uses, f"{eager:.3f}",
                 graphed, f"{limit:.3f}", f"{best / limit:.1f}x"]
            )  # fmt: skip
            records.add(
                table="fused", weight=weight, job=job.name, method=method, in_use=used,
                eager_ms=eager, graphed_ms=_number(graphed), limit_ms=limit,
                times_limit=best / limit, bandwidth_gbs=bandwidth,
            )  # fmt: skip
    return header, rows


def fused_methods(
    w: torch.Tensor, keep: torch.Tensor, chosen: cusparselt.Packer | None
) -> list[tuple[Job, str, Callable[[], object], str]]:
    """``(job, method, step, why not timed)`` for each method of each job on ``w``
    (``keep``: its greedy mask, as a stored mask)."""
    cuda = w.device.type == "cuda"
    triton = chosen is not None and chosen.name == cusparselt.TRITON
    no_triton = (
        "" if triton else f"not used here ({chosen.why if chosen else 'no GPU'})"
    )
    no_cslt = "" if cuda else "n/a (CUDA only)"
    rows, columns = packing(keep), packing(keep.t().contiguous())

    def torch_runtime() -> object:
        w24 = w * greedy_2to4_mask(w)
        return compress(w24), compress(w24.t().contiguous())

    def cslt_runtime() -> object:
        w24 = positive_zeros(w * greedy_2to4_mask(w))
        return torch._cslt_compress(w24), torch._cslt_compress(w24.t().contiguous())

    def torch_stored() -> object:
        return rows.compress(w), columns.compress(w.t().contiguous())

    def cslt_stored() -> object:
        w24 = positive_zeros(w * keep)
        return torch._cslt_compress(w24), torch._cslt_compress(w24.t().contiguous())

    return [
        (RUNTIME, TRITON_MASK_AND_PACK, lambda: cusparselt.triton_sparse24.mask_and_pack(w), no_triton),
        (RUNTIME, "torch ops: tile-op mask, our packer", torch_runtime, ""),
        (RUNTIME, "tile-op mask, torch._cslt_compress", cslt_runtime, no_cslt),
        (STORED, "Triton: W, W.T, one pass", lambda: cusparselt.triton_sparse24.pack(w, keep), no_triton),
        (STORED, "torch ops: our packer at the stored positions", torch_stored, ""),
        (STORED, "torch._cslt_compress", cslt_stored, no_cslt),
        (MASK, "tile-op mask alone (greedy_2to4_mask)", lambda: greedy_2to4_mask(w), ""),
    ]  # fmt: skip


def in_use(method: str, chosen: str) -> bool:
    """Whether training runs ``method`` here, given the packer chosen."""
    if method.startswith("Triton"):
        return chosen == cusparselt.TRITON
    if method.startswith("torch ops"):
        return chosen == cusparselt.TORCH_OPS
    if "_cslt_compress" in method:
        return chosen == cusparselt.CSLT
    return (
        chosen != cusparselt.TRITON
    )  # the tile-op mask: the runtime mask of the others


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """GB/s of ``dst.copy_(src)`` on 256 MiB (8 MiB on the CPU), counting each byte read and
    written: the memory bound of the packing jobs, measured in this run."""
    size = (256 if device.type == "cuda" else 8) << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * size / (ms * 1e6)


def packing_steps(
    pack: Callable[[torch.Tensor], torch.Tensor],
    pack_t: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
) -> list[Callable[[], object]]:
    """What a training step packs: ``W`` (forward), ``W.T`` made row-major (input gradient),
    and both."""

    def rows() -> torch.Tensor:
        return pack(weight)

    def columns() -> torch.Tensor:
        return pack_t(weight.t().contiguous())

    return [rows, columns, lambda: (rows(), columns())]


def graph_ms(step: Callable[[], object], timer: Timer, device: torch.device) -> str:
    """Median ms of ``step`` replayed as a CUDA graph ("-" off a GPU, or why it failed)."""
    if device.type != "cuda":
        return "-"
    try:
        replay = cuda_graphed(step)
    except RuntimeError as err:
        return f"not capturable ({str(err).splitlines()[0][:80]})"
    return f"{timer(replay):.3f}"


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, default=list(STAGES), help="what to run"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[],
        help="layers whose label contains one of these",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help="layer variants whose name contains one of these (dense always)",
    )
    parser.add_argument(
        "--compiled",
        nargs="+",
        default=COMPILED,
        help="layers (label substrings, 'all' or 'none') also timed compiled",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--time-limit", type=float, help="seconds; skip what is left")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on the CPU"
    )
    args = parser.parse_args(argv)
    linears = SMOKE_LINEARS if args.cpu_smoke else LINEARS
    args.linears = [
        linear
        for linear in linears
        if not args.shapes
        or any(
            s in f"{linear[0]}: {linear[1]}x{linear[2]} -> {linear[3]}"
            for s in args.shapes
        )
    ]
    args.weights = SMOKE_WEIGHTS if args.cpu_smoke else WEIGHTS
    args.fused_weights = SMOKE_WEIGHTS if args.cpu_smoke else FUSED_WEIGHTS
    if args.cpu_smoke:
        args.repeats, args.warmup = 1, 0
        args.compiled = ["all"]
    args.deadline = Deadline(args.time_limit)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    found = benchmark_device("sparse_linear.py", args.cpu_smoke, "float32 emulation")
    if found is None:
        return
    device, where = found
    print(
        f"torch {torch.__version__}, {where}; median of {args.repeats} runs after "
        f"{args.warmup} warm-up runs ({COMPILED_WARMUP} compiled)\n",
        flush=True,
    )
    timer, records = Timer(device, args.repeats, args.warmup), Records(args.json)
    if "mask" in args.stages:
        header = [
            "weight",
            "mask step",
            "eager ms",
            "CUDA graph ms",
            "same as reference",
        ]
        print(markdown_table(header, mask_rows(args, device, timer, records)) + "\n")
    if "packing" in args.stages:
        header = [
            "weight",
            "packer",
            "training uses it for",
            "W ms",
            "W.T ms",
            "W and W.T ms",
        ]
        header += ["W graph ms", "W.T graph ms", "W and W.T graph ms"]
        print(markdown_table(header, packing_rows(args, device, timer, records)) + "\n")
    if "fused" in args.stages:
        line, rows = fused_rows(args, device, timer, records)
        header = ["weight", "job", "method", "training uses it", "eager ms"]
        header += ["CUDA graph ms", "memory-bound ms", "x memory-bound"]
        print(line + "\n\n" + markdown_table(header, rows) + "\n")
    if "layers" in args.stages:
        header = ["workload", "variant", "eager ms (fwd+bwd)", "vs dense"]
        header += ["compiled ms", "vs dense"]
        print(markdown_table(header, layer_rows(args, device, timer, records)) + "\n")
    print("Kernel checks in this process:\n")
    print(kernel_check_table())
    if args.deadline.skipped:
        print(f"\n{args.deadline.note()}")


if __name__ == "__main__":
    main()
