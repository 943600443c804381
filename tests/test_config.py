from __future__ import annotations

from pathlib import Path

import pytest

from dptrain import config
from dptrain.config import ConfigError, RunConfig, check_world


def test_defaults_are_the_readme_main_job():
    cfg = config.load()
    assert (cfg.data.name, cfg.model.name, cfg.strategy.name) == ("fashion-mnist", "mnist-cnn", "ddp")
    assert cfg.output.run_dir == Path("runs/run")


def test_toml_then_overrides_take_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nlr = 0.1\nname = "sgd"\n[train]\nepochs = 3\nbf16 = true\n')
    cfg = config.load(path, [("optim.lr", "3e-4"), ("train.max_steps", "30"), ("data.synthetic_shape", "[3, 8, 8]")])
    assert cfg.optim.lr == 3e-4 and cfg.optim.name == "sgd"
    assert cfg.train.epochs == 3 and cfg.train.bf16 is True and cfg.train.max_steps == 30
    assert cfg.data.synthetic_shape == (3, 8, 8)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = config.load(None, [("optim.lr", "0.05"), ("train.grad_clip", "1.5"), ("output.name", 'a "quoted" name')])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(cfg))
    assert config.load(path) == cfg


def test_none_is_accepted_where_none_means_something():
    cfg = config.load(None, [("train.max_steps", "none")])
    assert cfg.train.max_steps is None


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ([("optim.lrr", "1")], "unknown option optim.lrr; valid options in [optim] are: name, lr,"),
        ([("optimizer.lr", "1")], "unknown option --optimizer.lr; valid sections are: data, model, optim"),
        ([("lr", "1")], "not of the form --section.option"),
        ([("optim.lr", "fast")], "optim.lr expects a number, got 'fast'"),
        ([("train.epochs", "2.5")], "train.epochs expects an integer"),
        ([("train.bf16", "maybe")], "train.bf16 expects true or false"),
        ([("optim.name", "lamb")], "optim.name = 'lamb' is not one of sgd, adam, adamw"),
        ([("data.name", "imagenet")], "data.name = 'imagenet' is not one of"),
        ([("train.global_batch_size", "0")], "train.global_batch_size = 0 must be greater than 0"),
        ([("data.synthetic_shape", "[1, 28]")], "data.synthetic_shape = [1, 28] must be three positive sizes"),
    ],
)
def test_bad_options_are_one_sentence_naming_themselves(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message and message.endswith(".")


def test_bad_toml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[optim\nlr = 1\n")
    with pytest.raises(ConfigError, match="broken.toml is not valid TOML"):
        config.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "absent.toml")
    path.write_text("[optim]\nmomentum = 0.5\nbetas = 1\n")
    with pytest.raises(ConfigError, match="unknown option optim.betas"):
        config.load(path)


def test_check_world_refuses_impossible_splits():
    cfg = config.load(None, [("train.global_batch_size", "100")])
    check_world(cfg, 4, 1000)
    with pytest.raises(ConfigError, match="global_batch_size 100 is not divisible by the world size 3; choose a multiple of 3, for example 99"):
        check_world(cfg, 3, 1000)
    with pytest.raises(ConfigError, match="world size 4 is larger than the training split \\(3 samples\\)"):
        check_world(cfg, 4, 3)
    single = config.load(None, [("strategy.name", "single")])
    with pytest.raises(ConfigError, match="strategy single cannot run on 2 processes"):
        check_world(single, 2, 1000)


def test_run_config_is_frozen():
    cfg = RunConfig()
    with pytest.raises(Exception):
        cfg.train.epochs = 5  # type: ignore[misc]  # frozen on purpose


def test_strategy_options_are_checked_together():
    with pytest.raises(ConfigError, match="strategy.comm_hook ring applies to ddp and zero1 only, not fsdp"):
        config.load(None, [("strategy.name", "fsdp"), ("strategy.comm_hook", "ring")])
    with pytest.raises(ConfigError, match="strategy.param_dtype = 'fp8' is not one of auto, float32, bfloat16, float16"):
        config.load(None, [("strategy.param_dtype", "fp8")])
    dedicated = config.load(None, [("strategy.name", "ps"), ("strategy.dedicated_server", "true"), ("train.global_batch_size", "128")])
    assert dedicated.strategy.data_world_size(4) == 3
    with pytest.raises(ConfigError, match="not divisible by the number of training ranks 3"):
        check_world(dedicated, 4, 1000)  # 3 workers take the data; rank 0 only serves
    with pytest.raises(ConfigError, match="dedicated_server needs at least 2 processes"):
        check_world(dedicated, 1, 1000)
    dp = config.load(None, [("strategy.name", "dp")])
    with pytest.raises(ConfigError, match="strategy dp cannot run on 2 processes \\(dp drives every GPU from one process\\)"):
        check_world(dp, 2, 1000)
