"""The doctests of a module whose optional dependency is not installed are not collected (its
tests skip the same way), so the suite runs without the ``hf`` and ``cpu`` extras."""

import importlib.util

OPTIONAL = {
    "lightning_sparse/demo/hf.py": "transformers",
    "lightning_sparse/kernels/loops.py": "numba",
}
collect_ignore = [
    path
    for path, module in OPTIONAL.items()
    if importlib.util.find_spec(module) is None
]
