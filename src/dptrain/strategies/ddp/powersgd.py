"""PowerSGD (torch's powerSGD_hook) with its memory kept per parameter: a snapshot holds it, and a resume goes on
exactly, whatever DDP's buckets, and at any number of processes above one.

torch's PowerSGDState keeps each rank's error feedback and the warm-started factors Q by DDP's bucket index, and draws
a bucket's first Q from one generator, bucket after bucket. DDP's buckets are not fixed: it starts with one layout and
rebuilds it after its first step (in the order the gradients became ready), so a resumed run compresses its first step
in the layout that a run never stopped left before it compressed anything; and strategy.ddp.bucket_mb may change at a
resume. So before the hook compresses a bucket, the memory of the bucket's parameters is moved under the bucket's index
from wherever it lies (PowerSGD.move_in: per parameter, or in a bucket of another layout), and each parameter's first
Q is drawn from a generator of its own, seeded by the parameter's place in the model. The math is the hook's own,
tensor by tensor; only where the memory lies depends on the buckets.

A snapshot holds, per rank (PowerSGDPart), the step count, each parameter's Q (the same on every rank) and its error
feedback (each rank's own). The hook compresses the mean over the ranks of gradient plus error, and each rank's new
error is its own sum less that compression: the steps after a snapshot depend on the errors through their mean only.
So on another number of processes each rank starts from the mean of the old ranks' errors. One process runs no hook
(DDP is not used there), so a snapshot of several is refused on one: its errors would be dropped.

No `from __future__ import annotations` here: DDP checks a hook's annotations as objects.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress

from dptrain.strategies.state import LoadFile, SaveFile, StatePart

log = logging.getLogger(__name__)

START_ITER = 2
"""PowerSGD compresses from the third step on; the first two all-reduce the gradients plainly, as the algorithm needs
for its error feedback (DDP rebuilds its buckets after the first)."""


@dataclass(frozen=True)
class Slot:
    """Where one parameter's memory lies in a bucket's: its error feedback in the bucket's buffer, its Q in the
    bucket's Q memory (None: its gradient is sent as it is), each as (first element, number of elements)."""

    name: str
    error: tuple[int, int]
    factor: tuple[int, int] | None


