"""diloco: DiLoCo (Douillard et al., arXiv 2311.08105). Each rank runs the configured optimizer (the inner one) on its
own share of every global batch; every strategy.diloco.period steps (H) the ranks average their pseudo-gradients,
the global model less their own, and one outer step of SGD with Nesterov momentum (outer_lr 0.7, outer_momentum 0.9,
the paper's) moves the global model, from which every rank goes on.

The schedule, on every rank, after its inner step s (counted from the run's first step):

    s % H != 0   nothing but the inner step: no collective
    s % H == 0   pseudo-gradient = global - own, for every parameter; with the floating buffers (BatchNorm's
                 statistics, averaged as they are) in one flat all-reduce, divided by the number of ranks; the outer
                 optimizer steps on the global model with the mean pseudo-gradient as its gradient; every rank's
                 model becomes the global one (its buffers the mean)

Streaming (strategy.diloco.overlap_steps T > 0, on 2 ranks or more): at s % H == 0 the all-reduce of the
pseudo-gradient starts on a process group of its own (another group's collectives do not queue behind it), each rank
keeping a copy of its model as it sent it, and the inner steps go on; after step s + T the rank waits for it, the
outer step moves the global model, and the rank's model becomes the global one plus what the rank learnt since it
sent (its model now less the copy). With T = 0 this is the schedule above. What it costs: one more copy of the model
and its floating buffers, and the wait, where the exchange takes longer than T inner steps. A snapshot, the
evaluation and the final weights settle first (settle()): the owed outer step is taken there, early, in an
uninterrupted run and a resumed one alike, so no snapshot holds an exchange under way.

With H = 1, outer_lr 1 and outer_momentum 0 the global model is the mean of the ranks' after each step: with SGD as
the inner optimizer, ddp's model (tests/strategies/test_semi_synchronous.py). On one rank there is nothing to average,
but the outer step still runs (a lookahead of the inner optimizer), as on many.

The model of the run (evaluated, the snapshot's DCP model, the final weights) is the global model: as of the last
outer step. A snapshot holds it, and each rank's own model, inner optimizer state, step count and the outer
optimizer's momentum (one file a rank), so a resume goes on exactly from any step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dptrain.strategies.base import local_bytes
from dptrain.strategies.diloco.options import SPEC
from dptrain.strategies.local_sgd.strategy import LocalSGD, averaged_tensors


@dataclass
class OuterExchange:
    """An outer exchange under way (streaming): its all-reduces, the inner step after which it is waited for, and
    this rank's parameters and floating buffers as it sent them."""

    works: list[Any]
    due: int
    sent_from: list[torch.Tensor]


class DiLoCo(LocalSGD):
    """Traffic: after every period-th step one ring all-reduce of the pseudo-gradient and the floating buffers, 2 (N-1)/N
    of the parameters' bytes from each rank (as local_sgd's averaging)."""

    spec = SPEC
    outer_optimizer: torch.optim.Optimizer | None = None
    under_way: OuterExchange | None = None
    """The outer exchange started and not yet waited for (streaming only)."""
    group: dist.ProcessGroup | None = None
    """The streaming exchanges' process group (None: the world's)."""

    @property
    def overlap_steps(self) -> int:
        """strategy.diloco.overlap_steps, on 2 ranks or more (one rank has nothing to wait for)."""
        return self.cfg.diloco.overlap_steps if self.env.world_size > 1 else 0

    @property
    def period(self) -> int:
        return self.cfg.diloco.period

    @property
    def post_local_steps(self) -> int:
        return 0

    @property
    def step_is_local(self) -> bool:
        return False  # the outer step comes every period steps: no graph of one step replays it

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapped = super().wrap(model)
        assert self.consensus is not None
        options = self.cfg.diloco
        self.consensus.requires_grad_(True)  # the global model: the outer optimizer's parameters
        self.outer_optimizer = torch.optim.SGD(self.consensus.parameters(), lr=options.outer_lr,
                                               momentum=options.outer_momentum,
                                               nesterov=options.outer_nesterov and options.outer_momentum > 0)
        if self.overlap_steps:
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))
        return wrapped

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.steps += 1
        if self.under_way is not None and self.steps >= self.under_way.due:
            self.finish_exchange()
        if self.steps % self.period == 0:
            if self.overlap_steps:
                self.start_exchange()  # waited for overlap_steps inner steps later
            else:
                self.exchange()

    def exchange(self) -> None:
        """A whole outer exchange at once, as without streaming (bench's hook probe times this)."""
        self.start_exchange()
        self.finish_exchange()

    def start_exchange(self) -> None:
        """The pseudo-gradient (global less own) and the floating buffers packed, their all-reduce started; with
        streaming, a copy of what this rank sent."""
        assert self.module is not None and self.consensus is not None and self.packed is not None
        own, outer = averaged_tensors(self.module), averaged_tensors(self.consensus)
        params = sum(1 for _ in self.module.parameters())
        with torch.no_grad():
            self.packed.pack([g - o for g, o in zip(outer[:params], own[:params])] + own[params:])
        works, sent = self.packed.start_sum(self.env.world_size, self.group)
        self.counter.bytes_sent += sent
        copies = [t.clone() for t in own] if self.overlap_steps else []
        self.under_way = OuterExchange(works, self.steps + self.overlap_steps, copies)

    def finish_exchange(self) -> None:
        """The outer step: the mean pseudo-gradient into the global model's gradients, its optimizer's step; every
        rank's model then the global one (the floating buffers the ranks' mean), plus, with streaming, what the rank
        learnt since it sent."""
        assert self.module is not None and self.consensus is not None and self.packed is not None
        assert self.outer_optimizer is not None and self.under_way is not None
        exchange, self.under_way = self.under_way, None
        own, outer = averaged_tensors(self.module), averaged_tensors(self.consensus)
        params = sum(1 for _ in self.module.parameters())
        with torch.no_grad():
            self.packed.finish_mean(exchange.works, self.env.world_size)
            means = [torch.empty_like(t) for t in outer]
            self.packed.unpack_into(means)
        for p, mean in zip(self.consensus.parameters(), means[:params]):
            p.grad = mean
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, mean in zip(outer[params:], means[params:]):
                buffer.copy_(mean)
            if not exchange.sent_from:
                for mine, theirs in zip(own, outer):
                    mine.copy_(theirs)
                return
            for mine, theirs, sent in zip(own, outer, exchange.sent_from):  # theirs + (mine - sent), in place
                mine.sub_(sent).add_(theirs)

    def settle(self) -> None:
        """The run's model is the global one, as the last outer step left it: with an exchange under way, that step
        is taken now."""
        if self.under_way is not None:
            self.finish_exchange()

    def memory_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """LocalSGD's, and where the exchange is streamed, the copy of what this rank sent, held while it is owed."""
        held = super().memory_bytes(optimizer)
        if self.overlap_steps:
            assert self.module is not None
            held["params"] += local_bytes(self.module.parameters())
        return held

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        return [] if self.outer_optimizer is None else [self.outer_optimizer]

    def own_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Besides local_sgd's: the outer optimizer's momentum (the global model itself is the snapshot's DCP model)."""
        assert self.outer_optimizer is not None
        return {**super().own_state(optimizer), "outer_optim": self.outer_optimizer.state_dict()}

    def load_own_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        assert self.outer_optimizer is not None
        super().load_own_state(state, optimizer)
        self.outer_optimizer.load_state_dict(state["outer_optim"])
