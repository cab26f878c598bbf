"""The ``lightning-sparse`` command: answers ``--help`` and ``--version`` at once, and chooses
how OpenMP threads wait before torch loads; the subcommands run :mod:`lightning_sparse.cli.main`.

torch and Lightning take seconds to import, and the subcommands need them; the tool's own help
and version do not, so this module imports neither (``lightning-sparse fit --help`` lists a
subcommand's options through LightningCLI, after those imports).

On a machine that other processes keep busy, torch's OpenMP threads spin while they wait for
each other, on the cores the others need. So when the load average says at least one core is
busy and the environment sets no wait policy, the command sets ``OMP_WAIT_POLICY=PASSIVE``
before torch loads, and says so (:func:`lightning_sparse.openmp.choose_wait_policy`). The
thread count stays as it is, and so do the results, bit for bit; an idle machine keeps the
spinning threads, which are faster there.

Example:
    >>> HELP.splitlines()[0]
    'usage: lightning-sparse [-h] [--version] {fit,validate,plan} --config RECIPE.yaml [...]'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from lightning_sparse import __version__
from lightning_sparse.openmp import choose_wait_policy

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


if __name__ == "__main__":
    main()
