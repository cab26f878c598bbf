"""The ``lightning-sparse`` command: answers ``--help`` and ``--version`` at once, and chooses
how OpenMP threads wait before torch loads; the subcommands run :mod:`lightning_sparse.cli.main`.

torch and Lightning take seconds to import, and the subcommands need them; the tool's own help
and version do not, so this module imports neither (``lightning-sparse fit --help`` lists a
subcommand's options through LightningCLI, after those imports).

On a machine that other processes keep busy, torch's OpenMP threads spin while they wait for
each other, on the cores the others need: a run of the CPU demo took 5x as long beside two busy
processes, 2x with threads that sleep instead. So when the load average says at least one core
is busy and the environment sets no wait policy, the command sets ``OMP_WAIT_POLICY=PASSIVE``
before torch loads, and says so. The thread count stays as it is, and so do the results, bit
for bit; an idle machine keeps the spinning threads, which are faster there.

Example:
    >>> wait_policy(load=2.6, environ={})
    'PASSIVE'
    >>> wait_policy(load=0.2, environ={}) is None
    True
    >>> wait_policy(load=2.6, environ={"OMP_WAIT_POLICY": "ACTIVE"}) is None
    True
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence

from lightning_sparse import __version__

HELP = """\
usage: lightning-sparse [-h] [--version] {fit,validate,plan} --config RECIPE.yaml [...]

Sparse training on a schedule for PyTorch Lightning: a LightningCLI whose recipes add a
SparsityCallback (masks, N:M and 2:4 sparsity, phases such as "2:4 for 70% of the steps, then
dense") to any LightningModule and LightningDataModule named by class_path.

subcommands:
  fit        train a recipe; ends with each group's summary, the validation metrics and
             the wall time
  validate   run a recipe's validation loop (--ckpt_path: the weights of a checkpoint)
  plan       dry run on any machine, without data or a GPU: what each SparsityCallback
             would sparsify, its backends (--gpu h100: predicted for that GPU), the FLOPs
             saved, and a plot of the schedule

options:
  -h, --help  show this message
  --version   show the version

Examples:
  lightning-sparse fit --config recipes/vit/cpu_demo.yaml
  lightning-sparse plan --config recipes/dinov2/vitl14_24_70pct.yaml --gpu h100
  lightning-sparse fit --config base.yaml --config recipes/overlays/sparsity_24_70pct.yaml

'lightning-sparse SUBCOMMAND --help' lists a subcommand's options (it loads torch and
Lightning first). Docs: docs/cli.md.
"""


def wait_policy(load: float | None, environ: Mapping[str, str]) -> str | None:
    """The ``OMP_WAIT_POLICY`` to set: ``"PASSIVE"`` when other processes keep at least one
    core busy (a 1-minute ``load`` average of 1 or more; ``None``: not known) and ``environ``
    chooses no wait policy (``OMP_WAIT_POLICY``, or libgomp's ``GOMP_SPINCOUNT``), else
    ``None`` (OpenMP's default: spin). torch runs a thread on every core, so one busy core is
    enough for the others to wait on a thread that lost its core."""
    chosen = "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ
    if chosen or load is None or load < 1.0:
        return None
    return "PASSIVE"


def _load_and_cores() -> tuple[float | None, int]:
    """The 1-minute load average (``None`` where the system has none) and the cores this
    process may run on."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1
    )
    return load, cores


def main(args: Sequence[str] | None = None) -> None:
    """The ``lightning-sparse`` command (``args``: the command line, default ``sys.argv``)."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, end="")
        return
    if argv[0] == "--version":
        print(f"lightning-sparse {__version__}")
        return
    choose_wait_policy()
    # the subcommands import torch and Lightning: only now, after the answers above
    importlib.import_module("lightning_sparse.cli.main").main(args)


def choose_wait_policy() -> None:
    """Set this process's ``OMP_WAIT_POLICY`` to what :func:`wait_policy` says for this
    machine now, and say so on stderr; to be called before torch loads, which is when its
    OpenMP threads read it."""
    load, cores = _load_and_cores()
    policy = wait_policy(load, os.environ)
    if policy is None:
        return
    os.environ["OMP_WAIT_POLICY"] = policy
    print(
        f"lightning-sparse: the load average ({load:.1f} on {cores} cores) says other "
        f"processes keep cores busy, so OpenMP threads will sleep instead of spinning "
        f"while they wait (OMP_WAIT_POLICY={policy}: same thread count, same results); "
        f"set OMP_WAIT_POLICY=ACTIVE to keep them spinning",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
