"""fsdp's collectives per step, counted where they run, against what the strategy says it sends (comm_bytes); and
its all-gathers and reduce-scatters through shared memory (CPU ranks on one host) against FSDP2's own on gloo.

The root's parameters are gathered once a step, whatever reshard_after_forward says (torch's default for the root:
backward needs them first); the units under it twice when resharded. Under wrap whole, the tutorials' plain FSDP2
(fully_shard on the root alone), that is one all-gather and one reduce-scatter a step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ranks import run_on_ranks

CASES = [("whole", True), ("whole", False), ("block", True), ("block", False), ("size", True)]


def _strategy(rank: int, world: int, wrap: str, reshard: bool, shared: bool, **options):
    from dptrain.config import StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.fsdp.strategy import FSDP

    base = StrategyConfig(name="fsdp")
    fsdp = replace(base.fsdp, wrap=wrap, wrap_min_params=100_000, reshard_after_forward=reshard, **options)
    strategy = FSDP(replace(base, fsdp=fsdp), DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"),
                    torch.device("cpu"))
    if not shared:
        strategy.uses_shared_memory = lambda: False  # FSDP2's own collectives, on gloo
    return strategy


def _train(strategy, steps: int, before_step=lambda step: None) -> dict[str, torch.Tensor]:
    """`steps` SGD steps of the tutorials' CNN on 4 images per rank (the same everywhere); the final full weights."""
    import torch.nn.functional as F

    from dptrain.config import ModelConfig
    from dptrain.models import build_model

    torch.manual_seed(0)
    model = strategy.wrap(build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    world = strategy.env.world_size
    for step in range(steps):
        torch.manual_seed(100 * step + strategy.env.global_rank)
        images, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
        before_step(step)
        optimizer.zero_grad(set_to_none=True)
        strategy.backward(F.cross_entropy(model(images), labels, reduction="sum"), len(labels) * world)
        optimizer.step()
    return strategy.full_state_dict()


def _count_step(rank: int, world: int) -> dict:
    """Per case and transport: the all-gathers and reduce-scatters of the second training step, with the elements
    this rank sends under that transport's accounting, and the strategy's comm_bytes for one step."""
    import torch.distributed as dist

    plain = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}
    counted: dict = {}

    def add(name: str, numel: int) -> None:
        counted[name] = counted.get(name, 0) + 1
        counted[name + "_numel"] = counted.get(name + "_numel", 0) + numel

    def gloo_all_gather(output, input, *args, **kwargs):  # noqa: A002 - torch's names
        add("all_gather", output.numel() * (world - 1) // world)  # a ring sends (N-1)/N of the whole
        return plain["all_gather"](output, input, *args, **kwargs)

    def gloo_reduce_scatter(output, input, *args, **kwargs):  # noqa: A002
        add("reduce_scatter", input.numel() * (world - 1) // world)
        return plain["reduce_scatter"](output, input, *args, **kwargs)

    results = {}
    for wrap, reshard in CASES:
        for shared in (False, True):
            strategy = _strategy(rank, world, wrap, reshard, shared)

            def count_from_the_second(step: int) -> None:  # the first step's lazy set-up is not a step's traffic
                counted.clear()
                if step == 0:
                    return
                if strategy.shared_memory_collectives is None:
                    dist.all_gather_single, dist.reduce_scatter_single = gloo_all_gather, gloo_reduce_scatter
                    return
                collectives = strategy.shared_memory_collectives
                gather, scatter = collectives.all_gather, collectives.reduce_scatter
                collectives.all_gather = lambda out, inp: (add("all_gather", inp.numel()), gather(out, inp))
                collectives.reduce_scatter = lambda out, inp, average: (add("reduce_scatter", inp.numel()),
                                                                        scatter(out, inp, average))

            try:
                _train(strategy, 2, count_from_the_second)
                results[(wrap, reshard, shared)] = dict(counted, comm_bytes=strategy.comm_bytes(1),
                                                        through_shared_memory=strategy.shared_memory_collectives is not None)
            finally:
                dist.all_gather_single, dist.reduce_scatter_single = plain.values()
                counted.clear()
    return results


@pytest.fixture(scope="module")
def counted() -> dict:
    return run_on_ranks(_count_step, 2, timeout=60)[0]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
def test_the_root_is_gathered_once_a_step_so_wrap_whole_is_the_tutorials_fsdp2(counted, shared):
    # one unit, the root: one all-gather and one reduce-scatter a step, as fully_shard(model) alone does
    for reshard in (True, False):
        assert counted[("whole", reshard, shared)]["all_gather"] == 1
        assert counted[("whole", reshard, shared)]["reduce_scatter"] == 1


@pytest.mark.parametrize("shared", [False, True])
def test_the_units_under_the_root_are_gathered_again_for_backward_only_when_resharded(counted, shared):
    # block: conv1, conv2, fc1 and fc2 as units, the root holding no parameters of its own (no collective of its own)
    assert counted[("block", True, shared)]["all_gather"] == 8
    assert counted[("block", False, shared)]["all_gather"] == 4
    assert counted[("block", True, shared)]["reduce_scatter"] == 4
    # size (100,000): fc1 a unit, twice; the root with conv1, conv2 and fc2, once
    assert counted[("size", True, shared)]["all_gather"] == 3


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_comm_bytes_is_what_the_collectives_send(counted, case, shared):
    got = counted[(*case, shared)]
    assert got["through_shared_memory"] is shared
    # float32; no padding: every parameter of the tutorials' CNN has an even number of elements
    assert got["comm_bytes"] == (got["all_gather_numel"] + got["reduce_scatter_numel"]) * 4


def _train_both_ways(rank: int, world: int, buffer_bytes: int) -> list[bytes]:
    """Final weights of 3 steps under wrap block and whole, through gloo and through a shared buffer of
    buffer_bytes (small: the collectives go through in pieces), serialised."""
    import io

    from dptrain.strategies import shared_memory

    usual, shared_memory.BUFFER_BYTES = shared_memory.BUFFER_BYTES, buffer_bytes
    out = []
    try:
        for wrap in ("block", "whole"):
            for shared in (False, True):
                strategy = _strategy(rank, world, wrap, True, shared)
                weights = _train(strategy, 3)
                assert (strategy.shared_memory_collectives is not None) is shared
                buffer = io.BytesIO()
                torch.save(weights, buffer)
                out.append(buffer.getvalue())
    finally:  # the rank processes serve later tests
        shared_memory.BUFFER_BYTES = usual
    return out


def _load(data: bytes) -> dict[str, torch.Tensor]:
    import io

    return torch.load(io.BytesIO(data))


@pytest.mark.slow
@pytest.mark.parametrize("buffer_bytes", [32 * 2**20, 2**20])
def test_through_shared_memory_two_ranks_train_to_gloos_bits(buffer_bytes):
    # Two ranks: a + b = b + a, and the mean divides that sum as gloo does; 1 MiB: fc1's 4.7 MB go in pieces
    block_gloo, block_shared, whole_gloo, whole_shared = map(_load, run_on_ranks(_train_both_ways, 2, buffer_bytes)[0])
    for gloo, shared in ((block_gloo, block_shared), (whole_gloo, whole_shared)):
        assert gloo.keys() == shared.keys()
        for name in gloo:
            assert torch.equal(gloo[name], shared[name]), name


@pytest.mark.slow
def test_through_shared_memory_three_ranks_train_as_gloo_to_rounding():
    # Three ranks (uneven shards, padding): each element summed in rank order, gloo's order may differ
    block_gloo, block_shared, whole_gloo, whole_shared = map(_load, run_on_ranks(_train_both_ways, 3, 2**20)[0])
    for gloo, shared in ((block_gloo, block_shared), (whole_gloo, whole_shared)):
        for name in gloo:
            scale = gloo[name].abs().max().item()
            assert (gloo[name] - shared[name]).abs().max().item() <= 1e-6 * scale, name
