"""strategy.ddp.update_in_next_forward: each bucket's all-reduce left running when backward ends, and each layer's
update applied just before the next forward reaches it, so that the next forward runs its first layers while the
last layers' gradients still travel.

DDP waits for every bucket at the end of backward, and the next forward starts after the optimizer step. Here DDP's
communication hook starts the bucket's all-reduce (async) on the gradients in place (they are views of the bucket:
gradient_as_bucket_view) and hands DDP the bucket at once; the loop's optimizer step only notes the step's
hyperparameters (the learning rate the scheduler then moves on). In the next forward, a pre-hook on each module
waits for the buckets of its parameters, averages them, and runs the optimizer on those parameters alone with the
noted hyperparameters; after the forward, whatever is still pending is settled, so the next backward starts from
settled gradients. The buckets that hold only the layers before the largest parameter (in the model's order, the
forward's first layers) go over a second process group, so that on a slow link they arrive while the big layer's
bucket is still on the wire, instead of after it (one group serves its collectives in the order they were issued).
With a compressing hook (fp16, bf16, PowerSGD), the hook is called instead and its future left running: the bucket
holds the mean once it completes, as DDP would have waited for.

The math is the step's own: every parameter gets the averaged gradient of the global batch and one update with the
step's hyperparameters, float64-equal to one process, and the bytes sent are DDP's. Anything that reads the weights
between steps (a snapshot, the evaluation, the final weights) settles first (settle()): no snapshot holds a
half-applied update. What it needs: an optimizer without coupling between parameters (SGD, Adam, AdamW: no global
gradient clipping), a hook that leaves its communication running (not the ring, which has sent all when it
returns), and no compiled model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class PendingBucket:
    """One bucket's communication in flight, and the parameters whose gradients it holds."""

    work: Any
    """The all-reduce's Work (the sum), or a communication hook's future (the mean, in the bucket or as its value)."""
    buffer: torch.Tensor
    params: list[nn.Parameter]
    averaged: bool = False
    """Whether `work` ends with the mean (a hook's future) rather than the sum."""


@dataclass
class StepTiming:
    """One step's gradient exchange: from its first bucket's start to its last one's end, and the time the next
    forward waited for buckets (what was not hidden), in nanoseconds of time.perf_counter_ns."""

    first_start_ns: int = 0
    last_done_ns: int = 0
    """When the last of its all-reduces was seen complete (a callback of its future, on the backend's thread)."""
    waited_ns: int = 0

    def done(self, _future: object) -> None:
        self.last_done_ns = max(self.last_done_ns, time.perf_counter_ns())


