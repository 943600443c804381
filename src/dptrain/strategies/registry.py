"""STRATEGIES: name -> the Strategy class that runs it, each imported from its folder (strategies/<name>/strategy.py,
where the class registers itself by being defined: Strategy.__init_subclass__); the one place a strategy's name is
resolved to torch code. The names and their order are the catalog's (strategies/catalog.py: FOLDERS)."""

from __future__ import annotations

import importlib

import torch

from dptrain.config import SPECS, LaunchConfig, RunConfig, StrategyConfig
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.strategies.base import REGISTERED, Strategy

for _name in SPECS:
    importlib.import_module(f"dptrain.strategies.{_name}.strategy")  # its class registers itself
STRATEGIES: dict[str, type[Strategy]] = {name: REGISTERED[name] for name in SPECS}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device,
                   timeout_s: float = LaunchConfig.timeout_s, micro_batches: int = 1) -> Strategy:
    """timeout_s: launch.timeout_s, for the collectives a strategy runs itself; micro_batches: train.accumulate_steps."""
    return STRATEGIES[cfg.name](cfg, env, device, timeout_s, micro_batches)


def data_world_size(cfg: StrategyConfig, world_size: int) -> int:
    """How many of `world_size` ranks take a share of each global batch."""
    return STRATEGIES[cfg.name].data_world_size(cfg, world_size)


def check_sync_batchnorm(strategy: type[Strategy], on_cpu: bool) -> None:
    """model.sync_batchnorm where torch's SyncBatchNorm can run: several processes of DDP, on GPUs."""
    if strategy.one_process:
        raise ConfigError(f"model.sync_batchnorm synchronises BatchNorm over processes, and strategy {strategy.name} "
                          f"runs one; drop it, or use --strategy.name ddp (one process per GPU).")
    if not strategy.syncs_batchnorm:
        raise ConfigError(f"model.sync_batchnorm runs under DDP's strategies only (torch's SyncBatchNorm is made for "
                          f"DDP), not {strategy.name}; drop it, or use --strategy.name ddp.")
    if on_cpu:
        raise ConfigError("model.sync_batchnorm needs GPUs (torch's SyncBatchNorm takes no CPU tensors in training); "
                          "drop it on the CPU, or run on GPUs with --launch.device cuda.")


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
    if cfg.train.fp16 and on_cpu:
        raise ConfigError("train.fp16 scales float16 losses on GPUs, and this run is on the CPU; use --train.bf16 true "
                          "for 16-bit autocast on the CPU, or run on GPUs.")
    if cfg.train.fp16 and strategy.fp16_refusal is not None:
        raise ConfigError(strategy.fp16_refusal)
    if cfg.model.sync_batchnorm:
        check_sync_batchnorm(strategy, on_cpu)
    data_world = strategy.data_world_size(cfg.strategy, world_size)
    gb, pieces = cfg.train.global_batch_size, cfg.train.accumulate_steps
    if gb % data_world:
        who = "the world size" if data_world == world_size else "the number of training ranks"
        raise ConfigError(
            f"train.global_batch_size {gb} is not divisible by {who} {data_world}; "
            f"choose a multiple of {data_world}, for example {max(data_world, gb - gb % data_world)}."
        )
    if gb % (data_world * pieces):
        unit = data_world * pieces
        raise ConfigError(
            f"train.global_batch_size {gb} does not split into {data_world} ranks x {pieces} micro-batches "
            f"(train.accumulate_steps) of equal size; choose a multiple of {unit}, for example "
            f"{max(unit, gb - gb % unit)}, or another train.accumulate_steps."
        )
    if data_world > train_size:
        raise ConfigError(
            f"world size {data_world} is larger than the training split ({train_size} samples); use fewer workers."
        )
