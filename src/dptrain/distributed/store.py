"""The world's key-value store and its networking: which address listens, which interface gloo uses, how long a rank
waits for a host that does not answer, and who is missing when the world does not fill."""

from __future__ import annotations

import datetime
import errno
import ipaddress
import logging
import os
import socket
import time

import torch.distributed as dist

from dptrain.distributed.env import DistEnv, check_master_resolves
from dptrain.distributed.failures import _one_line
from dptrain.errors import LaunchError

log = logging.getLogger(__name__)


def join_store(env: DistEnv, timeout_s: float) -> dist.Store:
    """The world's key-value store, once every rank has checked in; else an error naming who is missing.

    torch's own rendezvous only counts ("1/4 clients joined"); here each rank writes its own key, so
    that rank 0 can say which ranks never came, and the others that rank 0 is not there.
    Under torchrun with TORCHELASTIC_USE_AGENT_STORE the agent already hosts the store on
    MASTER_PORT and every rank joins it as a client, as env:// would.
    One deadline, timeout_s from the call, covers both reaching the store and waiting for every rank.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    if env.global_rank == 0 and not agent_hosts_store:
        store = listening_store(env.master_addr, env.master_port, timeout_s)
    else:
        store = reach_store(env.master_addr, env.master_port, timeout_s, "the store of rank 0", "rank 0")
    # Keys are per restart of the elastic agent, whose store may outlive a round.
    prefix = f"dptrain/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{env.global_rank}", "1")
    if env.global_rank == 0:
        while missing := [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]:
            if left() <= 0:
                shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
                raise RuntimeError(f"rank{'s' if len(missing) > 1 else ''} {shown} of {env.world_size} never joined within "
                                   f"{timeout_s:g} s; check that every rank was started with the same MASTER_ADDR:MASTER_PORT")
            time.sleep(0.05)
        store.set(f"{prefix}all", "1")
    else:
        try:  # never a zero timeout: to torch's store that means no timeout at all
            store.wait([f"{prefix}all"], datetime.timedelta(seconds=max(0.05, left())))
        except RuntimeError as exc:  # DistStoreError and the timeouts of older torch versions
            raise RuntimeError(f"rank 0 did not see every rank join within {timeout_s:g} s (it names the missing ones)") from exc
    return store


UNREACHABLE_GRACE_S = 30.0  # how long a host may stay unreachable (no route, no answer) before a rank gives up on it


def reach_store(addr: str, port: int, timeout_s: float, what: str, owner: str) -> dist.TCPStore:
    """A client of the store at addr:port, waiting up to timeout_s for it to accept; LaunchError naming what, where
    and whose (owner) it is when it does not.

    First wait until the port accepts: torch's client retries a refused connection with a back-off and gives each
    try the whole timeout (seen: 44 s for a timeout of 20 s). The store's later waits get the whole timeout_s.
    """
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    unreachable = f"could not reach {what} at {addr}:{port} within {timeout_s:g} s: {owner} is missing or unreachable"
    # Refused means the host is there and nobody listens yet (rank 0 still importing torch, say): wait for it up to
    # the deadline. No route, or packets dropped, means the network does not lead there: fail sooner.
    unreachable_since: float | None = None
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left()))).close()
            break
        except socket.gaierror:  # an OSError too, but no wait makes a name resolve
            check_master_resolves(addr)
            exc = None
        except OSError as error:
            exc = error
            if isinstance(error, ConnectionRefusedError):
                unreachable_since = None
            elif unreachable_since is None:
                unreachable_since = time.monotonic()
            elif time.monotonic() - unreachable_since >= min(UNREACHABLE_GRACE_S, timeout_s / 2):
                raise LaunchError(f"{addr}:{port} ({what}) is not reachable from {socket.gethostname()} "
                                  f"({error.strerror or error}); check that {owner}'s host is up, that its address is "
                                  f"one this host can reach, and that no firewall blocks the port.") from error
        if left() <= 0:
            raise LaunchError(f"{unreachable} ({(exc.strerror or exc) if exc else 'no answer'})") from exc
        time.sleep(min(0.1, left()))
    try:  # the port answers: a second at least for torch's handshake, even at the deadline's very end
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=datetime.timedelta(seconds=max(1.0, left())))
    except RuntimeError as exc:  # DistStoreError and the timeouts of older torch versions
        raise LaunchError(f"{unreachable} ({_one_line(exc)})") from exc
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def is_loopback(addr: str) -> bool:
    """Whether addr resolves to this host's loopback only (every rank of the run is on this host)."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(addr, None))
    except (socket.gaierror, ValueError):
        return False


def loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def pin_collective_interface(master_addr: str) -> None:
    """The network interface gloo's sockets use: loopback when the master is loopback (every rank is on this host;
    nccl's bootstrap too); else the interface this host reaches the master through. By default gloo binds the
    address its host name resolves to, which on many machines is 127.0.1.1 (Debian's /etc/hosts) or a management
    network that the other nodes cannot reach: the run then hangs until its timeout. A user's setting wins.

    torch reads these variables each time it makes a group, so they stay set while the world lives;
    unpin_collective_interface takes them back when it ends: a run in the calling process (one rank, no agent) left
    GLOO_SOCKET_IFNAME=lo there, and a later multi-host run in that process bound loopback and never met its peers."""
    if is_loopback(master_addr):
        pinned = {"GLOO_SOCKET_IFNAME": loopback_interface(), "NCCL_SOCKET_IFNAME": loopback_interface()}
    else:
        interface = interface_of(address_towards(master_addr))
        pinned = {} if interface is None else {"GLOO_SOCKET_IFNAME": interface}
    for key, value in pinned.items():
        if key not in os.environ:
            os.environ[key] = value
            _pinned.append(key)


_pinned: list[str] = []  # the variables pin_collective_interface set (not a user's), for unpin_collective_interface


def unpin_collective_interface() -> None:
    """Take back the variables pin_collective_interface set: the process's environment is again as it was."""
    while _pinned:
        os.environ.pop(_pinned.pop(), None)


def address_towards(host: str) -> str:
    """This host's address on the route to host (the source address the kernel would pick; nothing is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)
        except OSError:  # no route: let gloo fall back to its own choice
            return "127.0.0.1" if is_loopback(host) else socket.gethostname()
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding address, or None."""
    import psutil

    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in entries):
            return name
    return None


def listening_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server listening on addr's interface only: loopback for a local run, the master's address on a
    cluster (torch's own listens on every interface). It has no authentication: see docs/security.md."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        raise LaunchError(f"master address {addr!r} does not resolve on {socket.gethostname()}; set MASTER_ADDR to "
                          f"the first node's IP address or add it to /etc/hosts.") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} on {addr} is taken by another program; choose another MASTER_PORT.") from None
        raise LaunchError(f"rank 0 cannot listen on {addr}:{port} ({exc.strerror}): MASTER_ADDR must be an address of "
                          f"rank 0's host {socket.gethostname()}; set it to that host's address.") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    port = sock.getsockname()[1]  # the one picked, for port 0
    fd = sock.detach()  # the store owns the socket from now on
    try:
        return dist.TCPStore(addr, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, NotImplementedError):  # a libuv store without listen-fd support (older torch): the classic one
        return dist.TCPStore(addr, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
