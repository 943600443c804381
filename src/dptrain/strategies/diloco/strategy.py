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

With H = 1, outer_lr 1 and outer_momentum 0 the global model is the mean of the ranks' after each step: with SGD as
the inner optimizer, ddp's model (tests/strategies/test_semi_synchronous.py). On one rank there is nothing to average,
but the outer step still runs (a lookahead of the inner optimizer), as on many.

The model of the run (evaluated, the snapshot's DCP model, the final weights) is the global model: as of the last
outer step. A snapshot holds it, and each rank's own model, inner optimizer state, step count and the outer
optimizer's momentum (one file a rank), so a resume goes on exactly from any step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.strategies.diloco.options import SPEC
from dptrain.strategies.local_sgd.strategy import LocalSGD, averaged_tensors


class DiLoCo(LocalSGD):
    """Traffic: after every period-th step one ring all-reduce of the pseudo-gradient and the floating buffers, 2 (N-1)/N
    of the parameters' bytes from each rank (as local_sgd's averaging)."""

    spec = SPEC
    outer_optimizer: torch.optim.Optimizer | None = None

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
        return wrapped

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self.exchange()

    def exchange(self) -> None:
        """The outer step: the mean pseudo-gradient into the global model's gradients, its optimizer's step, and every
        rank's model the global one (the floating buffers the ranks' mean)."""
        assert self.module is not None and self.consensus is not None and self.packed is not None
        assert self.outer_optimizer is not None
        own, outer = averaged_tensors(self.module), averaged_tensors(self.consensus)
        params = sum(1 for _ in self.module.parameters())
        with torch.no_grad():
            self.packed.pack([g - o for g, o in zip(outer[:params], own[:params])] + own[params:])
            self.counter.bytes_sent += self.packed.mean_over(self.env.world_size)
            means = [torch.empty_like(t) for t in outer]
            self.packed.unpack_into(means)
        for p, mean in zip(self.consensus.parameters(), means[:params]):
            p.grad = mean
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, mean in zip(outer[params:], means[params:]):
                buffer.copy_(mean)
            for mine, theirs in zip(own, outer):
                mine.copy_(theirs)

    def settle(self) -> None:
        """The run's model is the global one, as the last outer step left it: nothing to make."""

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
