"""The options of one sparsity group, checked, and how the group is built on a model.

Both front ends take the same options: :class:`~lightning_sparse.SparsityCallback` (Lightning's
``Trainer``) and :class:`~lightning_sparse.SparseTraining` (a loop you write: Fabric or plain
PyTorch). :class:`GroupSettings` checks them once, with messages that name the argument and
the fix, and :meth:`GroupSettings.build` selects the parameters and builds the group's engine
for a run of known length. No Lightning here.

Example:
    >>> from torch import nn
    >>> from lightning_sparse.algorithms import RunLength
    >>> settings = GroupSettings("SparseTraining", phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}])
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> sparsifier, selection = settings.build(net, RunLength(total_steps=100))
    >>> [(p.start, p.end) for p in sparsifier.phases], [t.name for t in selection.targets]
    ([(0, 70), (70, 100)], ['0.weight'])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any

import torch
from torch import nn

from lightning_sparse.algorithms import RunLength, check_phases
from lightning_sparse.backends import validate_backend
from lightning_sparse.backends.gpus import GpuTarget
from lightning_sparse.backends.speed import timing_for
from lightning_sparse.core.head import record_calls
from lightning_sparse.core.schedule import Phase, resolve_phases, validate_phase_list
from lightning_sparse.core.selection import (
    Selection,
    check_disjoint,
    compile_patterns,
    empty_selection_message,
    select_parameters,
)
from lightning_sparse.engine.resume import ON_SCHEDULE_CHANGE
from lightning_sparse.engine.sparsifier import Sparsifier


class GroupSettings:
    """One group's options (those of :class:`~lightning_sparse.SparsityCallback`, which
    documents each), checked; ``owner`` names the front end in messages."""

    def __init__(
        self,
        owner: str,
        sparsity: str | float | None = None,
        phases: Sequence[Phase | dict[str, Any]] | None = None,
        params: Sequence[str] | str | None = None,
        exclude: Sequence[str] | str | None = None,
        backend: str = "auto",
        name: str = "sparsity",
        log_every_n_steps: int | None = None,
        verbose: bool = True,
        verify_speed: bool | str | None = None,
        verify_speed_tokens: int | None = None,
        on_schedule_change: str = "error",
        allow_skipped_layers: bool = False,
        restore_rng: bool = False,
        **phase_options: Any,
    ) -> None:
        if (sparsity is None) == (phases is None):
            raise ValueError(
                f"{owner} needs exactly one of sparsity= (one phase for the whole run, "
                "e.g. sparsity=0.7) or phases= (e.g. phases=[{'sparsity': '2:4', 'until': 0.7}, "
                f"{{'sparsity': 0.0}}]); got sparsity={sparsity!r}, phases={phases!r}"
            )
        # LightningCLI passes every phase key, the unset ones at their defaults
        phase_options = {
            key: value
            for key, value in phase_options.items()
            if key not in _PHASE_DEFAULTS or value != _PHASE_DEFAULTS[key]
        }
        check_phase_options(phase_options, sparsity is not None, owner)
        if phases is None:
            # a call of Phase itself, so that LightningCLI knows the options' types
            phases = [Phase(sparsity=sparsity, **phase_options)]
        if not isinstance(phases, Sequence) or isinstance(phases, str):
            raise TypeError(
                f"phases={phases!r}: give a list of phases, e.g. [{{'sparsity': 0.7}}]"
            )
        self.owner = owner
        self.phases = [Phase.from_any(p, f"phases[{i}]") for i, p in enumerate(phases)]
        validate_phase_list(self.phases)
        check_phases(self.phases)
        compile_patterns(params, "params")
        compile_patterns(exclude, "exclude")
        self.params = params
        self.exclude = exclude
        self.backend = validate_backend(backend, verify_speed, verify_speed_tokens)
        self.verify_speed = verify_speed
        self.verify_speed_tokens = verify_speed_tokens
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: give the group a non-empty string name")
        self.name = name
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(
                f"log_every_n_steps={log_every_n_steps!r}: use a positive integer"
            )
        self.log_every_n_steps = log_every_n_steps
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose={verbose!r}: use True or False")
        self.verbose = verbose
        if on_schedule_change not in ON_SCHEDULE_CHANGE:
            raise ValueError(
                f"on_schedule_change={on_schedule_change!r}: use 'error' (a resume from a "
                f"checkpoint trained with other phases or parameters stops and names the "
                f"differences) or 'reselect' (this schedule applies from the resume step, "
                f"masks chosen afresh there)"
            )
        self.on_schedule_change = on_schedule_change
        if not isinstance(allow_skipped_layers, bool):
            raise TypeError(
                f"allow_skipped_layers={allow_skipped_layers!r}: use True (a layer that does "
                f"not run in the first sparse step is logged) or False (an error, the default)"
            )
        self.allow_skipped_layers = allow_skipped_layers
        if not isinstance(restore_rng, bool):
            raise TypeError(
                f"restore_rng={restore_rng!r}: use True (checkpoints hold every process's "
                f"random number generator states, restored when training resumes) or False"
            )
        self.restore_rng = restore_rng

    def build(
        self,
        model: nn.Module,
        run: RunLength,
        compute_dtype: torch.dtype | None = None,
        others: Sequence[tuple[str, Selection]] = (),
        gpu: GpuTarget | None = None,
        calibration_forwards: Callable[[int, int], int] | None = None,
        example_forward: Callable[[], Any] | None = None,
        log: Callable[[str], None] = lambda message: None,
    ) -> tuple[Sparsifier, Selection]:
        """Select the group's parameters of ``model`` and build its engine for a run of
        ``run`` optimizer steps, without touching the model (no mask is applied); see
        :meth:`SparsityCallback.build <lightning_sparse.SparsityCallback.build>` for the
        arguments. ``log`` receives the engine's messages."""
        resolved = resolve_phases(
            self.phases, run.total_steps, run.steps_per_epoch, run.advice
        )
        calls = None
        if self.params is None and example_forward is not None:
            source = "the forward of example_input_array"
            calls = record_calls(model, example_forward, source)
        selection = select_parameters(model, self.params, self.exclude, resolved, calls)
        check_disjoint(self.name, selection, others)
        if not selection.targets and any(not p.spec.is_dense for p in resolved):
            raise ValueError(
                empty_selection_message(
                    selection, self.name, type(model).__name__, self.owner
                )
            )
        timing = (
            timing_for(self.verify_speed, model) if self.backend == "auto" else None
        )
        sparsifier = Sparsifier(
            self.name,
            selection.targets,
            resolved,
            run,
            self.backend,
            log=log,
            compute_dtype=compute_dtype,
            verify_speed=timing or False,
            gpu=gpu,
            calibration_forwards=calibration_forwards,
            allow_skipped_layers=self.allow_skipped_layers,
            verify_speed_tokens=self.verify_speed_tokens,
            verify_on_gpus_only=self.verify_speed is None,
        )
        return sparsifier, selection


