"""Stragglers named while training: each rank times its own work outside the collectives (OwnClock), the epoch's
account compares the ranks' times (epoch_account: one all-reduce of a world x 4 table per epoch), and straggler()
names the rank that is slower than the others, with its host, the phase (compute, data or link) and by how much.

Every `train.log_every` steps the ranks also compare the window of steps since the last log step, through the
world's store rather than a collective (which would change what the collectives' faults and counts see): each rank
sets its window's four numbers under a key of its own just before the log step's loss all-reduce, so that once that
all-reduce has returned on rank 0 every rank's window is there, and rank 0 reads them all (one multi_get where the
store has it) and names the window's straggler in the step event. One key a rank, overwritten: nothing piles up in
the store. What it costs: one store set a rank and one read of the world's keys on rank 0, each log step.

Why not the step's time: a data-parallel step ends in a collective that waits for the slowest rank, so every rank's
step takes as long as the slowest one's, and per-rank step times name no one. A rank's own time is what it would
take alone:

- data: the wait for its next batch (the loader's next(), host time);
- compute: from its model's forward (the inner module's forward pre-hook, after DDP's buffer broadcast) to its last
  gradient ready (the parameters' post-accumulate hooks): forward and backward without DDP's wait for the other
  ranks' buckets, which comes after the last gradient. The optimizer step is left out: ZeRO-1, local SGD and DiLoCo
  exchange there, and for the others it is the same work on every rank.

On CPU every step's compute is timed twice, with the host's wall clock and with the process's CPU time (a hook call
per parameter per step, about a microsecond each): the wall clock sees a rank held up by a CPU quota or a sleep, the
CPU time sees a rank that computes more for the same step (a slower or throttled core) even where the ranks share
cores and take each other's time, as 4 ranks on 2 cores do. On CUDA the host clock would time the launches, not the
work: one step in every `every` is timed with CUDA events, read at a later step once the work has finished, and there
is no CPU column.

Each epoch's first step is not timed: it carries the loader's start and, in a run's first epoch, the one-time costs
(the allocator's first blocks, the first use of each kernel, DDP's first buckets), which differ from rank to rank by
more than the margin: a 2-step epoch of two equal ranks named one 28% and 106% slower. Nor is a straggler named in an
epoch of fewer than MIN_STEPS timed steps: a step's own time varies by 10-20% from one step to the next on a shared
CPU, and a handful of them does not average that out.

A slow link shows in no rank's own time: every rank of a ring waits as long as the slowest link. In a run of 3 nodes
or more each node's link is measured at the epoch's end (metrics.link_probe), and a node whose link is more than
SLOWER_PCT slower than the others' is named, in the link phase (link_straggler), where it is more above the others
than any rank's own time: in one lab run a slow link also raised its rank's compute CPU time by 34% (likely gloo's
threads, which send the buckets during backward and count in the process's CPU time; not checked), so that rank can
be named in compute too. The log steps' windows do not probe: a window can name a slow link's rank in compute. With
2 nodes, `dptrain doctor` measures their link before a run.

What it cannot see: waits inside forward on FSDP (its all-gathers count as compute there).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from dptrain import faults
from dptrain.events import (DATA_WAIT_MS_PER_STEP, OWN_COMPUTE_CPU_MS_PER_STEP, OWN_COMPUTE_MS_PER_STEP, STRAGGLER_HOST,
                            STRAGGLER_PHASE, STRAGGLER_RANK, STRAGGLER_SLOWER_PCT)
from dptrain.metrics.link_probe import FLOOR_MS, MIN_NODES, PROBE_BYTES

SLOWER_PCT = 20.0
"""A rank is named a straggler of an epoch when its own time (or its compute's CPU time) a step is more than this many
percent above the other ranks' median."""
MIN_STEPS = 8
"""The fewest timed steps (each rank's, in the epoch) over which a straggler is named."""


class OwnClock:
    """This rank's own time in the training steps of an epoch (see the module's docstring): data and compute seconds,
    and the steps timed. Armed only inside a training step (step()), so evaluation's forwards are not counted."""

    def __init__(self, module: nn.Module, device: torch.device, every: int = 1,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.device, self.clock, self.cpu_clock = device, clock, cpu_clock
        self.on_cuda = device.type == "cuda"
        self.every = 1 if not self.on_cuda else max(1, every)
        self.data_s = self.compute_s = self.compute_cpu_s = 0.0
        self.started_cpu = self.last_grad_cpu = 0.0
        self.step_compute_cpu_s = 0.0
        self.steps = self.timed_steps = 0
        self.waited_s = 0.0  # the wait for the batches of the step under way, counted when it ends
        self.last_window: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)
        self.armed = self.cuda_started = self.warm = False
        self.started: float | None = None
        self.last_grad: float | None = None
        self.step_compute_s = self.previous_compute_s = self.previous_compute_cpu_s = 0.0
        self.events: tuple[Any, Any] | None = None
        self.pending: tuple[Any, Any] | None = None
        self.slow, self.slow_data = faults.slow_fraction("compute"), faults.slow_fraction("data")
        params = [p for p in module.parameters() if p.requires_grad]
        # On CUDA only the first parameters, whose gradients backward makes last: an event record costs microseconds.
        watched = params[:4] if self.on_cuda else params
        self.handles = [module.register_forward_pre_hook(self._forward_starts)]
        try:
            self.handles += [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in watched]
        except RuntimeError:  # a parameter that is no leaf of autograd's (a strategy's own kind): compute untimed
            self.close()

    def batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The batches, the wait for each added to data_s."""
        iterator = iter(batches)
        while True:
            began = self.clock()
            if self.slow_data:  # faults.SLOW in data: a slower disk, waited for
                time.sleep(self.slow_data * self.previous_compute_s)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.waited_s += self.clock() - began
            yield batch

    def step(self) -> "_Armed":
        """The training step's span: hooks count inside it only."""
        return _Armed(self)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def totals(self, wait: bool = True) -> tuple[float, float, float, int]:
        """(compute seconds, compute CPU seconds, data seconds, steps) of this epoch so far; on CUDA the compute of the
        timed steps scaled to every step, and -1 for the CPU seconds (not measured). wait: for a timed CUDA step's
        events to complete (else what has completed)."""
        self._read_pending(wait=wait)
        compute = self.compute_s * self.steps / self.timed_steps if self.timed_steps else 0.0
        return compute, -1.0 if self.on_cuda else self.compute_cpu_s, self.data_s, self.steps

    def window(self) -> tuple[float, float, float, int]:
        """totals() since the last call in this epoch (or its start), without waiting on the device: a log step's
        window of steps. -1 for the CPU seconds on CUDA."""
        now = self.totals(wait=False)
        before, self.last_window = self.last_window, now
        compute, cpu, data, steps = (a - b for a, b in zip(now, before))
        return compute, (-1.0 if self.on_cuda else cpu), data, int(steps)

    # ---- the hooks ---------------------------------------------------------------------------------------------

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if not self.armed:
            return
        self._close_interval()  # a micro-batch's forward after the previous one's backward
        if self.on_cuda:
            if self.events is not None and not self.cuda_started:  # from the first micro-batch's forward
                self.events[0].record()
                self.cuda_started = True
            return
        self.started, self.started_cpu = self.clock(), self.cpu_clock()
        if self.slow:  # faults.SLOW: a CPU that much slower, spun here, inside the compute it slows
            # the spin's own thread's CPU time: the process's also counts other threads' work meanwhile
            spin_until(time.thread_time() + self.slow * self.previous_compute_cpu_s, time.thread_time)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        if self.events is not None:
            self.events[1].record()  # re-recorded: the last record marks the last gradient
        elif not self.on_cuda:
            self.last_grad, self.last_grad_cpu = self.clock(), self.cpu_clock()

    def _close_interval(self) -> None:
        if self.started is not None and self.last_grad is not None and self.last_grad > self.started:
            self.step_compute_s += self.last_grad - self.started
            self.step_compute_cpu_s += self.last_grad_cpu - self.started_cpu
        self.started = self.last_grad = None

    def _enter(self) -> None:
        self._read_pending(wait=False)
        self.armed, self.step_compute_s, self.step_compute_cpu_s, self.cuda_started = True, 0.0, 0.0, False
        if self.on_cuda and self.warm and self.steps % self.every == 0 and self.pending is None:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def _leave(self) -> None:
        self.armed = False
        timed, self.warm = self.warm, True  # the epoch's first step is not timed (the module's docstring)
        waited, self.waited_s = self.waited_s, 0.0
        if not self.on_cuda:
            self._close_interval()
            self.previous_compute_cpu_s = self.step_compute_cpu_s / (1 + self.slow)  # the compute without the spin
            self.previous_compute_s = self.step_compute_s
        if not timed:
            return
        self.steps += 1
        self.data_s += waited
        if self.on_cuda:
            if self.events is not None:
                self.pending, self.events = self.events, None
            return
        self.compute_s += self.step_compute_s
        self.compute_cpu_s += self.step_compute_cpu_s
        self.timed_steps += 1

    def _read_pending(self, wait: bool) -> None:
        """A timed CUDA step's compute, once its events have completed (at the latest at the epoch's end)."""
        if self.pending is None:
            return
        start, end = self.pending
        if not wait and not end.query():
            return
        end.synchronize()
        self.compute_s += start.elapsed_time(end) / 1e3
        self.timed_steps += 1
        self.pending = None


class _Armed:
    def __init__(self, clock: OwnClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.clock._enter()

    def __exit__(self, *exc: Any) -> None:
        self.clock._leave()


def spin_until(deadline: float, clock: Callable[[], float]) -> None:
    """Busy work until the clock reaches deadline (a slower CPU's extra time is spent computing, not sleeping)."""
    while clock() < deadline:
        pass


@dataclass(frozen=True)
class Straggler:
    """The rank slower than the others over an epoch: its rank and host, the phase its extra time went to, how much
    slower it was than the median of the other ranks, and by which measure (its own time a step, or its compute's CPU
    time a step)."""

    rank: int
    host: str
    phase: str
    slower_pct: float
    measure: str
    own_ms: float
    others_ms: float

    def fields(self) -> dict[str, Any]:
        return {STRAGGLER_RANK: self.rank, STRAGGLER_HOST: self.host, STRAGGLER_PHASE: self.phase,
                STRAGGLER_SLOWER_PCT: round(self.slower_pct, 1)}

    def sentence(self, epoch: int) -> str:
        if self.phase == LINK_PHASE:
            return (f"the link of {self.host} (the node of rank {self.rank}) was {self.slower_pct:.0f}% slower than "
                    f"the other nodes' in epoch {epoch} ({self.own_ms:.1f} ms to move the link probe's "
                    f"{PROBE_BYTES // 1024} KiB against {self.others_ms:.1f}); every all-reduce waited for it: check "
                    f"that host's cable, port speed and interface, or leave it out of the run (launch.leave_slow_node "
                    f"does, in a run of --nnodes MIN:MAX)")
        return (f"rank {self.rank} ({self.host}) was {self.slower_pct:.0f}% slower than the other ranks in epoch "
                f"{epoch}, in {self.phase} ({self.own_ms:.1f} ms of {self.measure} a step against {self.others_ms:.1f}); "
                f"the others waited for it at every step: look at that host's load, or leave it out of the run "
                f"(launch.leave_slow_node does, in a run of --nnodes MIN:MAX)")


OWN_TIME_MEASURE, CPU_MEASURE, LINK_MEASURE = "its own time", "CPU time", "link time"
LINK_PHASE = "link"


def straggler(compute_ms: Sequence[float], data_ms: Sequence[float], hosts: Sequence[str] | None = None,
              compute_cpu_ms: Sequence[float] | None = None, slower_pct: float = SLOWER_PCT,
              steps: int | None = None) -> Straggler | None:
    """The rank most above the median of the other ranks, where that is more than slower_pct, by either measure: its
    own time a step (compute + data; the phase is the one whose own excess over the others' median is the larger), or
    its compute's CPU time a step (phase compute). None with one rank, over fewer than MIN_STEPS timed steps (steps:
    the fewest of any rank; None: not checked), or where no rank is that much slower."""
    ranks = len(compute_ms)
    if ranks < 2 or len(data_ms) != ranks or (steps is not None and steps < MIN_STEPS):
        return None
    own = [c + d for c, d in zip(compute_ms, data_ms)]
    measures = [(OWN_TIME_MEASURE, own)]
    if compute_cpu_ms is not None and len(compute_cpu_ms) == ranks and min(compute_cpu_ms) >= 0:
        measures.append((CPU_MEASURE, list(compute_cpu_ms)))
    found: Straggler | None = None
    for measure, values in measures:
        hit = most_above(values, slower_pct)
        if hit is None or (found is not None and found.slower_pct >= hit[1]):
            continue
        rank, pct, median = hit
        phase = "compute"
        if measure == OWN_TIME_MEASURE:
            others = [r for r in range(ranks) if r != rank]
            compute_excess = compute_ms[rank] - statistics.median(compute_ms[r] for r in others)
            data_excess = data_ms[rank] - statistics.median(data_ms[r] for r in others)
            phase = "compute" if compute_excess >= data_excess else "data"
        host = hosts[rank] if hosts is not None and rank < len(hosts) else "?"
        found = Straggler(rank=rank, host=host, phase=phase, slower_pct=pct, measure=measure,
                          own_ms=values[rank], others_ms=median)
    return found


def most_above(values: Sequence[float], slower_pct: float, floor: float = 0.0) -> tuple[int, float, float] | None:
    """(index, percent above, the others' median) of the value most above the median of the others, where that is
    more than slower_pct and the value more than floor (the first of equals); None where none is."""
    found: tuple[int, float, float] | None = None
    for index, value in enumerate(values):
        median = statistics.median(v for i, v in enumerate(values) if i != index)
        if median <= 0 or value <= max(median * (1 + slower_pct / 100), floor):
            continue
        pct = 100 * (value / median - 1)
        if found is None or pct > found[1]:
            found = (index, pct, median)
    return found


def link_straggler(link_ms: Sequence[float], per_node: int, hosts: Sequence[str] | None = None,
                   slower_pct: float = SLOWER_PCT) -> Straggler | None:
    """The node whose link time (metrics.link_probe.node_link_ms) is the most above the other nodes' median, where
    that is more than slower_pct and its link time is above link_probe.FLOOR_MS, named by its first rank and host, in
    the link phase; None with fewer than link_probe.MIN_NODES nodes or where no link is that much slower."""
    hit = most_above(link_ms, slower_pct, floor=FLOOR_MS) if len(link_ms) >= MIN_NODES else None
    if hit is None:
        return None
    node, pct, median = hit
    rank = node * per_node
    host = hosts[rank] if hosts is not None and rank < len(hosts) else "?"
    return Straggler(rank=rank, host=host, phase=LINK_PHASE, slower_pct=pct, measure=LINK_MEASURE,
                     own_ms=link_ms[node], others_ms=median)


WINDOW_KEY = "dptrain/own_window/"
"""The store's key prefix of each rank's last window (its global rank appended)."""


def publish_window(store: Any, rank: int, step: int, window: tuple[float, float, float, int]) -> None:
    """This rank's window of own times up to log step `step`, for rank 0 (before the step's loss all-reduce)."""
    store.set(f"{WINDOW_KEY}{rank}", json.dumps([step, *window]))


def window_straggler(store: Any, world_size: int, step: int, hosts: Sequence[str] | None) -> Straggler | None:
    """Rank 0, after log step `step`'s loss all-reduce: the straggler of the ranks' windows ending at that step, or
    None (no rank that much slower, fewer than MIN_STEPS steps in a window, or a rank already past it: a strategy that
    steps without collectives between log steps lets one run ahead)."""
    keys = [f"{WINDOW_KEY}{rank}" for rank in range(world_size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
    rows = [json.loads(value) for value in values]
    if any(row[0] != step for row in rows):
        return None
    return straggler_of([[row[i] for row in rows] for i in range(1, 5)], hosts)


def straggler_of(columns: Sequence[Sequence[float]], hosts: Sequence[str] | None) -> Straggler | None:
    """straggler() of the (compute s, compute CPU s, data s, steps) columns over the ranks: an epoch's (the
    epoch account's table) or a log step's window's."""
    times = own_time_fields(columns)
    return straggler(times[OWN_COMPUTE_MS_PER_STEP], times[DATA_WAIT_MS_PER_STEP], hosts,
                     compute_cpu_ms=times.get(OWN_COMPUTE_CPU_MS_PER_STEP), steps=int(min(columns[3])))


def own_time_fields(columns: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """The epoch event's per-rank milliseconds a step, from the (compute s, compute CPU s, data s, steps) columns over
    the ranks; no CPU field where a rank did not measure it (CUDA)."""
    compute, compute_cpu, data, steps = columns
    per_step = [max(n, 1) for n in steps]
    fields = {OWN_COMPUTE_MS_PER_STEP: [round(1e3 * c / n, 3) for c, n in zip(compute, per_step)]}
    if min(compute_cpu) >= 0:
        fields[OWN_COMPUTE_CPU_MS_PER_STEP] = [round(1e3 * c / n, 3) for c, n in zip(compute_cpu, per_step)]
    return fields | {DATA_WAIT_MS_PER_STEP: [round(1e3 * d / n, 3) for d, n in zip(data, per_step)]}
