"""The demo models' ``compile`` option: ``torch.compile`` a network in place, names unchanged.

``module.compile(mode=...)`` compiles the module's call in place, so parameter names,
``state_dict`` keys and a SparsityCallback's ``params`` patterns stay as they are
(``torch.compile(module)`` would return a wrapper whose names start with ``_orig_mod.``). A
mask update within a phase reuses the compiled graph; a phase change that swaps a layer's
forward fails the graph's guards and recompiles once.

Example:
    >>> compile_mode(False), compile_mode(True), compile_mode("reduce-overhead")
    (None, 'default', 'reduce-overhead')
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4))
    >>> compile_in_place("default", net)
    >>> list(net.state_dict())
    ['0.weight', '0.bias']
"""

from __future__ import annotations

from torch import nn

#: The ``torch.compile`` modes a demo model's ``compile`` names (``True`` is ``"default"``).
COMPILE_MODES = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)


def compile_mode(compile: bool | str) -> str | None:
    """The ``torch.compile`` mode that ``compile`` asks for (``None``: run eagerly), or raise a
    ValueError naming the accepted values."""
    if compile is False:
        return None
    if compile is True:
        return "default"
    if compile in COMPILE_MODES:
        return compile
    raise ValueError(
        f"compile={compile!r} is invalid: pass false (eager), true (torch.compile's default "
        f"mode) or a mode: {', '.join(map(repr, COMPILE_MODES))}"
    )


def compile_in_place(mode: str | None, *modules: nn.Module) -> None:
    """``module.compile(mode=mode)`` for each module (nothing for ``mode=None``).

    Calling it again with the same mode reuses the graphs already compiled, so it can run in
    ``configure_model``, which Lightning calls for every ``fit``, ``validate`` and ``test``.
    """
    if mode is None:
        return
    for module in modules:
        module.compile(mode=mode)


__all__ = ["COMPILE_MODES", "compile_in_place", "compile_mode"]
