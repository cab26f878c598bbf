"""The doctests of a module whose optional dependency is not installed are not collected (its
tests skip the same way), so the suite runs without the ``hf`` and ``cpu`` extras, and on the
CPU torch build (no Triton)."""

import importlib.util

OPTIONAL = {
    "lightning_sparse/demo/hf.py": "transformers",
    "lightning_sparse/kernels/loops.py": "numba",
    "lightning_sparse/backends/triton_sparse24.py": "triton",
}
collect_ignore = [
    path
    for path, module in OPTIONAL.items()
    if importlib.util.find_spec(module) is None
]
