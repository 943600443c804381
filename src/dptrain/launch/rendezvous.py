"""The rendezvous of the nodes' elastic agents: torch's c10d rendezvous on a store that listens on the rendezvous
address only, hosted by node 0, whose nodes take their ranks in --node-rank order (without --node-rank: node 0 is
the node at the endpoint's host, the others numbered as they come), with its times checked; the node that never
came, the node lost and a host that is gone named; a worker's refusal that no restart can change ending
the launch at once."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import math
import errno
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from dptrain.config import MAX_TIMEOUT_S
from dptrain.distributed.env import Nodes
from dptrain.distributed.store import listening_store, reach_store
from dptrain.errors import ConfigError, LaunchError

log = logging.getLogger(__name__)

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
# The range either may take: below 0.1 s the beats flood the store and any pause of a busy machine loses a node
# (1e-9 is a beat, or a last call, of 0 s to torch's timedelta); a week bounds every wait of a run, as it bounds
# launch.timeout_s (1e308 overflowed that timedelta: a traceback inside the agent).
FEWEST_RDZV_S, MOST_RDZV_S = 0.1, MAX_TIMEOUT_S


@dataclass(frozen=True)
class RendezvousTimes:
    """The heart beat and the last call of the agents' rendezvous, in seconds, checked (rendezvous_times)."""

    keep_alive_s: float
    last_call_s: float

    @property
    def lost_after_s(self) -> float:
        """How long the nodes left wait before they meet again without a lost node: its missed beats, the last call."""
        return KEEP_ALIVE_MISSED * self.keep_alive_s + self.last_call_s


def seconds_from_env(name: str, default: float) -> float:
    """A number of seconds from FEWEST_RDZV_S to MOST_RDZV_S from the environment variable `name`, else `default`;
    ConfigError in one sentence for another value."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not FEWEST_RDZV_S <= value <= MOST_RDZV_S:  # nan and inf fail too
        raise ConfigError(f"{name}={text!r} is not a number of seconds from {FEWEST_RDZV_S:g} to {MOST_RDZV_S:g} (a "
                          f"week); set it to one (e.g. {default:g}), or unset it for {default:g}.")
    return value


def rendezvous_times(join_s: float, nodes: Nodes | None = None) -> RendezvousTimes:
    """The rendezvous' times from the environment (DPTRAIN_RDZV_*), checked before the agent starts; ConfigError in
    one sentence for a value out of its range or, in an elastic run (nodes.elastic), for a lost node whose notice and
    last call would not fit in join_s (launch.timeout_s, the longest the nodes left wait to meet again): they would
    time out instead, and say that a node never came."""
    times = RendezvousTimes(keep_alive_s=seconds_from_env(KEEP_ALIVE_ENV, KEEP_ALIVE_S),
                            last_call_s=seconds_from_env(LAST_CALL_ENV, LAST_CALL_S))
    if nodes is not None and nodes.elastic and times.lost_after_s >= join_s:
        raise ConfigError(
            f"a --nnodes {nodes.spelled} run notices a lost node after {KEEP_ALIVE_MISSED} missed heart beats of "
            f"{times.keep_alive_s:g} s ({KEEP_ALIVE_ENV}) and then waits {times.last_call_s:g} s ({LAST_CALL_ENV}) for "
            f"other nodes, {times.lost_after_s:g} s in all, which must stay below launch.timeout_s ({join_s:g} s) or "
            f"the nodes left time out before they meet again; lower those or raise --launch.timeout_s.")
    return times


def register_rendezvous() -> None:
    """torch's c10d rendezvous, on a store that listens on the rendezvous address only (torch's listens on every
    interface, where anyone on the network could read and write the run's keys), hosted by node 0 (torch guesses
    the host by matching host names, which fails where a node's name does not resolve to its address). Its times
    come in the launch's rdzv_configs (see rendezvous_times)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

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
    host = host.strip("[]")
    given_rank = params.config.get("node_rank")  # None: this node's number comes from the rendezvous
    if given_rank is None:
        store, node_rank = _numbered_by_the_rendezvous(host, int(port), join_s)
    else:
        node_rank = int(given_rank)
        if params.get_as_bool("is_host", False):
            store = listening_store(host, int(port), join_s)
            _rendezvous_host[:] = [store]
        else:
            store = reach_store(host, int(port), join_s, "the rendezvous of node 0", "node 0's dptrain")
    store.set(f"{CAME}{node_rank}", "1")  # node 0 names the nodes that never came (rendezvous_timeout)
    # A node that died (its agent killed with its workers) leaves the rendezvous once it missed KEEP_ALIVE_MISSED
    # heart beats; then the nodes left meet without it, after waiting LAST_CALL_S for any other node to join.
    times = RendezvousTimes(float(params.config["keep_alive_s"]), float(params.config["last_call_s"]))
    timeout = RendezvousTimeout(join=datetime.timedelta(seconds=join_s),
                                last_call=datetime.timedelta(seconds=times.last_call_s))
    with nodes_in_node_rank_order(node_rank):
        handler = DynamicRendezvousHandler.from_backend(
            params.run_id, store, Backend(store, params.run_id), params.min_nodes, params.max_nodes,
            local_addr=params.local_addr, timeout=timeout, **_keep_alive(DynamicRendezvousHandler, times.keep_alive_s))
    ranks_store_s = join_s if params.get_as_bool("serves_the_ranks_store", False) else None
    return RefusalAware(handler, int(params.config.get("ranks_per_node", 1)), by_address=given_rank is None,
                        ranks_store_s=ranks_store_s)


