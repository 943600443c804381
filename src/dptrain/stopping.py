"""SIGTERM and SIGUSR1: stop at the next step boundary with a snapshot, on every rank at the same step.

The handler only sets a flag: it may run between any two bytecodes, in the middle of a collective,
where saving is impossible. Ranks get the signal at different moments (or only some of them get
it), so the flags are OR-ed over the ranks: each step starts a one-element all-reduce on a small
CPU (gloo) group and the next step reads the previous step's result. Every rank thus sees the
same answer at the same step, at most one step after the signal, and a GPU never waits on it;
the cost is one tiny asynchronous CPU collective per step.

A rehearsal (`dptrain submit --rehearse`) sets DRILLS_VAR to N: the first N signals each write their snapshot as a
stop's would, and training goes on; the next one stops. Each signal's receipt time on every rank is kept, so that the
time from signal to snapshot is measured on the ranks themselves.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

EXIT_STOPPED = 75
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after its snapshot was written (EX_TEMPFAIL: try again)."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DRILLS_VAR = "DPTRAIN_STOP_DRILLS"
"""The number of signals that write a snapshot and let the run go on before one stops it (a rehearsal's job sets it)."""


class Stopped(Exception):
    """The run stopped on a signal: raised out of the loop once every rank agreed (and saved), or by the launcher."""

    @classmethod
    def after_step(cls, signal_name: str, step: int) -> Stopped:
        return cls(f"stopped by {signal_name} after step {step}, a snapshot of step {step} is written; "
                   f"run the same command to resume.")


EXIT_LEFT = 76
"""Exit code of the ranks of a node that leaves an elastic run because it stayed slower than the others
(launch.leave_slow_node): their agent ends without starting them again, and the other nodes go on without it."""
FEWEST_NODES_VAR = "DPTRAIN_FEWEST_NODES"
"""Set by dptrain's agent for its workers where launch.leave_slow_node is on: the fewest nodes the run may go on with
(--nnodes MIN:MAX's MIN)."""


class NodeLeaves(Stopped):
    """Raised on every rank at an epoch's end, after a snapshot of it, once one node's ranks have been the straggler
    for launch.leave_slow_node epochs in a row (SlowNode): that node's ranks leave the run (leaving: exit EXIT_LEFT),
    the others stop to be started again by their agents, without it, from that snapshot."""

    def __init__(self, message: str, leaving: bool) -> None:
        super().__init__(message)
        self.leaving = leaving


class SlowNode:
    """Which node leaves an elastic run, and when: the node whose rank the epochs name the straggler `epochs` epochs in
    a row, while the run has more nodes than the fewest it may go on with. Never node 0: it hosts the rendezvous the
    others meet at again (it is named, and stays). The same answer on every rank: each epoch's straggler comes out of
    the same all-reduced table on each. A node is global ranks node * ranks_per_node onwards (torch's agent numbers
    the ranks node by node, node 0 first)."""

    def __init__(self, epochs: int, ranks_per_node: int, nodes: int, fewest: int) -> None:
        self.epochs, self.ranks_per_node, self.nodes, self.fewest = epochs, ranks_per_node, nodes, fewest
        self.node: int | None = None
        self.count = 0

    def after_epoch(self, straggler_rank: int | None) -> int | None:
        """The node that leaves now, or None, given this epoch's straggler (None: no rank was named)."""
        node = None if straggler_rank is None else straggler_rank // self.ranks_per_node
        self.count = self.count + 1 if node is not None and node == self.node else int(node is not None)
        self.node = node
        if node and self.count >= self.epochs and self.nodes > self.fewest:
            return node
        return None


class StopRequest:
    """Catches SIGTERM/SIGUSR1 in this rank and tells the loop, identically on every rank, when to stop."""

    def __init__(self, world_size: int) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None  # when this rank got the signal (seconds since 1970)
        self.drills_left = int(os.environ.get(DRILLS_VAR) or 0)
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - the signal module's signature
        self.signal_name = signal.Signals(signum).name
        if self.received_at is None:
            self.received_at = time.time()

    def agreed(self) -> str | None:
        """The signal's name on every rank at the same step once any rank has one; else None."""
        if self._group is None:
            return self.signal_name
        stop = None
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            if flag.item():
                stop = self.signal_name or "a signal on another rank"
        flag = torch.tensor([1 if self.signal_name else 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return stop

    def receipts(self) -> list[float | None]:
        """When each rank got the agreed signal, by global rank (None: it got none); a collective at the agreed step."""
        if self._group is None:
            return [self.received_at]
        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, self.received_at, group=self._group)
        return gathered

    def drill(self) -> bool:
        """Whether the agreed signal is a drill (DRILLS_VAR): then it is forgotten on every rank, the exchange already
        started with it dropped, and the next signal counts anew (call it at the agreed step, on every rank)."""
        if self.drills_left <= 0:
            return False
        self.drills_left -= 1
        self.signal_name, self.received_at = None, None
        if self._pending is not None:  # started at this step with this signal's flag: it would stop the next step
            self._pending[0].wait()
            self._pending = None
        return True

    def close(self, wait: bool = True) -> None:
        """Give the signals back; with wait, first finish the last exchange (every rank started it).

        After a failure a peer may be gone, and waiting would only run into the timeout.
        """
        if wait and self._pending is not None:
            self._pending[0].wait()
        self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
