"""One epoch's accounting on one rank: the loop hands it each step's numbers, then what the rank measured of the
epoch; the account reduces them over the ranks (EpochAccount.reduce: its collectives written out in their order, with
float64 sums so that the totals are exact) and gives the epoch event's training fields (loss, accuracy, samples, time,
rates, memory, communication, utilisation), named and ordered as events.EPOCH_EVENT has them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from dptrain.events import (ACHIEVED_TFLOPS, COMM_TIMING, EPOCH_TIME_S, FOOTPRINT, LINK_PROBE_MS, LINK_PROBE_S, LR,
                            MODEL_FLOPS_PER_SAMPLE, PEAK_MEM_MB, SAMPLES_PER_S, SKIPPED_STEPS, TRAIN_ACC, TRAIN_LOSS,
                            TRAIN_SAMPLES)
from dptrain.metrics.link_probe import LinkProbe, node_link_ms
from dptrain.metrics.stragglers import Straggler, link_straggler, own_time_fields, straggler_of
from dptrain.metrics.utilisation import peak_memory_mb, per_rank


class StepCount(Protocol):
    """What the account keeps up to date in the loop's TrainState (metrics sits beside train_state: no import)."""

    epoch_elapsed: float
    epoch_seen: int

    def count_step(self, loss_sum: torch.Tensor, correct: torch.Tensor, rank_count: int, global_count: int) -> None: ...


class EpochAccount:
    """This rank's count of the epoch under way: its steps in this process and its clock, which goes on from the
    snapshot's time in a resumed epoch. The sums themselves live in the TrainState (a snapshot keeps them)."""

    def __init__(self, state: StepCount, world_size: int, global_rank: int,
                 clock: Callable[[], float] = time.perf_counter, hosts: Sequence[str] | None = None) -> None:
        self.state, self.world_size, self.global_rank, self.clock = state, world_size, global_rank, clock
        self.hosts = hosts
        """Every rank's host, by global rank, to name a straggler's (None: named ?)."""
        self.steps = 0
        """Steps in this process's part of the epoch (the bytes sent per step divide by them)."""
        self.started = clock() - state.epoch_elapsed

    def count(self, loss_sum: torch.Tensor, correct: torch.Tensor, rank_count: int, global_count: int) -> None:
        """One step done: its sums into the state (on the device, in place: no host sync) and the time so far."""
        self.state.count_step(loss_sum, correct, rank_count, global_count)
        self.steps += 1
        self.state.epoch_elapsed = self.clock() - self.started  # host clock, no sync: what a snapshot records

    def stop_clock(self) -> float:
        """The epoch's time: read once the sums' reduction has waited for every rank, so that it covers the slowest."""
        self.state.epoch_elapsed = self.clock() - self.started
        return self.state.epoch_elapsed

    def reduce(self, sums: torch.Tensor, all_reduce: AllReduce, device: torch.device, measured: RankMeasures,
               link_probe: LinkProbe | None = None) -> EpochTotals:
        """The epoch over every rank (a collective), in this order of all-reduces, the same on each rank: this rank's
        float64 sums (loss, correct, samples), which also wait for every rank, so that the clock, stopped after them,
        covers the slowest; the peak memory; the footprint table; the communication times' table (where the strategy
        times them, with 2 ranks or more); the own times' table (where timed); the link probe's table (with a probe,
        measured here, after the clock); the utilisation table."""
        totals = all_reduce(sums.clone())
        elapsed = self.stop_clock()
        peak = all_reduce(torch.tensor([peak_memory_mb(device)], device=device), op="max")
        footprint = all_reduce(self.own_row([*measured.held_bytes, measured.sent_bytes_per_step], device)).t().tolist()
        timing = None
        if measured.times_comm and self.world_size > 1:
            row = [-1.0, -1.0] if measured.comm_ms is None else list(measured.comm_ms)
            timing = all_reduce(self.own_row(row, device)).t().tolist()
        own_time, slow = None, None
        if measured.own_time is not None:
            own_time = all_reduce(self.own_row(measured.own_time, device)).t().tolist()
            slow = straggler_of(own_time, self.hosts)
        link_ms, link_probe_s = None, None
        if link_probe is not None:  # no rank's own time shows a slow link (metrics.link_probe)
            table = all_reduce(self.own_row(link_probe.measure(), device)).tolist()
            link_ms, link_probe_s = node_link_ms(table, link_probe.per_node), max(row[2] for row in table)
            # the more slowed of the two: a slow link also raised its rank's CPU time in a lab run (stragglers.py)
            found = [s for s in (slow, link_straggler(link_ms, link_probe.per_node, self.hosts)) if s is not None]
            slow = max(found, key=lambda s: s.slower_pct, default=None)
        utilisation = {} if measured.utilisation is None else per_rank(
            measured.utilisation, self.world_size, self.global_rank, all_reduce, device)
        loss_sum, correct, samples = totals.tolist()
        return EpochTotals(loss_sum=loss_sum, correct=correct, samples=samples, seen=self.state.epoch_seen,
                           elapsed_s=elapsed, peak_mem_mb=peak.item(), lr=measured.lr, footprint=footprint,
                           comm_timing=timing, own_time=own_time, link_ms=link_ms, link_probe_s=link_probe_s,
                           straggler=slow, utilisation=utilisation, flops_per_sample=measured.flops_per_sample,
                           skipped_steps=measured.skipped_steps)

    def own_row(self, values: Sequence[float], device: torch.device) -> torch.Tensor:
        """A world_size x len(values) float64 table, this rank's values in its row and zeros in the others': summed
        over the ranks (one all-reduce for all of them), it holds every rank's values, exactly."""
        table = torch.zeros(self.world_size, len(values), dtype=torch.float64, device=device)
        table[self.global_rank] = torch.tensor(list(values), dtype=torch.float64)
        return table


