"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

reshard_after_forward=true frees each unit's gathered parameters after its forward and gathers
them again for backward (FULL_SHARD, ZeRO-3); false keeps them until backward (SHARD_GRAD_OP,
ZeRO-2), trading memory for one all-gather less per step. The root's own parameters (all of them
under wrap whole) stay gathered from forward to backward either way, as torch's default for the root:
backward needs them first, so freeing them would only gather them again at once.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from dptrain.config import StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies.base import Strategy

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""None: the parameters' own dtype, no cast (FSDP's default)."""


def blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The root's children that hold parameters, one level into plain containers (ResNet's stages)."""
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child) > 1:
            yield from (c for c in child.children() if any(True for _ in c.parameters()))
        elif any(True for _ in child.parameters()):
            yield child


def units(model: nn.Module, wrap: str, min_params: int) -> list[nn.Module]:
    """The modules sharded as units of their own before the root (strategy.fsdp.wrap): block, blocks(model); size,
    innermost first, every module whose parameters not in a unit already reach min_params; whole, none."""
    if wrap == "whole":
        return []
    if wrap == "block":
        return list(blocks(model))
    found: list[nn.Module] = []

    def left(module: nn.Module) -> int:  # the module's parameters outside the units found below it
        count = sum(p.numel() for p in module.parameters(recurse=False)) + sum(left(c) for c in module.children())
        if module is not model and count >= min_params:
            found.append(module)
            return 0
        return count

    left(model)
    return found


class FSDP(Strategy):
    """Traffic computed per step: all-gather of the parameters in forward (and again in backward for the units under
    the root when resharding), reduce-scatter of the gradients; each (N-1)/N of the bytes, in their dtypes."""

    name = "fsdp"
    step_is_local = False  # collectives inside the step

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        """FSDP2 runs on the CPU (gloo) from torch 2.7 on; 2.6 fails in the first step ('Stream' has no record_event)."""
        from torch.torch_version import TorchVersion

        if on_cpu and TorchVersion(torch_version) < (2, 7):
            raise ConfigError(f"strategy fsdp on the CPU needs torch 2.7 or newer, and this is torch {torch_version}; "
                              f"use --strategy.name ddp or zero1, or upgrade torch.")

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 shards contiguous parameters only: channels_last weights go back to NCHW (inputs may stay NHWC).
        model = model.to(self.device, memory_format=torch.contiguous_format)
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[self.cfg.fsdp.param_dtype], reduce_dtype=DTYPES[self.cfg.fsdp.reduce_dtype])
        inner = units(model, self.cfg.fsdp.wrap, self.cfg.fsdp.wrap_min_params)
        in_units = {p for unit in inner for p in unit.parameters()}
        self.numel_in_units = sum(p.numel() for p in in_units)
        for unit in inner:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.cfg.fsdp.reshard_after_forward, mp_policy=policy)
        # The root is never resharded after forward (torch's own default for it): backward starts with the root's
        # parameters, so resharding them would free them only to gather them again right away, which costs one
        # all-gather of them a step (under wrap whole, of the whole model: 2 instead of 1 a step) and saves no memory
        # (backward's peak holds them anyway). The sums are the same.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        self.module = model
        return model

    def comm_bytes(self, steps: int) -> int:
        world = self.env.world_size
        numel = sum(p.numel() for p in self.eval_module.parameters())  # DTensor numel: the full size
        # Gathered once a step: the root's own parameters, and every unit's unless resharded after forward (twice).
        gathered = numel + (self.numel_in_units if self.cfg.fsdp.reshard_after_forward else 0)
        own_size = next(self.eval_module.parameters()).element_size()
        param_size = getattr(DTYPES[self.cfg.fsdp.param_dtype], "itemsize", own_size)
        reduce_size = getattr(DTYPES[self.cfg.fsdp.reduce_dtype], "itemsize", own_size)
        per_step = (gathered * param_size + numel * reduce_size) * (world - 1) // world
        return steps * per_step
