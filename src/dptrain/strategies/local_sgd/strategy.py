"""local_sgd: each rank steps alone on its share of every global batch, and every strategy.local_sgd.period steps the
ranks average their models; optionally post-local SGD (Lin et al., arXiv 1808.07217): exact DDP for the first
post_local_steps steps.

The schedule, on every rank, after its optimizer step s (counted from the run's first step; K: post_local_steps, H:
period):

    s <= K       DDP's all-reduce of the gradients in backward (torch's post_localSGD_hook), each step as ddp's
    s > K        no collective in the step; where (s - K) is a multiple of H, one flat all-reduce of every parameter
                 and floating buffer (BatchNorm's statistics), divided by the number of ranks: each rank goes on
                 from the mean

torch's PeriodicModelAverager is not used for the averaging: it rebinds each parameter's .data to a view of a new flat
buffer at every averaging (a new allocation each time, and a channels_last weight comes back contiguous), and it
averages neither the BatchNorm buffers nor parameters without a gradient. The flat buffer here is made once and each
tensor copied back in place.

The model of the run (evaluated, in a snapshot's DCP model, the final weights) is the mean of the ranks' models, made
by settle() in a copy (`consensus`) without touching the ranks' own: evaluating or saving never changes what is
trained. A snapshot holds, besides, each rank's own model and optimizer state and the step count (one file a rank),
so a run resumed from it goes on exactly; on another number of ranks each goes on from the mean of them all.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.strategies import comm_hooks
from dptrain.strategies.base import OptimizerSpec, Strategy, local_bytes, model_shards
from dptrain.strategies.local_sgd.options import SPEC
from dptrain.strategies.state import LoadFile, SaveFile, StatePart

log = logging.getLogger(__name__)


@dataclass
class Packed:
    """Tensors laid end to end in one buffer per dtype (made once), for one all-reduce per dtype of them all."""

    tensors: list[torch.Tensor]
    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for dtype in dict.fromkeys(t.dtype for t in self.tensors):
            numel = sum(t.numel() for t in self.tensors if t.dtype == dtype)
            self.buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.tensors[0].device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _slots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, its slice of its dtype's buffer, shaped as it) for each tensor."""
        at = dict.fromkeys(self.buffers, 0)
        slots = []
        for t in self.tensors:
            start = at[t.dtype]
            slots.append((t, self.buffers[t.dtype][start:start + t.numel()].view(t.shape)))
            at[t.dtype] = start + t.numel()
        return slots

    def pack(self, values: list[torch.Tensor]) -> None:
        """values[i] into tensor i's slice (values: one per tensor, of its shape)."""
        for (_, slot), value in zip(self._slots(), values):
            slot.copy_(value)

    def mean_over(self, world_size: int, group: dist.ProcessGroup | None = None) -> int:
        """The buffers summed over the ranks and divided by their number, in place; the bytes this rank sent."""
        works, sent = self.start_sum(world_size, group)
        self.finish_mean(works, world_size)
        return sent

    def start_sum(self, world_size: int, group: dist.ProcessGroup | None = None) -> tuple[list[Any], int]:
        """The buffers' all-reduces started, not waited for: their works, and the bytes this rank sends."""
        works, sent = [], 0
        for buffer in self.buffers.values():
            if world_size > 1:
                works.append(dist.all_reduce(buffer, group=group, async_op=True))
            sent += comm_hooks.bytes_per_allreduce(buffer.numel(), buffer.element_size(), world_size)
        return works, sent

    def finish_mean(self, works: list[Any], world_size: int) -> None:
        """start_sum's all-reduces waited for, each buffer then divided by the number of ranks."""
        for work in works:
            work.wait()
        if world_size > 1:
            for buffer in self.buffers.values():
                buffer.div_(world_size)

    def unpack_into(self, targets: list[torch.Tensor]) -> None:
        """Tensor i's slice into targets[i], in place (each keeps its memory format)."""
        for (_, slot), target in zip(self._slots(), targets):
            target.copy_(slot)