_PHASE_DEFAULTS = {
    f.name: f.default if f.default is not MISSING else f.default_factory()
    for f in fields(Phase)
    if f.name != "sparsity"
}
PHASE_OPTIONS = tuple(_PHASE_DEFAULTS)
"""The keys of a phase that the front ends accept beside ``sparsity=``."""


def check_phase_options(
    options: Mapping[str, Any], one_phase: bool, owner: str = "SparsityCallback"
) -> None:
    """Refuse keyword ``options`` of ``owner`` that are not a phase's keys, or that come with
    ``phases=`` (``one_phase`` is ``False``), naming the fix.

    Example:
        >>> check_phase_options({"algorithm": "gmp"}, one_phase=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: algorithm='gmp' is a key of one phase: with phases=, give it inside ...
    """
    unknown = sorted(set(options) - set(PHASE_OPTIONS))
    if unknown:
        raise TypeError(
            f"{owner} got unknown argument(s) {unknown}: beside its own arguments it "
            f"takes a phase's keys along with sparsity= ({', '.join(PHASE_OPTIONS)})"
        )
    if options and not one_phase:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        example = ", ".join(f"{k!r}: {v!r}" for k, v in options.items())
        raise ValueError(
            f"{given} {'is a key' if len(options) == 1 else 'are keys'} of one phase: with "
            f"phases=, give {'it' if len(options) == 1 else 'them'} inside each phase that "
            f"uses {'it' if len(options) == 1 else 'them'} (phases=[{{'sparsity': 0.9, "
            f"{example}}}, ...]), or give sparsity= instead of phases= for one phase"
        )
