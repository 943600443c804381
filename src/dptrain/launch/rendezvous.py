"""The rendezvous of the nodes' elastic agents: torch's c10d rendezvous on a store that listens on the rendezvous
address only, hosted by node 0, whose nodes take their ranks in --node-rank order; the node that never came named;
a worker's refusal that no restart can change ending the launch at once."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from dataclasses import dataclass
from typing import Any, Iterator

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from dptrain.dist.env import Nodes
from dptrain.dist.store import listening_store, reach_store
from dptrain.errors import LaunchError

REFUSAL_FILE = "DPTRAIN_REFUSAL_FILE"
"""Names the file where a worker leaves the sentence of a refusal that no restart can change, for its agent."""


class Refused(Exception):
    """Raised in the agent, at the rendezvous of a restart, when a worker refused: its sentence is the message."""


RENDEZVOUS = "dptrain"
# How an elastic run (--nnodes MIN:MAX) notices a lost node: each agent writes a heart beat to the rendezvous store
# every KEEP_ALIVE_S; one silent for KEEP_ALIVE_MISSED beats is out (torch's defaults, 5 s x 3, took 15 s; a beat is
# one small store write). Once MIN nodes have come, the rendezvous waits LAST_CALL_S for more (torch: 30 s) before
# the workers start: that long is added to every restart of a run that is not at its MAX nodes. Both can be set in
# the agents' environment (docs/launching.md): shorter notices sooner, but a node whose beats a busy machine delays may
# be taken for lost.
KEEP_ALIVE_S = 2
KEEP_ALIVE_MISSED = 3
LAST_CALL_S = 10
KEEP_ALIVE_ENV, LAST_CALL_ENV = "DPTRAIN_RDZV_KEEP_ALIVE_S", "DPTRAIN_RDZV_LAST_CALL_S"


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name`, else `default`; LaunchError in one sentence
    for another value."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise LaunchError(f"{name}={text!r} is not a number of seconds above 0; set it to one (e.g. {default:g}), or "
                          f"unset it for {default:g}.")
    return value


def register_rendezvous() -> None:
    """torch's c10d rendezvous, on a store that listens on the rendezvous address only (torch's listens on every
    interface, where anyone on the network could read and write the run's keys), hosted by node 0 (torch guesses
    the host by matching host names, which fails where a node's name does not resolve to its address)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    for name, default in ((KEEP_ALIVE_ENV, KEEP_ALIVE_S), (LAST_CALL_ENV, LAST_CALL_S)):
        seconds_from_env(name, default)  # a bad value refused here, in one sentence, not later inside the agent
    rendezvous_handler_registry.register(RENDEZVOUS, _rendezvous)


