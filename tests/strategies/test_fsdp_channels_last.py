"""fsdp under train.channels_last: FSDP2 gathers the convolutions' weights in NCHW (it shards contiguous parameters
only), so the strategy puts their inputs in channels_last, and the convolutions still run oneDNN's channels_last
kernels (a step of the tutorials' CNN: 48 instead of 67 ms of CPU on one thread)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.config import ModelConfig
from dptrain.models import build_model
from dptrain.strategies.fsdp.strategy import channels_last_convolutions
from tests.ranks import run_on_ranks


def test_the_convolutions_laid_out_channels_last_are_told_by_their_strides():
    cnn = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
    assert channels_last_convolutions(cnn) == []
    cnn = cnn.to(memory_format=torch.channels_last)
    # conv1's weight has one input channel: contiguous in both layouts, told apart by its strides only
    assert channels_last_convolutions(cnn) == [cnn.conv1, cnn.conv2]
    resnet = build_model(ModelConfig(name="resnet18"), (3, 32, 32), 10).to(memory_format=torch.channels_last)
    convolutions = [m for m in resnet.modules() if isinstance(m, nn.Conv2d)]
    assert channels_last_convolutions(resnet) == convolutions  # the 1x1 shortcuts too


def _layouts(rank: int, world: int) -> dict[bool, tuple[list[tuple[bool, bool]], torch.Tensor]]:
    """Per model layout: for each convolution of the wrapped tutorials' CNN, whether its input and its output were
    channels_last in a training step; and the logits of an evaluation after it."""
    from dataclasses import replace

    import torch.nn.functional as F

    from dptrain.config import StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.fsdp.strategy import FSDP

    found = {}
    for channels_last in (False, True):
        strategy = FSDP(replace(StrategyConfig(name="fsdp")), DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"),
                        torch.device("cpu"))
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = strategy.wrap(model)
        seen = []
        for conv in (model.conv1, model.conv2):
            conv.register_forward_hook(lambda m, args, out: seen.append(
                (args[0].stride(1) == 1, out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous())))
        torch.manual_seed(rank)
        images = torch.randn(8, 1, 28, 28)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)  # as the loader gives them
        F.cross_entropy(model(images), torch.arange(8), reduction="sum").backward()
        model.eval()  # no dropout: its masks are drawn in memory order, so they differ between the layouts
        with torch.no_grad():
            logits = model(images)
        found[channels_last] = (seen[:2], logits)
    return found


@pytest.fixture(scope="module")
def layouts() -> dict:
    return run_on_ranks(_layouts, 2, timeout=60)[0]


def test_under_channels_last_the_convolutions_run_channels_last(layouts):
    seen, _ = layouts[True]
    assert seen == [(True, True), (True, True)]


def test_without_channels_last_they_run_in_nchw(layouts):
    seen, _ = layouts[False]
    assert seen == [(False, False), (False, False)]


def test_the_layout_changes_no_result_beyond_rounding(layouts):
    nchw, channels_last = layouts[False][1], layouts[True][1]
    assert (channels_last - nchw).abs().max().item() <= 1e-5 * nchw.abs().max().item()