class PowerSGD(PowerSGDState):
    """torch's PowerSGDState (error feedback and warm start on), its memory moved between DDP's buckets and entries
    per parameter (see the module's docstring); register `hook` with it."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, rank: int) -> None:
        super().__init__(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER,
                         use_error_feedback=True, warm_start=True)
        named = list(module.named_parameters())
        self.names = {id(p): name for name, p in named}
        self.places = {name: place for place, (name, _) in enumerate(named)}
        self.errors: dict[str, torch.Tensor] = {}
        """Error feedback, flat in the order of the gradient's memory, of the parameters whose memory is in no bucket."""
        self.factors: dict[str, torch.Tensor] = {}
        """Q, flat, of the parameters whose memory is in no bucket."""
        self.slots: dict[int, list[Slot]] = {}
        """Bucket index -> the parameters whose memory PowerSGD's dicts hold under that index, and where."""
        self.handed_over = 0
        """Steps whose last bucket DDP has handed over: what the byte count goes by (iter moves on the hook's thread)."""

    def move_in(self, bucket: dist.GradBucket) -> None:
        """Put the memory of the bucket's parameters where PowerSGD looks for it, under the bucket's index; draw the
        first Q of those that have none. Runs where the hook runs, just before it: the buckets of earlier steps have
        all completed (DDP waits for them at the end of backward; update_in_next_forward, in the next forward), and a
        bucket of this step holds other parameters under another index."""
        index, names = bucket.index(), [self.names[id(p)] for p in bucket.parameters()]
        if [slot.name for slot in self.slots.get(index, ())] == names:
            return  # where the last step left it: the buckets have not changed
        wanted = set(names)
        for other in [i for i, slots in self.slots.items() if i == index or any(s.name in wanted for s in slots)]:
            self._move_out(other)
        buffer, grads = bucket.buffer(), bucket.gradients()
        slots = self._slots(buffer, names, grads)
        if any(slot.name in self.errors for slot in slots):  # none before the first compressed step: the hook's zeros
            error = torch.zeros_like(buffer)
            for slot in slots:
                if slot.name in self.errors:
                    start, numel = slot.error
                    error[start:start + numel].copy_(self.errors.pop(slot.name))
            self.error_dict[index] = error
        factors = torch.empty(sum(s.factor[1] for s in slots if s.factor), dtype=buffer.dtype, device=buffer.device)
        for slot in slots:
            if slot.factor is not None:
                start, numel = slot.factor
                kept = self.factors.pop(slot.name, None)
                factors[start:start + numel].copy_(kept if kept is not None else self._first_factor(slot.name, numel, buffer.dtype))
        self.q_memory_dict[index] = factors
        # P is computed afresh from Q every step: memory only (its presence tells the hook to warm-start from Q)
        self.p_memory_dict[index] = torch.empty(sum(self._p_numel(g) for s, g in zip(slots, grads) if s.factor),
                                                dtype=buffer.dtype, device=buffer.device)
        self.slots[index] = slots

    def _slots(self, buffer: torch.Tensor, names: list[str], grads: list[torch.Tensor]) -> list[Slot]:
        """Each parameter's place in the bucket's memory. The Qs lie as the hook lays them out: the gradients it
        compresses (those of _should_compress), grouped by matrix shape in the order each shape first comes."""
        by_shape: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for name, grad in zip(names, grads):
            n, m = grad.shape[0], grad.numel() // grad.shape[0]
            rank = min(n, m, self.matrix_approximation_rank)
            if _should_compress(n, m, rank, self.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append((name, m * rank))
        factor_at, start = {}, 0
        for name, numel in (member for members in by_shape.values() for member in members):
            factor_at[name] = (start, numel)
            start += numel
        return [Slot(name, ((grad.data_ptr() - buffer.data_ptr()) // buffer.element_size(), grad.numel()),
                     factor_at.get(name)) for name, grad in zip(names, grads)]

    def _p_numel(self, grad: torch.Tensor) -> int:
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        return n * min(n, m, self.matrix_approximation_rank)

    def _first_factor(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A parameter's first Q: normal draws from a generator seeded by its place in the model, the same on every
        rank and in every layout of the buckets (the hook orthogonalises it)."""
        generator = torch.Generator().manual_seed(self.places[name])
        return torch.randn(numel, generator=generator, dtype=dtype)

    def _move_out(self, index: int) -> None:
        """A bucket's memory back to entries per parameter."""
        slots, error, factors = self.slots.pop(index), self.error_dict.pop(index, None), self.q_memory_dict.pop(index)
        self.p_memory_dict.pop(index, None)
        for slot in slots:
            if error is not None:
                start, numel = slot.error
                self.errors[slot.name] = error[start:start + numel].clone()
            if slot.factor is not None:
                start, numel = slot.factor
                self.factors[slot.name] = factors[start:start + numel].clone()

    def state_dict(self) -> dict[str, Any]:
        """The step count, and each parameter's Q and this rank's error feedback, on the CPU (between steps: settled)."""
        errors = {name: t.detach().to("cpu", copy=True) for name, t in self.errors.items()}
        factors = {name: t.detach().to("cpu", copy=True) for name, t in self.factors.items()}
        for index, slots in self.slots.items():
            error, q = self.error_dict.get(index), self.q_memory_dict[index]
            for slot in slots:
                if error is not None:
                    errors[slot.name] = error[slot.error[0]:sum(slot.error)].detach().to("cpu", copy=True)
                if slot.factor is not None:
                    factors[slot.name] = q[slot.factor[0]:sum(slot.factor)].detach().to("cpu", copy=True)
        return {"iter": self.iter, "errors": errors, "factors": factors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from state_dict()'s state; each bucket's memory is moved in as the bucket comes."""
        self.iter = self.handed_over = int(state["iter"])
        self.errors, self.factors = dict(state["errors"]), dict(state["factors"])
        for memory in (self.error_dict, self.p_memory_dict, self.q_memory_dict, self.slots):
            memory.clear()


def hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, the bucket's memory moved in first once it compresses."""
    if state.iter >= state.start_powerSGD_iter:
        state.move_in(bucket)
    return powerSGD_hook.powerSGD_hook(state, bucket)


def mean_of(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of several ranks as one rank of another number of them goes on from it: the same step count and Qs
    (equal on every rank), and the mean of their error feedback (what the steps after depend on)."""
    errors = {name: sum(s["errors"][name] for s in states) / len(states) for name in states[0]["errors"]}
    return {"iter": states[0]["iter"], "errors": errors, "factors": states[0]["factors"]}


def rank_file(rank: int) -> str:
    return f"powersgd-rank{rank}.pt"


class PowerSGDPart(StatePart):
    """PowerSGD's memory in a snapshot: one file per rank (each rank's error feedback is its own); none from one
    process, which runs no hook."""

    name = "powersgd"
    storage = "one file per rank"
    without_it = ("PowerSGD starts afresh (two plain all-reduces, then new factors and no error feedback), so the run "
                  "does not go on exactly as it would have")

    def __init__(self, state: PowerSGD | None, global_rank: int, world_size: int) -> None:
        self.state, self.global_rank, self.world_size = state, global_rank, world_size

    def files(self, world_size: int) -> set[str]:
        return set() if world_size == 1 else {rank_file(rank) for rank in range(world_size)}

    def resumes_on(self, written: int, world_size: int) -> str | None:
        if written > 1 and world_size == 1:
            return (f"holds PowerSGD's error feedback of {written} processes, which one process cannot go on from (it "
                    f"sends no gradients, so it runs no hook); resume on 2 processes or more")
        return None

    def save(self, folder: Path, save_file: SaveFile) -> None:
        if self.state is not None:
            save_file(self.state.state_dict(), folder / rank_file(self.global_rank))

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        if world_size == 1 or self.state is None:
            return  # written by one process, which compressed nothing: PowerSGD starts with this run
        if world_size == self.world_size:
            self.state.load_state_dict(load_file(folder / rank_file(self.global_rank)))
        else:
            self.state.load_state_dict(mean_of([load_file(folder / rank_file(rank)) for rank in range(world_size)]))
            log.info("PowerSGD goes on from the mean of the error feedback of %d processes", world_size)