@dataclass
class DeferredUpdate:
    """The hook, the pre-hooks and the deferred optimizer step of one DDP model; install() wires them."""

    module: nn.Module
    world_size: int
    comm_hook: Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]] | None = None
    """A communication hook whose future is left running (fp16, bf16, PowerSGD: comm_hooks.DEFERRABLE), called with
    comm_hook_state; None: gloo's or nccl's all-reduce of the bucket, as DDP's own."""
    comm_hook_state: object = None
    settled_steps: int = 1
    """The first steps settled at once: DDP rebuilds its buckets in the second forward, copying the gradients into new
    ones, so none may be in flight then. (PowerSGD's first factors, drawn in its first compressed step, come from
    generators of their own, powersgd.py, not from the global one that a forward draws dropout masks from.)"""
    group: Any = None
    """The process group of the all-reduces (not the first layers'); None: the default group."""
    priority_group: Any = None
    """The process group of the first layers' buckets; None: every bucket on `group`."""
    priority_params: set[int] = field(default_factory=set)
    """id() of the parameters before the largest one, in the model's order."""
    optimizer: torch.optim.Optimizer | None = None
    pending: dict[int, PendingBucket] = field(default_factory=dict)
    """Bucket index -> its all-reduce in flight, of the last step."""
    by_param: dict[int, int] = field(default_factory=dict)
    """id() of a parameter -> the index of its pending bucket."""
    hyperparameters: list[dict[str, Any]] | None = None
    """The param groups' settings (lr, ...) at the last step, for its deferred update; None: no step is owed."""
    timing: StepTiming = field(default_factory=StepTiming)
    timed: list[StepTiming] = field(default_factory=list)
    """The steps whose update was applied since the last take_timing(); their ends are read then (a future's
    callbacks may run after the wait on it returns)."""
    steps: int = 0
    """Steps taken since install() (the first settled_steps are settled at once)."""

    def install(self, ddp: Any) -> None:
        def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return self.hook(state, bucket)

        # DDP checks the hook's annotations as objects; this module's (from __future__) are strings
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        ddp.register_comm_hook(None, hook)
        for sub in self.module.modules():
            if any(True for _ in sub.parameters(recurse=False)):
                sub.register_forward_pre_hook(self._before_forward)
        self.module.register_forward_hook(self._after_forward)

    # ---- backward: start each bucket's sum, hand the bucket back at once

    def hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer, params = bucket.buffer(), list(bucket.parameters())
        if not self.pending:
            self.timing = StepTiming(first_start_ns=time.perf_counter_ns())
        if self.comm_hook is not None:
            work = future = self.comm_hook(self.comm_hook_state, bucket)
        else:
            group = self.priority_group if self.priority_group is not None and all(
                id(p) in self.priority_params for p in params) else self.group
            work = dist.all_reduce(buffer, group=group, async_op=True)
            future = work.get_future()
        future.then(self.timing.done)
        self.pending[bucket.index()] = PendingBucket(work, buffer, params, averaged=self.comm_hook is not None)
        for p in params:
            self.by_param[id(p)] = bucket.index()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)  # the same tensor: DDP's copy back onto the gradients' views is then skipped
        return done

    # ---- the loop's step: noted, applied bucket by bucket in the next forward

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop's optimizer step: note the settings it would run with; the update follows bucket by bucket."""
        self.optimizer = optimizer
        self.steps += 1
        if not self.pending:  # no bucket went out (nothing to sum): nothing is owed to the next forward
            optimizer.step()
            return
        self.hyperparameters = [settings_of(group) for group in optimizer.param_groups]
        if self.steps <= self.settled_steps:
            self.settle()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop's zero_grad: the gradients of buckets still owed their update stay until it is applied."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.by_param:
                    p.grad = None

    def settle(self) -> None:
        """Apply every update still owed (before anything reads the weights or the gradients)."""
        for index in list(self.pending):
            self._apply(index)

    def _before_forward(self, module: nn.Module, _inputs: Any) -> None:
        if not self.pending:
            return
        for p in module.parameters(recurse=False):
            index = self.by_param.get(id(p))  # only a pending bucket's parameters are in by_param
            if index is not None:
                self._apply(index)

    def _after_forward(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self.pending:
            self.settle()

    def _apply(self, index: int) -> None:
        bucket = self.pending.pop(index)
        waited = time.perf_counter_ns()
        result = bucket.work.wait()
        self.timing.waited_ns += time.perf_counter_ns() - waited
        if not bucket.averaged:
            bucket.buffer.div_(self.world_size)
        elif isinstance(result, torch.Tensor) and result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result)  # a hook that hands back a tensor of its own (DDP would copy it over)
        assert self.optimizer is not None and self.hyperparameters is not None, "a bucket was sent without a step"
        update_only(self.optimizer, {id(p) for p in bucket.params}, self.hyperparameters)
        for p in bucket.params:
            p.grad = None  # DDP points it at its bucket again in the next backward
            del self.by_param[id(p)]
        if not self.pending:  # the step's last bucket: its update is complete
            self.hyperparameters = None
            self.timed.append(self.timing)

    def take_timing(self) -> tuple[float, float] | None:
        """(the mean time from a step's first bucket's start to its last one's end, the mean time the next forward
        waited for them), in ms, over the steps applied since the last call; None: none was."""
        steps, self.timed = self.timed, []
        if not steps:
            return None
        spans = [max(0, t.last_done_ns - t.first_start_ns) for t in steps]
        return sum(spans) / len(steps) / 1e6, sum(t.waited_ns for t in steps) / len(steps) / 1e6


def settings_of(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (lr, momentum, ...): everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def update_only(optimizer: torch.optim.Optimizer, chosen: set[int], hyperparameters: list[dict[str, Any]]) -> None:
    """optimizer.step() on the parameters whose id() is in chosen, with each group's settings as given; the groups'
    parameter lists and settings are put back as they were. Only for optimizers whose update of one parameter reads
    nothing of another's (SGD, Adam, AdamW)."""
    groups = optimizer.param_groups
    kept = [(group["params"], settings_of(group)) for group in groups]
    try:
        for group, settings in zip(groups, hyperparameters):
            group.update(settings)
            group["params"] = [p for p in group["params"] if id(p) in chosen]
        optimizer.step()
    finally:
        for group, (params, settings) in zip(groups, kept):
            group["params"] = params
            group.update(settings)


def priority_params(module: nn.Module) -> set[int]:
    """id() of the parameters before the largest one in the model's order (the forward's first layers, usually):
    their buckets may travel beside the largest one's."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return set()
    largest = max(range(len(params)), key=lambda i: params[i].numel())
    return {id(p) for p in params[:largest]}
