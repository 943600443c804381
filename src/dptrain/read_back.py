"""Reading back the files dptrain and its lab wrote (JSON, JSON lines, TOML, CSV) from folders that others may have
written to: one bounded read, and the checks of the values taken from what was read.

A run folder, a sweep's folder, `--probes-from` and `--fitted-on` are paths a user gives and anyone with write access
to them may have planted a file in: a link to /dev/zero (a read that never ends), a FIFO (a read that never returns),
a file of gigabytes, numbers that overflow (1e308 seconds), that divide by zero (0 TFLOPS) or that are not numbers at
all. So every such file is opened without blocking, taken only when it is a regular file (after links), read up to a
cap and no further, and each value is checked as it is taken (a finite number in its range, of the right type); what
is not what dptrain writes is refused in one sentence (UnreadableFile) that names the file and what is wrong in it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar

from dptrain.errors import ConfigError

T = TypeVar("T")

# The caps: far above what dptrain writes into each kind of file, far below what would hurt a 1 GB node.
SMALL_BYTES = 1 << 20  # a JSON or TOML file of settings or figures: env.json, peak.json, link.json, sweep.json, a manifest
TABLE_BYTES = 256 << 20  # metrics.jsonl (an event per logged step: ~200 bytes each), results.csv


NOT_JSON = "it is not JSON"


class UnreadableFile(ConfigError):
    """A file read back that is not what dptrain writes there; str() is one sentence: the path, what is wrong
    (`problem`, a phrase a caller may show on its own), and what to do."""

    def __init__(self, path: Path, problem: str, advice: str = "delete it, or give another folder") -> None:
        self.path, self.problem = path, problem
        super().__init__(f"{path} {problem}; {advice}.")


class BadValue(ValueError):
    """A value taken from a file that is not what dptrain writes there; str() is a phrase: 'probes[0].seconds is
    1e+308, not a number from 1e-09 to 1e+04'."""


ADVICE = "delete it, or give another folder"


