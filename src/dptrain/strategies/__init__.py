"""STRATEGIES: name -> class; the one place a strategy name is resolved."""

from __future__ import annotations

import torch

from dptrain.config import StrategyConfig
from dptrain.launch.env import DistEnv
from dptrain.strategies.base import Strategy
from dptrain.strategies.ddp import DDP
from dptrain.strategies.dp import DataParallel
from dptrain.strategies.fsdp import FSDP
from dptrain.strategies.parameter_server import ParameterServer
from dptrain.strategies.single import SingleDevice
from dptrain.strategies.zero import Zero1

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice, "dp": DataParallel, "ddp": DDP, "zero1": Zero1, "fsdp": FSDP, "ps": ParameterServer,
}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device) -> Strategy:
    return STRATEGIES[cfg.name](cfg, env, device)
