"""TrainState: where the loop stands, the one owner of the position a snapshot must keep to resume exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainState:
    """The loop's position. The loop changes it; snapshots save and restore it through state_dict."""

    step: int = 0
    """Optimizer steps done over the whole run."""
    epoch: int = 0
    """The current epoch, from 0."""
    batches_consumed: int = 0
    """Global batches of the current epoch already trained (the loader resumes after them)."""
    epoch_sums: torch.Tensor | None = None
    """This rank's sums over the epoch so far: loss, correct, samples (float64, on the device); None between epochs."""
    epoch_elapsed: float = 0.0
    """Seconds of training in this epoch so far, before a resume too (the epoch's time covers all of it)."""
    epoch_seen: int = 0
    """Samples over all ranks trained in this epoch so far."""
    epoch_reported: bool = False
    """Whether this epoch's event (training metrics and evaluation) has been emitted."""
    epoch_skipped: int = 0
    """Optimizer steps of this epoch whose update train.fp16's loss scaler skipped (the same on every rank)."""

    def start_epoch(self, epoch: int, device: torch.device) -> None:
        """A fresh epoch: nothing of it trained, counted or reported yet."""
        self.epoch, self.batches_consumed, self.epoch_elapsed, self.epoch_seen, self.epoch_reported = epoch, 0, 0.0, 0, False
        self.epoch_skipped = 0
        self.epoch_sums = torch.zeros(3, dtype=torch.float64, device=device)

    def count_step(self, loss_sum: torch.Tensor, correct: torch.Tensor, rank_count: int, global_count: int) -> None:
        """One optimizer step done; sums stay on the device (in place, no host sync)."""
        assert self.epoch_sums is not None, "start_epoch() first"
        # From device values and a Python int: a tensor made from the count would be a host-to-device
        # copy, which waits for the GPU every step and costs ~30% of a step on an H100.
        self.epoch_sums[0] += loss_sum
        self.epoch_sums[1] += correct
        self.epoch_sums[2] += rank_count
        self.epoch_seen += global_count
        self.step += 1
        self.batches_consumed += 1

    def enter_epoch(self, epoch: int, device: torch.device) -> None:
        """Where the loop begins `epoch`: a fresh start, or, where a resume put it mid-way, on from the snapshot."""
        if not self.resumes_mid_epoch(epoch):
            self.start_epoch(epoch, device)

    def steps_left_in_epoch(self, steps_per_epoch: int, total_steps: int) -> int:
        """The steps this epoch still trains: its batches not yet consumed, fewer where train.max_steps ends the run."""
        return min(steps_per_epoch - self.batches_consumed, total_steps - self.step)

    def resumes_mid_epoch(self, epoch: int) -> bool:
        """Whether `epoch` was under way in the snapshot this run resumed from (its sums came with it)."""
        return epoch == self.epoch and self.epoch_sums is not None

    def owes_epoch_event(self) -> bool:
        """An epoch under way whose event is not emitted yet (a run stopped after its last step, before evaluation)."""
        return self.epoch_sums is not None and not self.epoch_reported

    def is_complete(self, total_steps: int) -> bool:
        """Every step trained and every epoch's event emitted: nothing left to do."""
        return self.step >= total_steps and not self.owes_epoch_event()

    def epoch_done(self, steps_per_epoch: int) -> bool:
        return self.batches_consumed >= steps_per_epoch

    def roll_over(self, steps_per_epoch: int) -> None:
        """After a resume: an epoch whose steps and event are done continues with the next one."""
        if self.epoch_done(steps_per_epoch) and self.epoch_reported:
            self.epoch, self.batches_consumed, self.epoch_sums = self.epoch + 1, 0, None

    # The shared part is the same on every rank; the sums are each rank's own.

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batches_consumed": self.batches_consumed,
                "epoch_elapsed": self.epoch_elapsed, "epoch_seen": self.epoch_seen, "epoch_reported": self.epoch_reported,
                "epoch_skipped": self.epoch_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.batches_consumed = int(state["step"]), int(state["epoch"]), int(state["batches_consumed"])
        self.epoch_elapsed, self.epoch_seen = float(state["epoch_elapsed"]), int(state["epoch_seen"])
        self.epoch_reported = bool(state["epoch_reported"])
        self.epoch_skipped = int(state.get("epoch_skipped", 0))  # 0 in a snapshot of before train.fp16