def _rendezvous(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler's backend has the requested name
            return RENDEZVOUS

    join_s = float(params.config.get("join_timeout", 600))
    host, _, port = params.endpoint.rpartition(":")
    if params.get_as_bool("is_host", False):
        store = listening_store(host, int(port), join_s)
        _rendezvous_host[:] = [store]
    else:
        store = reach_store(host, int(port), join_s, "the rendezvous of node 0", "node 0's dptrain")
    node_rank = int(params.config["node_rank"])
    store.set(f"{CAME}{node_rank}", "1")  # node 0 names the nodes that never came (rendezvous_timeout)
    # A node that died (its agent killed with its workers) leaves the rendezvous once it missed KEEP_ALIVE_MISSED
    # heart beats; then the nodes left meet without it, after waiting LAST_CALL_S for any other node to join.
    timeout = RendezvousTimeout(join=datetime.timedelta(seconds=join_s),
                                last_call=datetime.timedelta(seconds=seconds_from_env(LAST_CALL_ENV, LAST_CALL_S)))
    with nodes_in_node_rank_order(node_rank):
        handler = DynamicRendezvousHandler.from_backend(
            params.run_id, store, Backend(store, params.run_id), params.min_nodes, params.max_nodes,
            local_addr=params.local_addr, timeout=timeout, **_keep_alive(DynamicRendezvousHandler))
    return RefusalAware(handler)


def _keep_alive(handler_class: Any) -> dict[str, Any]:
    """The heart beat settings for torchs whose handler takes them (older ones keep their 5 s x 3)."""
    taken = inspect.signature(handler_class.from_backend).parameters
    return ({"keep_alive_interval": seconds_from_env(KEEP_ALIVE_ENV, KEEP_ALIVE_S),  # seconds; torch makes a timedelta
             "keep_alive_max_attempt": KEEP_ALIVE_MISSED}
            if "keep_alive_interval" in taken else {})


class RefusalAware:
    """torch's rendezvous handler, which the agent calls again before every restart: there a worker's refusal (see
    no_restart_changes) ends the launch instead, once, with its sentence."""

    def __init__(self, handler: Any) -> None:
        self._handler = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def next_rendezvous(self) -> Any:
        path = os.environ.get(REFUSAL_FILE)
        if path:
            with contextlib.suppress(OSError), open(path) as f:
                raise Refused(f.read(4096))
        return self._handler.next_rendezvous()


CAME = "dptrain/node-came/"
_rendezvous_host: list[Any] = []  # node 0's rendezvous store, kept to read which nodes came after a timeout


def forget_the_rendezvous() -> None:
    """After a launch: node 0's rendezvous store is let go (it was kept to name the nodes that never came)."""
    _rendezvous_host.clear()


def rendezvous_timeout(nodes: Nodes, timeout_s: float) -> str:
    """The sentence for a rendezvous that timed out: on node 0, which nodes never came (torch says only
    RendezvousTimeoutError, in a 46-line traceback)."""
    fix = (f"start `dptrain train` on every node with --nnodes {nodes.spelled} and the same --master-addr and "
           f"--master-port, each with its own --node-rank from 0 to {nodes.count - 1}, or give them longer "
           f"(--launch.timeout_s).")
    missing: list[int] = []
    if _rendezvous_host:
        with contextlib.suppress(RuntimeError):
            missing = [r for r in range(nodes.count) if not _rendezvous_host[0].check([f"{CAME}{r}"])]
    if missing:
        shown = ", ".join(map(str, missing))
        return (f"node{'s' if len(missing) > 1 else ''} {shown} of {nodes.count} never came to the rendezvous at "
                f"{nodes.endpoint} within {timeout_s:g} s; {fix}")
    return (f"the {nodes.count} nodes did not all come to the rendezvous at {nodes.endpoint} within {timeout_s:g} s "
            f"(this is node {nodes.rank}); {fix}")


@dataclass(eq=True, frozen=True, repr=False)
class NodeInOrder(_NodeDesc):
    """torch's description of a node (address, pid, a process-wide id), ordered by the node's --node-rank first.

    torch gives the agents their ranks in the sorted order of these descriptions, which sorts by address: the node
    started with --node-rank 1 got global rank 0 where its address sorted first, and the node the user treats as
    the master printed nothing. Ordered by node rank, rank 0 (and its console, its metrics) is on node 0. Every
    agent of a run is dptrain's, so every description in the rendezvous is one of these.
    """

    node_rank: int = 0

    def _key(self) -> tuple[int, str, int, int]:
        return (self.node_rank, self.addr, self.pid, self.local_id)

    def __lt__(self, other: Any) -> bool:
        return self._key() < other._key()

    def __le__(self, other: Any) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: Any) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: Any) -> bool:
        return self._key() >= other._key()


class _InNodeRankOrder:
    """torch's generator of node descriptions, whose descriptions carry this node's rank."""

    def __init__(self, generator: Any, node_rank: int) -> None:
        self.generator, self.node_rank = generator, node_rank

    def generate(self, local_addr: str | None = None) -> NodeInOrder:
        node = self.generator.generate(local_addr)
        return NodeInOrder(node.addr, node.pid, node.local_id, node_rank=self.node_rank)


@contextlib.contextmanager
def nodes_in_node_rank_order(node_rank: int) -> Iterator[None]:
    """Within: the rendezvous handlers torch makes describe this node with its --node-rank (see NodeInOrder)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    torchs = DynamicRendezvousHandler._node_desc_generator
    DynamicRendezvousHandler._node_desc_generator = _InNodeRankOrder(torchs, node_rank)
    try:
        yield
    finally:
        DynamicRendezvousHandler._node_desc_generator = torchs
