"""The learning rate over a run: the peak (optim.lr, maybe scaled to the global batch), a schedule, a warm-up.

    peak = optim.lr * scale, scale = 1 (none), B / B_ref (linear) or sqrt(B / B_ref) (sqrt),
           B = train.global_batch_size, B_ref = optim.reference_batch_size
    lr(s) = peak * shape(s) * warm(s)      after s optimizer steps, W = optim.warmup_steps
    warm(s) = s / W (linear) or log(s + 1) / log(max(2, W)) (log, DeepSpeed's WarmupLR) for s < W, then 1

shape is the schedule's (constant, cosine, onecycle, step) over the run's total steps: the warm-up
steps are counted in that total, and the warm-up scales the first of them from 0 (the first step
runs at lr 0: Adam's moments see one gradient before any update). The log rise is taken from a
ds_config.json's WarmupLR (strategy.deepspeed.warmup_type), as DeepSpeed computes it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from dptrain.config import FLOAT32_MAX, RunConfig

log = logging.getLogger("dptrain")


def peak_lr(cfg: RunConfig) -> float:
    """optim.lr, scaled to the global batch as optim.scale_lr_with says (the large-batch recipe)."""
    return cfg.optim.peak_lr(cfg.train.global_batch_size)


def build_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int) -> "Schedule":
    """Stepped once per optimizer step; total_steps is the run's, so cosine and one-cycle end at the end."""
    o = cfg.optim
    if o.schedule == "onecycle":
        shape: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr(cfg), total_steps=total_steps)
    else:
        factor = {
            "constant": lambda s: 1.0,
            "cosine": lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
            "step": lambda s: _power(o.gamma, s // (o.step_epochs * steps_per_epoch)),
        }[o.schedule]
        shape = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    warning = warmup_warning(cfg, total_steps)
    if warning is not None and (not dist.is_initialized() or dist.get_rank() == 0):  # every rank's warnings reach
        log.warning(warning)  # the console: one line a run
    return Schedule(shape, o.warmup_steps, cfg.strategy.deepspeed.warmup_type)


def warmup_factor(kind: str, steps_done: int, warmup_steps: int) -> float:
    """warm(s): what the warm-up multiplies the rate by after steps_done optimizer steps. log is DeepSpeed's WarmupLR
    (deepspeed.runtime.lr_schedules), which counts at least 2 steps (log 1 is 0)."""
    if steps_done >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(steps_done + 1) / math.log(max(2, warmup_steps))
    return steps_done / warmup_steps


def warmup_warning(cfg: RunConfig, total_steps: int) -> str | None:
    """One line where the warm-up outlasts the run (the rate then never reaches its peak); None where it does not."""
    warmup = cfg.optim.warmup_steps
    if warmup <= total_steps or total_steps <= 0:
        return None
    last = warmup_factor(cfg.strategy.deepspeed.warmup_type, total_steps - 1, warmup)
    return (f"optim.warmup_steps {warmup} is longer than the run's {total_steps} optimizer steps, so the learning rate "
            f"never reaches its peak {peak_lr(cfg):g} (the last step runs at {100 * last:.2g}% of it); lower "
            f"--optim.warmup_steps, or train for more steps.")


def _power(base: float, exponent: int) -> float:
    """base ** exponent, inf where that is beyond a float (Python raises OverflowError: a step schedule whose gamma
    above 1 raises the rate drop after drop)."""
    try:
        return base**exponent
    except OverflowError:
        return math.inf


def _held(lr: float) -> float:
    """A rate as the optimizer's float32 tensors take it: inf where it is beyond their range (a rate raised past it by
    a step schedule's gamma), which the loop then reports as a diverged run naming optim.lr; torch refused a finite
    rate beyond that range mid-step ("value cannot be converted to type float without overflow")."""
    return math.inf if lr > FLOAT32_MAX else lr


class Schedule:
    """A torch schedule with a warm-up on top: the learning rate the schedule sets, times warmup_factor(s).

    Every schedule here computes its rate from the step count alone (LambdaLR from the base rates, OneCycleLR in
    closed form), never from the rate it set before, so scaling what it sets changes nothing it computes later.
    Its state is the inner schedule's: a resume restores the step count, and the warm-up follows from it.
    """

    def __init__(self, shape: Any, warmup_steps: int, warmup_type: str = "linear") -> None:
        self.shape, self.warmup_steps, self.warmup_type = shape, warmup_steps, warmup_type
        self.optimizer = shape.optimizer
        self._warm()

    def step(self) -> None:
        self.shape.step()
        self._warm()

    def _warm(self) -> None:
        steps = self.shape.last_epoch  # optimizer steps done: the rate set now is for step steps + 1
        factor = warmup_factor(self.warmup_type, steps, self.warmup_steps)
        for group, lr in zip(self.optimizer.param_groups, self.shape.get_last_lr()):
            group["lr"] = _held(lr * factor)

    def get_last_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return self.shape.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shape.load_state_dict(state)
        self._warm()