ARRIVED = "dptrain/nodes-arrived"


def _numbered_by_the_rendezvous(host: str, port: int, join_s: float) -> tuple[Any, int]:
    """(the rendezvous store, this node's number) for a node started without --node-rank: the node at the endpoint's
    host hosts the store and is node 0, as torch's c10d rendezvous hosts it there (torch guesses that node by its
    host name; here the address decides); the others join it and are numbered 1, 2, ... as they come."""
    if is_address_of_this_host(host):
        try:
            store = listening_store(host, port, join_s)
        except LaunchError:  # another agent on this host hosts it already (two nodes on one host): join that one
            if not _port_taken(host, port):
                raise
        else:
            _rendezvous_host[:] = [store]
            return store, 0
    store = reach_store(host, port, join_s, "the rendezvous", f"the dptrain of the node at {host}")
    return store, int(store.add(ARRIVED, 1))


def is_address_of_this_host(host: str) -> bool:
    """Whether host resolves to an address of this host (one a socket here can bind to)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True


def _port_taken(host: str, port: int) -> bool:
    """Whether something on this host listens at host:port already."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _keep_alive(handler_class: Any, keep_alive_s: float) -> dict[str, Any]:
    """The heart beat settings for torchs whose handler takes them (older ones keep their 5 s x 3)."""
    taken = inspect.signature(handler_class.from_backend).parameters
    return ({"keep_alive_interval": keep_alive_s,  # seconds; torch makes a timedelta
             "keep_alive_max_attempt": KEEP_ALIVE_MISSED}
            if "keep_alive_interval" in taken else {})


class RefusalAware:
    """torch's rendezvous handler, which the agent calls again before every restart: there a worker's refusal (see
    no_restart_changes) ends the launch instead, once, with its sentence; and a round without a node of the one
    before says on this node's console which node was lost and with how many the run goes on (nodes_lost).

    With ranks_store_s (a script of the user's on one node), each round also gets a store of the agent's own for the
    ranks, on loopback, which the ranks join as torchrun's do its store (TORCHELASTIC_USE_AGENT_STORE): otherwise the
    script's rank 0 hosts one on every interface (torch's TCPStore binds no address), open to anyone on the network.
    A new one each round: a restarted round must not read the keys of the round before (pytorch/pytorch#135712)."""

    def __init__(self, handler: Any, ranks_per_node: int = 1, by_address: bool = False,
                 ranks_store_s: float | None = None) -> None:
        self._handler = handler
        self._ranks_per_node = ranks_per_node
        self._by_address = by_address  # nodes without a --node-rank are named by their address
        self._nodes_before: list[int] | list[str] = []
        self._ranks_store_s = ranks_store_s  # the timeout of the ranks' store; None: the agent serves none
        self._ranks_store: Any = None  # this round's (the round before's closes once nothing holds it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    @property
    def use_agent_store(self) -> bool:
        """What the agent tells its workers (TORCHELASTIC_USE_AGENT_STORE): join the store at MASTER_ADDR:MASTER_PORT
        rather than host it on rank 0."""
        return self._ranks_store_s is not None or self._handler.use_agent_store

    def next_rendezvous(self) -> Any:
        path = os.environ.get(REFUSAL_FILE)
        if path:
            with contextlib.suppress(OSError), open(path) as f:
                raise Refused(f.read(4096))
        info = self._handler.next_rendezvous()
        nodes = self._node_ranks()
        if lost := sorted(set(self._nodes_before) - set(nodes)):
            sentence = nodes_lost(lost, nodes, self._ranks_per_node)
            log.warning("%s", sentence)  # in logs/launcher.log too
            print(f"dptrain: {sentence}", file=sys.stderr, flush=True)  # this node's console, as the CLI's sentences
        self._nodes_before = nodes
        if self._ranks_store_s is not None:
            from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

            self._ranks_store = listening_store("127.0.0.1", 0, self._ranks_store_s)
            info = RendezvousInfo(info.store, info.rank, info.world_size,
                                  RendezvousStoreInfo("127.0.0.1", self._ranks_store.port))
        return info

    def _node_ranks(self) -> list[int] | list[str]:
        """The --node-rank of every node in the round just met, or its address where the nodes have none (torch's
        state of the rendezvous; none where unread)."""
        try:
            participants = self._handler._state_holder.state.participants
        except AttributeError:  # a torch whose handler keeps its state elsewhere: no sentence, the run is the same
            return []
        ours = sorted(node for node in participants if isinstance(node, NodeInOrder))
        return [node.addr for node in ours] if self._by_address else [node.node_rank for node in ours]


