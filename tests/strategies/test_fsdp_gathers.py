"""fsdp's collectives per step, counted where FSDP2 calls them, against what the strategy says it sends (comm_bytes).

The root's parameters are gathered once a step, whatever reshard_after_forward says (torch's default for the root:
backward needs them first); the units under it twice when resharded. Under wrap whole, the tutorials' plain FSDP2
(fully_shard on the root alone), that is one all-gather and one reduce-scatter a step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.distributed import run_on_ranks

CASES = [("whole", True), ("whole", False), ("block", True), ("block", False), ("size", True)]


def _count_step(rank: int, world: int) -> dict:
    """Per case: the all-gathers and reduce-scatters of one training step after a first one, with the elements
    they carry (the whole gathered or scattered tensor), and the strategy's comm_bytes for one step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from dptrain.config import ModelConfig, StrategyConfig
    from dptrain.dist.env import DistEnv
    from dptrain.models import build_model
    from dptrain.strategies.fsdp import FSDP

    counted: dict = {}
    plain = {"all_gather_single": dist.all_gather_single, "reduce_scatter_single": dist.reduce_scatter_single}

    def counting(name: str, which: int):
        def call(*args, **kwargs):
            tensor = kwargs.get("output" if name.startswith("all") else "input", None)
            tensor = tensor if tensor is not None else args[which]
            counted[name] = counted.get(name, 0) + 1
            counted[name + "_numel"] = counted.get(name + "_numel", 0) + tensor.numel()
            return plain[name](*args, **kwargs)
        return call

    results = {}
    images, labels = torch.randn(4, 1, 28, 28), torch.arange(4)
    for wrap, reshard in CASES:
        base = StrategyConfig(name="fsdp")
        cfg = replace(base, fsdp=replace(base.fsdp, wrap=wrap, wrap_min_params=100_000, reshard_after_forward=reshard))
        strategy = FSDP(cfg, DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"), torch.device("cpu"))
        torch.manual_seed(0)
        model = strategy.wrap(build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):  # the first step's lazy set-up is not a step's traffic
            counted.clear()
            dist.all_gather_single = counting("all_gather_single", 0)
            dist.reduce_scatter_single = counting("reduce_scatter_single", 1)
            try:
                optimizer.zero_grad(set_to_none=True)
                strategy.backward(F.cross_entropy(model(images), labels, reduction="sum"), len(labels) * world)
                optimizer.step()
            finally:
                dist.all_gather_single, dist.reduce_scatter_single = plain.values()
        results[(wrap, reshard)] = dict(counted, comm_bytes=strategy.comm_bytes(1))
    return results


@pytest.fixture(scope="module")
def counted() -> dict:
    return run_on_ranks(_count_step, 2, timeout=60)[0]


def test_the_root_is_gathered_once_a_step_so_wrap_whole_is_the_tutorials_fsdp2(counted):
    # one unit, the root: one all-gather and one reduce-scatter a step, as fully_shard(model) alone does
    for reshard in (True, False):
        assert counted[("whole", reshard)]["all_gather_single"] == 1
        assert counted[("whole", reshard)]["reduce_scatter_single"] == 1


def test_the_units_under_the_root_are_gathered_again_for_backward_only_when_resharded(counted):
    # block: conv1, conv2, fc1 and fc2 as units, the root holding no parameters of its own (no collective of its own)
    assert counted[("block", True)]["all_gather_single"] == 8
    assert counted[("block", False)]["all_gather_single"] == 4
    assert counted[("block", True)]["reduce_scatter_single"] == 4
    # size (100,000): fc1 a unit, twice; the root with conv1, conv2 and fc2, once
    assert counted[("size", True)]["all_gather_single"] == 3


@pytest.mark.parametrize("case", CASES)
def test_comm_bytes_is_what_fsdp_gathers_and_reduce_scatters(counted, case):
    got = counted[case]
    # float32 everywhere; each rank sends (N-1)/N of each gathered or scattered tensor (N = 2); no padding: every
    # parameter of the tutorials' CNN has an even number of elements
    sent = (got["all_gather_single_numel"] + got["reduce_scatter_single_numel"]) * 4 // 2
    assert got["comm_bytes"] == sent
