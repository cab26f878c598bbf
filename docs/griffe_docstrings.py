"""Griffe extension for the docs build: our docstrings' reST habits, read as Markdown.

The docstrings use Google-style sections but title examples ``Example:`` (griffe's Google parser
knows only ``Examples:``), name objects with reST roles (``:func:`~pkg.mod.name```) and open
literal blocks with ``::``. This rewrites those three in the text griffe parses; the source files
stay as they are, and doctest still runs them.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]+?)(?:\s*<([^`>]+)>)?`")
_LITERAL = re.compile(r"::[ \t]*$", re.MULTILINE)


def _role(match: re.Match) -> str:
    """A role becomes a code span: its title, else its target (the last part after ``~``)."""
    tilde, text, target = match.groups()
    if target is None and tilde:
        text = text.rsplit(".", 1)[-1]
    return f"`{text.strip()}`"


class ReSTDocstrings(griffe.Extension):
    """Rewrites ``Example:`` titles, reST roles and ``::`` before a docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            text = _ROLE.sub(_role, text)
            obj.docstring.value = _LITERAL.sub(":", text)
