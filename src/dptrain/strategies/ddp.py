"""DistributedDataParallel: a full replica per rank; gradients all-reduced in buckets during backward."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.strategies.base import Strategy


class DDP(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving one copy per step.
        return DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)
