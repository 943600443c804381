"""ZeRO-1: DDP, with each rank holding the optimizer state of its partition of the parameters only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.strategies import comm_hooks
from dptrain.strategies.base import OptimizerSpec, model_shards
from dptrain.strategies.ddp.strategy import DDP
from dptrain.strategies.state import WHOLE_OPTIMIZER, StatePart, WholeFile
from dptrain.strategies.zero1.options import SPEC


class Zero1(DDP):
    """After its local step each rank broadcasts its updated partition; traffic is the gradient all-reduce (as DDP
    counts or computes it) plus an all-gather of the parameters, computed as (N-1)/N of their bytes per step."""

    spec = SPEC
    step_is_local = False  # collectives inside the step

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (slow, noisy).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=spec.cls, **spec.kwargs)

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        """The model in DCP; ZeroRedundancyOptimizer's state_dict is its whole state, consolidated on rank 0 (every
        rank sends its partition), written as one file; on load each rank keeps its own partition, at any world size. And
        the comm hook's state, as DDP's."""

        def consolidated() -> dict[str, Any] | None:
            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # a collective
            return optimizer.state_dict() if self.env.global_rank == 0 else None

        return [model_shards(self.eval_module), WholeFile("optimizer", WHOLE_OPTIMIZER, consolidated, optimizer.load_state_dict),
                *self.hook_state_parts()]

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim  # type: ignore[attr-defined]  # ZeroRedundancyOptimizer's own shard optimizer

    def comm_bytes(self, steps: int) -> int:
        param_bytes = sum(p.numel() * p.element_size() for p in self.eval_module.parameters())
        world = self.env.world_size
        return super().comm_bytes(steps) + steps * comm_hooks.bytes_per_allreduce(param_bytes, 1, world) // 2
