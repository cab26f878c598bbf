"""Disk size of what ``pip install -e ".[EXTRA]"`` installs, read from the environment it runs in.

Walks the dependency closure of ``lightning-sparse[EXTRA]`` through the installed distributions'
metadata (``importlib.metadata``: each one's requirements, markers evaluated here) and adds up
the files each distribution installed (its ``RECORD``). It then splits off what only a CUDA
build of torch brings: the ``nvidia-*``, ``cuda-*`` and ``triton`` distributions and torch's
own CUDA libraries (``torch/lib/*cuda*``, ``*nvshmem*``). What is left is an estimate of the same
install on torch's CPU wheels (``--index-url https://download.pytorch.org/whl/cpu``): those
wheels are built separately, so their files differ somewhat from the CPU part of a CUDA wheel.

    python benchmarks/install_size.py demo     # in an environment where the extra is installed
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata

from packaging.requirements import Requirement

CUDA_ONLY = re.compile(r"^(nvidia|cuda|triton)([-_].*)?$")
CUDA_LIBRARY = re.compile(r"^torch/lib/.*(cuda|nvshmem)")


def closure(name: str, extras: set[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution ``name[extras]`` needs, by normalized name."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(name, extras)]
    while pending:
        wanted, wanted_extras = pending.pop()
        key = re.sub(r"[-_.]+", "-", wanted).lower()
        dist = metadata.distribution(wanted)
        if key in found and not wanted_extras:
            continue
        found[key] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            markers = [{"extra": extra} for extra in wanted_extras or {""}]
            if requirement.marker is None or any(
                requirement.marker.evaluate(env) for env in markers
            ):
                pending.append((requirement.name, set(requirement.extras)))
    return found


def sizes(dist: metadata.Distribution) -> tuple[int, int]:
    """Bytes of the distribution's installed files: all, and those only CUDA needs."""
    total = cuda = 0
    for file in dist.files or []:
        path = file.locate()
        size = path.stat().st_size if path.is_file() else 0
        total += size
        if CUDA_LIBRARY.match(str(file)):
            cuda += size
    return total, cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extra", help="the extra of lightning-sparse, e.g. demo")
    args = parser.parse_args()
    total = cuda = 0
    rows = []
    for key, dist in sorted(closure("lightning-sparse", {args.extra}).items()):
        size, cuda_part = sizes(dist)
        cuda_part = size if CUDA_ONLY.match(key) else cuda_part
        total, cuda = total + size, cuda + cuda_part
        rows.append((size, key, cuda_part))
    for size, key, cuda_part in sorted(rows, reverse=True)[:12]:
        print(
            f"{size / 2**20:9.0f} MiB  {key}"
            + (f"  (CUDA only: {cuda_part / 2**20:.0f} MiB)" if cuda_part else "")
        )
    print(
        f"\nlightning-sparse[{args.extra}]: {len(rows)} distributions, {total / 2**30:.2f} GiB "
        f"installed; without what only CUDA needs: {(total - cuda) / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
