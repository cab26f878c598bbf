"""Modules whose optional dependency is not installed are not collected: the doctests of
modules that need an extra or Triton (so the suite runs without the ``hf`` and ``cpu`` extras,
and on the CPU torch build), and the test modules that need ``hypothesis`` (so that
``pytest -m gpu`` collects on a GPU machine that has only torch, Lightning and pytest). The
run's header says what was left out."""

from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).parent
OPTIONAL = {
    "lightning_sparse/demo/hf.py": "transformers",
    "lightning_sparse/kernels/loops.py": "numba",
    "lightning_sparse/backends/triton_sparse24.py": "triton",
}
OPTIONAL.update(
    {
        str(path.relative_to(ROOT)): "hypothesis"
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "\nfrom hypothesis import" in path.read_text()
    }
)


def installed(package: str) -> bool:
    try:
        metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = [path for path, package in OPTIONAL.items() if not installed(package)]
# a bare machine's start-up, for subprocesses: imported here, it would hide packages from the suite
collect_ignore.append("tests/bare_gpu_machine")


def pytest_report_header() -> list[str]:
    left_out = [path for path in collect_ignore if path in OPTIONAL]
    if not left_out:
        return []
    missing = sorted({OPTIONAL[path] for path in left_out})
    return [
        f"not installed: {', '.join(missing)}; not collected: {', '.join(left_out)}"
    ]
