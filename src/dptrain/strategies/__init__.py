"""STRATEGIES: name -> class; the one place a strategy name is resolved."""

from __future__ import annotations

import torch

from dptrain.config import StrategyConfig
from dptrain.launch.env import DistEnv
from dptrain.strategies.base import Strategy
from dptrain.strategies.ddp import DDP
from dptrain.strategies.single import SingleDevice

STRATEGIES: dict[str, type[Strategy]] = {"single": SingleDevice, "ddp": DDP}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device) -> Strategy:
    return STRATEGIES[cfg.name](env, device)
