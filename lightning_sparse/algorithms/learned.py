"""``learned``: N:M masks learned end to end (MaskLLM, Fang et al., NeurIPS 2024).

Every group of ``M`` weights along a layer's inputs keeps one logit per candidate pattern
(:mod:`~lightning_sparse.masks.candidates`: 6 for 2:4). A training forward multiplies the weight
by a differentiable sample of the patterns, ``softmax((scale * logits + gumbel) / temperature)``
averaged over the pattern table (soft, MaskLLM's choice; ``hard: true`` takes the sampled pattern
with the soft gradient, straight-through Gumbel), so the loss trains the logits; an evaluation
forward uses each group's most likely pattern, a valid N:M mask. The temperature and the logit
scale anneal linearly over the phase (MaskLLM: 4 to 0.05 and 100 to 500), so the samples harden
toward that most likely pattern, which the next sparse phase starts from.

The logits start from a prior mask (``init``: magnitude by default, or ``wanda``): small random
logits plus ``prior_strength`` times their standard deviation for every weight a candidate keeps
in common with the prior (at the default strength of 3, the noise puts about 6% of the groups
on another pattern than the prior's, as MaskLLM's initialisation does). They train with an Adam
optimizer of their own (``mask_lr``), stepped once per training step of the run; a sparse-weight
regulariser (``weight_reg``, decaying linearly to zero over the phase) adds the gradient of
``-weight_reg * sum(|W * mask|^2)``, which favours patterns that keep large weights (MaskLLM's remedy for vanishing gradients). The Gumbel
noise of a layer is drawn from ``(seed, parameter name, step)``, identical on every rank, for
every micro-batch of a step and after a resume.

With ``transposable`` on (2:4 only), the mask the next phase starts from is transposable (2:4
along the rows and the columns of every 4x4 tile), so a ``static`` phase after it can run on the
2:4 kernels: ``tiles`` learns logits over the 90 transposable 4x4 tiles
(:mod:`~lightning_sparse.masks.tile_candidates`: 90 logits per 16 weights instead of 6 per 4,
3.75x the memory), so every mask it samples is transposable; ``project`` learns the 6-pattern
form and, at the handover, takes per tile the transposable tile whose 4 rows' logits sum highest
(exact over the 90), counting the groups that moved (:attr:`Learned.projected`). Both start from
a transposable prior (the best transposable mask by the ``init`` score), so that the projection
moves only the groups the learning moved off it. A weight
without 4x4 tiles (a convolution, a dimension not a multiple of 4) learns and hands over N:M
groups either way.

The algorithm is a rule over rows (each weight as its layer computes, inputs last), like every
algorithm: it never touches modules or optimizers of the model. The engine
(:mod:`~lightning_sparse.engine.learning`) installs its forwards, averages its gradients over
ranks, steps it, freezes the weights (``train_weights: false``) and saves its state.

Example:
    >>> import torch
    >>> from lightning_sparse.core.schedule import Phase, resolve_phases
    >>> from lightning_sparse.algorithms import MaskContext, build_algorithm
    >>> phase = resolve_phases([Phase(sparsity="2:4", algorithm="learned")], total_steps=10)[0]
    >>> algo = build_algorithm(phase)
    >>> w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    >>> prior = algo.initial_mask(w, phase.target, MaskContext("w", 0, 0))
    >>> algo.begin(0, {"w": prior})
    >>> changed, groups, entropy = algo.statistics("w")  # the initial noise moves a few groups
    >>> groups, round(changed / groups, 2), algo.most_likely("w").shape
    (1024, 0.06, torch.Size([64, 64]))
    >>> soft = algo.sample("w", training=True)
    >>> bool(soft.requires_grad), algo.temperature_at(0), algo.temperature_at(10)
    (True, 4.0, 0.05)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.algorithms.base import (
    UNKNOWN_RUN,
    RunLength,
    SparsityAlgorithm,
    best_tiles,
    register_algorithm,
)
from lightning_sparse.core.schedule import Phase, ResolvedPhase
from lightning_sparse.masks import NM, Sparsity, name_seed
from lightning_sparse.masks.candidates import (
    candidate_count,
    candidate_patterns,
    candidates_unsupported,
    pattern_indices,
    patterns_to_mask,
)
from lightning_sparse.masks.tile_candidates import (
    TILE_CANDIDATES,
    as_tiles,
    from_tiles,
    project_to_tiles,
    tile_candidates,
    tile_indices,
    tiles_to_mask,
)
from lightning_sparse.masks.tiles import has_4x4_tiles

INIT_STD = 0.01
"""Standard deviation of the random logits a phase starts from (before the logit scale), as
MaskLLM draws them; ``prior_strength`` counts in these units."""


@dataclass(frozen=True)
class Anneal:
    """A value that goes linearly from ``start`` (at the phase start) to ``end`` (at its end)."""

    start: float
    end: float

    def at(self, progress: float) -> float:
        return self.start * (1.0 - progress) + self.end * progress  # exact at both ends


DEFAULTS: dict[str, Any] = {
    "temperature": Anneal(4.0, 0.05),
    "logit_scale": Anneal(100.0, 500.0),
    "prior_strength": 3.0,
    "mask_lr": 5e-4,
    "weight_reg": 1e-5,
    "hard": False,
    "train_weights": True,
    "transposable": False,
}
"""The options' defaults: MaskLLM's for LLaMA-2 7B (temperature 4 to 0.05, logit scale 100 to
500, prior strength 3, sparse-weight regulariser 1e-5; its learning rate 5e-5 with a 10x
multiplier for the mask, read as 5e-4), except that the weights train (``train_weights``);
the masks handed over are not transposable unless ``transposable`` says how."""

TRANSPOSABLE_FORMS = ("tiles", "project")
"""The ways a learned phase hands over transposable 2:4 masks (option ``transposable``)."""

RECOMMENDED_FORM = "project"
"""What ``transposable: true`` means: the form measured best (docs/benchmarks.md)."""


class Unsplit:
    """Which of a weight's units (N:M groups or 4x4 tiles, in row order) the logits here
    learn, and how the learners' shares become whole: here every unit, with nothing to
    gather. A distributed run splits them over its ranks
    (:class:`~lightning_sparse.engine.logit_shards.RankShards`).

    Example:
        >>> Unsplit().owned(6), Unsplit().sum([2.0, 1.0])
        (slice(0, 6, None), [2.0, 1.0])
    """

    splits = False  #: whether the units are split over more than one learner

    def owned(self, units: int) -> slice:
        """The units, of a weight's ``units``, that the logits here learn."""
        return slice(0, units)

    def gather(
        self, local: Tensor, units: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Every learner's ``local`` values (one row per owned unit) as the whole
        ``(units, ...)``, in ``dtype`` (``None``: as they are), differentiable."""
        return local if dtype is None else local.to(dtype)

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over the learners."""
        return list(values)


@register_algorithm("learned")
class Learned(SparsityAlgorithm):
    """Learned N:M masks: logits over every group's candidate patterns, trained end to end
    through Gumbel-softmax samples (see the module docstring for the method).

    Options (all optional): ``temperature`` and ``logit_scale`` (a number, or ``[start, end]``
    annealed linearly over the phase), ``prior_strength`` (>= 0), ``mask_lr`` (> 0, the logits'
    Adam learning rate), ``weight_reg`` (>= 0), ``hard`` (straight-through Gumbel samples
    instead of soft ones), ``train_weights`` (``true``: the selected weights train with the
    gradient of the masked product; ``"dense"``: with the dense gradient, straight-through;
    ``false``: they stay as they are, MaskLLM's setting), ``transposable`` (2:4: ``tiles``,
    ``project``, ``true`` for the recommended form, or ``false``: the mask handed over is
    transposable 2:4, see the module docstring), ``init`` (the prior: ``topk``, ``wanda``,
    ``random``, ``from_zeros``) and ``seed``.

    Example:
        >>> from lightning_sparse import SparsityCallback
        >>> cb = SparsityCallback(phases=[
        ...     {"sparsity": "2:4", "algorithm": "learned", "until": 0.3, "train_weights": False},
        ...     {"sparsity": "2:4", "algorithm": "static"},
        ... ])
    """

    straight_through = True  # stored weights stay dense; the forward masks them
    learns = True
    option_names = frozenset({"init", "seed", "calibration_batches", *DEFAULTS})

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        # no masked decay: the logits, not the weights' magnitudes, choose the mask
        return cls.option_names

    @classmethod
    def validate(cls, spec: Phase, where: str) -> None:
        super().validate(spec, where)
        target = cls.require_nm(
            spec,
            where,
            "learns which N of every M weights to keep",
            "use an N:M sparsity such as sparsity: '2:4'",
        )
        problem = candidates_unsupported(target)
        if problem is not None:
            raise ValueError(
                f"{where}: algorithm 'learned' cannot learn sparsity '{target}': "
                f"{problem}; use M <= 8, or algorithm 'runtime' for '{target}'"
            )
        _options(spec, where)

    def __init__(self, phase: ResolvedPhase, run: RunLength = UNKNOWN_RUN) -> None:
        super().__init__(phase, run)
        where = f"phases[{phase.index}]"
        if phase.end is None:
            raise ValueError(
                f"{where}: algorithm 'learned' anneals its temperature and logit scale over "
                f"the phase, which has no end here: give the phase an 'until', or "
                f"{run.advice}"
            )
        options = _options(phase.spec, where)
        self.temperature: Anneal = options["temperature"]
        self.logit_scale: Anneal = options["logit_scale"]
        self.prior_strength: float = options["prior_strength"]
        self.mask_lr: float = options["mask_lr"]
        self.weight_reg: float = options["weight_reg"]
        self.hard: bool = options["hard"]
        self.train_weights: bool | str = options["train_weights"]
        self.transposable: str | bool = options["transposable"]
        assert isinstance(phase.target, NM)
        self.target: NM = phase.target
        self.step = phase.start  #: the optimizer step the forwards belong to
        self.logits: dict[str, Tensor] = {}  #: (groups, candidates) fp32 per parameter
        self.prior: dict[str, Tensor] = {}  #: the prior's pattern index per group
        self.shapes: dict[str, torch.Size] = {}  #: each weight as rows
        self.tiled: set[str] = set()  #: the parameters whose logits are per 4x4 tile
        #: per parameter handed over by ``project``: the groups the projection changed
        self.projected: dict[str, int] = {}
        self.optimizer: torch.optim.Adam | None = None
        #: the units each weight's logits learn here; the engine splits them over the ranks
        self.shards: Unsplit = Unsplit()
        self.owned: dict[str, slice] = {}  #: per parameter, the units its logits hold
        self._likely: dict[str, Tensor] = {}  # most likely masks, until the next step

    # -- the schedule ---------------------------------------------------------------------------
    def progress(self, step: int) -> float:
        """How far into the phase ``step`` is: 0 at its first step, 1 at its end."""
        assert self.phase.end is not None
        return (step - self.phase.start) / (self.phase.end - self.phase.start)

    def temperature_at(self, step: int) -> float:
        """The Gumbel-softmax temperature of the forwards of optimizer step ``step``."""
        return self.temperature.at(self.progress(step))

    def logit_scale_at(self, step: int) -> float:
        """What the logits are multiplied by in the forwards of optimizer step ``step``."""
        return self.logit_scale.at(self.progress(step))

    def weight_reg_at(self, step: int) -> float:
        """The sparse-weight regulariser's factor at ``step``: ``weight_reg``, decaying
        linearly to zero at the phase end, as MaskLLM removes it."""
        return self.weight_reg * (1.0 - self.progress(step))

    # -- masks ----------------------------------------------------------------------------------
    def nm_layout(self, like: Tensor, target: NM) -> str | None:
        # the prior and the learned patterns: transposable tiles with ``tiles`` where they fit
        return "tiles" if self.learns_tiles(like.shape) else "groups"

    def select(self, score: Tensor, target: Sparsity) -> Tensor:
        # the prior is transposable wherever the handover is (``project`` too), so that
        # learning starts from the best transposable mask and the projection moves few groups
        if isinstance(target, NM) and self.hands_over_tiles(score.shape):
            return best_tiles(score)
        return super().select(score, target)

    def learns_tiles(self, shape: torch.Size) -> bool:
        """Whether a weight whose rows have ``shape`` learns logits per 4x4 tile."""
        return self.transposable == "tiles" and _has_tiles(shape)

    def hands_over_tiles(self, shape: torch.Size) -> bool:
        """Whether the mask handed to the next phase for rows of ``shape`` is transposable."""
        return bool(self.transposable) and _has_tiles(shape)

    def logit_count(self, shape: torch.Size) -> tuple[int, int]:
        """``(units, candidates)`` of the logits of a weight whose rows have ``shape``: 4x4
        tiles and 90 transposable tiles each, or N:M groups and ``C(M, N)`` patterns each."""
        if self.learns_tiles(shape):
            return math.prod(shape) // 16, TILE_CANDIDATES
        return math.prod(shape) // self.target.m, candidate_count(self.target)

    def _table(self, name: str, device: torch.device) -> Tensor:
        """The bool candidate table of ``name``: ``(90, 16)`` tiles or ``(C, M)`` patterns."""
        if name in self.tiled:
            return tile_candidates(device)
        return candidate_patterns(self.target, device)

    def begin(self, step: int, priors: Mapping[str, Tensor]) -> None:
        """Start learning at ``step`` from ``priors`` (bool N:M masks as rows, by parameter
        name, on their weights' devices): small random logits, seeded by the phase's seed and
        the parameter name, plus ``prior_strength * INIT_STD`` for every kept weight a
        candidate shares with its group's (or, learning tiles, its tile's) prior, kept for the
        units :attr:`shards` gives here. Learning tiles, a prior that is not transposable
        becomes, per tile, the transposable tile that keeps most of it."""
        self.step = step
        logits = {}
        for name, mask in priors.items():
            self.shapes[name] = mask.shape
            owned = self.owned[name] = self.shards.owned(self._units(name))
            if self.learns_tiles(mask.shape):
                self.tiled.add(name)
                # a prior handed over by a learned phase may be row-wise only: start from
                # the transposable mask that keeps most of it (itself if transposable)
                prior = tile_indices(best_tiles(mask.float()))
            else:
                prior = pattern_indices(mask, self.target)
            table = self._table(name, torch.device("cpu")).float()  # (C, M) or (90, 16)
            gen = torch.Generator().manual_seed(name_seed(self.seed, f"{name}|logits"))
            noise = torch.randn(prior.numel(), len(table), generator=gen) * INIT_STD
            overlap = table[prior.cpu()] @ table.T  # (units, C): kept weights in common
            init = noise + self.prior_strength * INIT_STD * overlap
            logits[name] = init[owned].to(mask.device)
            self.prior[name] = prior[owned].to(torch.uint8)
        self._start(logits)

    def _start(self, logits: Mapping[str, Tensor]) -> None:
        self.logits = {
            name: value.detach().float().requires_grad_(True)
            for name, value in logits.items()
        }
        self.optimizer = torch.optim.Adam(list(self.logits.values()), lr=self.mask_lr)
        self._likely.clear()

    def parameters(self) -> Iterator[Tensor]:
        """The trainable logits, in parameter order."""
        return iter(self.logits.values())

    def _units(self, name: str) -> int:
        """How many units (groups or tiles) the whole weight ``name`` has."""
        return self.logit_count(self.shapes[name])[0]

    def as_units(self, name: str, rows: Tensor) -> Tensor:
        """``rows`` (shaped like ``name``'s weight as rows) as one row per unit: ``(tiles,
        16)`` for logits per 4x4 tile, else ``(groups, M)``, in the logits' order."""
        if name in self.tiled:
            return as_tiles(rows)
        return rows.reshape(-1, self.target.m)

    def _from_units(self, name: str, units: Tensor) -> Tensor:
        """One row per unit back as ``name``'s weight as rows."""
        if name in self.tiled:
            return from_tiles(units, self.shapes[name])
        return units.reshape(self.shapes[name])

    def _kept(self, name: str) -> Tensor:
        """The Gumbel sample of the units ``name``'s logits hold here: per unit, the kept
        fraction of each of its weights, ``(owned units, M or 16)`` float32, differentiable in
        the logits, computed in float32 under autocast too. The noise is drawn for the whole
        weight, so that it does not depend on how the units are split."""
        logits = self.logits[name]
        gen = torch.Generator(device=logits.device).manual_seed(
            name_seed(self.seed, f"{name}|gumbel", self.step)
        )
        whole = (self._units(name), logits.shape[1])
        exponential = torch.empty(
            whole, dtype=logits.dtype, device=logits.device
        ).exponential_(generator=gen)[self.owned[name]]
        gumbel = -exponential.clamp_min_(torch.finfo(logits.dtype).tiny).log()
        with torch.autocast(logits.device.type, enabled=False):
            scaled = logits * self.logit_scale_at(self.step) + gumbel
            weights = F.softmax(
                scaled / self.temperature_at(self.step), dim=-1
            )  # (G, C)
            if self.hard:
                one_hot = F.one_hot(weights.argmax(-1), weights.shape[-1])
                weights = one_hot.to(weights.dtype) - weights.detach() + weights
            return weights @ self._table(name, logits.device).to(weights.dtype)

    def sample(
        self, name: str, training: bool, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The mask ``name``'s forward multiplies its weight (rows) by, in ``dtype`` (``None``:
        float32): in training, a Gumbel sample at this step's temperature and logit scale,
        differentiable in the logits (soft, or with ``hard`` the sampled pattern
        straight-through), gathered whole from the learners' units (:attr:`shards`);
        otherwise the most likely pattern (a 0/1 mask)."""
        if not training:
            return self.most_likely(name).to(dtype or torch.float32)
        kept = self.shards.gather(self._kept(name), self._units(name), dtype)
        return self._from_units(name, kept)

    def most_likely(self, name: str) -> Tensor:
        """Each group's most likely pattern (the largest logit) as a bool mask (rows), whole
        (gathered from the learners' units); what evaluation forwards use, what checkpoints
        and exports hold, and what the next phase starts from. Ties go to the first
        pattern."""
        mask = self._likely.get(name)
        if mask is None:
            best = self.logits[name].detach().argmax(-1).to(torch.uint8)
            whole = self.shards.gather(best, self._units(name)).long()
            mask = self._likely[name] = self._to_mask(name, whole)
        return mask

    def _to_mask(self, name: str, indices: Tensor) -> Tensor:
        """The bool mask (rows) of ``name`` whose tiles or groups keep candidates ``indices``."""
        if name in self.tiled:
            return tiles_to_mask(indices, self.shapes[name])
        return patterns_to_mask(indices, self.target, self.shapes[name])

    def handover(self, name: str) -> Tensor:
        """The mask (rows) the next phase starts from: the most likely one, transposable
        with ``tiles``; with ``project``, per 4x4 tile the transposable tile whose rows'
        logits sum highest (over the whole logits, gathered), the groups it changed counted
        in :attr:`projected`."""
        mask = self.most_likely(name)
        shape = self.shapes[name]
        if self.transposable != "project" or not _has_tiles(shape):
            return mask
        logits = self.shards.gather(self.logits[name].detach(), self._units(name))
        projected = tiles_to_mask(project_to_tiles(logits, shape), shape)
        moved = (projected != mask).reshape(-1, self.target.m).any(-1)
        self.projected[name] = int(moved.sum())
        return projected

    # -- learning -------------------------------------------------------------------------------
    def learn(self, step: int, weights: Mapping[str, Tensor] | None = None) -> None:
        """One optimizer step of the logits with their accumulated (and, in a distributed
        run, averaged) gradients: first the sparse-weight regulariser's gradient for
        ``weights`` (whole rows, as the forwards of ``step`` saw them, each read once; needed
        when ``weight_reg`` is set), then Adam, then the gradients are cleared."""
        assert self.optimizer is not None
        factor = self.weight_reg_at(step)
        if factor > 0 and weights is not None:
            with torch.enable_grad():
                for name in self.logits:
                    rows = weights[name].detach().float()
                    mine = self.as_units(name, rows)[self.owned[name]]
                    kept = (mine.square() * self._kept(name)).sum()
                    (-factor * kept).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._likely.clear()

    def skip(self) -> None:
        """Drop the accumulated gradients without a step (a step the run skips)."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def statistics(self, name: str) -> tuple[int, int, float]:
        """``(groups whose most likely pattern differs from the prior's, groups, mean pattern
        entropy in nats)`` of parameter ``name``, over the whole weight (summed over the
        learners); the patterns' distribution is ``softmax(logit_scale * logits)`` at the
        current step, which hard Gumbel samples follow (the entropy of a uniform one is
        ``ln C(M, N)``: 1.79 for 2:4)."""
        logits = self.logits[name].detach()
        log_p = F.log_softmax(logits * self.logit_scale_at(self.step), dim=-1)
        entropy = float(-(log_p.exp() * log_p).sum(-1).double().sum())
        best, prior = logits.argmax(-1), self.prior[name].long()
        if name not in self.tiled:
            moved = best != prior
        else:  # per tile: the groups (tile rows) whose pattern left the prior's
            table = self._table(name, logits.device)
            moved = (table[best] != table[prior]).view(-1, 4, 4).any(-1)
        changed, groups, entropy = self.shards.sum(
            [float(moved.sum()), float(moved.numel()), entropy]
        )
        # per group: a tile's entropy is spread over its 4 groups
        return int(changed), int(groups), entropy / max(groups, 1)

    def release(self) -> None:
        """Free the logits and their optimizer (the phase is over)."""
        self.logits, self.prior, self._likely, self.owned = {}, {}, {}, {}
        self.tiled = set()
        self.optimizer = None

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The logits, the prior's patterns and the Adam state, whole (gathered from the
        learners' units, one parameter at a time: a collective where :attr:`shards` splits
        them), on the CPU (plain tensors and values, readable with
        ``torch.load(weights_only=True)``), so that a state resumes on any number of ranks."""
        assert self.optimizer is not None
        names = list(self.logits)

        def whole(name: str, value: Tensor) -> Tensor:
            return self.shards.gather(value.detach(), self._units(name)).to("cpu")

        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            index: {
                key: whole(names[index], value) if _per_unit(value) else value
                for key, value in state.items()
            }
            for index, state in optimizer["state"].items()
        }
        return {
            "logits": {n: whole(n, v).clone() for n, v in self.logits.items()},
            "prior": {n: whole(n, v).clone() for n, v in self.prior.items()},
            "optimizer": _to_cpu(optimizer),
        }

    def check_state(
        self,
        state: Any,
        shapes: Mapping[str, torch.Size],
        devices: Mapping[str, torch.device],
    ) -> dict[str, Any]:
        """:meth:`state_dict`'s output read back for weights of ``shapes`` (rows, by name) on
        ``devices``, checked, without changing this algorithm: what :meth:`restore` takes
        (the units :attr:`shards` gives here, of the whole state). A ``ValueError`` says what
        does not fit."""
        if not isinstance(state, Mapping) or not {
            "logits",
            "prior",
            "optimizer",
        } <= set(state):
            raise ValueError(
                "its state has no learned logits, prior and optimizer state (key 'learned')"
            )
        logits, prior = state["logits"], state["prior"]
        if not (isinstance(logits, Mapping) and isinstance(prior, Mapping)):
            raise ValueError(  # noqa: TRY004 (a file's content, not an argument's type)
                "its learned logits or prior are not dicts"
            )
        if set(logits) != set(shapes) or set(prior) != set(shapes):
            raise ValueError(
                f"it has learned logits for {sorted(map(str, logits))[:5]}, and this phase "
                f"learns masks for {sorted(shapes)[:5]}"
            )
        for name, shape in shapes.items():
            units, count = self.logit_count(shape)
            what = (
                f"{units} 4x4 tiles, {count} transposable tiles"
                if self.learns_tiles(shape)
                else f"{units} groups of {self.target.m}, {count} patterns"
            )
            value, kept = logits[name], prior[name]
            if not (
                isinstance(value, Tensor)
                and value.dtype == torch.float32
                and tuple(value.shape) == (units, count)
                and bool(value.isfinite().all())
            ):
                raise ValueError(
                    f"the learned logits of {name!r} are not a finite float32 tensor of "
                    f"shape {(units, count)} ({what})"
                )
            if not (
                isinstance(kept, Tensor)
                and kept.dtype == torch.uint8
                and tuple(kept.shape) == (units,)
                and bool((kept < count).all())
            ):
                raise ValueError(
                    f"the learned prior of {name!r} is not {units} pattern indices (uint8) "
                    f"below {count}"
                )
        owned = {name: self.shards.owned(len(logits[name])) for name in shapes}
        values = {
            name: logits[name][owned[name]].to(devices[name]).requires_grad_(True)
            for name in shapes
        }
        optimizer = torch.optim.Adam(list(values.values()), lr=self.mask_lr)
        try:
            optimizer.load_state_dict(_owned_state(state["optimizer"], logits, owned))
        except (KeyError, ValueError, TypeError, IndexError, AttributeError) as err:
            raise ValueError(
                f"its learned logits' optimizer state does not fit: {err}"
            ) from None
        return {
            "logits": values,
            "prior": {
                name: prior[name][owned[name]].to(devices[name]) for name in shapes
            },
            "optimizer": optimizer,
            "shapes": dict(shapes),
            "owned": owned,
        }

    def restore(self, checked: Mapping[str, Any], step: int) -> None:
        """Continue from a state :meth:`check_state` read, at optimizer ``step`` (at the
        phase's end: its last step, whose forwards the state followed)."""
        assert self.phase.end is not None
        self.step = min(step, self.phase.end - 1)
        self.shapes = checked["shapes"]
        self.tiled = {name for name, s in self.shapes.items() if self.learns_tiles(s)}
        self.prior = checked["prior"]
        self.logits = checked["logits"]
        self.owned = checked["owned"]
        self.optimizer = checked["optimizer"]
        self._likely.clear()


def _per_unit(value: Any) -> bool:
    """Whether an optimizer state entry has one row per unit (Adam's moments), not a count."""
    return isinstance(value, Tensor) and value.dim() > 0


def _owned_state(
    optimizer: Any, logits: Mapping[str, Tensor], owned: Mapping[str, slice]
) -> Any:
    """A saved (whole) optimizer state of the logits ``logits`` (in order), cut to the units
    ``owned`` here; an entry with one row per unit must have the logits' shape."""
    names = list(logits)
    state = {}
    for index, entries in optimizer["state"].items():
        name = names[index]
        state[index] = {}
        for key, value in entries.items():
            if _per_unit(value):
                if value.shape != logits[name].shape:
                    raise ValueError(
                        f"its {key!r} of {name!r} has shape {tuple(value.shape)}, not "
                        f"the logits' {tuple(logits[name].shape)}"
                    )
                value = value[owned[name]]
            state[index][key] = value
    return {**optimizer, "state": state}


def _options(spec: Phase, where: str) -> dict[str, Any]:
    """The phase's learned-mask options, checked, with the defaults filled in."""
    options = dict(DEFAULTS)
    for key in ("temperature", "logit_scale"):
        value = getattr(spec, key)
        if value is not None:
            options[key] = _anneal(value, f"{where}.{key}")
    for key, minimum in (("prior_strength", 0.0), ("weight_reg", 0.0)):
        value = getattr(spec, key)
        if value is not None:
            options[key] = _number(value, f"{where}.{key}", minimum, positive=False)
    if spec.mask_lr is not None:
        options["mask_lr"] = _number(spec.mask_lr, f"{where}.mask_lr", 0.0, True)
    for key, dense in (("hard", ""), ("train_weights", ", or 'dense'")):
        value = getattr(spec, key)
        if value is not None and not (
            isinstance(value, bool) or (dense and value == "dense")
        ):
            raise TypeError(
                f"{where}.{key}={value!r} has type {type(value).__name__}: use true or "
                f"false{dense}"
            )
        if value is not None:
            options[key] = value
    options["transposable"] = _transposable(spec, where)
    return options


def _transposable(spec: Phase, where: str) -> str | bool:
    """The phase's ``transposable`` option: ``'tiles'``, ``'project'`` or ``False``."""
    value = spec.transposable
    if value is None or value is False:
        return False
    form = RECOMMENDED_FORM if value is True else value
    if form not in TRANSPOSABLE_FORMS:
        raise ValueError(
            f"{where}.transposable={value!r}: use 'tiles' (learn over the 90 transposable "
            f"4x4 tiles), 'project' (learn N:M patterns, project them onto transposable "
            f"tiles at the phase's end), true (the recommended form, "
            f"{RECOMMENDED_FORM!r}) or false (masks handed over as learned)"
        )
    if spec.target != NM(2, 4):
        raise ValueError(
            f"{where}.transposable={value!r} makes the masks 2:4 along the rows and the "
            f"columns of 4x4 tiles, which needs sparsity '2:4', not '{spec.target}': use "
            f"sparsity '2:4' or remove transposable"
        )
    return form


def _has_tiles(shape: torch.Size) -> bool:
    """Whether rows of ``shape`` are 2-D with both dimensions multiples of 4."""
    return has_4x4_tiles(torch.empty(shape, device="meta"))


def _number(value: Any, where: str, minimum: float, positive: bool) -> float:
    """A finite number (a string of one, as YAML 1.1 reads ``1e-5``, counts as the number)
    at least ``minimum`` (above it with ``positive``)."""
    wanted = f"a finite number {'>' if positive else '>='} {minimum:g}"
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(
                f"{where}={value!r} is not a number: use {wanted}"
            ) from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(
            f"{where}={value!r} has type {type(value).__name__}: use {wanted}"
        )
    low = number > minimum if positive else number >= minimum
    if not (math.isfinite(number) and low):
        raise ValueError(f"{where}={value!r}: use {wanted}")
    return float(number)


def _anneal(value: Any, where: str) -> Anneal:
    """A positive number (constant over the phase) or ``[start, end]`` (linear)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(
                f"{where}={value!r}: give [start, end] (annealed linearly over the phase) "
                f"or one number (constant)"
            )
        start, end = (_number(v, where, 0.0, True) for v in value)
        return Anneal(start, end)
    number = _number(value, where, 0.0, True)
    return Anneal(number, number)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (an optimizer's ``state_dict``)."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
