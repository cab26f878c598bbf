"""Which parameters a callback sparsifies: patterns, the default heuristic, and the reasons.

Patterns are globs (``fnmatch``, ``*`` also crosses dots) or ``re:``-prefixed regular expressions
(``re.search``; anchor with ``^``/``$``). A glob matches a parameter name or any suffix of it that
starts at a dot, so ``blocks.*.mlp.fc1.weight`` matches ``model.blocks.0.mlp.fc1.weight`` in a
LightningModule that wraps the network as ``self.model``.

Without ``params``: every weight with two or more dimensions that belongs to a layer of a known
type (``nn.Linear``, ``nn.ConvNd``, Hugging Face ``Conv1D``: :mod:`~lightning_sparse.core.layers`),
except embeddings, norms, the output head (found by a forward when one is given, else by name:
:mod:`~lightning_sparse.core.head`), weights tied to an embedding, and parameters with
``requires_dense = True``. Given the schedule's phases, the default also leaves dense each layer
that cannot hold one of its N:M patterns (a ResNet stem's 3 input channels for 2:4), with the
reason, for the whole run: a group keeps one set of parameters through all its phases. Explicit
``params`` select such a layer anyway, and building the group then names it in an error.

Example:
    >>> import torch.nn as nn
    >>> from lightning_sparse.core.selection import select_parameters
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> sel = select_parameters(net)
    >>> [t.name for t in sel.targets], sel.excluded
    (['0.weight'], {'0.bias': '1-D', '2.weight': 'output head', '2.bias': '1-D'})
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    >>> sel = select_parameters(net, phases=resolve_phases([Phase(sparsity="2:4")], 10))
    >>> [t.name for t in sel.targets], sel.excluded["0.weight"]
    (['2.weight'], '6 inputs per output, not a multiple of M=4 (2:4 in phase 1)')
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_sparse.core.closest import closest
from lightning_sparse.core.head import EMBEDDING_TYPES, Calls, find_heads, is_layer
from lightning_sparse.core.layers import (
    LAYER_TYPES,
    STORED,
    LayerType,
    layer_type,
    nm_misfit,
)
from lightning_sparse.core.schedule import ResolvedPhase
from lightning_sparse.masks import NM, describe


@dataclass
class ParamTarget:
    """A selected parameter and every ``(module, attribute)`` that holds it."""

    name: str
    param: nn.Parameter
    owners: list[tuple[str, nn.Module, str]]  # (module name, module, attribute name)
    #: modules that read the parameter outside its owner's forward, and how
    readers: list[str] = field(default_factory=list)
    #: the readers read it as an attribute of its owner (``module.attr``), which a
    #: straight-through phase can make sparse (see ``backends.masked.install_sparse_attribute``)
    sparse_reads: bool = False

    @property
    def module(self) -> nn.Module:
        return self.owners[0][1]

    @property
    def module_name(self) -> str:
        return self.owners[0][0]

    @property
    def layer(self) -> LayerType:
        """How the owner computes with the parameter (the first owner of a known type)."""
        for _, module, attr in self.owners:
            found = layer_type(module, attr)
            if found is not STORED:
                return found
        return STORED

    @property
    def rows_shape(self) -> torch.Size:
        """The shape of the weight as rows (whole, also for a sharded parameter)."""
        return self.layer.to_rows(torch.empty(self.param.shape, device="meta")).shape


@dataclass
class Selection:
    """Selected parameters in model order, plus ``excluded``: name -> reason, and for a default
    selection ``heads``: output head module name -> how it was found, for the report."""

    targets: list[ParamTarget]
    excluded: dict[str, str] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)


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
    if not isinstance(patterns, Sequence):
        raise TypeError(
            f"{where}={patterns!r}: give a glob string, 're:<regex>', or a list of them"
        )
    return [_Pattern(p, f"{where}[{i}]") for i, p in enumerate(patterns)]


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module_name, module, attr))
    return owners


def _default_exclusion(
    name: str, owners: list[tuple[str, nn.Module, str]], heads: Mapping[str, str]
) -> str | None:
    """Why the default heuristic leaves a >=2-D parameter dense, or None to select it."""
    if any(isinstance(m, EMBEDDING_TYPES) for _, m, _ in owners):
        if len({id(m) for _, m, _ in owners}) > 1:
            return "tied to an embedding"
        return "embedding"
    module_name, module, attr = owners[0]
    if not is_layer(module) or attr != "weight":
        names = [t.name for t in LAYER_TYPES]
        kinds = f"{', '.join(names[:-1])} or {names[-1]}"
        return f"not a {kinds} weight ({type(module).__name__}.{attr})"
    if "norm" in type(module).__name__.lower():
        return "norm"
    parts = module_name.split(".")
    if any("embed" in part.lower() for part in parts) or name.split(".")[-2:-1] in (
        ["wte"],
        ["wpe"],
    ):
        return "embedding"
    if module_name in heads:
        return "output head"
    return None


def _misfit(target: ParamTarget, phases: Sequence[ResolvedPhase]) -> str | None:
    """Why ``target`` cannot hold the N:M pattern of one of ``phases``, or ``None``."""
    for phase in phases:
        if isinstance(phase.target, NM):
            misfit = nm_misfit(target.layer, target.param.shape, phase.target.m)
            if misfit is not None:
                return f"{misfit} ({describe(phase.target)} in phase {phase.index + 1})"
    return None


def _readers(
    modules: dict[str, nn.Module], owners: list[tuple[str, nn.Module, str]]
) -> list[str]:
    """How modules read a parameter outside its owner's forward (so a sparse forward swapped
    into the owner would never run)."""
    found = []
    for module_name, module, attr in owners:
        parent_name, _, child = module_name.rpartition(".")
        if isinstance(module, nn.MultiheadAttention):
            found.append(
                f"nn.MultiheadAttention ({module_name or 'model'}) hands {attr} to "
                f"F.multi_head_attention_forward itself"
            )
        elif (
            isinstance(modules.get(parent_name), nn.MultiheadAttention)
            and child == "out_proj"
        ):
            found.append(
                f"nn.MultiheadAttention ({parent_name or 'model'}) hands out_proj.weight to "
                f"F.multi_head_attention_forward itself and never calls out_proj"
            )
    return found


def _read_as_attribute(owners: list[tuple[str, nn.Module, str]]) -> bool:
    """Whether ``nn.MultiheadAttention`` reads the parameter as ``self.in_proj_weight`` or
    ``self.out_proj.weight`` (one attribute of one module), not as one of separate q/k/v
    weights of the same module."""
    if len(owners) != 1:
        return False
    _, module, attr = owners[0]
    if isinstance(module, nn.MultiheadAttention):
        return attr == "in_proj_weight"
    return attr == "weight"


def read_elsewhere(readers: Sequence[str]) -> str | None:
    """Why a straight-through forward cannot make a parameter with ``readers`` sparse."""
    if not readers:
        return None
    return f"{'; '.join(readers)}, so no sparse forward of its layer would ever run"


def _tied_to(name: str, model: nn.Module) -> str | None:
    """The parameter name a tied alias ``name`` (e.g. ``lm_head.weight``) stands for."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    param = module._parameters.get(attr)
    if param is None:
        return None
    return next((n for n, p in model.named_parameters() if p is param), None)


