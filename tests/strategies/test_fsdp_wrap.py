"""strategy.fsdp.wrap: how FSDP2 cuts the model into units that gather and free their parameters together."""

from __future__ import annotations

import pytest

from dptrain import config
from dptrain.errors import ConfigError
from dptrain.models import build_model
from dptrain.strategies.fsdp.strategy import units


def names(model, modules) -> list[str]:
    by_module = {module: name for name, module in model.named_modules()}
    return [by_module[m] for m in modules]


def test_each_wrap_cuts_the_tutorials_cnn_as_it_says():
    # conv1 320 parameters, conv2 18,496, fc1 1,179,776, fc2 1,290; the dropouts none
    model = build_model(config.ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
    assert names(model, units(model, "block", 0)) == ["conv1", "conv2", "fc1", "fc2"]
    assert names(model, units(model, "size", 1_000)) == ["conv2", "fc1", "fc2"]  # conv1 stays with the root
    assert names(model, units(model, "size", 100_000)) == ["fc1"]
    assert names(model, units(model, "whole", 0)) == []


def test_size_wraps_the_innermost_modules_first_and_counts_what_is_left():
    model = build_model(config.ModelConfig(name="resnet18"), (3, 32, 32), 10)
    found = names(model, units(model, "size", 1_000_000))
    # the last stage's 3x3 convolutions hold 1.2 to 2.4 million parameters each: units of their own, in order; what
    # their stage keeps then is under a million, and the rest of the stages together pass it, at their container
    assert found == ["layers.2.1", "layers.3.0.conv1", "layers.3.0.conv2", "layers.3.1.conv1", "layers.3.1.conv2",
                     "layers"]


def test_the_wrap_options_are_checked():
    with pytest.raises(ConfigError, match="strategy.fsdp.wrap_min_params"):
        config.load(None, [("strategy.name", "fsdp"), ("strategy.fsdp.wrap_min_params", "0")])
    with pytest.raises(ConfigError, match="strategy.fsdp.wrap"):
        config.load(None, [("strategy.name", "fsdp"), ("strategy.fsdp.wrap", "layer")])
