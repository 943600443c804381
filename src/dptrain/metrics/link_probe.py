"""Each node's link, measured at every epoch's end of a run of MIN_NODES nodes or more: the link phase of a
straggler (metrics.stragglers).

Why a probe: in a ring all-reduce every rank waits as long as the slowest link, so no rank's own time shows which
link is slow. So the first rank of each node (its leader) moves PROBE_BYTES to its two neighbours in the ring of
nodes, all leaders at once (each sends one payload and receives one, on either direction of its link), first to the
right, then to the left, each ROUNDS times, the best kept:
- the transfer a -> b takes as long as the slower of a's sending side and b's receiving side;
- a node's sending time is the faster of its two transfers out, its receiving time the faster of its two transfers
  in: with 3 nodes or more a node's two neighbours differ, so a neighbour of a slow node still has one fast transfer
  each way;
- a node's link time is the slower of its sending and receiving times (node_link_ms).
A node whose link time is more than stragglers.SLOWER_PCT above the other nodes' median, and above FLOOR_MS, is the
epoch's straggler, in the link phase (stragglers.link_straggler). With 2 nodes there is one link between them and
nothing to compare it with: no probe.

The probe goes over a gloo group of the leaders, made once by every rank (torch needs every rank to make a group):
the hosts' TCP links, those a CPU run's collectives use; NCCL may move a GPU run's tensors over another transport
(InfiniBand), which this does not measure. Its time is kept out of the epoch's: it runs after the epoch's clock has
stopped. What it costs: 2 x ROUNDS transfers of PROBE_BYTES and 2 x ROUNDS barriers of the leaders an epoch, about
0.22 s at 100 Mbit/s, and one all-reduce of a world x 3 table; the epoch event's link_probe_s says what it took.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from dptrain import faults

MIN_NODES = 3
"""The fewest nodes whose links are compared (with 2, one link joins them: nothing to compare it with)."""
PROBE_BYTES = 256 * 1024
"""What each leader sends each neighbour in one round: about 21 ms at 100 Mbit/s, 2 ms at 1 Gbit/s."""
ROUNDS = 5
"""Transfers each way; the fastest is kept (a transfer can be held up by something else the host did: with 3, one node
of 20 lab runs of 4 hosts sharing 2 cores had all of its transfers to one neighbour 27% slow, its link then named)."""
FLOOR_MS = 2.0
"""No link is named that moved PROBE_BYTES in less (faster than about 1 Gbit/s): there the probe measures latency and
the hosts' scheduling more than the wire, which differ by more than the margin from one transfer to the next."""
FAULT_BASE_S = PROBE_BYTES * 8 / 100e6
"""faults.SLOW's link phase delays each of the rank's sends by its fraction of this: the probe's time at 100 Mbit/s."""


class LinkProbe:
    """The probe of one rank: its node and whether it leads it, and the leaders' group (on the leaders)."""

    def __init__(self, global_rank: int, world_size: int, local_world_size: int, timeout_s: float) -> None:
        self.per_node = local_world_size
        self.nodes = world_size // local_world_size
        self.node = global_rank // local_world_size
        self.leads = global_rank % local_world_size == 0
        leaders = [n * local_world_size for n in range(self.nodes)]
        # every rank makes the group (torch's rule); only the leaders are in it
        self.group = dist.new_group(leaders, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.delay_s = faults.slow_fraction("link") * FAULT_BASE_S

    @classmethod
    def for_run(cls, global_rank: int, world_size: int, local_world_size: int, timeout_s: float) -> "LinkProbe | None":
        """A probe where the run has MIN_NODES nodes or more, each of local_world_size ranks; else None."""
        if local_world_size < 1 or world_size % local_world_size or world_size // local_world_size < MIN_NODES:
            return None
        return cls(global_rank, world_size, local_world_size, timeout_s)

    def measure(self) -> tuple[float, float, float]:
        """On a leader (every leader at once): the fastest transfer in from the node on the left and from the node
        on the right, and the whole probe's time, in seconds; (0, 0, 0) on the other ranks, at once."""
        if not self.leads:
            return 0.0, 0.0, 0.0
        began_probe = time.perf_counter()
        payload = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32)
        received = torch.empty_like(payload)
        best = []
        for step in (1, -1):  # to the right: in from the left; then to the left: in from the right
            to, source = (self.node + step) % self.nodes, (self.node - step) % self.nodes
            fastest = float("inf")
            for _ in range(ROUNDS):
                dist.barrier(group=self.group)
                began = time.perf_counter()
                if self.delay_s:
                    time.sleep(self.delay_s)
                sending = dist.isend(payload, to * self.per_node, group=self.group)
                dist.recv(received, source * self.per_node, group=self.group)
                fastest = min(fastest, time.perf_counter() - began)
                sending.wait()
            best.append(fastest)
        return best[0], best[1], time.perf_counter() - began_probe


def node_link_ms(table: Sequence[Sequence[float]], per_node: int) -> list[float]:
    """Each node's link time in milliseconds, from the world's (in from the left, in from the right, ...) seconds by
    global rank (the leaders' rows: every per_node-th): the slower of its sending and receiving times (the module's
    docstring)."""
    rows = [table[n * per_node] for n in range(len(table) // per_node)]
    nodes = len(rows)
    times = []
    for n in range(nodes):
        sending = min(rows[(n + 1) % nodes][0], rows[(n - 1) % nodes][1])
        receiving = min(rows[n][0], rows[n][1])
        times.append(1e3 * max(sending, receiving))
    return times