def averaged_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What the ranks average: every parameter, and every floating buffer (BatchNorm's running statistics; its
    integer batch count moves alike on every rank)."""
    return [*(p.detach() for p in module.parameters()),
            *(b for b in module.buffers() if b.is_floating_point())]


def counting_post_local_hook(counter: comm_hooks.CommCounter) -> Any:
    """torch's post_localSGD_hook, counting the bytes of its all-reduces (the steps up to start_localSGD_iter)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    def hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if state.iter < state.start_localSGD_iter:
            buffer = bucket.buffer()
            counter.bytes_sent += comm_hooks.bytes_per_allreduce(buffer.numel(), buffer.element_size(),
                                                                 dist.get_world_size())
        return post_localSGD_hook(state, bucket)

    # DDP checks the hook's annotations as objects; this module's (from __future__) are strings
    hook.__annotations__ = {"state": PostLocalSGDState, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def rank_file(name: str, rank: int) -> str:
    return f"{name}-rank{rank}.pt"


def mean_state(states: list[Any]) -> Any:
    """Several ranks' states as one: floating tensors averaged, everything else (step counts, settings) the first's."""
    first = states[0]
    if isinstance(first, dict):
        return {key: mean_state([s[key] for s in states]) for key in first}
    if isinstance(first, list):
        return [mean_state([s[i] for s in states]) for i in range(len(first))]
    if torch.is_tensor(first) and first.is_floating_point():
        return sum(states) / len(states)
    return first


class LocalSGD(Strategy):
    """Traffic: after every period-th step (past post_local_steps) one ring all-reduce of the parameters and floating
    buffers, 2 (N-1)/N of their bytes from each rank; in the first post_local_steps steps DDP's of the gradients."""

    spec = SPEC
    module: nn.Module | None = None
    consensus: nn.Module | None = None
    """The model of the run: the mean of the ranks' (settle()); evaluated, saved as the snapshot's model."""
    ddp: nn.Module | None = None
    """The model as DDP wraps it for the first post_local_steps steps (None without them, or on one rank)."""
    hook_state: Any = None
    """torch's PostLocalSGDState, where DDP runs the first steps."""
    steps = 0
    """Optimizer steps taken since the run's first (a snapshot holds it)."""
    in_sync = True
    """Whether every rank holds the same model now (after an averaging, or a DDP step): settle() then copies it."""
    packed: Packed | None = None

    @property
    def period(self) -> int:
        return self.cfg.local_sgd.period

    @property
    def post_local_steps(self) -> int:
        return self.cfg.local_sgd.post_local_steps

    @property
    def step_is_local(self) -> bool:
        return self.env.world_size == 1

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        self.consensus = copy.deepcopy(self.module).requires_grad_(False)
        self.packed = Packed(averaged_tensors(self.module))
        if self.env.world_size > 1 and self.post_local_steps > 0:
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)
            # post_local_gradient_allreduce False: after the first steps the hook sends nothing (no subgroups)
            self.hook_state = PostLocalSGDState(process_group=None, subgroup=None,
                                                start_localSGD_iter=self.post_local_steps,
                                                post_local_gradient_allreduce=False)
            self.ddp.register_comm_hook(self.hook_state, counting_post_local_hook(self.counter))
            return self.ddp
        return self.module

    @property
    def eval_module(self) -> nn.Module:
        assert self.consensus is not None, "wrap() first"
        return self.consensus

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        """Over this rank's own model (what it trains), not the run's mean (eval_module)."""
        assert self.module is not None, "wrap() first"
        return spec.build(self.module.parameters())

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.steps += 1
        self._follow_phase()
        since = self.steps - self.post_local_steps
        if since <= 0:
            return  # DDP's step: the ranks are in sync
        self.in_sync = False
        if since % self.period == 0:
            self.exchange()

    def _follow_phase(self) -> None:
        """DDP broadcasts rank 0's buffers at each forward of its steps only: past them each rank keeps its own."""
        if self.ddp is not None:
            self.ddp.broadcast_buffers = self.steps < self.post_local_steps  # type: ignore[assignment]

    def exchange(self) -> None:
        """Every rank's parameters and floating buffers replaced by their mean over the ranks."""
        if self.env.world_size == 1:
            return
        assert self.module is not None and self.packed is not None
        tensors = averaged_tensors(self.module)
        self.packed.pack(tensors)
        self.counter.bytes_sent += self.packed.mean_over(self.env.world_size)
        self.packed.unpack_into(tensors)
        self.in_sync = True

    def settle(self) -> None:
        """The run's model (consensus): the ranks' mean, summed into the consensus copy (a collective where the ranks
        have stepped apart since the last averaging); the ranks' own models are left as they are."""
        assert self.module is not None and self.consensus is not None and self.packed is not None
        targets = averaged_tensors(self.consensus)
        if self.in_sync or self.env.world_size == 1:
            for target, source in zip(targets, averaged_tensors(self.module)):
                target.copy_(source)
            return
        self.packed.pack(averaged_tensors(self.module))
        self.packed.mean_over(self.env.world_size)  # not counted: the run's model, not the training's traffic
        self.packed.unpack_into(targets)

    def comm_bytes(self, steps: int) -> int:
        return self.counter.take()

    def memory_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """This rank's model and the consensus copy; its gradients; its optimizer's state and any outer one's."""
        assert self.module is not None and self.consensus is not None
        own = list(self.module.parameters())
        state = [v for opt in (optimizer, *self.outer_optimizers()) for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        return {"params": local_bytes(own) + local_bytes(self.consensus.parameters()),
                "grads": local_bytes(p.grad for p in own if p.grad is not None), "optim": local_bytes(state)}

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers besides the configured one (DiLoCo's outer one)."""
        return []

    # Snapshots: the run's model through DCP (eval, predict and export read it), and each rank's own state.

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        return [model_shards(self.eval_module), OwnState(self, optimizer)]

    def own_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's state beside the run's model: its model, its optimizer, the step count."""
        assert self.module is not None
        return {"model": self.module.state_dict(), "optim": optimizer.state_dict(), "steps": self.steps}

    def load_own_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        assert self.module is not None
        self.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        self.steps = int(state["steps"])
        if self.hook_state is not None:
            self.hook_state.iter = min(self.steps, self.post_local_steps)
        self._follow_phase()
        self.in_sync = self.steps <= self.post_local_steps or (self.steps - self.post_local_steps) % self.period == 0


class OwnState(StatePart):
    """Each rank's own model, optimizer state and step count (they differ between averagings): one file a rank.
    On another number of ranks, each goes on from the mean of them all."""

    storage = "one file per rank"

    def __init__(self, strategy: LocalSGD, optimizer: torch.optim.Optimizer) -> None:
        self.strategy, self.optimizer = strategy, optimizer
        self.name = strategy.name

    def files(self, world_size: int) -> set[str]:
        return {rank_file(self.name, rank) for rank in range(world_size)}

    def save(self, folder: Path, save_file: SaveFile) -> None:
        save_file(self.strategy.own_state(self.optimizer), folder / rank_file(self.name, self.strategy.env.global_rank))

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        if world_size == self.strategy.env.world_size:
            state = load_file(folder / rank_file(self.name, self.strategy.env.global_rank))
        else:
            state = mean_state([load_file(folder / rank_file(self.name, rank)) for rank in range(world_size)])
            log.info("strategy %s goes on from the mean of the models and optimizer states of %d ranks", self.name,
                     world_size)
        self.strategy.load_own_state(state, self.optimizer)