def nodes_lost(lost: list[int] | list[str], left: list[int] | list[str], ranks_per_node: int) -> str:
    """The sentence for a round of the rendezvous without nodes `lost` of the round before: the run goes on with the
    nodes `left`, from its last snapshot (the workers stopped, or failed, when those nodes went). Nodes are named by
    their --node-rank (ints), or by their address (strs) where they had none."""
    def named(nodes: list[int] | list[str]) -> str:
        at = " at" if nodes and isinstance(nodes[0], str) else ""
        return f"node{'s' if len(nodes) > 1 else ''}{at} {', '.join(map(str, nodes))}"

    ranks = len(left) * ranks_per_node
    its, host = ("their", "hosts") if len(lost) > 1 else ("its", "host")
    ranks_left = f"{ranks} rank{'s' if ranks > 1 else ''}"
    nodes_left = f"{len(left)} node{'s' if len(left) > 1 else ''} ({named(left)}; {ranks_left})"
    return (f"{named(lost)} left the run ({its} `dptrain train` ended, or {its} {host} stopped answering); the run "
            f"goes on with {nodes_left} from its last snapshot.")


CAME = "dptrain/node-came/"
_rendezvous_host: list[Any] = []  # node 0's rendezvous store, kept to read which nodes came after a timeout


def forget_the_rendezvous() -> None:
    """After a launch: node 0's rendezvous store is let go (it was kept to name the nodes that never came)."""
    _rendezvous_host.clear()


def rendezvous_host_gone(nodes: Nodes) -> str:
    """The sentence for a rendezvous store that stopped answering (torch printed 90-odd lines of C++ frames and a
    RendezvousConnectionError traceback): node 0, its host, is gone, and no run goes on without it."""
    if nodes.rank == 0 or (nodes.rank is None and _rendezvous_host):
        return (f"the rendezvous store this node hosts at {nodes.endpoint} stopped answering; run the "
                f"same command again on every node to resume from the last snapshot.")
    node_0 = "node 0" if nodes.rank is not None else f"the node at {nodes.host}"
    return (f"{node_0}, which hosts the run's rendezvous at {nodes.endpoint}, is gone (its `dptrain train` ended, or "
            f"its host or the network failed) and the run cannot go on without it; run the same command again on "
            f"every node, {node_0} included, to resume from the last snapshot.")


def rendezvous_timeout(nodes: Nodes, timeout_s: float) -> str:
    """The sentence for a rendezvous that timed out: on node 0, which nodes never came (torch says only
    RendezvousTimeoutError, in a 46-line traceback)."""
    if nodes.rank is None:
        return _unnumbered_nodes_timeout(nodes, timeout_s)
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


def _unnumbered_nodes_timeout(nodes: Nodes, timeout_s: float) -> str:
    """rendezvous_timeout's sentence for nodes without --node-rank: how many came, where the host can count them."""
    fix = (f"start `dptrain train` on every node with --nnodes {nodes.spelled} and the same rendezvous endpoint "
           f"{nodes.endpoint}, whose host must be one of the nodes, or give them longer (--launch.timeout_s).")
    came = None
    if _rendezvous_host:
        with contextlib.suppress(RuntimeError):
            came = 1 + int(_rendezvous_host[0].add(ARRIVED, 0))  # the host, and the nodes numbered as they came
    if came is not None:
        return (f"only {came} of {nodes.count} nodes came to the rendezvous at {nodes.endpoint} within "
                f"{timeout_s:g} s; {fix}")
    return (f"the {nodes.count} nodes did not all come to the rendezvous at {nodes.endpoint} within {timeout_s:g} s; "
            f"{fix}")


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
