"""Rank 0's progress: a live rich bar in a terminal, a plain line every few seconds in a file or pipe."""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dptrain.metrics.sinks import CONSOLE

log = logging.getLogger("dptrain")


def progress_line(epoch: int, num_epochs: int, step: int, total_steps: int, images_per_s: float, eta_s: float) -> str:
    """`progress: epoch 1/2 step 120/938 1163 images/s ETA 0:11:42`: one line a log collector can parse."""
    if not math.isfinite(eta_s):
        eta = "unknown"
    elif eta_s < 86400:
        eta = time.strftime("%H:%M:%S", time.gmtime(max(eta_s, 0.0)))
    else:
        eta = f"{eta_s / 3600:.0f}h"
    return f"progress: epoch {epoch}/{num_epochs} step {step}/{total_steps} {images_per_s:.0f} images/s ETA {eta}"


class ProgressBar:
    """A live bar when stdout is a terminal; otherwise (SLURM output files, `tail -f`, CI) a plain progress line
    every `every_s` seconds (0: none): epoch, step of the run's total, images/s since the last line, ETA."""

    def __init__(self, enabled: bool, every_s: float = 0.0, total_steps: int = 0, start_step: int = 0,
                 console: Console | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.console = console or CONSOLE
        terminal = self.console.is_terminal
        self.enabled = enabled and terminal
        self.lines = enabled and not terminal and every_s > 0
        self.every_s, self.total_steps, self.clock = every_s, total_steps, clock
        self.progress: Progress | None = None
        self.task = None
        self.epoch, self.num_epochs = 0, 0
        self.start_step, self.start_time = start_step, clock()  # the ETA's rate: steps done in this process
        self.mark_time, self.mark_samples = self.start_time, 0  # images/s: over the interval since the last line

    def start_epoch(self, epoch: int, num_epochs: int, total: int, done: int = 0) -> None:
        self.epoch, self.num_epochs = epoch, num_epochs
        if not self.enabled:
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
            )
            self.progress.start()
        self.task = self.progress.add_task(f"epoch {epoch}/{num_epochs}", total=total, completed=done, loss="")

    def advance(self, loss: float | None = None, step: int = 0, samples: int = 0) -> None:
        """One step done: `step` is the run's global step, `samples` the global batch it trained."""
        if self.progress is not None:
            fields = {"loss": f"loss {loss:.4f}"} if loss is not None else {}
            self.progress.update(self.task, advance=1, **fields)
        if self.lines:
            self._maybe_line(step, samples)

    def _maybe_line(self, step: int, samples: int) -> None:
        self.mark_samples += samples
        now = self.clock()  # host clock, no device sync: the rate covers whatever the device has queued
        if now - self.mark_time < self.every_s:
            return
        rate = self.mark_samples / (now - self.mark_time)
        done = step - self.start_step
        eta = (self.total_steps - step) * (now - self.start_time) / done if done > 0 else float("inf")
        log.info(progress_line(self.epoch, self.num_epochs, step, self.total_steps, rate, eta))
        self.mark_time, self.mark_samples = now, 0

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