class NotRegularFile(OSError):
    """The path is a FIFO, a device, a socket or a folder (after links): opening or reading it could block for ever or
    never end. strerror says what it is: 'a FIFO, not a regular file'."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", str(path))
        self.kind = kind


def special_kind(mode: int) -> str | None:
    """What a stat mode names, where it is not a regular file ('a FIFO', 'a character device'); None for a regular
    file."""
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in kinds if is_kind(mode)), "not a file")


def open_regular(path: Path) -> BinaryIO:
    """path opened for binary reading if it is a regular file, after links (NotRegularFile otherwise; FileNotFoundError
    or another OSError if it cannot be opened): the one way dptrain opens a file that others may have put there.

    Checked before the open (opening a device can have effects of its own) and again on the open file, for a path
    swapped since; O_NONBLOCK makes that open of a swapped-in FIFO return at once instead of waiting for a writer."""
    kind = special_kind(os.stat(path).st_mode)
    if kind is not None:
        raise NotRegularFile(path, kind)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = special_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotRegularFile(path, kind)
        os.set_blocking(fd, True)  # a regular file, read as usual from here
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def not_regular_problem(exc: NotRegularFile) -> str:
    """The phrase an UnreadableFile (or a caller's own sentence) says of a path that is no regular file."""
    return "is a folder, not a file" if exc.kind == "a folder" else f"is {exc.kind}, not a regular file"


def read_bytes(path: Path, limit: int = SMALL_BYTES, advice: str = ADVICE, *, cut: bool = False) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (cut: its first `limit` bytes, however large it is).
    FileNotFoundError passes through (a missing file is often no fault: the caller words it); anything else that is
    not such a file is UnreadableFile, whose sentence ends with `advice`."""
    try:
        with open_regular(path) as file:
            data = file.read(limit if cut else limit + 1)
    except FileNotFoundError:
        raise
    except NotRegularFile as exc:
        raise UnreadableFile(path, not_regular_problem(exc), advice) from None
    except IsADirectoryError:
        raise UnreadableFile(path, "is a folder, not a file", advice) from None
    except OSError as exc:
        raise UnreadableFile(path, f"cannot be read ({exc.strerror or type(exc).__name__})", advice) from None
    if len(data) > limit:
        raise UnreadableFile(path, f"is larger than {_size(limit)}, far more than dptrain writes there", advice)
    return data


def read_text(path: Path, limit: int = SMALL_BYTES, errors: str = "strict", advice: str = ADVICE) -> str:
    """read_bytes as UTF-8 text (errors="replace" for a log, where a bad byte is no reason to refuse)."""
    data = read_bytes(path, limit, advice)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise UnreadableFile(path, f"is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})", advice) from None


def read_head(path: Path, limit: int) -> str:
    """The first `limit` bytes of a regular file as text, bad bytes replaced: a log's or an error file's head."""
    return read_bytes(path, limit, cut=True).decode("utf-8", errors="replace")


def read_json(path: Path, take: Callable[[Any], T], limit: int = SMALL_BYTES, advice: str = ADVICE) -> T:
    """A JSON file's value, through `take` (which checks what it takes, raising BadValue): UnreadableFile where the
    file is not one read_bytes takes, not JSON, or holds a value `take` refuses."""
    value = parse_json(read_text(path, limit, advice=advice), path, advice)
    try:
        return take(value)
    except BadValue as exc:
        raise UnreadableFile(path, f"is not what dptrain writes there ({exc})", advice) from None


def read_json_object(path: Path, limit: int = SMALL_BYTES) -> dict[str, Any]:
    """A small JSON file that holds one object (env.json, a manifest); UnreadableFile where it is not one."""
    return read_json(path, lambda value: mapping(value, "the file"), limit)


def parse_json(text: str, path: Path, advice: str = ADVICE) -> Any:
    """JSON text of a file (path names it in the refusal)."""
    try:
        return json.loads(text)
    # ValueError: not JSON, or an integer of over 4,300 digits; RecursionError: brackets nested about 1,000 deep
    except (ValueError, RecursionError) as exc:
        raise UnreadableFile(path, f"is not JSON ({str(exc)[:80]})", advice) from None


def parse_json_line(line: str) -> Any:
    """One line of a JSON-lines file; BadValue where it is not JSON."""
    try:
        return json.loads(line)
    except RecursionError:  # brackets nested thousands deep: Python's parser recurses once per bracket
        raise BadValue("it nests brackets too deep to be an event") from None
    except ValueError:
        raise BadValue(NOT_JSON) from None


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"


# ---- values, checked as they are taken --------------------------------------------------------------------------------

def shown(value: Any) -> str:
    """A bad value quoted in a message, cut short: it came from a file that may hold anything."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_number(value: Any) -> bool:
    """A finite int or float; True and False are ints to Python but not numbers in a file of figures."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number(value: Any, name: str, low: float, high: float, *, above_low: bool = False) -> float:
    """value as a float where it is a finite number from low (excluded where above_low) to high; else BadValue."""
    if not is_number(value) or value > high or value < low or (above_low and value == low):
        span = f"above {low:g} and at most {high:g}" if above_low else f"from {low:g} to {high:g}"
        raise BadValue(f"{name} = {shown(value)}, not a number {span}")
    return float(value)


def integer(value: Any, name: str, low: int, high: int) -> int:
    """value as an int where it is an integer (1.0 counts) from low to high; else BadValue."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value) < 20:
        value = int(value)  # a JSON object's keys are strings: {"256": ...}
    if not is_number(value) or value != int(value) or not low <= value <= high:
        raise BadValue(f"{name} = {shown(value)}, not an integer from {low} to {high}")
    return int(value)


def text(value: Any, name: str, max_chars: int = 200) -> str:
    """value where it is a string of at most max_chars characters; else BadValue."""
    if not isinstance(value, str) or len(value) > max_chars:
        raise BadValue(f"{name} = {shown(value)}, not a text of at most {max_chars} characters")
    return value


def mapping(value: Any, name: str, max_items: int = 10_000) -> dict[str, Any]:
    """value where it is a JSON object of at most max_items keys; else BadValue."""
    if not isinstance(value, dict) or len(value) > max_items:
        raise BadValue(f"{name} is {'too large' if isinstance(value, dict) else shown(value)}, not an object "
                       f"of at most {max_items} entries")
    return value


def sequence(value: Any, name: str, max_items: int = 10_000) -> list[Any]:
    """value where it is a JSON array of at most max_items items; else BadValue."""
    if not isinstance(value, list) or len(value) > max_items:
        raise BadValue(f"{name} is {'too long' if isinstance(value, list) else shown(value)}, not a list of at most "
                       f"{max_items} items")
    return value


def field(data: dict[str, Any], key: str, name: str) -> Any:
    """data[key], BadValue in words where it is missing (name: where data sits, 'probes[0]')."""
    if key not in data:
        raise BadValue(f"{name} has no {key}")
    return data[key]


def read_json_lines(path: Path, problem_of: Callable[[dict[str, Any]], str | None] = lambda event: None,
                    limit: int = TABLE_BYTES) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects of a JSON-lines file (metrics.jsonl) that problem_of finds nothing wrong with, and where and why
    the others were skipped ("line 7: ..."); nothing where the file is missing.

    One rule for every line that cannot be used, whether it is not JSON, JSON but no object, or an object whose
    fields problem_of refuses: it is skipped, as a line cut short by a killed writer always was, and counted, so that
    numbers never come silently from fewer lines. The last line alone, when it is not JSON, is skipped without a
    word: that is how a killed writer's file ends. Refusing the file instead would hold up every other run for one
    line; a file that is not one read_bytes takes (too large, a device) is refused (UnreadableFile)."""
    try:
        lines = read_text(path, limit, errors="replace").split("\n")
    except FileNotFoundError:
        return [], []
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    objects, skipped = [], []
    for number, line in enumerate(lines, start=1):
        try:
            value = parse_json_line(line)
        except BadValue as exc:
            cut_short = number == len(lines) and str(exc) == NOT_JSON
            if line.strip() and not cut_short:
                skipped.append(f"line {number}: {exc}")
            continue
        problem = problem_of(value) if isinstance(value, dict) else "it is JSON but not an object"
        if problem:
            skipped.append(f"line {number}: {problem}")
        else:
            objects.append(value)
    return objects, skipped
