"""Which parameters a callback sparsifies: patterns, the default heuristic, and the reasons.

Patterns are globs (``fnmatch``, ``*`` also crosses dots) or ``re:``-prefixed regular expressions
(``re.search``; anchor with ``^``/``$``). A glob matches a parameter name or any suffix of it that
starts at a dot, so ``blocks.*.mlp.fc1.weight`` matches ``model.blocks.0.mlp.fc1.weight`` in a
LightningModule that wraps the network as ``self.model``.

Without ``params``: every weight with two or more dimensions that belongs to a Linear or Conv
layer, except embeddings, norms, the output head, weights tied to an embedding, and parameters
with ``requires_dense = True``.

Example:
    >>> import torch.nn as nn
    >>> from lightning_sparse.core.selection import select_parameters
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> sel = select_parameters(net)
    >>> [t.name for t in sel.targets], sel.excluded
    (['0.weight'], {'0.bias': '1-D', '2.weight': 'output head', '2.bias': '1-D'})
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
_HEAD_NAMES = {"head", "lm_head", "classifier", "output", "fc_out", "output_layer"}


@dataclass
class ParamTarget:
    """A selected parameter and every ``(module, attribute)`` that holds it."""

    name: str
    param: nn.Parameter
    owners: list[tuple[str, nn.Module, str]]  # (module name, module, attribute name)

    @property
    def module(self) -> nn.Module:
        return self.owners[0][1]

    @property
    def module_name(self) -> str:
        return self.owners[0][0]


@dataclass
class Selection:
    """Selected parameters in model order, plus ``excluded``: name -> reason, for the report."""

    targets: list[ParamTarget]
    excluded: dict[str, str] = field(default_factory=dict)


class _Pattern:
    def __init__(self, text: str, where: str) -> None:
        if not isinstance(text, str) or not text:
            raise TypeError(
                f"{where}: {text!r} is not a pattern; use a glob string or 're:<regex>'"
            )
        self.text = text
        if text.startswith("re:"):
            try:
                self._regex: re.Pattern[str] | None = re.compile(text[3:])
            except re.error as err:
                raise ValueError(
                    f"{where}: {text!r} is not a valid regular expression: {err}"
                ) from None
        else:
            self._regex = None

    def matches(self, name: str) -> bool:
        if self._regex is not None:
            return self._regex.search(name) is not None
        parts = name.split(".")
        return any(
            fnmatch.fnmatchcase(".".join(parts[i:]), self.text)
            for i in range(len(parts))
        )


def compile_patterns(
    patterns: str | Sequence[str] | None, where: str
) -> list[_Pattern]:
    """Validate patterns eagerly (at callback construction)."""
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    return [_Pattern(p, f"{where}[{i}]") for i, p in enumerate(patterns)]


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module_name, module, attr))
    return owners


def _default_exclusion(
    name: str, owners: list[tuple[str, nn.Module, str]], last_layer: str | None
) -> str | None:
    """Why the default heuristic leaves a >=2-D parameter dense, or None to select it."""
    if any(isinstance(m, _EMBEDDING_TYPES) for _, m, _ in owners):
        if len({id(m) for _, m, _ in owners}) > 1:
            return "tied to an embedding"
        return "embedding"
    module_name, module, attr = owners[0]
    if not isinstance(module, _LAYER_TYPES) or attr != "weight":
        return f"not a Linear/Conv weight ({type(module).__name__}.{attr})"
    if "norm" in type(module).__name__.lower():
        return "norm"
    parts = module_name.split(".")
    if any("embed" in part.lower() for part in parts) or name.split(".")[-2:-1] in (
        ["wte"],
        ["wpe"],
    ):
        return "embedding"
    if parts[-1] in _HEAD_NAMES or module_name == last_layer:
        return "output head"
    return None


def select_parameters(
    model: nn.Module,
    params: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
) -> Selection:
    """Select the parameters to sparsify (see the module docstring for the rules).

    Raises:
        ValueError: a pattern in ``params`` or ``exclude`` matches no parameter; the message
            names the pattern (and, if it only matched parameters that cannot be sparsified, why).
    """
    include = compile_patterns(params, "params")
    skip = compile_patterns(exclude, "exclude")
    owners = _owners(model)
    named = list(model.named_parameters())  # deduplicated: a tied weight appears once
    layers = [n for n, m in model.named_modules() if isinstance(m, _LAYER_TYPES)]
    last_layer = layers[-1] if layers else None

    hits: dict[str, list[str]] = {p.text: [] for p in include + skip}
    targets: list[ParamTarget] = []
    excluded: dict[str, str] = {}
    for name, param in named:
        matched_include = [p for p in include if p.matches(name)]
        matched_skip = [p for p in skip if p.matches(name)]
        for p in matched_include + matched_skip:
            hits[p.text].append(name)
        reason: str | None
        if getattr(param, "requires_dense", False):
            reason = "requires_dense"
        elif param.ndim < 2:
            reason = "1-D"
        elif matched_skip:
            reason = f"excluded by {matched_skip[0].text!r}"
        elif include:
            reason = None if matched_include else "not matched by params"
        else:
            reason = _default_exclusion(name, owners[id(param)], last_layer)
        if reason is None:
            targets.append(ParamTarget(name, param, owners[id(param)]))
        else:
            excluded[name] = reason

    for pattern in include + skip:
        kind = "params" if pattern in include else "exclude"
        matched = hits[pattern.text]
        if not matched:
            raise ValueError(
                f"{kind} pattern {pattern.text!r} matches no parameter of {type(model).__name__}; "
                f"parameter names look like {[n for n, _ in named[:3]]} (globs may match a "
                f"dotted suffix; prefix a regex with 're:')"
            )
        if kind == "params" and not any(t.name in matched for t in targets):
            why = {n: excluded[n] for n in matched[:5]}
            raise ValueError(
                f"params pattern {pattern.text!r} matches only parameters that cannot be "
                f"sparsified: {why}; point it at weights with 2 or more dimensions"
            )
    return Selection(targets, excluded)
