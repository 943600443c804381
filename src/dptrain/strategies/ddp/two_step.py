"""Summing CPU gradients of ranks on several hosts, several ranks a host, in two steps: within each host through
shared memory, then across the hosts by one rank of each (gloo), whose sum the host's ranks then read.

A flat ring all-reduce of N = H hosts x L ranks sends 2(N-1)/N of the gradients from every rank, and the L ranks of
a host share its one link, which carries about L times one rank's share; in two steps only one rank a host sends,
2(H-1)/H of the gradients: about L times less over every host's link. Within a host the sum goes through
shared memory (strategies/shared_memory.py), a tenth of gloo's loopback time; where a host cannot set that up, its
ranks sum through gloo among themselves, and the two steps stay.

The hook hands each bucket to one thread of the rank's and returns at once, so backward goes on computing while
the bucket is summed: the host's sum, the sum across hosts and the sharing out all run on that thread, bucket after
bucket in the order DDP hands them over, which is the same on every rank (a collective order every rank agrees on).
The sums are those of a flat all-reduce in another order: equal up to rounding (float64 tests hold them to 1e-12).
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations against dist.GradBucket itself.

import logging

import torch
import torch.distributed as dist

from dptrain.distributed.world import where_each_rank_runs
from dptrain.strategies import comm_hooks
from dptrain.strategies.shared_memory import SharedMemoryAllReduce, open_on_this_host

log = logging.getLogger(__name__)


def hosts_of_the_ranks() -> dict[str, list[int]]:
    """Host name -> the global ranks on it, hosts in the order of their first rank (collective)."""
    hosts: dict[str, list[int]] = {}
    for rank, (name, _) in enumerate(where_each_rank_runs()):
        hosts.setdefault(name, []).append(rank)
    return hosts


class TwoStepAllReduce:
    """The two-step sum of one rank: its host's ranks (shared memory, else gloo among them), then one rank a host.

    Build it with `open_across_hosts`, which returns None where the ranks are not on several hosts with several
    ranks on one at least (then the flat all-reduce is as good).
    """

    def __init__(self, hosts: int, world: int, local: SharedMemoryAllReduce | None,
                 local_group: dist.ProcessGroup | None, leaders: dist.ProcessGroup | None) -> None:
        self.hosts, self.world = hosts, world
        self.local, self.local_group, self.leaders = local, local_group, leaders
        self.counter = comm_hooks.CommCounter()
        """Bytes this rank sent across hosts (a leader's share of the ring between hosts) and within its host."""
        self._in_order = comm_hooks.InOrder(self._sum_bucket, "dptrain-two-step-sum")

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: DDP's default (divide by the world size, then sum), in two steps on the rank's thread."""
        return self._in_order.hook(state, bucket)

    def take(self) -> int:
        """Bytes sent since the last call, across hosts and within this one."""
        within = self.local.counter.take() if self.local is not None else 0
        return self.counter.take() + within

    def close(self) -> None:
        self._in_order.close()

    def _sum_bucket(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.all_reduce_mean(buffer)
        return comm_hooks.completed(buffer)

    def all_reduce_mean(self, buffer: torch.Tensor) -> None:
        """buffer <- the mean over every rank of buffer, in two steps."""
        if self.local is not None:
            self.local.all_reduce(buffer, divisor=self.world)
        else:
            buffer.div_(self.world)
            if self.local_group is not None:
                dist.all_reduce(buffer, group=self.local_group)
        if self.leaders is not None:
            dist.all_reduce(buffer, group=self.leaders)
            self.counter.bytes_sent += comm_hooks.bytes_per_allreduce(buffer.numel(), buffer.element_size(), self.hosts)
        if self.local is not None:
            self.local.broadcast(buffer, root=0)
        elif self.local_group is not None:
            dist.broadcast(buffer, dist.get_global_rank(self.local_group, 0), group=self.local_group)


def open_across_hosts(max_numel: int, element_size: int, timeout_s: float) -> TwoStepAllReduce | None:
    """The two-step sum for this rank where the ranks run on several hosts, several on one host at least; else None.
    Collective: every rank calls it (the groups of every host are made by every rank, as torch requires)."""
    import datetime

    hosts = hosts_of_the_ranks()
    if len(hosts) < 2 or max(len(ranks) for ranks in hosts.values()) < 2:
        return None
    rank, timeout = dist.get_rank(), datetime.timedelta(seconds=timeout_s)
    groups = {name: dist.new_group(ranks, timeout=timeout) for name, ranks in hosts.items()}
    leaders = dist.new_group([ranks[0] for ranks in hosts.values()], timeout=timeout)
    mine = next(name for name, ranks in hosts.items() if rank in ranks)
    on_this_host = hosts[mine]
    local_group = groups[mine] if len(on_this_host) > 1 else None
    local = (open_on_this_host(max_numel, element_size, timeout_s, group=local_group)
             if local_group is not None else None)
    if rank == 0:
        log.info("gradients are summed in two steps: within each of %d hosts (%s ranks), then across them by one rank "
                 "a host", len(hosts), ",".join(str(len(r)) for r in hosts.values()))
    if local_group is not None and local is None:
        log.info("gradients of this host's ranks are summed through gloo: its shared memory could not be set up")
    return TwoStepAllReduce(len(hosts), dist.get_world_size(), local, local_group,
                            leaders if rank == on_this_host[0] else None)
