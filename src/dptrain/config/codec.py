"""The config as data: a RunConfig built from a tree of TOML tables or dotted --section.option overrides (each value
coerced to its field's type, in one place), and back to a tree or to TOML; the names an option had before the strategy
tables (refused in a config, read in an old snapshot's record); the options a resume must keep."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

from dptrain.option_fields import choice, field_types, is_table, key_shown
from dptrain.config.reading import read_toml
from dptrain.config.sections import LEGACY_STRATEGY_KEYS, MAX_RUN_NAME_CHARS, RunConfig
from dptrain.errors import ConfigError


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check or convert a TOML value or CLI string to the field's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        refusals = []
        for member in inner:  # the first type that takes the value, in the order declared
            try:
                return _coerce(value, member, name)
            except ConfigError as exc:
                refusals.append(exc)
        if len(inner) == 1:
            raise refusals[0]
        raise ConfigError(f"{name} expects {' or '.join(map(_type_words, inner))}, got {value!r}.")
    if origin is Literal:
        value = _coerce(value, type(args[0]), name)
        choice(value, name, args)
        return value
    if origin is tuple:
        items = value
        if isinstance(value, str) and args[0] is str:  # a list of lines: a string on the command line is one line
            items = [value] if value.strip() not in ("", "[]") else []
        elif isinstance(value, str):
            items = [v for v in value.strip("[]()").replace(",", " ").split() if v]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name} expects a list like [1, 28, 28], got {value!r}.")
        return tuple(_coerce(v, args[0], name) for v in items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name} expects true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} expects an integer, got {value!r}.")
        try:
            return int(value) if isinstance(value, int) else int(str(value), 0)
        except ValueError:
            raise ConfigError(f"{name} expects an integer, got {value!r}.") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} expects a number, got {value!r}.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} expects a number, got {value!r}.") from None
        if not math.isfinite(number):  # nan passes every `<=` check; 1e400 reads as inf
            reads_as = "" if str(value).strip().lower() == str(number) else f" (it reads as {number})"
            raise ConfigError(f"{name} = {value}{reads_as} is not a finite number; give a finite value.")
        return number
    if tp is str:
        return str(value)
    raise AssertionError(f"unsupported config type {tp} for {name}")


def _type_words(tp: Any) -> str:
    """How an error message names a type: 'an integer', 'auto'."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(tp, str(tp))


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    types_ = field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ConfigError(
            f"unknown option {section}.{key_shown(unknown[0])}; valid options in [{section}] are: {', '.join(types_)}."
        )
    built = {}
    for key, value in values.items():
        if is_table(types_[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"[{section}.{key}] must be a table of options, got {value!r}.")
            built[key] = _build_section(types_[key], value, f"{section}.{key}")
        else:
            built[key] = _coerce(value, types_[key], f"{section}.{key}")
    return cls(**built)


def _move_legacy_keys(tree: dict[str, Any]) -> None:
    """Move [strategy]'s flat keys of before its tables (comm_hook) to their tables (ddp.comm_hook), in place, for
    upgraded's records (a config is refused them)."""
    strategy = tree.get("strategy")
    if not isinstance(strategy, dict):
        return
    for old in [key for key in strategy if key in LEGACY_STRATEGY_KEYS]:
        table, option = LEGACY_STRATEGY_KEYS[old].split(".")
        into = strategy.setdefault(table, {})
        if not isinstance(into, dict):
            raise ConfigError(f"[strategy.{table}] must be a table of options, got {into!r}.")
        if option in into:
            raise ConfigError(f"strategy.{old} and strategy.{table}.{option} are the same option, given twice; keep "
                              f"strategy.{table}.{option} only.")
        into[option] = strategy.pop(old)


def upgraded(tree: Any) -> Any:
    """A copy of a config tree as today's code writes it, for records written before (a sweep's sweep.json):
    [strategy]'s flat keys of before the tables moved to their tables (no note), and an option added since at its
    default, which is what that record ran with. Anything but a table is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    copy = _deep_copy(tree)
    try:
        _move_legacy_keys(copy)
    except ConfigError:  # a key given twice: left as it is, so that it compares unequal
        return tree
    for section, options in to_dict(RunConfig()).items():  # the sections it records (a record may leave some out)
        if isinstance(copy.get(section), dict):
            _fill_defaults(copy[section], options)
    return copy


def _fill_defaults(table: dict[str, Any], defaults: dict[str, Any]) -> None:
    """The options a table lacks, from defaults, its own tables too; what it has stays as it is."""
    for key, value in defaults.items():
        if key not in table:
            table[key] = _deep_copy(value)
        elif isinstance(value, dict) and isinstance(table[key], dict):
            _fill_defaults(table[key], value)


def _refuse_flat_keys(tree: dict[str, Any], spelled: str = "") -> None:
    """Refuse [strategy]'s flat keys of before its tables (strategy.comm_hook), naming each one's table key; spelled:
    "--" where the key came from the command line. No release ever read them."""
    strategy = tree.get("strategy")
    for old in strategy if isinstance(strategy, dict) else ():
        if old in LEGACY_STRATEGY_KEYS:
            raise ConfigError(f"{spelled}strategy.{old} is no option: each strategy's options sit in its own table; "
                              f"write {spelled}strategy.{LEGACY_STRATEGY_KEYS[old]} instead.")


def from_dict(tree: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from nested plain data (a parsed TOML file, or to_dict() output)."""
    sections = field_types(RunConfig)
    unknown = sorted(set(tree) - set(sections))
    if unknown:
        raise ConfigError(f"unknown config section [{key_shown(unknown[0])}]; valid sections are: {', '.join(sections)}.")
    _refuse_flat_keys(tree)
    built = {}
    for name, cls in sections.items():
        values = tree.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of options, got {values!r}.")
        built[name] = _build_section(cls, values, name)
    return RunConfig(**built)


def _deep_copy(values: Any) -> Any:
    return {k: _deep_copy(v) for k, v in values.items()} if isinstance(values, dict) else values


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain data; from_dict(to_dict(c)) == c."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in field_types(RunConfig)}


def _flat_fields(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field]]:
    """Every option of a section as (dotted name, its field), tables' options included."""
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if is_table(tp):
            yield from _flat_fields(tp, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", f


def fixed_at_resume(cfg: RunConfig) -> dict[str, Any]:
    """Every option that a resume must keep (it changes the computation), by dotted name; the others' fields, or
    their sections', say MAY_CHANGE_AT_RESUME."""
    fixed = {}
    for section in dataclasses.fields(RunConfig):
        if section.metadata.get("may_change_at_resume"):
            continue
        for name, f in _flat_fields(field_types(RunConfig)[section.name], section.name):
            if not f.metadata.get("may_change_at_resume"):
                value: Any = cfg
                for part in name.split("."):
                    value = getattr(value, part)
                fixed[name] = value
    return fixed


def experiment_name(cfg: RunConfig) -> str:
    """The run's default name: what makes it another run than others, so that a new experiment starts afresh in a
    folder of its own while the same command finds its own folder again and resumes. <data.name>_<model.name>_
    <strategy.name> (fashion-mnist_mnist-cnn_ddp), and, where any other option a resume must keep (fixed_at_resume,
    train.batch_size_per_rank too, with train.accumulate_steps beside it) differs from its default, _ and 8 hex digits
    of a hash of those options and their values: an option added to dptrain later, at its default, leaves the names
    of earlier runs as they were."""
    named = ("data.name", "model.name", "strategy.name")
    defaults = fixed_at_resume(RunConfig())
    changed = {key: value for key, value in fixed_at_resume(cfg).items()
               if key not in named and value != defaults.get(key)}
    if cfg.train.batch_size_per_rank is not None:  # it sets the global batch, as the world size resolves it
        changed["train.batch_size_per_rank"] = cfg.train.batch_size_per_rank
        if cfg.train.accumulate_steps != 1:  # and so do the micro-batches of a step, with it
            changed["train.accumulate_steps"] = cfg.train.accumulate_steps
    suffix = ""
    if changed:
        text = json.dumps(changed, sort_keys=True, default=str)
        suffix = "_" + hashlib.sha256(text.encode()).hexdigest()[:8]
    parts = "_".join(re.sub(r"[^A-Za-z0-9._+=@-]", "-", str(value)) for value in
                     (cfg.data.name, cfg.model.name, cfg.strategy.name))  # a user's pkg.mod:Class as pkg.mod-Class
    return parts[:MAX_RUN_NAME_CHARS - len(suffix)] + suffix


def current_name(name: str) -> str:
    """An option's dotted name as a snapshot of before the strategy tables recorded it (strategy.comm_hook), now."""
    section, _, rest = name.partition(".")
    key, space, words = rest.partition(" ")  # "strategy.deepspeed_config (sha256 of its settings)"
    if section == "strategy" and key in LEGACY_STRATEGY_KEYS:
        return f"strategy.{LEGACY_STRATEGY_KEYS[key]}{space}{words}"
    return name


def parse_overrides(pairs: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """[("optim.lr", "3e-4"), ("strategy.ddp.comm_hook", "fp16")] -> {"optim": {"lr": "3e-4"}, "strategy": {"ddp":
    {"comm_hook": "fp16"}}}; strings are typed later by from_dict. An old flat strategy key is refused."""
    tree: dict[str, dict[str, Any]] = {}
    sections = field_types(RunConfig)
    for key, value in pairs:
        section, *path = key.split(".")
        if not path or not all(path) or len(path) > 2:
            raise ConfigError(f"option --{key} is not of the form --section.option (for example --optim.lr 3e-4, "
                              f"or --strategy.ddp.comm_hook fp16 for a strategy's own option).")
        if section not in sections:
            raise ConfigError(f"unknown option --{key}; valid sections are: {', '.join(sections)}.")
        into = tree.setdefault(section, {})
        if len(path) == 2:
            table = into.setdefault(path[0], {})
            if not isinstance(table, dict):
                raise ConfigError(f"option --{section}.{path[0]} is a table of options, not a value; give one of its "
                                  f"options, as --{key} does.")
            into = table
        into[path[-1]] = value
    _refuse_flat_keys(tree, "--")
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any], where: str) -> None:
    """over's values into base, table by table (a CLI option replaces the file's value, and only it)."""
    for key, value in over.items():
        if isinstance(value, dict):
            inner = base.setdefault(key, {})
            if not isinstance(inner, dict):
                raise ConfigError(f"[{key}] must be a table of options in {where}.")
            _merge(inner, value, where)
        else:
            base[key] = value


def load(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> RunConfig:
    """TOML file (optional) with dotted overrides on top, validated."""
    return read(path, overrides)[0]


def read(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> tuple[RunConfig, set[str]]:
    """(the TOML file (optional) with dotted overrides on top, validated; the options the file or the overrides set,
    by dotted name), the file read once."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            tree = read_toml(path, f"config file {path}")
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; check the path given to --config.") from None
    _refuse_flat_keys(tree)
    given = set(_dotted_names(tree)) | {key for key, _ in overrides or []}
    _merge(tree, parse_overrides(overrides or []), str(path))
    return from_dict(tree), given


def _dotted_names(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every value's dotted name in a tree of tables (data.root, strategy.ddp.comm_hook)."""
    return [name for key, value in tree.items()
            for name in (_dotted_names(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that load() reads back; None values are left out (None is the default)."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None and not isinstance(v, dict))
        lines.append("")
        for key, inner in values.items():
            if isinstance(inner, dict):
                table(f"{name}.{key}", inner)

    for section, values in to_dict(cfg).items():
        table(section, values)
    return "\n".join(lines)
