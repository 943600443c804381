"""strategies.shared_memory: the sum through /dev/shm is gloo's sum, the same on every rank, and fails like gloo.

DDP training with it is compared with one process in tests/strategies/test_strategies_distributed.py (the CLI's ranks run
on one host, so ddp and zero1 there sum through shared memory); here a DDP step with it against one with gloo.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow

SIZES = [1, 2, 7, 1001, 100_003]


def _inputs(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * size + rank), dtype=dtype)


def _sums(rank: int, world: int, max_numel: int, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """(the shared-memory sum, gloo's) of each size of SIZES, and of a mean (divisor = world); and the bytes this rank
    wrote to shared memory for the others (comm_bytes_per_step)."""
    import torch.distributed as dist

    from dptrain.strategies.shared_memory import open_on_this_host

    transport = open_on_this_host(max_numel=max_numel, element_size=8, timeout_s=30)
    assert transport is not None
    results = []
    for size in SIZES:
        for divisor in (1, world):
            x = _inputs(rank, size, dtype)
            expected = x / divisor if divisor != 1 else x.clone()
            dist.all_reduce(expected)
            transport.all_reduce(x, divisor=divisor)
            results.append((x, expected))
    written = transport.counter.take()
    transport.close()
    return results, written


def _assert_written(by_rank: list, world: int, element_size: int) -> None:
    """Every rank writes each tensor once into its slot, and the ranks' parts of the sum cover it once more."""
    summed = 2 * sum(SIZES) * element_size  # every size, as a sum and as a mean
    assert sum(written for _, written in by_rank) == (world + 1) * summed


@pytest.mark.parametrize("max_numel", [10**6, 100])  # 100: a 1001-element tensor goes through in 11 pieces
def test_two_ranks_get_gloos_sum_bit_for_bit(max_numel):
    by_rank = run_on_ranks(_sums, 2, max_numel, torch.float32, timeout=60)
    for ours, gloo in by_rank[0][0]:
        assert torch.equal(ours, gloo)  # a + b = b + a: the same bits as gloo's ring
    for (mine, _), (theirs, _) in zip(by_rank[0][0], by_rank[1][0]):
        assert torch.equal(mine, theirs)
    _assert_written(by_rank, 2, 4)


@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_get_one_sum_the_same_on_every_rank(world):
    """In float64 the sum is exact to 1e-15 of gloo's; whatever the order, every rank holds the same bits."""
    by_rank = run_on_ranks(_sums, world, 100, torch.float64, timeout=90)
    _assert_written(by_rank, world, 8)
    for results in zip(*(results for results, _ in by_rank)):
        first = results[0][0]
        for ours, gloo in results:
            assert torch.equal(ours, first)
            assert (ours - gloo).abs().max().item() <= 1e-15 * world * gloo.abs().max().item() + 1e-300


def _set_up_in(rank: int, world: int, folder: str) -> tuple[bool, list[str]]:
    from dptrain.strategies.shared_memory import open_on_this_host

    transport = open_on_this_host(max_numel=1000, element_size=4, timeout_s=30, shm_dir=folder)
    left = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if transport is not None:
        transport.close()
    return transport is not None, left


def test_set_up_leaves_nothing_behind_and_every_rank_falls_back_together(tmp_path):
    folder = str(tmp_path)
    assert run_on_ranks(_set_up_in, 2, folder) == [(True, []), (True, [])]  # the private folder is gone already
    missing = str(tmp_path / "not-there")
    assert run_on_ranks(_set_up_in, 2, missing) == [(False, []), (False, [])]  # rank 0 cannot create: all use gloo


def _one_rank_leaves(rank: int, world: int) -> str | None:
    from dptrain.distributed.failures import _is_peer_failure
    from dptrain.strategies.shared_memory import open_on_this_host

    transport = open_on_this_host(max_numel=1000, element_size=4, timeout_s=30)
    if rank == 1:
        return None  # its process ends (leaving=(1,)): its ends of the FIFOs close
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        transport.all_reduce(torch.ones(10))
    assert _is_peer_failure(caught.value)  # the worker's roll call counts it as a peer's failure
    assert time.monotonic() - started < 10  # the closed ends are seen at once, not after the timeout
    return str(caught.value)


def test_a_peer_that_dies_is_an_error_at_once():
    message = run_on_ranks(_one_rank_leaves, 2, timeout=60, leaving=(1,))[0]
    assert "shared-memory peer lost" in message


def _one_rank_is_late(rank: int, world: int) -> str | None:
    from dptrain.distributed.failures import _is_peer_failure
    from dptrain.strategies.shared_memory import open_on_this_host

    transport = open_on_this_host(max_numel=1000, element_size=4, timeout_s=1)
    if rank == 1:
        time.sleep(3)  # late for rank 0's sum, which gives up after 1 s
        transport.close()
        return None
    with pytest.raises(RuntimeError) as caught:
        transport.all_reduce(torch.ones(10))
    assert _is_peer_failure(caught.value)
    transport.close()
    return str(caught.value)


def test_a_silent_peer_is_an_error_after_the_timeout_naming_it():
    message = run_on_ranks(_one_rank_is_late, 2, timeout=60)[0]
    assert "rank(s) [1] did not reach the shared-memory all-reduce within 1 s" in message


def _ddp_steps(rank: int, world: int, shared: bool) -> dict[str, torch.Tensor]:
    """Three SGD steps of DDP on the tutorials' CNN, gradients summed through shared memory or gloo."""
    from dptrain.config import StrategyConfig
    from dptrain.strategies.ddp.options import DDPOptions
    from dptrain.distributed.env import DistEnv
    from dptrain.models.mnist_cnn import MnistCNN
    from dptrain.strategies.ddp.strategy import DDP

    env = DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun")
    strategy = DDP(StrategyConfig(ddp=DDPOptions(shared_memory=shared)), env, torch.device("cpu"), timeout_s=30)
    torch.manual_seed(0)
    model = strategy.wrap(MnistCNN().eval())  # eval: no dropout, so that the steps are the same computation
    assert (strategy.shared_memory_sum is not None) == shared
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        images, labels = torch.randn(8, 1, 28, 28, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in strategy.eval_module.named_parameters()}


def test_ddp_through_shared_memory_trains_exactly_as_through_gloo():
    shared, gloo = (run_on_ranks(_ddp_steps, 2, flag, timeout=90) for flag in (True, False))
    for name, weight in gloo[0].items():
        assert torch.equal(shared[0][name], weight), name
        assert torch.equal(shared[1][name], weight), name
