"""Per-process runtime: device, CPU threads, process group with bounded timeouts, seeding, phases."""

from __future__ import annotations

import contextlib
import datetime
import errno
import faulthandler
import ipaddress
import logging
import os
import random
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from dptrain.launch.env import DistEnv, LaunchError, check_master_resolves

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A failure inside a worker, already labelled with its rank and phase."""


class Phase:
    """Names what this rank is doing, so that any failure says 'rank R failed during PHASE'.

    Once the world is joined, a failed collective also says which ranks no longer answer (see roll_call).
    """

    def __init__(self, global_rank: int) -> None:
        self.global_rank = global_rank
        self.name = "start-up"
        self.world: tuple[dist.Store, DistEnv, float] | None = None
        """(store, env, seconds to wait) once the world is joined; set by join_store's caller."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        previous, self.name = self.name, name
        try:
            yield
        except WorkerFailure:
            raise
        except Exception as exc:
            silent = roll_call(*self.world) if self.world is not None and _is_peer_failure(exc) else []
            reason = _one_line(exc)
            if silent:  # the cause first; the backend's own words after it
                reason = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer (dead or stuck): {reason}"
            raise WorkerFailure(f"rank {self.global_rank} failed during {name}: {reason}") from exc
        finally:
            self.name = previous


SHARED_MEMORY_PEER_LOST = "shared-memory peer lost"
"""In every error that a peer's death or silence causes in strategies.shared_memory's all-reduce."""


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (gloo raises a plain RuntimeError that says so).

    A rank's own error (a bug in its model, say) is not: a roll call there would name the peers
    that are, correctly, still waiting for it in the collective.
    """
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        mark in text for mark in ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL",
                                  "timeout caused pair closure",  # gloo, when a peer's link goes silent mid-collective
                                  SHARED_MEMORY_PEER_LOST)
    )


def roll_call(store: dist.Store, env: DistEnv, wait_s: float) -> list[int]:
    """After a failed collective: the ranks that do not check in on the store within wait_s.

    The survivors of a failure all fail their collective and check in here at about the same time,
    so the ranks still missing after wait_s are the dead or stuck ones. If the store itself is gone,
    its host, rank 0, is the one missing.
    """
    prefix = f"dptrain/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    # A store whose host is gone: c10d warns with 15 lines of C++ frames before the error this answers with [0].
    with cpp_warnings_off():
        try:
            store.set(f"{prefix}{env.global_rank}", "1")
            deadline = time.monotonic() + wait_s
            while True:
                silent = [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except RuntimeError:
            return [0] if env.global_rank != 0 else []


def _one_line(exc: BaseException) -> str:
    """The first line of the message: ours are one sentence; torch's first line says what broke."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", line)  # gloo's "[.../pair.cc:553] " source prefix


