"""A command-line or config error as one paragraph: the key, the value given, the closest valid
key or value, and the fix.

jsonargparse reports a mistake as text that nests every alternative of a type union (a typo
under a callback's ``init_args`` is a twenty-line dump ending in the whole callbacks list);
:func:`explain_parse_error` reads that text and says what a user needs, in the form they used
(``--key=value`` on the command line, ``key:`` in a config). It imports neither jsonargparse
nor torch: it works on the message alone, the keys the subcommand takes, and the classes the
config names.

Example:
    >>> message = ('Parser key "trainer.max_epochs":\\n Does not validate against any of the '
    ...            "Union subtypes\\n Errors:\\n  - Expected a <class 'int'>\\n  - Expected a "
    ...            "<class 'NoneType'>\\n Given value type: <class 'str'>\\n Given value: abc")
    >>> print(explain_parse_error(message, ["fit", "--trainer.max_epochs=abc"]))
    --trainer.max_epochs=abc: trainer.max_epochs takes an integer or null, and 'abc' is neither: give it an integer, e.g. --trainer.max_epochs=10
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Sequence

from lightning_sparse.core.closest import closest

SUBCOMMANDS = ("fit", "validate", "plan")

OVERLAY_ONLY = (
    "the config names no model{data}: a sparsity overlay (such as "
    "recipes/overlays/sparsity_24_70pct.yaml) only adds a SparsityCallback to "
    "trainer.callbacks, so give a base config first, which names the model, the data and the "
    "trainer: lightning-sparse {subcommand} --config my_recipe.yaml --config "
    "recipes/overlays/sparsity_24_70pct.yaml"
)
NO_CONFIG = (
    "no model{data} given: {subcommand} runs a recipe, a YAML config naming the model, the data "
    "and the trainer (recipes/README.md lists them): lightning-sparse {subcommand} --config "
    "recipes/vit/cpu_demo.yaml"
)

# how each type in jsonargparse's "Expected a ..." lines reads, with a value of it
_TYPES = {
    "int": ("an integer", "10"),
    "float": ("a number", "0.5"),
    "str": ("a string", None),
    "bool": ("true or false", "true"),
    "NoneType": ("null", None),
    "dict": ("a mapping", None),
    "list": ("a list", None),
    "Sequence": ("a list", None),
}
_EXPECTED = re.compile(
    r"Expected a (?:<class '([\w.]+)'>|typing\.Literal\[(.*)\]|([\w.\[\], ]+))"
)


def explain_parse_error(
    message: str, args: Sequence[str], keys: Sequence[str] = ()
) -> str:
    """``message`` (jsonargparse's, for the command line ``args``) as one paragraph; ``keys``:
    the dotted keys the subcommand takes (``trainer.max_steps``...), for the closest one to an
    unknown key. A message of another form is returned on one line, as it is."""
    subcommand = next((a for a in args if a in SUBCOMMANDS), None)
    help_hint = f"lightning-sparse {subcommand or ''} --help".replace("  ", " ")
    if "required:" in message and f"{subcommand}.model" in message:
        missing = message.split("required:")[-1]
        data = " or data" if f"{subcommand}.data" in missing else ""
        given = any(a in ("-c", "--config") or a.startswith("--config=") for a in args)
        template = OVERLAY_ONLY if given else NO_CONFIG
        return template.format(data=data, subcommand=subcommand)
    unrecognized = re.search(r"unrecognized arguments: (.*)", message)
    if unrecognized:
        return _unknown_options(unrecognized.group(1).split(), keys, help_hint)
    unknown = re.search(
        r"does not accept option '([^']+)'|Option '([^']+)' is not accepted", message
    )
    if unknown and not message.startswith("Parser key"):
        key = unknown.group(1) or unknown.group(2)
        return _unknown_config_key(key, keys, help_hint)
    parser_key = re.match(r'Parser key "([^"]+)":', message)
    if parser_key:
        return _bad_value(parser_key.group(1), message, args, help_hint, subcommand)
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _unknown_options(tokens: list[str], keys: Sequence[str], help_hint: str) -> str:
    """``--a.b=value`` options that no key takes, each with the closest key."""
    parts = []
    for i, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        name, sep, value = token[2:].partition("=")
        if not sep and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, sep = tokens[i + 1], "="
        meant = closest(name, keys)
        fix = (
            f"did you mean --{meant[0]}? Write --{meant[0]}{sep}{value}"
            if meant
            else "no option is close to it"
        )
        parts.append(f"unknown option --{name} (given as {token}): {fix}")
    if not parts:  # words that are no option at all
        parts.append(f"unrecognized arguments: {' '.join(tokens)}")
    return "; ".join(parts) + f" ({help_hint} lists the options)"


def _unknown_config_key(key: str, keys: Sequence[str], help_hint: str) -> str:
    """A key in a config that no key of the subcommand is."""
    meant = closest(key, keys)
    if not meant:
        fix = "no key is close to it: remove it"
    else:
        given, valid = key.split("."), meant[0].split(".")
        # the first part that differs is the typo: trainr.max_steps or trainer.max_stepz
        at = next((i for i, (a, b) in enumerate(zip(given, valid)) if a != b), 0)
        under = f" under {'.'.join(given[:at])}:" if at else ""
        fix = f"did you mean {meant[0]}? Rename {given[at]}:{under} to {valid[at]}:"
    return (
        f"a config sets {key}, which is not a key of this command: {fix} ({help_hint} lists "
        f"the keys)"
    )


def _bad_value(
    key: str, message: str, args: Sequence[str], help_hint: str, subcommand: str | None
) -> str:
    """A value jsonargparse refused for ``key``: an unknown argument of the class it names, a
    class that does not exist, or a value of the wrong type."""
    problem = re.search(
        r"Problem with given class_path '([^']+)':\n(.*)", message, re.DOTALL
    )
    if problem is None:
        return _wrong_type(key, message, args)
    class_path, inner = problem.group(1), problem.group(2)
    option = re.match(r"\s*Option '([^']+)' is not accepted", inner)
    index = _list_index(message, class_path, option.group(1) if option else None)
    where = key if index is None else f"{key}[{index}]"
    if option:
        name = option.group(1)
        meant = closest(name, _init_arguments(class_path))
        fix = (
            f"did you mean {meant[0]!r}? Rename {name}: to {meant[0]}: in its init_args"
            if meant
            else f"remove {name}: from its init_args"
        )
        lister = f"lightning-sparse {subcommand or 'fit'} --{key}.help {class_path}"
        return (
            f"{where}: {class_path} takes no argument {name!r}: {fix} ({lister} lists its "
            f"arguments)"
        )
    nested = re.search(r'( *)Parser key "([^"]+)":', inner)
    if nested:
        block = _block(inner[nested.start() :], len(nested.group(1)))
        return f"{where}: {class_path}'s " + _wrong_type(
            nested.group(2), block, args, True
        )
    missing = re.search(r"module '([\w.]+)' has no attribute '(\w+)'", inner)
    if missing:
        module, name = missing.groups()
        meant = closest(name, _public_names(module))
        fix = (
            f"did you mean {module}.{meant[0]}?"
            if meant
            else f"check the name in {module}"
        )
        return (
            f"{where}: there is no class {class_path} ({module} has no {name!r}): {fix}"
        )
    first = next((line.strip() for line in inner.splitlines() if line.strip()), "")
    return f"{where}: {class_path}: {first} ({help_hint})"


def _wrong_type(
    key: str, message: str, args: Sequence[str], in_class: bool = False
) -> str:
    """``key``'s value is none of the types it takes (``in_class``: ``key`` is an argument in a
    class's init_args, which only a config sets)."""
    given = re.search(r"Given value: (.*)", message)
    value = given.group(1).strip() if given else "?"
    types: list[str] = []
    examples: list[tuple[str, str]] = []  # (a type, a value of it)
    choices: list[str] = []
    for match in _EXPECTED.finditer(message):
        simple, literal, other = match.groups()
        if literal is not None:
            choices += [c.strip().strip("'\"") for c in literal.split(",")]
            continue
        name = (simple or other or "").rsplit(".", 1)[-1]
        words, example = _TYPES.get(name, (f"a {name}", None))
        if words not in types:
            types.append(words)
        if example is not None:
            examples.append((words, example))
    if choices:
        types.insert(0, "one of " + ", ".join(dict.fromkeys(choices)))
    kinds = (
        " or ".join(types)
        if len(types) <= 2
        else ", ".join(types[:-1]) + " or " + types[-1]
    )
    neither = {1: "not", 2: "neither"}.get(len(types), "none of them")
    cli = f"--{key}"
    on_command_line = not in_class and any(
        a == cli or a.startswith(cli + "=") for a in args
    )
    if on_command_line:
        given_as, form = f"{cli}={value}", f"{cli}={{}}"
    else:
        given_as, form = f"{key}: {value}", f"{key.rpartition('.')[2]}: {{}}"
    if choices:
        meant = closest(value, choices, cutoff=0.0)[0]
        fix = f"did you mean {meant}? Write {form.format(meant)}"
    elif examples:
        fix = f"give it {examples[0][0]}, e.g. {form.format(examples[0][1])}"
    else:
        fix = f"give it {types[0] if types else 'another value'}"
    return f"{given_as}: {key} takes {kinds}, and {value!r} is {neither}: {fix}"


def _block(text: str, indent: int) -> str:
    """The lines of ``text`` up to the first one indented less than ``indent`` (a nested
    error's own lines, without those of the error around it)."""
    lines = text.splitlines()
    kept = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        kept.append(line)
    return "\n".join(kept)


def _list_index(message: str, class_path: str, name: str | None = None) -> int | None:
    """Which item of the list jsonargparse was given (its last ``Given value: [...]``) names
    ``class_path`` (and, among several, holds the key ``name``), if one does."""
    given = re.findall(r"\n *Given value: (\[.*\])", message)
    try:
        tree = ast.parse(given[-1], mode="eval").body if given else None
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    found = [
        (i, ast.get_source_segment(given[-1], item) or "")
        for i, item in enumerate(tree.elts)
        if _class_path_of(item) == class_path
    ]
    if len(found) > 1 and name is not None:
        found = [(i, text) for i, text in found if repr(name) in text]
    return found[0][0] if len(found) == 1 else None


def _class_path_of(item: ast.expr) -> object:
    """The ``class_path`` of a list item as jsonargparse prints it: a dict, or a
    ``Namespace(class_path=...)``."""
    if isinstance(item, ast.Dict):
        fields = {
            k.value: v
            for k, v in zip(item.keys, item.values)
            if isinstance(k, ast.Constant)
        }
    elif isinstance(item, ast.Call):
        fields = {k.arg: k.value for k in item.keywords}
    else:
        return None
    value = fields.get("class_path")
    return value.value if isinstance(value, ast.Constant) else None


def _init_arguments(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s class takes (``[]`` if it does not import)."""
    cls = _import(class_path)
    if cls is None:
        return []
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _public_names(module: str) -> list[str]:
    try:
        return [
            n for n in dir(importlib.import_module(module)) if not n.startswith("_")
        ]
    except ImportError:
        return []


def _import(class_path: str) -> object | None:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
