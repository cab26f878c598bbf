"""Put this folder on ``PYTHONPATH`` and a Python process starts as on the bare GPU image the
acceptance runs on: ``jsonargparse`` and ``hypothesis`` are not installed. Importing them
raises ``ModuleNotFoundError``, and ``importlib.metadata`` finds no distribution of them, so
version probes such as Lightning's ``RequirementCache`` see them missing too (blocking the
import alone would make Lightning's own CLI module fail, which on that machine it does not)."""

import sys
from importlib import metadata
from importlib.machinery import ModuleSpec

MISSING = ("jsonargparse", "hypothesis")


def _missing(name: str) -> bool:
    return name.partition(".")[0].lower().replace("-", "_") in MISSING


class _NotInstalled:
    """A finder whose modules fail to load, as a package that is not installed."""

    def find_spec(self, name, path=None, target=None):
        return ModuleSpec(name, self) if _missing(name) else None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise AssertionError(module)


class _NoDistribution(metadata.DistributionFinder):
    """A metadata finder that answers first, and has nothing for the missing packages."""

    def find_spec(self, name, path=None, target=None):
        return None  # it finds distributions, not modules

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and _missing(name):
            raise metadata.PackageNotFoundError(name)
        return iter(())


sys.meta_path.insert(0, _NotInstalled())
sys.meta_path.insert(0, _NoDistribution())
