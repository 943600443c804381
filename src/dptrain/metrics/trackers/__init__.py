"""Experiment trackers beside TensorBoard (output.trackers): rank 0's events sent to MLflow, Weights & Biases, ...

    $ pip install 'dptrain[mlflow]' && dptrain train --output.trackers mlflow     # a store in runs/<name>/mlflow/
    $ pip install 'dptrain[wandb]' && dptrain train --output.trackers wandb      # offline, runs/<name>/wandb/

A tracker is one module with one class (the Tracker protocol below: start, log, artifact, finish) and one line in
config.choices' TRACKERS (docs/extending.md). TrackerSink turns the events metrics.jsonl holds into its calls, the
same for every tracker: run_start -> start(the configuration as flat parameters), step and epoch -> log(their
numbers at the run's step), run_end -> artifact(the final weights), then finish("finished"); stopped ->
finish("stopped"); a run that ends otherwise -> finish("failed").

The calls run on a thread of the sink's own, in order (the tracker's import, its store's set-up and every write
included): the loop only puts each event on a queue, and never waits for a tracker. A tracker that raises is said
in one warning line and sent nothing more; the run goes on (metrics.jsonl keeps every event). At the run's end the
sink waits up to CLOSE_WAIT_S for what is still queued, and says so in one warning line where that was not enough.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any, Literal, Protocol

from dptrain.config import TRACKERS, RunConfig, to_dict
from dptrain.events import (EPOCH, EPOCH_EVENT, EVENT, RUN_END_EVENT, RUN_START_EVENT, STEP, STEP_EVENT, STOPPED_EVENT,
                            TIME)
from dptrain.imports import import_object
from dptrain.metrics.tensorboard import flat_hparams

log = logging.getLogger("dptrain")

CLOSE_WAIT_S = 120.0
"""How long the run's end waits for a tracker's queued calls (an MLflow store's first set-up takes seconds)."""

Status = Literal["finished", "stopped", "failed"]


class Tracker(Protocol):
    """One experiment tracker, as TrackerSink calls it (on its thread, in this order)."""

    def __init__(self, cfg: RunConfig) -> None: ...

    def start(self, params: dict[str, bool | int | float | str]) -> None:
        """Open (or, for a run folder that already has one, go on with) the tracker's run; log params on a new one."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Numbers at the run's optimizer step."""

    def artifact(self, path: Path) -> None:
        """A file of the run (the final weights)."""

    def finish(self, status: Status) -> None:
        """Close the tracker's run (a stopped run is resumed later, and goes on with it)."""


def metrics_of(event: dict[str, Any]) -> dict[str, float]:
    """A step's or epoch's numbers as a tracker takes them: step/<key> and epoch/<key>, each per-rank list as
    <kind>/<key>/rank<R>; not the step and epoch themselves (the step is the x value), nor nulls (a diverged loss)."""
    kind, numbers = event[EVENT], {}
    for key, value in event.items():
        if key in (EVENT, TIME, STEP) or (key == EPOCH and kind == EPOCH_EVENT.name):
            continue
        if isinstance(value, list):
            numbers.update({f"{kind}/{key}/rank{rank}": float(v) for rank, v in enumerate(value) if _number(v)})
        elif _number(value):
            numbers[f"{kind}/{key}"] = float(value)
    return numbers


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TrackerSink:
    """A Sink (write, close) that hands the events to one tracker on a thread of its own."""

    def __init__(self, name: str, tracker: Tracker, config: dict[str, Any], weights: Path) -> None:
        self.name, self.tracker, self.config, self.weights = name, tracker, config, weights
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = False
        self.step = 0
        self.ended = False
        self.thread = threading.Thread(target=self._run, name=f"dptrain-tracker-{name}", daemon=True)
        self.thread.start()

    def write(self, event: dict[str, Any]) -> None:
        """Never waits: the event's calls are queued for the tracker's thread."""
        if self.failed:
            return
        kind, self.step = event[EVENT], event.get(STEP, self.step)
        if kind == RUN_START_EVENT.name:
            self.calls.put((self.tracker.start, (flat_hparams(self.config),), self.step))
        elif kind in (STEP_EVENT.name, EPOCH_EVENT.name):
            self.calls.put((self.tracker.log, (metrics_of(event), self.step), self.step))
        elif kind == RUN_END_EVENT.name:
            if self.weights.is_file():
                self.calls.put((self.tracker.artifact, (self.weights,), self.step))
            self._finish("finished")
        elif kind == STOPPED_EVENT.name:
            self._finish("stopped")

    def _finish(self, status: Status) -> None:
        if not self.ended:
            self.ended = True
            self.calls.put((self.tracker.finish, (status,), self.step))

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            method, args, step = call
            if self.failed:
                continue
            try:
                method(*args)
            except Exception as exc:  # noqa: BLE001 - any failure of a tracker is its own, never the run's
                self.failed = True
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                log.warning("tracker %s failed at step %d (%s%s); the run goes on without it: metrics.jsonl keeps "
                            "every event", self.name, step, type(exc).__name__, f": {first}" if first else "")

    def close(self) -> None:
        """The run's end (or failure): its last calls, then the thread's end, waited for CLOSE_WAIT_S at most."""
        self._finish("failed")  # where neither run_end nor stopped came: the run failed
        self.calls.put(None)
        self.thread.join(CLOSE_WAIT_S)
        if self.thread.is_alive():
            log.warning("tracker %s had not sent everything %.0f s after the run ended; what it had not sent is lost "
                        "(metrics.jsonl keeps every event)", self.name, CLOSE_WAIT_S)


def open_trackers(cfg: RunConfig) -> list[TrackerSink]:
    """Rank 0's sink for each tracker of output.trackers (their imports and stores are made on their threads)."""
    config = to_dict(cfg)
    return [TrackerSink(name, import_object(TRACKERS[name].builds, "output.trackers")(cfg), config, cfg.output.weights)
            for name in cfg.output.trackers]
