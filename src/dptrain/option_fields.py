"""What the config's sections share: the checks of one value (one of a set, above zero), how a value is quoted in a
sentence, the metadata that marks a field, and the type introspection the codec, the help and the range checks use."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from dptrain.errors import ConfigError


def choice(value: Any, name: str, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(map(str, choices))}; pick one of them.")


def name_or_import_path(value: str, name: str, choices: tuple[str, ...]) -> None:
    """A built-in name, or a user's `package.module:Name` (imported, and so checked, by preflight)."""
    if not is_import_path(value) and value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}, nor an import path "
                          f"package.module:Name; pick one of them or give an import path.")


def positive(value: float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{name} = {value} must be greater than 0.")


def not_negative(value: float, name: str) -> None:
    if value < 0:
        raise ConfigError(f"{name} = {value} must be 0 or more.")


def shown(text: str, limit: int = 60) -> str:
    """A user's text in an error message: quoted and escaped (no line breaks or escapes reach the console), cut short."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def key_shown(key: str) -> str:
    """A file's key in an error message: as it is where printable and short, else as shown gives it (a quoted TOML
    key may hold any character)."""
    return key if key.isprintable() and len(key) <= 60 else shown(key)


def is_import_path(name: str) -> bool:
    """True for a user's `package.module:Name`."""
    return ":" in name


MAY_CHANGE_AT_RESUME = {"may_change_at_resume": True}
"""A field's metadata: the option may change between a snapshot and its resume (how long to run, where data and logs
live, how often to save, how evaluation is batched, which device). Every other option changes the computation, so a
resume refuses it (snapshots.check_compatible); the world size may change too (the shards are resharded on load)."""


SHOWN_DEFAULT = "shown_default"
"""A field's metadata key: the default as --help and the option reference show it, where the value the field holds
is not what a run gets when the option is not given (output.name: a name made from the experiment)."""


REFUSED_ELSEWHERE = {"refused_elsewhere": True}
"""A strategy option's metadata: set (to other than its default) with a strategy its table does not apply to, the run is
refused, since the user expects an effect that would not come (a comm hook with fsdp, a ZeRO stage with ddp)."""


def may_change_at_resume(default: Any) -> Any:
    """A field of that default whose option may change at resume."""
    return field(default=default, metadata=MAY_CHANGE_AT_RESUME)


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def is_table(tp: Any) -> bool:
    """A field holding a table of options of its own ([strategy.ddp])."""
    return dataclasses.is_dataclass(tp)
