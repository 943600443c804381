"""One event stream -> sinks: metrics.jsonl, `[METRIC] key=value` log lines, a rich progress bar.

An event is one flat dict with stable keys (`event`, `epoch`, `step`, `train_loss`, ...). Only the
global rank 0 gets sinks; the numbers it writes are already reduced over every rank.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger("dptrain")

CONSOLE = Console(stderr=False)


class Sink(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per event; flushed per line so a killed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def write(self, event: dict[str, Any]) -> None:
        self.file.write(json.dumps(event, sort_keys=False) + "\n")

    def close(self) -> None:
        self.file.close()


def metric_line(event: dict[str, Any]) -> str:
    """`[METRIC] epoch=1 train_loss=0.5123 ...`, the form the tutorials' collect scripts parse."""
    parts = []
    for key, value in event.items():
        if key in ("event", "time"):
            continue
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, list):  # one value per rank, no spaces: key=v0,v1,...
            value = ",".join(map(str, value))
        parts.append(f"{key}={value}")
    return "[METRIC] " + " ".join(parts)


class MetricLineSink:
    """One `[METRIC]` log line per epoch event."""

    def write(self, event: dict[str, Any]) -> None:
        if event["event"] == "epoch":
            log.info(metric_line(event))

    def close(self) -> None:
        pass


class EventLog:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class ProgressBar:
    """Rank 0's live bar in a terminal; silent when output goes to a file (SLURM logs, CI)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and CONSOLE.is_terminal
        self.progress: Progress | None = None
        self.task = None

    def start_epoch(self, epoch: int, num_epochs: int, total: int, done: int = 0) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=CONSOLE,
            )
            self.progress.start()
        self.task = self.progress.add_task(f"epoch {epoch}/{num_epochs}", total=total, completed=done, loss="")

    def advance(self, loss: float | None = None) -> None:
        if self.progress is not None:
            fields = {"loss": f"loss {loss:.4f}"} if loss is not None else {}
            self.progress.update(self.task, advance=1, **fields)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / 1024 if sys.platform != "darwin" else rss_kb / 2**20


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN; a diverged loss is written as null and said so in the log."""
    return x if math.isfinite(x) else None
