"""train.profile FIRST:LAST: torch.profiler over those optimizer steps on every rank, each rank's trace in the run's
TensorBoard folder (tb/profile/rank<R>.<time>.pt.trace.json), for TensorBoard's profiler plugin, Perfetto or
chrome://tracing.

    $ dptrain train --nproc-per-node 2 --train.profile 10:15

The step itself (TrainStep) enters StepProfiler.step() around every step: the profiler starts before step FIRST (or
the first step of a resumed run that stands between FIRST and LAST), marks each step (ProfilerStep#N, N the run's step),
and stops after step LAST, or the run's last step where that comes first, when the trace is written. A run stopped
before then (a signal, a failure) writes none. The profiler's own cost (its record of every operator) falls on the
profiled steps only: their time in the epoch's numbers is the profiled one.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

log = logging.getLogger("dptrain")


class StepProfiler:
    """torch.profiler from step `first` to step `last` (both included) of the run, this rank's trace into `folder`."""

    def __init__(self, first: int, last: int, folder: Path, rank: int, device: torch.device, next_step: int,
                 total_steps: int) -> None:
        self.first, self.last = first, min(last, total_steps)
        self.folder, self.rank, self.device = folder, rank, device
        self.next_step = next_step
        """The run's step that the next call of step() is (a resumed run's first is its snapshot's step + 1)."""
        self.profiler: Any = None
        if first > total_steps and rank == 0:
            log.warning("train.profile %d:%d starts after the run's last step (%d): nothing is profiled", first, last,
                        total_steps)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step, profiled where it lies in FIRST:LAST."""
        step, self.next_step = self.next_step, self.next_step + 1
        if not self.first <= step <= self.last:
            yield
            return
        if self.profiler is None:
            self._start(step)
        yield
        if step < self.last:
            self.profiler.step()  # ends ProfilerStep#<step>, begins the next one's
        else:
            self._stop(step)

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.folder.mkdir(parents=True, exist_ok=True)
        # A schedule that records every step until stop(): with one, the profiler marks the steps (without, it does not)
        handler = tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")
        self.profiler = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD, on_trace_ready=handler)
        self.profiler.step_num = step  # its step marks say the run's step: ProfilerStep#<step>
        self.started = step
        self.profiler.start()

    def _stop(self, step: int) -> None:
        self.profiler.stop()  # writes the trace (on_trace_ready)
        self.profiler = None
        if self.rank == 0:
            log.info("train.profile: steps %d to %d profiled on every rank, the traces in %s", self.started, step,
                     self.folder)
