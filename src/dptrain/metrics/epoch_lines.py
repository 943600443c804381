"""Lines people read, one per epoch: rank 0's summary of the run, and each rank's own account in its log.

    Epoch 01/05 | train loss 0.4942 | acc 82.5% | eval acc 87.8% | 31.3 s | 1,919 img/s     (rank 0: console + log)
    rank 1 epoch 2: 469 steps, 30,016 samples in 31.2 s, train loss 0.4987, peak memory 512 MiB   (logs/rank1.log,
                                                                   and the console with output.rank_epoch_lines)

They sit beside the `[METRIC]` line, which stays as it is: scripts parse that one, people read these.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Protocol

import torch

from dptrain.events import (EPOCH, EPOCH_EVENT, EPOCH_TIME_S, EVAL_ACC, EVENT, SAMPLES_PER_S, STRAGGLER_HOST,
                            STRAGGLER_PHASE, STRAGGLER_RANK, STRAGGLER_SLOWER_PCT, TRAIN_ACC, TRAIN_LOSS)
from dptrain.metrics.utilisation import peak_memory_mb


class EpochSoFar(Protocol):
    """What a rank's own epoch line reads of the loop's TrainState (metrics sits below train_state: no import)."""

    epoch_sums: torch.Tensor | None
    batches_consumed: int
    epoch_elapsed: float

log = logging.getLogger("dptrain")


def run_epochs(configured_epochs: int, total_steps: int, steps_per_epoch: int) -> int:
    """The epochs this run reaches: train.epochs, or fewer where train.max_steps ends it in an earlier epoch
    (that last epoch partial). A total of 5 on a run that stops in epoch 3 would promise two epochs never run."""
    return min(configured_epochs, math.ceil(total_steps / max(steps_per_epoch, 1)))


def epoch_line(event: dict[str, Any], num_epochs: int) -> str:
    """`Epoch 01/05 | train loss 0.4942 | acc 82.5% | eval acc 87.8% | 31.3 s | 1,919 img/s`: the epoch zero-padded to
    the width of the total; eval acc only for an epoch that evaluated; a diverged (null) loss reads `nan`; an epoch
    with a straggler ends with it (`straggler rank 3 (node4) +31% compute`)."""
    width = len(str(num_epochs))
    loss = event.get(TRAIN_LOSS)
    parts = [f"Epoch {event[EPOCH]:0{width}d}/{num_epochs}",
             f"train loss {loss if loss is not None else math.nan:.4f}",
             f"acc {100 * event[TRAIN_ACC]:.1f}%"]
    if event.get(EVAL_ACC) is not None:
        parts.append(f"eval acc {100 * event[EVAL_ACC]:.1f}%")
    parts += [f"{event[EPOCH_TIME_S]:.1f} s", f"{event[SAMPLES_PER_S]:,.0f} img/s"]
    if event.get(STRAGGLER_RANK) is not None:
        parts.append(f"straggler rank {event[STRAGGLER_RANK]} ({event.get(STRAGGLER_HOST)}) "
                     f"+{event.get(STRAGGLER_SLOWER_PCT, 0):.0f}% {event.get(STRAGGLER_PHASE)}")
    return " | ".join(parts)


class EpochLineSink:
    """Rank 0: one `Epoch NN/NN | ...` line per epoch event, to the console and rank 0's log."""

    def __init__(self, num_epochs: int) -> None:
        self.num_epochs = num_epochs

    def write(self, event: dict[str, Any]) -> None:
        if event[EVENT] == EPOCH_EVENT.name:
            log.info(epoch_line(event, self.num_epochs))

    def close(self) -> None:
        pass


def rank_epoch_line(global_rank: int, epoch: int, steps: int, samples: int, seconds: float, loss: float | None,
                    peak_mb: float) -> str:
    """`rank 1 epoch 2: 469 steps, 30,016 samples in 31.2 s, train loss 0.4987, peak memory 512 MiB`: one rank's own
    numbers (its share of the samples, its clock, its mean loss), not the reduced ones rank 0 prints."""
    loss_part = f", train loss {loss:.4f}" if loss is not None else ""
    return (f"rank {global_rank} epoch {epoch}: {steps:,} steps, {samples:,} samples in {seconds:.1f} s{loss_part}, "
            f"peak memory {peak_mb:,.0f} MiB")


EVERY_RANK = "every_rank"
"""A log record's attribute: the console shows it on every rank, not on rank 0 only (worker.setup_logging)."""


class RankEpochSink:
    """Every rank: its own per-epoch line, in its log file only (rank 0's console has the `Epoch` line instead), or
    also on the console of every rank where `on_console` (output.rank_epoch_lines: the tutorials print every rank's).

    Reads the loop's TrainState (an EpochSoFar) when the epoch event is emitted: the event holds the reduced numbers, the state still
    holds this rank's sums (they are reset when the next epoch starts). Reading them is one host sync, at the epoch's
    end, after the reduction has synchronised already."""

    def __init__(self, global_rank: int, state: Callable[[], EpochSoFar], device: torch.device,
                 on_console: bool = False) -> None:
        self.global_rank, self.state, self.device, self.on_console = global_rank, state, device, on_console

    def write(self, event: dict[str, Any]) -> None:
        if event[EVENT] != EPOCH_EVENT.name:
            return
        state = self.state()
        if state.epoch_sums is None:  # no epoch under way: nothing of this rank's own to say
            return
        loss_sum, _, samples = state.epoch_sums.tolist()
        loss = loss_sum / samples if samples and math.isfinite(loss_sum) else None
        line = rank_epoch_line(self.global_rank, event[EPOCH], state.batches_consumed, int(samples),
                               state.epoch_elapsed, loss, peak_memory_mb(self.device))
        log.info(line, extra={"file_only": not self.on_console, EVERY_RANK: self.on_console})

    def close(self) -> None:
        pass
