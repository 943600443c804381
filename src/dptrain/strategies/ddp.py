"""DistributedDataParallel: a full replica per rank; gradients all-reduced in buckets during backward."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.strategies import comm_hooks
from dptrain.strategies.base import Strategy


class DDP(Strategy):
    """Traffic: counted by the hook where one is set; for plain all-reduce computed from the gradient
    sizes as a ring all-reduce, 2 (N-1)/N of the gradient bytes per step."""

    name = "ddp"

    @property
    def step_is_local(self) -> bool:
        return self.env.world_size == 1

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        if self.env.world_size == 1:  # nothing to synchronise: the bare model, without DDP's per-step bookkeeping
            return self.module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving one copy per step.
        ddp = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)
        if self.cfg.comm_hook != "allreduce":
            comm_hooks.install(ddp, self.cfg.comm_hook, self.cfg.powersgd_rank, self.counter)
        return ddp

    def comm_bytes(self, steps: int) -> int:
        if self.cfg.comm_hook != "allreduce":
            return self.counter.take()
        grad_bytes = sum(p.numel() * p.element_size() for p in self.eval_module.parameters() if p.requires_grad)
        return steps * comm_hooks.bytes_per_allreduce(grad_bytes, 1, self.env.world_size)