def select_parameters(
    model: nn.Module,
    params: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    phases: Sequence[ResolvedPhase] = (),
    calls: Calls | None = None,
) -> Selection:
    """Select the parameters to sparsify (see the module docstring for the rules). Without
    ``params``, ``phases`` (the group's schedule) leave dense the layers that cannot hold one
    of its N:M patterns, and ``calls`` (a recorded forward) find the output head.

    Raises:
        ValueError: a pattern in ``params`` or ``exclude`` matches no parameter; the message
            names the pattern (and, if it only matched parameters that cannot be sparsified, why).
    """
    include = compile_patterns(params, "params")
    skip = compile_patterns(exclude, "exclude")
    owners = _owners(model)
    named = list(model.named_parameters())  # deduplicated: a tied weight appears once
    heads = {} if include else find_heads(model, calls)
    modules = dict(model.named_modules(remove_duplicate=False))

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
            reason = _default_exclusion(name, owners[id(param)], heads)
        if reason is None:
            holders = owners[id(param)]
            readers = _readers(modules, holders)
            attribute = bool(readers) and _read_as_attribute(holders)
            target = ParamTarget(name, param, holders, readers, attribute)
            reason = None if include else _misfit(target, phases)
            if reason is None:
                targets.append(target)
        if reason is not None:
            excluded[name] = reason

    for pattern in include + skip:
        kind = "params" if pattern in include else "exclude"
        matched = hits[pattern.text]
        if not matched:
            aliases = {
                alias: _tied_to(alias, model)
                for alias, _ in model.named_parameters(remove_duplicate=False)
                if pattern.matches(alias)
            }
            aliases = {a: n for a, n in aliases.items() if n is not None and n != a}
            if aliases:
                alias, real = next(iter(aliases.items()))
                why = excluded.get(real, "selected")
                raise ValueError(
                    f"{kind} pattern {pattern.text!r} names {alias!r}, which is tied to "
                    f"{real!r} (one Parameter, listed once under that name; by default: "
                    f"{why}); name {real!r} instead"
                )
            raise ValueError(
                f"{kind} pattern {pattern.text!r} matches no parameter of {type(model).__name__}; "
                f"the closest names are {closest(pattern.text, (n for n, _ in named), 3, 0.0)} "
                f"(globs may match a dotted suffix; prefix a regex with 're:')"
            )
        if kind == "params" and not any(t.name in matched for t in targets):
            why = {n: excluded[n] for n in matched[:5]}
            raise ValueError(
                f"params pattern {pattern.text!r} matches only parameters that cannot be "
                f"sparsified: {why}; point it at weights with 2 or more dimensions"
            )
    return Selection(targets, excluded, heads)


def empty_selection_message(
    selection: Selection, group: str, model: str, owner: str = "SparsityCallback"
) -> str:
    """Why the group ``group`` of ``owner`` (the front end), whose phases ask for sparsity,
    selected nothing: each parameter with two or more dimensions and why it was left dense
    (1-D ones are left out)."""
    left = {n: why for n, why in selection.excluded.items() if why != "1-D"}
    lines = [f"  {n}: {why}" for n, why in list(left.items())[:12]]
    if len(left) > 12:
        lines.append(f"  ... and {len(left) - 12} more")
    found = "\n".join(lines) if lines else "  (no parameter with 2 or more dimensions)"
    return (
        f"{owner} {group!r} selects no parameter of {model}, but its phases ask for "
        f"sparsity: the run would train dense. Parameters found and why each was left "
        f"dense:\n{found}\nName the weights to sparsify with params=[...] (globs over these "
        f"names, e.g. params=['*.weight'])"
    )


def check_disjoint(
    name: str, selection: Selection, others: Sequence[tuple[str, Selection]]
) -> None:
    """Raise if a parameter of group ``name`` belongs to another group too."""
    mine = {id(t.param) for t in selection.targets}
    for other, other_selection in others:
        for t in other_selection.targets:
            if id(t.param) in mine:
                raise ValueError(
                    f"parameter {t.name!r} is claimed by SparsityCallback {other!r} and "
                    f"SparsityCallback {name!r}: give the callbacks disjoint params/exclude "
                    f"patterns (each parameter belongs to one group)"
                )
