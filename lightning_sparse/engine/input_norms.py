"""Input norms for data-aware masks (Wanda): forward hooks on the selected layers.

:class:`InputNorms` hooks the layer of every target (each of its owners, for a shared weight),
sums the squares of the input features each weight entry multiplies while it is open (see
:attr:`~lightning_sparse.core.layers.LayerType.input_squares`: features of a Linear or
Conv1D, unfolded patches of a convolution), and on :meth:`InputNorms.result` sums them over
the ranks (one all-reduce, so every rank gets the same norms) and returns, per parameter, the
root mean square of each input feature over the calibration inputs, shaped to broadcast against
the weight's rows. ``|rows| * norm`` is then Wanda's score ``|W_ij| * ||X_j||_2`` up to a factor
per layer (``1 / sqrt(count)``), which changes no comparison within a layer and keeps layers fed
different numbers of inputs comparable for the ``global`` distribution.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_sparse.core.selection import select_parameters
    >>> net = nn.Linear(2, 3)
    >>> with InputNorms(select_parameters(net, params=["weight"]).targets) as norms:
    ...     _ = net(torch.tensor([[3.0, 0.0], [4.0, 1.0]]))
    >>> norms.result()["weight"]  # sqrt((9 + 16) / 2), sqrt(1 / 2)
    tensor([[3.5355, 0.7071]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Self  # a dependency of torch

from lightning_sparse.core.selection import ParamTarget
from lightning_sparse.engine.ranks import sum_over_ranks


def input_norms_unsupported(target: ParamTarget) -> str | None:
    """Why a hook cannot see the inputs ``target``'s weight multiplies, or ``None``."""
    if target.layer.input_squares is None:
        return (
            f"it is read as a {target.layer.name} (stored {target.layer.stored}), whose inputs "
            f"a forward hook does not see"
        )
    return None


class InputNorms:
    """Forward hooks that gather each target's input norms while the context is open."""

    def __init__(self, targets: Sequence[ParamTarget]) -> None:
        self.targets = list(targets)
        self.sums: dict[str, Tensor | None] = dict.fromkeys(
            (t.name for t in self.targets), None
        )
        self.counts: dict[str, int] = dict.fromkeys(self.sums, 0)
        self._handles: list[Any] = []

    def __enter__(self) -> Self:
        for t in self.targets:
            reason = input_norms_unsupported(t)
            if reason is not None:
                raise ValueError(f"input norms of parameter {t.name!r}: {reason}")
            for _, module, _ in t.owners:
                self._handles.append(
                    module.register_forward_pre_hook(self._hook(t), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, t: ParamTarget) -> Any:
        square_sums = t.layer.input_squares
        assert square_sums is not None

        @torch.no_grad()
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            input = args[0] if args else next(iter(kwargs.values()))
            sums, count = square_sums(module, input)
            total = self.sums[t.name]
            self.sums[t.name] = sums if total is None else total + sums
            self.counts[t.name] += count

        return hook

    @torch.no_grad()
    def result(self) -> dict[str, Tensor]:
        """Per parameter name, the root mean square of each input feature over every input
        seen on every rank (a collective when ``torch.distributed`` is initialized: call it on
        every rank). Raises if a layer saw no input (its forward never ran)."""
        device = self.targets[0].param.device if self.targets else torch.device("cpu")
        idle = [name for name, sums in self.sums.items() if sums is None]
        (flag,) = sum_over_ranks([torch.tensor([float(len(idle))], device=device)])
        if flag.item():  # on every rank, so that no rank waits in the reduction below
            raise ValueError(
                f"no input reached the layers of parameters {idle[:5]} during the calibration "
                f"forwards (on some rank): the model reads them without calling their layer, "
                f"or does not use them; exclude them or use init='topk'"
            )
        sums = {name: s for name, s in self.sums.items() if s is not None}
        counts = torch.tensor([float(n) for n in self.counts.values()], device=device)
        # one collective for every layer
        *parts, totals = sum_over_ranks(
            [*(s.to(device) for s in sums.values()), counts]
        )
        return {
            name: (part / totals[i]).sqrt()
            for i, (name, part) in enumerate(zip(sums, parts))
        }
