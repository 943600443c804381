"""Each strategy states what it needs of the world; config and cli know no strategy names."""

from __future__ import annotations

import typing

import pytest

from dptrain import config
from dptrain.config import DDPOptions, FSDPOptions, PSOptions, StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies import STRATEGIES, check_world, data_world_size
from dptrain.strategies.comm_hooks import COMM_HOOKS
from dptrain.strategies.fsdp import DTYPES


def test_the_tables_cover_the_configs_choices():
    hints = typing.get_type_hints(StrategyConfig)
    assert set(typing.get_args(hints["name"])) == set(STRATEGIES)
    assert set(typing.get_args(typing.get_type_hints(DDPOptions)["comm_hook"])) == set(COMM_HOOKS)
    for dtype in ("param_dtype", "reduce_dtype"):
        assert set(typing.get_args(typing.get_type_hints(FSDPOptions)[dtype])) == set(DTYPES)


def test_the_optimizer_table_covers_the_configs_choice():
    from dptrain.config import OptimConfig
    from dptrain.strategies.base import OPTIMIZERS

    assert set(typing.get_args(typing.get_type_hints(OptimConfig)["name"])) == set(OPTIMIZERS)


def test_every_table_applies_to_strategies_that_exist():
    for options in StrategyConfig().tables().values():
        assert set(options.applies_to) <= set(STRATEGIES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_runs_on_one_process(name):
    check_world(config.load(None, [("strategy.name", name)]), 1, 1000, on_cpu=True, torch_version="2.7.0")


@pytest.mark.parametrize(("name", "world", "refusal"), [
    ("single", 2, "strategy single cannot run on 2 processes \\(it runs one process\\)"),
    ("dp", 4, "strategy dp cannot run on 4 processes \\(dp drives every GPU from one process\\)"),
])
def test_one_process_strategies_refuse_more(name, world, refusal):
    with pytest.raises(ConfigError, match=refusal):
        STRATEGIES[name].check_world(StrategyConfig(name=name), world, on_cpu=False, torch_version="2.7.0")


def test_a_dedicated_server_leaves_the_data_to_the_others():
    served = StrategyConfig(name="ps", ps=PSOptions(dedicated_server=True))
    assert data_world_size(served, 4) == 3
    assert data_world_size(StrategyConfig(name="ps"), 4) == data_world_size(StrategyConfig(name="ddp"), 4) == 4
    with pytest.raises(ConfigError, match="dedicated_server needs at least 2 processes"):
        STRATEGIES["ps"].check_world(served, 1, on_cpu=True, torch_version="2.7.0")


def test_dp_drives_the_listed_gpus_the_first_as_root():
    from dptrain.strategies.dp import driven_gpus, root_gpu

    chosen = config.load(None, [("strategy.name", "dp"), ("strategy.dp.devices", "2,0")]).strategy.dp
    assert chosen.devices == (2, 0)
    assert driven_gpus(chosen, 4) == [2, 0] and root_gpu(chosen, 4) == 2
    every = config.load(None, [("strategy.name", "dp")]).strategy.dp
    assert driven_gpus(every, 3) == [0, 1, 2] and root_gpu(every, 3) == 0
    with pytest.raises(ConfigError, match="strategy.dp.devices names GPU 2, but this process sees 2 GPUs \\(indices: 0 to 1\\)"):
        driven_gpus(chosen, 2)
    with pytest.raises(ConfigError, match="names a GPU twice"):
        config.load(None, [("strategy.name", "dp"), ("strategy.dp.devices", "1,1")])
    with pytest.raises(ConfigError, match="holds a negative index"):
        config.load(None, [("strategy.name", "dp"), ("strategy.dp.devices", "-1")])
    with pytest.raises(ConfigError, match="strategy.dp.devices .* applies to strategy dp only, not ddp"):
        config.load(None, [("strategy.name", "ddp"), ("strategy.dp.devices", "0,1")])


def _ddp_bucket_cap(rank: int, world: int, bucket_mb: str) -> int:
    import torch

    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.ddp import DDP

    cfg = config.load(None, [("strategy.ddp.bucket_mb", bucket_mb), ("strategy.ddp.shared_memory", "false")]).strategy
    ddp = DDP(cfg, DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"), torch.device("cpu"))
    return ddp.wrap(torch.nn.Linear(4, 2)).bucket_bytes_cap


def test_ddp_takes_the_bucket_cap_it_is_given():
    from tests.distributed import run_on_ranks

    assert run_on_ranks(_ddp_bucket_cap, 2, "4") == [4 * 2**20] * 2
    assert run_on_ranks(_ddp_bucket_cap, 2, "none") == [25 * 2**20] * 2  # DDP's own where the sum is gloo's
    with pytest.raises(ConfigError, match="strategy.ddp.bucket_mb = 0.0 must be greater than 0"):
        config.load(None, [("strategy.ddp.bucket_mb", "0")])
    assert "bucket_mb" not in config.LEGACY_STRATEGY_KEYS  # a key of its table only, never a flat strategy.bucket_mb
