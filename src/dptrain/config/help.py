"""The options as --help and docs/configuration.md list them: each --section.option, its metavar, its default, and
its field's docstring (read from the sections' source, which Python keeps nowhere at run time)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from dptrain.config.codec import to_dict
from dptrain.option_fields import SHOWN_DEFAULT, field_types, is_table
from dptrain.config.sections import RunConfig


@dataclass(frozen=True)
class Option:
    """One --section.option: its value as typed on the command line, its default so typed, its field docstring."""

    section: str
    name: str
    metavar: str
    default: str
    doc: str


def _metavar(tp: Any) -> str:
    """What _coerce accepts for this type: INT, FLOAT, TEXT, {a,b}, INT,INT,INT, with |none where None is allowed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return "|".join(_metavar(a).strip("{}") for a in inner) + ("|none" if type(None) in args else "")
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin is tuple and args[-1] is Ellipsis:  # a list of lines (TOML); on the command line, one
        return "LINE" if args[0] is str else f"{_metavar(args[0])},..."
    if origin is tuple:
        return ",".join(_metavar(a) for a in args)
    if tp is bool:
        return "{true,false}"
    return {int: "INT", float: "FLOAT", str: "TEXT"}[tp]


def _cli_value(value: Any) -> str:
    """A value as typed after --section.option; _coerce reads it back to the same value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == ():
        return "[]"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field -> docstring of a section dataclass: each field's attribute docstring (the string literal after the field),
    which Python keeps nowhere at run time, from the class's source; or its FIELD_DOCS where it is made at run time
    (StrategyConfig, from the strategies' catalog)."""
    made = getattr(cls, "FIELD_DOCS", None)
    if made is not None:
        return dict(made)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source shipped (a frozen app): --help lists the options without their docs
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]  # the class
    return {node.target.id: inspect.cleandoc(doc.value.value)
            for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


@functools.cache
def options() -> tuple[Option, ...]:
    """Every option of every section, in declaration order; a strategy's own options in their table's section
    (strategy.ddp), after the section's own."""
    found: list[Option] = []

    def add(section: str, cls: type, defaults: dict[str, Any]) -> None:
        types_ = field_types(cls)
        shown = {f.name: f.metadata[SHOWN_DEFAULT] for f in dataclasses.fields(cls) if SHOWN_DEFAULT in f.metadata}
        found.extend(Option(section, name, _metavar(tp), shown.get(name, _cli_value(defaults[name])),
                            field_docs(cls).get(name, ""))
                     for name, tp in types_.items() if not is_table(tp))
        for name, tp in types_.items():
            if is_table(tp):
                add(f"{section}.{name}", tp, defaults[name])

    defaults = to_dict(RunConfig())
    for section, cls in field_types(RunConfig).items():
        add(section, cls, defaults[section])
    return tuple(found)


def options_help(width: int = 72) -> dict[str, str]:
    """Section -> its options as --help lists them: `--section.option METAVAR  (default: X)`, then the docstring."""
    text: dict[str, list[str]] = {}
    for opt in options():
        lines = text.setdefault(opt.section, [])
        lines.append(f"--{opt.section}.{opt.name} {opt.metavar}  (default: {opt.default})")
        lines += textwrap.wrap(" ".join(opt.doc.split()), width, initial_indent="    ", subsequent_indent="    ",
                               break_long_words=False, break_on_hyphens=False)
    return {section: "\n".join(lines) for section, lines in text.items()}
