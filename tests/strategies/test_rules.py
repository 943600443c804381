"""Each strategy states what it needs of the world; config and cli know no strategy names."""

from __future__ import annotations

import importlib
import dataclasses
import typing

import pytest

from dptrain import config
from dptrain.config import SPECS, StrategyConfig
from dptrain.strategies.catalog import FOLDERS, readers_of
from dptrain.strategies.ddp.options import CommHook
from dptrain.strategies.ps.options import PSOptions
from dptrain.errors import ConfigError
from dptrain.strategies.registry import STRATEGIES, check_world, data_world_size


def test_the_strategies_are_the_catalogs_folders():
    """The catalog's FOLDERS is the one registry of names: strategy.name's choices, SPECS and STRATEGIES, in its order;
    each strategy's spec is its folder's options.SPEC, its class its folder's strategy module's, naming that spec."""
    assert typing.get_args(typing.get_type_hints(StrategyConfig)["name"]) == tuple(SPECS) == tuple(STRATEGIES) == FOLDERS
    for name, cls in STRATEGIES.items():
        assert cls.spec is SPECS[name] and cls.name == name
        assert cls.__module__ == f"dptrain.strategies.{name}.strategy"
        assert importlib.import_module(f"dptrain.strategies.{name}.options").SPEC is SPECS[name]


def test_the_choices_tables_are_built_from_the_configs_lists():
    """The torch tables of comm hooks, FSDP dtypes and optimizers are keyed by config's lists of the choices."""
    import torch

    from dptrain.strategies.base import OPTIMIZERS
    from dptrain.strategies.comm_hooks import COMM_HOOKS, _hook_powersgd
    from dptrain.strategies.fsdp.strategy import DTYPES

    assert tuple(COMM_HOOKS) == typing.get_args(CommHook) and COMM_HOOKS["powersgd"] is _hook_powersgd
    assert DTYPES == {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert OPTIMIZERS == {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    assert typing.get_args(typing.get_type_hints(config.OptimConfig)["name"]) == tuple(config.OPTIMIZER_CLASSES)


def test_every_table_is_read_by_a_strategy_and_every_strategy_reads_a_table_or_none():
    tables = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}
    assert all(readers_of(table) for table in tables)
    assert {spec.table for spec in SPECS.values()} - {None} == tables
    assert readers_of("ddp") == ("ddp", "zero1")  # zero1 is DDP with a sharded optimizer: ddp's options are its own


def test_a_strategys_own_rules_come_from_its_spec():
    """train.compile's refusal is dp's spec's sentence; the other strategies compile."""
    with pytest.raises(ConfigError) as refused:
        config.load(None, [("strategy.name", "dp"), ("train.compile", "true")])
    assert str(refused.value) == SPECS["dp"].compile_refusal
    assert "nn.DataParallel's per-step replication" in str(refused.value)
    for name in SPECS:
        if name != "dp":
            assert config.load(None, [("strategy.name", name), ("train.compile", "true")]).train.compile


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
    from dptrain.strategies.dp.strategy import driven_gpus, root_gpu

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
    from dptrain.strategies.ddp.strategy import DDP

    cfg = config.load(None, [("strategy.ddp.bucket_mb", bucket_mb), ("strategy.ddp.shared_memory", "false")]).strategy
    ddp = DDP(cfg, DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"), torch.device("cpu"))
    return ddp.wrap(torch.nn.Linear(4, 2)).bucket_bytes_cap


def test_ddp_takes_the_bucket_cap_it_is_given():
    from tests.ranks import run_on_ranks

    assert run_on_ranks(_ddp_bucket_cap, 2, "4") == [4 * 2**20] * 2
    assert run_on_ranks(_ddp_bucket_cap, 2, "none") == [25 * 2**20] * 2  # DDP's own where the sum is gloo's
    with pytest.raises(ConfigError, match="strategy.ddp.bucket_mb = 0.0 must be greater than 0"):
        config.load(None, [("strategy.ddp.bucket_mb", "0")])
    assert "bucket_mb" not in config.LEGACY_STRATEGY_KEYS  # a key of its table only, never a flat strategy.bucket_mb


def test_what_the_run_asks_a_strategy_outside_its_loop_is_a_hook_of_its_class(tmp_path, monkeypatch):
    """prestart, checkpoint and worker ask the chosen class, never a strategy's name: the GPU a rank takes (dp: the
    first it drives), the options a resume keeps beyond the config's (deepspeed: its file's settings), the settings of
    a file of its own taken into the run (deepspeed); the others give the one-process answer."""
    import torch

    from dptrain import snapshots
    from dptrain.distributed.env import DistEnv
    from dptrain.worker import gpu_index

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    on_gpus = [("launch.device", "cuda")]
    dp = config.load(None, [("strategy.name", "dp"), ("strategy.dp.devices", "2,0"), *on_gpus])
    env = DistEnv(1, 1, 2, 2, "127.0.0.1", 0, "torchrun")
    assert gpu_index(dp, env) == 2 and gpu_index(config.load(None, on_gpus), env) == 1

    ds_file = tmp_path / "ds_config.json"
    ds_file.write_text('{"train_batch_size": 64}')
    ds = config.load(None, [("strategy.name", "deepspeed"), ("strategy.deepspeed.config", str(ds_file))])
    digest = "strategy.deepspeed.config (sha256 of its settings)"
    assert STRATEGIES["deepspeed"].computation_options(ds)[digest] is not None
    assert snapshots.computation_options(ds)[digest] == STRATEGIES["deepspeed"].computation_options(ds)[digest]
    assert STRATEGIES["ddp"].computation_options(dp) == {} and digest not in snapshots.computation_options(dp)
    assert STRATEGIES["deepspeed"].adopt_settings(ds, set()).train.global_batch_size == 64
    assert STRATEGIES["ddp"].adopt_settings(dp, set()) is dp
    # the line of the file's settings a run prints at start and its dry run shows (dry_run asks the class too)
    assert STRATEGIES["deepspeed"].settings_from_file(ds) == f"settings from {ds_file}: train.global_batch_size 64"
    assert all(STRATEGIES[name].settings_from_file(dp) is None for name in STRATEGIES if name != "deepspeed")


def test_the_strategies_torch_free_half_imports_no_torch():
    """config checks a strategy's name, options and rules, and the lab reads its traffic, before torch is imported."""
    import subprocess
    import sys

    probe = ("import sys; from dptrain.config import SPECS, choices; "
             "assert SPECS['fsdp'].traffic.sharded and choices.MODELS; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