def wants_cuda(requested: str) -> bool:
    """Whether launch.device resolves to CUDA here: asked for, or available with 'auto'."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> when asked for (or available with 'auto'), else cpu."""
    if wants_cuda(requested):
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device = cuda but CUDA is not available here; use --launch.device cpu.")
        count = torch.cuda.device_count()
        index = local_rank
        if local_rank >= count:
            if count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):  # one GPU bound to each task (srun --gpus-per-task)
                index = 0
            else:
                raise RuntimeError(f"local rank {local_rank} has no GPU (this node shows it {count}); "
                                   f"start at most {count} workers per node.")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def use_deterministic_kernels() -> None:
    """Ask torch for deterministic kernels; must run before the first cuBLAS call, which reads the workspace setting."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with a fixed workspace
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn, not fail, on ops without one (adaptive pooling...)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def libc_function(name: str) -> Any:
    """The C library's function `name` through ctypes, or None where there is no such library or function."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def cpp_warnings_off() -> Iterator[None]:
    """Within: libtorch's C++ warnings are not printed (c10's log level raised to ERROR, as TORCH_CPP_LOG_LEVEL=ERROR
    would at start-up); errors still are. For calls whose failure is expected and answered in a sentence of ours.
    Nothing changes where libc10 does not export the flag (a build logging through glog)."""
    import ctypes

    try:
        level = ctypes.c_int.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        yield
        return
    saved, level.value = level.value, max(level.value, 2)  # 2: ERROR
    try:
        yield
    finally:
        level.value = saved


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BLOCKS_UP_TO = 32 * 2**20  # glibc's largest mmap threshold on 64-bit machines


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed blocks of up to 32 MiB for reuse, instead of giving them back to the kernel.

    By default large blocks are mapped fresh and unmapped when freed, and the heap's top is trimmed, within limits
    that glibc adapts as it goes; a training step of the tutorials' CNN (64 images) still page-faults 6,000 to
    9,000 times, each page zeroed by the kernel again: 47 instead of 39 ms of CPU a step on one thread here,
    mostly in the max-pool's gradient. Kept, the faults drop to a few hundred at most. The cost: the process keeps
    its peak heap resident instead of shrinking between steps. False where the C library is not glibc (nothing
    changes there).
    """
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BLOCKS_UP_TO)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def set_cpu_threads(env: DistEnv) -> int:
    """Split the cores this process may use across the ranks sharing them; oversubscribed ranks slow each other down.

    Under SLURM the cores are the task's (--cpus-per-task; the CPU set may show the whole node where the cluster
    does not bind tasks): a task per rank keeps them all, an agent's task shares them among its node's ranks.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    task_cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    counted = task_cpus.isdigit() and int(task_cpus) > 0
    if counted:
        cores = min(cores, int(task_cpus))
    sharing = 1 if env.source == "slurm" and counted else env.local_world_size
    threads = max(1, cores // sharing)
    torch.set_num_threads(threads)
    return threads


def bf16_autocast(device: torch.device, enabled: bool, cache: bool = True) -> contextlib.AbstractContextManager:
    """The forward pass's bfloat16 autocast on device where enabled (train.bf16), else a context that does nothing.
    cache False where a CUDA graph replays the step: it cannot keep autocast's cache of cast weights between replays."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pick_backend(requested: str, device: torch.device) -> str:
    """launch.backend resolved: auto is nccl for CUDA devices and gloo for the CPU."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float, backend: str = "auto") -> dist.Store | None:
    """Join the world with a bounded timeout, on launch.backend (auto: nccl for CUDA, gloo for CPU).

    torch's default waits 30 minutes on a dead peer; here every collective and the rendezvous
    fail after timeout_s instead. Returns the world's store (None for one process without a launcher).
    """
    backend = pick_backend(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}  # binds nccl to this rank's GPU, no guessing
    if env.world_size == 1 and env.source == "none":
        # One process, no launcher: an in-memory store, no port needed.
        pin_collective_interface("127.0.0.1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
        return None
    check_master_resolves(env.master_addr)
    pin_collective_interface(env.master_addr)
    store = join_store(env, timeout_s)
    dist.init_process_group(backend, store=store, rank=env.global_rank, world_size=env.world_size, timeout=timeout, **kwargs)
    return store


def barrier() -> None:
    """dist.barrier on the default group, a no-op for one process; on nccl it names this rank's GPU (else torch
    guesses from the rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


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
    network that the other nodes cannot reach: the run then hangs until its timeout. A user's setting wins."""
    if is_loopback(master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
        return
    interface = interface_of(address_towards(master_addr))
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)


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
    cluster (torch's own listens on every interface). It has no authentication: see the README's security notes."""
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


def leave_now(code: int) -> None:
    """End this process with code, skipping Python's interpreter teardown: freeing torch's objects one by one takes
    about 0.9 s after a run, for nothing, since the process ends anyway. Callers have closed what is theirs (events,
    logs, snapshots, TensorBoard's writer, the agent's folder); the log handlers and standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def record_for_launcher(exc: BaseException) -> None:
    """The error file a torch launcher (dptrain's agent, torchrun) reads for a failed worker (TORCHELASTIC_ERROR_FILE,
    as torch's @record writes it; nothing without one): the first line of its message is the run's one sentence. Call
    from the except block: the file holds the traceback being handled. A full disk leaves the file unwritten: the
    launcher then says "exited with code 1", and the rank's log says more."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        with contextlib.suppress(OSError):
            ErrorHandler().record_exception(exc)


FAILED_RANK_EXIT_S = 30.0
"""How long a failed rank of a multi-process world may take to leave once its failure is logged (see exit_deadline)."""


def exit_deadline(exc: BaseException, log_file: Path | None, seconds: float = FAILED_RANK_EXIT_S) -> None:
    """Bound what is left of a failed rank's life: its teardown (leaving the process group, closing files, the
    interpreter's own) can wait on work still in flight towards a peer that is gone, one timeout after another, and
    its launcher waits for it: once a node's `dptrain train` stayed more than 100 s after a cut link.

    First the launcher's error file (TORCHELASTIC_ERROR_FILE, as torch's @record writes it once the exception has
    left the worker), so that the run's one sentence survives an early end; then, if this process still runs after
    `seconds`, faulthandler appends every thread's stack to log_file (else stderr) and ends it with exit code 1. Its
    own C thread does that, which needs no GIL: a teardown stuck in C++ may hold it. Call from the except block
    (the error file carries the traceback being handled); lift_exit_deadline() takes it back.
    """
    record_for_launcher(exc)
    stream: Any = sys.stderr
    if log_file is not None:
        with contextlib.suppress(OSError):
            stream = open(log_file, "a")  # noqa: SIM115 - open until the process ends or lift_exit_deadline
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
    except (ValueError, OSError):  # a stream without a file descriptor (a captured stderr): the process's own
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    _deadline.append(stream)


_deadline: list[Any] = []  # the armed deadline's stream: faulthandler has one timer a process; lift only ours (not pytest's)


def lift_exit_deadline() -> None:
    """For a process that lives on after a rank's failure (the CLI's caller, in tests): no end at exit_deadline's time."""
    if _deadline:
        faulthandler.cancel_dump_traceback_later()
        for stream in _deadline:
            if stream not in (sys.stderr, sys.__stderr__):
                stream.close()
        _deadline.clear()


def destroy_process_group() -> None:
    """Leave the world. First a short sleep without the GIL: gloo's worker threads free the last finished work,
    whose tensors they can only release holding the GIL; a group destroyed meanwhile (its destructor joins those
    threads while holding the GIL) deadlocks. Seen after a snapshot's final barrier: a rank hung at exit."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()
