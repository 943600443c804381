"""nn.DataParallel: one process drives every visible GPU; the batch is scattered from and the
outputs gathered to the first GPU, which also holds the only optimizer (the root-GPU bottleneck)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from dptrain.config import StrategyConfig
from dptrain.strategies.base import Strategy, refuse_more_than_one_process

log = logging.getLogger("dptrain")


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
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if gpus < 2:
            log.warning("strategy dp: %s, so it runs as one device", "no GPU here" if gpus == 0 else "one GPU here")
            self.wrapped = self.module
        else:
            log.info("strategy dp: one process driving %d GPUs", gpus)
            self.wrapped = nn.DataParallel(self.module, device_ids=list(range(gpus)), output_device=self.device.index)
        return self.wrapped