class AllReduce(Protocol):
    """A strategy's all_reduce: a tensor summed (or op="max") over the ranks, returned."""

    def __call__(self, tensor: torch.Tensor, op: str = ...) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class RankMeasures:
    """What one rank measured of its epoch besides the sums, for EpochAccount.reduce."""

    held_bytes: Sequence[int]
    """The parameters', gradients' and optimizer state's bytes this rank holds (events.FOOTPRINT's first three)."""
    sent_bytes_per_step: int
    lr: float
    times_comm: bool = False
    """Whether the strategy times its communication (Strategy.times_comm): the epoch then has comm_timing columns."""
    comm_ms: tuple[float, float] | None = None
    """A sampled step's communication, (total, exposed) ms; None before the first sample."""
    utilisation: dict[str, float] | None = None
    """This rank's utilisation (UtilisationSampler.take); None: no utilisation fields."""
    flops_per_sample: int | None = None
    skipped_steps: int | None = None
    """train.fp16: the epoch's steps the loss scaler skipped, the same on every rank; None: no loss scaler."""
    own_time: tuple[float, float, float, int] | None = None
    """This rank's own compute seconds, their CPU seconds (-1: not measured), data seconds and its steps
    (metrics.stragglers.OwnClock.totals); None: untimed."""


@dataclass(frozen=True, kw_only=True)
class EpochTotals:
    """An epoch's numbers over every rank, as the loop reduced them."""

    loss_sum: float
    """The training losses summed over every sample of the epoch, on every rank (float64)."""
    correct: float
    samples: float
    """Samples trained in the epoch over the ranks, each counted once (the sums' third column)."""
    seen: int
    """Samples of the global batches trained in the epoch (TrainState.epoch_seen): the rate's numerator."""
    elapsed_s: float
    peak_mem_mb: float
    """The largest rank's peak memory (events.PEAK_MEM_MB)."""
    lr: float
    footprint: Sequence[Sequence[float]]
    """events.FOOTPRINT's columns, each one value per rank."""
    comm_timing: Sequence[Sequence[float]] | None = None
    """events.COMM_TIMING's columns, -1 for a rank without a sampled step yet; None: the strategy does not time it."""
    own_time: Sequence[Sequence[float]] | None = None
    """The ranks' own compute seconds, their CPU seconds, data seconds and steps, a column each (None: not timed)."""
    link_ms: Sequence[float] | None = None
    """Each node's link time (metrics.link_probe.node_link_ms); None: no probe (fewer than 3 nodes, or untimed)."""
    link_probe_s: float | None = None
    """The probe's time on its slowest node, seconds (None: no probe)."""
    straggler: Straggler | None = None
    """The rank slower than the others over the epoch in its own time (metrics.stragglers.straggler) or the node whose
    link was (stragglers.link_straggler), whichever is more above the others, where one was."""
    utilisation: dict[str, list[float]]
    """events.UTILISATION's lists (metrics.per_rank); the fields some rank lacks are left out."""
    flops_per_sample: int | None = None
    """The model's operations per training sample (None: not counted, no rate fields)."""
    skipped_steps: int | None = None
    """events.SKIPPED_STEPS (None: no loss scaler, no field)."""


def train_fields(totals: EpochTotals) -> dict[str, Any]:
    """The epoch event's training fields, in events.EPOCH_EVENT's order."""
    rate = totals.seen / totals.elapsed_s
    fields: dict[str, Any] = {TRAIN_LOSS: totals.loss_sum / totals.samples, TRAIN_ACC: totals.correct / totals.samples,
                              TRAIN_SAMPLES: int(totals.samples), EPOCH_TIME_S: totals.elapsed_s, SAMPLES_PER_S: rate}
    if totals.flops_per_sample is not None:  # the model's own arithmetic: a strategy's extra work is not counted
        fields |= {MODEL_FLOPS_PER_SAMPLE: totals.flops_per_sample,
                   ACHIEVED_TFLOPS: totals.flops_per_sample * rate / 1e12}
    fields |= {PEAK_MEM_MB: totals.peak_mem_mb, LR: totals.lr}
    if totals.skipped_steps is not None:
        fields[SKIPPED_STEPS] = totals.skipped_steps
    fields |= {name: [int(v) for v in column] for name, column in zip(FOOTPRINT, totals.footprint, strict=True)}
    fields |= comm_timing_fields(totals.comm_timing)
    if totals.own_time is not None:
        fields |= own_time_fields(totals.own_time)
        if totals.link_ms is not None and totals.link_probe_s is not None:
            fields[LINK_PROBE_MS] = [round(v, 3) for v in totals.link_ms]
            fields[LINK_PROBE_S] = round(totals.link_probe_s, 4)
        if (slow := totals.straggler) is not None:
            fields |= slow.fields()
    return fields | totals.utilisation


def comm_timing_fields(columns: Sequence[Sequence[float]] | None) -> dict[str, list[float]]:
    """Milliseconds per step, to the microsecond, per rank; none while some rank has no sampled step yet (DDP samples
    its 10th step first)."""
    if columns is None or min(columns[0]) < 0:
        return {}
    return {name: [round(v, 3) for v in column] for name, column in zip(COMM_TIMING, columns, strict=True)}
