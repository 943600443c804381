"""strategies.two_step: ranks on several hosts, several on a host: the sum within each host, then across hosts.

Here 4 ranks on this machine told they run on 2 hosts of 2 (their host names), so that both steps run for real
(shared memory within a "host", gloo across); tests/clusters/test_lab_cluster.py runs DDP with it across real links.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow

SIZES = [1, 7, 100_003]


@contextlib.contextmanager
def host_named(name: str):
    """Within: this rank process says it runs on host `name` (the pool's processes serve other tests after)."""
    from dptrain.distributed import world

    real = world.host_name
    world.host_name = lambda: name
    try:
        yield
    finally:
        world.host_name = real


def _two_step_sums(rank: int, world: int, hosts_of: list[str], max_numel: int) -> tuple[list, int, bool]:
    """(each size's two-step mean through the hook, and gloo's flat mean), bytes sent, whether this rank leads."""
    import torch.distributed as dist

    from dptrain.strategies.ddp import two_step

    with host_named(hosts_of[rank]):
        summing = two_step.open_across_hosts(max_numel=max_numel, element_size=8, timeout_s=30)
    assert summing is not None
    results = []
    for size in SIZES:
        x = torch.randn(size, generator=torch.Generator().manual_seed(1000 * size + rank), dtype=torch.float64)
        expected = x / world
        dist.all_reduce(expected)

        class Bucket:  # what the hook reads of DDP's GradBucket
            def buffer(self) -> torch.Tensor:
                return x

        results.append((summing.hook(None, Bucket()).wait(), expected))
    sent = summing.counter.take()
    summing.close()
    return results, sent, summing.leaders is not None


@pytest.mark.parametrize("max_numel", [10**6, 1000])  # 1000: the 100,003-element tensor goes through in pieces
def test_two_hosts_of_two_ranks_get_the_flat_mean(max_numel):
    by_rank = run_on_ranks(_two_step_sums, 4, ["hostA", "hostA", "hostB", "hostB"], max_numel, timeout=90)
    for results, _, _ in by_rank:
        for ours, flat in results:
            assert torch.allclose(ours, flat, rtol=1e-12, atol=1e-15)  # another order of the same float64 sums
    for (mine, _), (theirs, _) in zip(by_rank[0][0], by_rank[1][0]):
        assert torch.equal(mine, theirs)  # one host's ranks read the very same sum
    assert [leads for _, _, leads in by_rank] == [True, False, True, False]  # the first rank of each host
    # a leader sends a ring's share between the 2 hosts, 2(2-1)/2 of each tensor; the others none across hosts
    across = sum(SIZES) * 8
    assert by_rank[1][1] < by_rank[0][1] and by_rank[0][1] >= across


def test_one_rank_a_host_or_one_host_is_left_to_the_flat_sum():
    assert run_on_ranks(_opened, 2, ["h1", "h2"]) == [False, False]  # one rank a host: nothing to sum within
    assert run_on_ranks(_opened, 2, ["h", "h"]) == [False, False]  # one host: the shared-memory sum's case


def _opened(rank: int, world: int, hosts_of: list[str]) -> bool:
    from dptrain.strategies.ddp import two_step

    with host_named(hosts_of[rank]):
        return two_step.open_across_hosts(max_numel=10, element_size=4, timeout_s=30) is not None
