"""STRATEGIES: name -> class; the one place a strategy name is resolved."""

from __future__ import annotations

import torch

from dptrain.config import LaunchConfig, RunConfig, StrategyConfig
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.strategies.base import Strategy
from dptrain.strategies.ddp import DDP
from dptrain.strategies.deepspeed import DeepSpeed
from dptrain.strategies.dp import DataParallel
from dptrain.strategies.fsdp import FSDP
from dptrain.strategies.parameter_server import ParameterServer
from dptrain.strategies.single import SingleDevice
from dptrain.strategies.zero import Zero1

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice, "dp": DataParallel, "ddp": DDP, "zero1": Zero1, "fsdp": FSDP, "ps": ParameterServer,
    "deepspeed": DeepSpeed,
}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device,
                   timeout_s: float = LaunchConfig.timeout_s) -> Strategy:
    """timeout_s: launch.timeout_s, for the collectives a strategy runs itself."""
    return STRATEGIES[cfg.name](cfg, env, device, timeout_s)


def data_world_size(cfg: StrategyConfig, world_size: int) -> int:
    """How many of `world_size` ranks take a share of each global batch."""
    return STRATEGIES[cfg.name].data_world_size(cfg, world_size)


def check_world(cfg: RunConfig, world_size: int, train_size: int, on_cpu: bool = False,
                torch_version: str | None = None) -> None:
    """Refuse settings impossible for this world, dataset and torch, before any worker starts (and in every worker).

    The strategy's own rules first (Strategy.check_world, then Strategy.check_run against the run's other
    settings), then the split of the global batch over the ranks that take data. on_cpu: the workers will
    run on the CPU; torch_version: theirs (None: this one).
    """
    strategy = STRATEGIES[cfg.strategy.name]
    strategy.check_world(cfg.strategy, world_size, on_cpu, torch.__version__ if torch_version is None else torch_version)
    strategy.check_run(cfg, world_size, on_cpu)
    data_world = strategy.data_world_size(cfg.strategy, world_size)
    gb = cfg.train.global_batch_size
    if gb % data_world:
        who = "the world size" if data_world == world_size else "the number of training ranks"
        raise ConfigError(
            f"train.global_batch_size {gb} is not divisible by {who} {data_world}; "
            f"choose a multiple of {data_world}, for example {max(data_world, gb - gb % data_world)}."
        )
    if data_world > train_size:
        raise ConfigError(
            f"world size {data_world} is larger than the training split ({train_size} samples); use fewer workers."
        )
