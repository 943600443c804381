"""Reading a config file (TOML, or DeepSpeed's JSON) within bounds: read_config_text, and read_toml, the one way
dptrain reads TOML."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from dptrain import read_back
from dptrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


# Bounds on a config file (TOML, or DeepSpeed's JSON), checked before a parser sees it. A config is a few KB:
# /dev/zero given as one was read until memory ran out (7 GB); tomllib's time grows with the square of a dotted key's
# parts (50,000 parts: 61 s, 15 GB); tomllib and json recurse once per level of brackets (RecursionError near 1,000);
# Python refuses integers of over 4,300 digits with a ValueError that neither parser turns into its own error.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NESTING = 32
MAX_KEY_PARTS = 16
MAX_WORD_CHARS = 100
# TOML's strings and comments (JSON's strings are a subset). Once started, a match cannot fail (an unterminated string
# ends at the end of its line, or of the text for a multi-line one; a backslash at the end is taken alone), so every
# match consumes what it scanned and the scan is linear in the text (a failing match retried from every quote was not).
_STRINGS_AND_COMMENTS = re.compile(r'"""(?:\\.?|[^\\])*?(?:"""|\Z)|\'\'\'.*?(?:\'\'\'|\Z)|"(?:\\.?|[^"\\\n])*(?:"|\n|\Z)'
                                   r"|'[^'\n]*(?:'|\n|\Z)|#[^\n]*", re.DOTALL)
_DOTTED_WORDS = re.compile(r"[\w+:-]+(?:[ \t]*\.[ \t]*[\w+:-]+)*")  # a bare or dotted key, a number, a date


def read_config_text(path: Path, where: str) -> str:
    """A config file's text, refused in one sentence (ConfigError starting with `where`) where it is a directory,
    unreadable, over MAX_CONFIG_BYTES, not UTF-8, or nests, dots or spells out its words beyond any config's needs.
    FileNotFoundError is left to the caller, whose sentence says where the path came from."""
    try:  # a regular file only (a link to /dev/zero, a FIFO: refused, not read), never more than the cap
        data = read_back.read_bytes(Path(path), MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise
    except read_back.UnreadableFile as exc:
        if exc.problem.startswith("is larger"):
            raise ConfigError(f"{where} is larger than {MAX_CONFIG_BYTES >> 20} MiB, far more than a config holds; "
                              f"check that the path names the right file.") from None
        if exc.problem.startswith("is a folder"):
            raise ConfigError(f"{where} is a directory, not a file; give the path of the file.") from None
        raise ConfigError(f"{where} {exc.problem}; check that the path names the right file.") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}; a binary file?); "
                          f"check that the path names the right file.") from None
    bare = _STRINGS_AND_COMMENTS.sub(lambda m: "" if m.group().startswith("#") else "s", text)
    depth = 0
    for bracket in re.sub(r"[^\[\]{}]+", "", bare):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_CONFIG_NESTING:
            raise ConfigError(f"{where} nests brackets more than {MAX_CONFIG_NESTING} deep, far more than a config "
                              f"needs; fix the file.")
    for words in _DOTTED_WORDS.finditer(bare):
        parts = words.group().split(".")
        if len(parts) > MAX_KEY_PARTS:
            raise ConfigError(f"{where} has a dotted key of {len(parts)} parts (at most {MAX_KEY_PARTS}: an option is "
                              f"section.option); fix the file.")
        if max(map(len, parts)) > MAX_WORD_CHARS:
            raise ConfigError(f"{where} has a key or number longer than {MAX_WORD_CHARS} characters; fix the file.")
    return text


def read_toml(path: Path, where: str) -> dict[str, Any]:
    """A TOML file's tables, through read_config_text's bounds: the one way dptrain reads TOML (tomllib, or tomli on
    Python 3.10). ConfigError in one sentence starting with `where`; FileNotFoundError is left to the caller."""
    try:
        return tomllib.loads(read_config_text(path, where))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML ({exc}); fix the file.") from None
