"""nn.DataParallel: one process drives several GPUs (strategy.dp.devices, else every visible one); the batch is
scattered from and the outputs gathered to the first of them, which also holds the only optimizer (the root-GPU
bottleneck)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from dptrain.config import DPOptions, StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies.base import Strategy, refuse_more_than_one_process

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


class DataParallel(Strategy):
    name = "dp"

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        refuse_more_than_one_process(cls.name, world_size, "dp drives every GPU from one process")

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
            self.wrapped = nn.DataParallel(self.module, device_ids=gpus, output_device=self.device.index)
        return self.wrapped
