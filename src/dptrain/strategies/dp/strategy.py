"""nn.DataParallel: one process drives several GPUs (strategy.dp.devices, else every visible one); the batch is
scattered from and the outputs gathered to the first of them, which also holds the only optimizer (the root-GPU
bottleneck)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dptrain.config import RunConfig, StrategyConfig
from dptrain.errors import ConfigError
from dptrain.runtime import wants_cuda
from dptrain.strategies.base import Strategy, refuse_more_than_one_process
from dptrain.strategies.dp.options import SPEC, DPOptions

log = logging.getLogger("dptrain")


def driven_gpus(options: DPOptions, visible: int) -> list[int]:
    """The GPU indices dp drives, the root first: strategy.dp.devices, else every one of the visible GPUs."""
    missing = [index for index in options.devices if index >= visible]
    if missing:
        shown = f"0 to {visible - 1}" if visible > 1 else ("0" if visible == 1 else "none")
        raise ConfigError(f"strategy.dp.devices names GPU {missing[0]}, but this process sees {visible} GPU"
                          f"{'' if visible == 1 else 's'} (indices: {shown}); name visible ones, or leave it empty for all.")
    return list(options.devices) or list(range(visible))


def root_gpu(options: DPOptions, visible: int) -> int:
    """The GPU that holds the model and the optimizer (the run's device): the first one dp drives."""
    gpus = driven_gpus(options, visible)
    return gpus[0] if gpus else 0


def in_callers_autocast(replicas: Sequence[nn.Module], device_type: str) -> list[Callable[..., Any]]:
    """Each replica's forward under the calling thread's autocast for device_type (its dtype, its cache), to be called
    on another thread; the replicas as they are where autocast is off here. A thread starts with the device's default
    autocast dtype (float16 on CUDA), and torch's parallel_apply passes each replica's thread the caller's on/off
    only: under train.bf16 the replicas ran in float16, which without a loss scaler can overflow and underflow."""
    if not torch.is_autocast_enabled(device_type):
        return list(replicas)
    dtype, cache = torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()

    def under_autocast(replica: nn.Module) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype, cache_enabled=cache):
                return replica(*args, **kwargs)

        return forward

    return [under_autocast(replica) for replica in replicas]


class AutocastDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas run under the caller's autocast, dtype included (see in_callers_autocast)."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        forwards = in_callers_autocast(replicas, self.src_device_obj.type)
        return super().parallel_apply(forwards, inputs, kwargs)  # type: ignore[arg-type]  # called as the modules are


class DataParallel(Strategy):
    spec = SPEC
    fp16_refusal = ("train.fp16 runs with one process per GPU (its loss scaler checked so), not with nn.DataParallel's "
                    "replicas; use --strategy.name ddp with one process per GPU, or --train.bf16 true.")
    one_process = True

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        refuse_more_than_one_process(cls.name, world_size, "dp drives every GPU from one process")

    @classmethod
    def gpu_index(cls, cfg: RunConfig, local_rank: int) -> int:
        """The first GPU it drives (strategy.dp.devices' first), which holds the model and the optimizer."""
        if cfg.strategy.dp.devices and wants_cuda(cfg.launch.device):
            return root_gpu(cfg.strategy.dp, torch.cuda.device_count())
        return local_rank

    @property
    def step_is_local(self) -> bool:
        return not isinstance(self.wrapped, nn.DataParallel)  # scatter and gather across GPUs cannot be captured

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        gpus = driven_gpus(self.cfg.dp, torch.cuda.device_count()) if self.device.type == "cuda" else []
        if len(gpus) < 2:
            log.warning("strategy dp: %s, so it runs as one device",
                        "no GPU here" if not gpus else f"one GPU (cuda:{gpus[0]})")
            self.wrapped = self.module
        else:
            log.info("strategy dp: one process driving GPUs %s", ",".join(map(str, gpus)))
            self.wrapped = AutocastDataParallel(self.module, device_ids=gpus, output_device=self.device.index)
        return self.wrapped
