"""DistributedDataParallel: a full replica per rank; gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.config import RunConfig
from dptrain.errors import ConfigError
from dptrain.strategies import comm_hooks, shared_memory
from dptrain.strategies.ddp import two_step
from dptrain.strategies.base import CommTiming, Strategy, refuse_gloo_send_recv_on_gpus
from dptrain.strategies.ddp.deferred_update import DeferredUpdate, priority_params
from dptrain.strategies.ddp.powersgd import PowerSGD, PowerSGDPart
from dptrain.strategies.state import StatePart
from dptrain.strategies.ddp.options import SPEC

log = logging.getLogger(__name__)


def comm_timing_from(timers: Mapping[str, Any], device_type: str) -> CommTiming | None:
    """A sampled step's gradient communication from DDP's logging data (times in ns), None before its first sample.

    On the CPU from the host clock's stamps of the reducer's events: gloo's buckets are done when DDP records the
    end. On CUDA those stamps say only when the work was queued (an nccl all-reduce returns before it runs), so from
    the durations DDP measures between the same events with CUDA events: the communication, and its overlap with
    backward's compute (from the first bucket's start to the compute's end), whose rest is the exposed part.
    """
    if device_type == "cuda":
        total, overlap = timers.get("backward_comm_time", 0), timers.get("backward_compute_comm_overlap_time", 0)
        if not total:
            return None  # no sampled step yet
        return CommTiming(total_ms=total / 1e6, exposed_ms=max(0, total - overlap) / 1e6)
    start, end = timers.get("backward_comm_time_start", 0), timers.get("backward_comm_time_end", 0)
    compute_end = timers.get("backward_compute_time_end", 0)
    if not (start and end and compute_end) or end < start:
        return None  # no sampled step yet
    return CommTiming(total_ms=(end - start) / 1e6, exposed_ms=max(0, end - compute_end) / 1e6)


def refuse_with_deferred_update(name: str, cfg: RunConfig) -> None:
    """ConfigError in one sentence for what strategy.ddp.update_in_next_forward cannot run with."""
    option = "strategy.ddp.update_in_next_forward"
    if name != "ddp":
        raise ConfigError(f"{option} applies to strategy ddp only, not {name}; drop it or use --strategy.name ddp.")
    if cfg.strategy.ddp.comm_hook not in comm_hooks.DEFERRABLE:
        raise ConfigError(f"{option} leaves a hook's communication running, and strategy.ddp.comm_hook "
                          f"{cfg.strategy.ddp.comm_hook} has finished its own when it returns; use "
                          f"{', '.join(comm_hooks.DEFERRABLE)}, or drop one of the two.")
    if cfg.train.grad_clip is not None:
        raise ConfigError(f"{option} updates each layer on its own, and train.grad_clip needs every gradient's norm "
                          f"first; drop one of the two.")
    if cfg.train.compile:
        raise ConfigError(f"{option} applies each layer's update in a hook before its forward, which train.compile "
                          f"would compile through; drop one of the two.")
    if cfg.train.fp16:
        raise ConfigError(f"{option} updates each layer on its own in a hook, and train.fp16's loss scaler decides for "
                          f"the whole step whether to update; drop one of the two.")
    if cfg.train.accumulate_steps > 1:
        raise ConfigError(f"{option} applies each step's update in the next forward, and train.accumulate_steps "
                          f"{cfg.train.accumulate_steps} runs {cfg.train.accumulate_steps} forwards a step; drop one of "
                          f"the two.")


class DDP(Strategy):
    """Traffic: counted by the hook where one is set, and by the shared-memory sum (what a rank writes there for the
    others: its gradients, and its 1/N of their sum); for gloo's or nccl's all-reduce computed from the gradient
    sizes as a ring all-reduce, 2 (N-1)/N of the gradient bytes per step."""

    spec = SPEC
    syncs_batchnorm = True  # zero1's forward is DDP's too
    times_comm = True  # from DDP's own timers, or the deferred update's
    shared_memory_sum: shared_memory.SharedMemoryAllReduce | None = None
    """The all-reduce through /dev/shm that the gradients take (strategy.ddp.shared_memory), once wrapped; None: gloo's."""
    two_step_sum: two_step.TwoStepAllReduce | None = None
    """Over several hosts with several ranks on one: the sum within each host, then across them (two_step.py)."""
    ddp: DistributedDataParallel | None = None
    """The model as wrapped, on more than one rank."""

    deferred: DeferredUpdate | None = None
    """strategy.ddp.update_in_next_forward's hooks, once wrapped on more than one rank."""
    powersgd: PowerSGD | None = None
    """comm_hook powersgd's state, once wrapped on more than one rank: its memory, which snapshots keep."""

    @classmethod
    def check_run(cls, cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
        if cfg.strategy.ddp.update_in_next_forward:
            refuse_with_deferred_update(cls.name, cfg)
        if cfg.strategy.ddp.comm_hook == "ring":
            refuse_gloo_send_recv_on_gpus(f"strategy {cls.name} with comm_hook ring", cfg.launch.backend, world_size,
                                          on_cpu, "another --strategy.ddp.comm_hook")

    @property
    def step_is_local(self) -> bool:
        return self.env.world_size == 1

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        if self.env.world_size == 1:  # nothing to synchronise: the bare model, without DDP's per-step bookkeeping
            return self.module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        gradients = [p for p in self.module.parameters() if p.requires_grad]
        sizes = dict(max_numel=sum(p.numel() for p in gradients), element_size=max(p.element_size() for p in gradients),
                     timeout_s=self.timeout_s)
        defer = self.cfg.ddp.update_in_next_forward
        if self.cfg.ddp.comm_hook == "allreduce" and self.uses_shared_memory():
            self.shared_memory_sum = shared_memory.open_on_this_host(**sizes)
            if defer and self.shared_memory_sum is not None:
                # every rank on this host: the sum takes well under a millisecond, nothing to leave running; gloo's
                # all-reduce left running measured 4% slower than it here (docs/benchmark.md)
                if self.env.global_rank == 0:
                    log.info("strategy.ddp.update_in_next_forward: every rank is on this host, so the gradients are "
                             "summed through shared memory at the end of backward instead")
                defer = False
        elif self.cfg.ddp.comm_hook == "allreduce" and self.may_sum_in_two_steps() and not defer:
            self.two_step_sum = two_step.open_across_hosts(**sizes)
        cap = self.bucket_cap_mb(gradients)
        buckets = {} if cap is None else {"bucket_cap_mb": cap}
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving one copy per step.
        ddp = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True, **buckets)
        if defer:  # its own hook: gloo's or nccl's all-reduce (or the compressing hook's), left running
            self.deferred = self.deferred_update(ddp)
            self.deferred.install(ddp)
        elif self.cfg.ddp.comm_hook != "allreduce":
            state = comm_hooks.install(ddp, self.cfg.ddp.comm_hook, self.cfg.ddp.powersgd_rank, self.counter)
            self.powersgd = state if isinstance(state, PowerSGD) else None
        elif self.shared_memory_sum is not None:
            ddp.register_comm_hook(None, shared_memory.allreduce_mean_hook(self.shared_memory_sum))
        elif self.two_step_sum is not None:
            ddp.register_comm_hook(None, self.two_step_sum.hook)
        self.ddp = ddp
        return ddp

    def bucket_cap_mb(self, gradients: list[nn.Parameter]) -> float | None:
        """The most MiB of gradients DDP sends in one bucket (strategy.ddp.bucket_mb); None: DDP's own (25 MiB, its
        first 1 MiB)."""
        if self.cfg.ddp.bucket_mb is not None:
            return self.cfg.ddp.bucket_mb
        if self.shared_memory_sum is not None:
            # One bucket, summed once at the end of backward. The sum runs inside backward on the rank's own
            # thread, so smaller buckets would overlap nothing; each would only be one more point where the
            # ranks wait for the slowest. (For the tutorials' CNN, 1 bucket against DDP's 2 measured within
            # noise: 1.485x against 1.463x the plain loop, 3 interleaved repeats.)
            return sum(p.numel() * p.element_size() for p in gradients) / 2**20 + 1
        return None

    def deferred_update(self, ddp: DistributedDataParallel) -> DeferredUpdate:
        """strategy.ddp.update_in_next_forward's hooks. The buckets go over process groups of their own, which nothing
        in the next forward uses: a BatchNorm model's buffers, broadcast on DDP's group as it starts, then need not
        wait behind them (nor meet a hook's collectives, which may still be going on its thread). With DDP's
        all-reduce, a second one for the first layers' buckets. Every rank makes the groups alike."""
        name = self.cfg.ddp.comm_hook

        def new_group() -> dist.ProcessGroup:  # waiting for a peer as long as the strategy's other collectives
            return dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))

        if name == "allreduce":
            return DeferredUpdate(self.module, self.env.world_size, group=new_group(), priority_group=new_group(),
                                  priority_params=priority_params(self.module))
        state, hook = comm_hooks.COMM_HOOKS[name](self.module, dist.get_backend(ddp.process_group),
                                                  self.cfg.ddp.powersgd_rank, self.counter, new_group())
        self.powersgd = state if isinstance(state, PowerSGD) else None
        return DeferredUpdate(self.module, self.env.world_size, comm_hook=hook, comm_hook_state=state)

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        return [*super().state_parts(optimizer), *self.hook_state_parts()]

    def hook_state_parts(self) -> list[StatePart]:
        """The state of the comm hook, where it has one to keep (PowerSGD's memory; the others keep none)."""
        if self.cfg.ddp.comm_hook != "powersgd":
            return []
        return [PowerSGDPart(self.powersgd, self.env.global_rank, self.env.world_size)]

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync for the micro-batches before a step's last: no bucket is all-reduced (nor handed to a comm
        hook, the shared-memory or the two-step sum), the gradients add up in place; the last one's backward
        synchronises their sum, once. One rank alone has nothing to synchronise."""
        if sync or self.ddp is None:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.deferred is None:
            super().zero_grad(optimizer)
        else:
            self.deferred.zero_grad(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.deferred is None:
            super().optimizer_step(optimizer)
        else:
            self.deferred.step(optimizer)

    def settle(self) -> None:
        if self.deferred is not None:
            self.deferred.settle()

    def uses_shared_memory(self) -> bool:
        """strategy.ddp.shared_memory applies: CPU ranks, all on this host (a decision every rank makes alike)."""
        return self.cfg.ddp.shared_memory and shared_memory.all_on_this_host(self.device, self.env)

    def may_sum_in_two_steps(self) -> bool:
        """strategy.ddp.shared_memory on CPU ranks over several hosts: within each host, then across them, where a
        host has several ranks (two_step.open_across_hosts asks the ranks where they run; a decision all make alike)."""
        return self.cfg.ddp.shared_memory and self.device.type == "cpu" and self.env.world_size > self.env.local_world_size

    def comm_timing(self) -> CommTiming | None:
        """From DDP's own timers (its logging data), which it fills on sampled steps only: the 10th, then every
        100th. Exposed: from the end of backward's compute to the end of the last bucket's communication. With
        update_in_next_forward, the mean over every step applied since the last call (not a sample): from a step's
        first bucket's start to its last one's end, and the time the next forward waited for them."""
        if self.deferred is not None:
            mean = self.deferred.take_timing()
            return None if mean is None else CommTiming(total_ms=mean[0], exposed_ms=mean[1])
        if self.ddp is None:
            return None
        try:
            timers = self.ddp._get_ddp_logging_data()  # a private API of DDP's: no timing rather than a failure
        except (AttributeError, RuntimeError):
            return None
        return comm_timing_from(timers, self.device.type)

    def comm_bytes(self, steps: int) -> int:
        if self.cfg.ddp.comm_hook != "allreduce":
            return self.counter.take()
        if self.shared_memory_sum is not None:
            return self.shared_memory_sum.counter.take()
        if self.two_step_sum is not None:
            return self.two_step_sum.take()
        grad_bytes = sum(p.numel() * p.element_size() for p in self.eval_module.parameters() if p.requires_grad)
        return steps * comm_hooks.bytes_per_allreduce(grad_bytes, 1, self.env.world_size)
