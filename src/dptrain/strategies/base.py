"""Strategy: how the model is replicated and kept in sync. The loop sees only this surface."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dptrain.launch.env import DistEnv

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Strategy:
    """The one-process case; subclasses override what their parallelism changes.

    Losses reach backward() as a sum over this rank's share of the global batch. Every strategy
    here averages gradients over ranks, so backward() scales by world_size / global_count: the
    result is the gradient of the mean loss over the whole global batch, exactly as one process
    computes it, even when the last batch is shared out unevenly.
    """

    name = "single"

    def __init__(self, env: DistEnv, device: torch.device) -> None:
        self.env, self.device = env, device
        self.module: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """Place the model and return what the loop calls for training forward passes."""
        self.module = model.to(self.device)
        return self.module

    @property
    def eval_module(self) -> nn.Module:
        """The bare model, for evaluation: no gradient hooks, no collectives."""
        assert self.module is not None, "wrap() first"
        return self.module

    def build_optimizer(self, model: nn.Module, make: OptimizerFactory) -> torch.optim.Optimizer:
        return make(model.parameters())

    def backward(self, loss_sum: torch.Tensor, global_count: int) -> None:
        (loss_sum * (self.env.world_size / global_count)).backward()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # Collectives on metrics; with one process they are the identity.

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.env.world_size > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()
