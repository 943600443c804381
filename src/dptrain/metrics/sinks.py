"""One event stream -> sinks: metrics.jsonl and `[METRIC] key=value` lines (TensorBoard: tensorboard.py).

An event is one flat dict with stable keys (`event`, `time`, `epoch`, `step`, `train_loss`, ...), each event's named in
dptrain.events' schema. Only the global rank 0 gets sinks; the numbers it writes are already reduced over every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from dptrain.distributed.failures import WorkerFailure
from dptrain.events import EPOCH_EVENT, EVENT, TIME

log = logging.getLogger("dptrain")

CONSOLE = Console(stderr=False)


class Sink(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class MetricsWriteError(WorkerFailure):
    """metrics.jsonl could not be written (a full disk): one sentence, said as it is wherever the loop stands."""


class JsonlSink:
    """Appends one JSON object per event; flushed per line so a killed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        drop_cut_line(path)
        self.file = path.open("a", buffering=1)

    def write(self, event: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(event, sort_keys=False) + "\n")
        except OSError as exc:
            raise MetricsWriteError(f"could not write the metrics to {self.path} ({exc.strerror or exc}); free space or "
                                    f"fix permissions there, then run the same command.") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a line that could not be written has been said already
            self.file.close()


def drop_cut_line(path: Path) -> None:
    """A full disk can cut the last line short: it goes, so that what is appended after it stays one object per line."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        tail = b""
        while size > len(tail) and b"\n" not in tail:  # back to the last newline, 4 KiB at a time
            f.seek(max(0, size - len(tail) - 4096))
            tail = f.read(size - f.tell())
        if not tail.endswith(b"\n"):
            f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)


def metric_line(event: dict[str, Any]) -> str:
    """`[METRIC] epoch=1 train_loss=0.5123 ...`, the form the tutorials' collect scripts parse."""
    parts = []
    for key, value in event.items():
        if key in (EVENT, TIME):
            continue
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, list):  # one value per rank, no spaces: key=v0,v1,...
            value = ",".join(map(str, value))
        parts.append(f"{key}={value}")
    return "[METRIC] " + " ".join(parts)


class MetricLineSink:
    """One `[METRIC]` line per epoch event, always one line: grep-based collectors read it line by line."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or CONSOLE

    def write(self, event: dict[str, Any]) -> None:
        if event[EVENT] != EPOCH_EVENT.name:
            return
        line = metric_line(event)
        if not self.console.is_terminal:  # files and pipes: the plain log handler writes it as it is
            log.info(line)
            return
        # rich's log handler would wrap it over many lines at the terminal's width: the log files get the
        # record, the terminal the line itself, unwrapped (soft_wrap: the terminal folds it, no newlines added).
        log.info(line, extra={"file_only": True})
        self.console.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)

    def close(self) -> None:
        pass


class EventLog:
    """What rank 0 writes: emit(name, **fields) stamps the event's name and time and hands it to every sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {EVENT: event, TIME: round(time.time(), 3), **fields}
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN; a diverged loss is written as null and said so in the log."""
    return x if math.isfinite(x) else None
