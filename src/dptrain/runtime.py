"""Per-process runtime: device, CPU threads, process group with bounded timeouts, seeding, phases."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import re
import time
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from dptrain.launch.env import DistEnv, check_master_resolves

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


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (gloo raises a plain RuntimeError that says so).

    A rank's own error (a bug in its model, say) is not: a roll call there would name the peers
    that are, correctly, still waiting for it in the collective.
    """
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        mark in text for mark in ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL")
    )


def roll_call(store: dist.Store, env: DistEnv, wait_s: float) -> list[int]:
    """After a failed collective: the ranks that do not check in on the store within wait_s.

    The survivors of a failure all fail their collective and check in here at about the same time,
    so the ranks still missing after wait_s are the dead or stuck ones. If the store itself is gone,
    its host, rank 0, is the one missing.
    """
    prefix = f"dptrain/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
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


def set_cpu_threads(local_world_size: int) -> int:
    """Split this node's cores across its local ranks; oversubscribed ranks slow each other down."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    threads = max(1, cores // local_world_size)
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> dist.Store | None:
    """Join the world with a bounded timeout; nccl for CUDA, gloo for CPU.

    torch's default waits 30 minutes on a dead peer; here every collective and the rendezvous
    fail after timeout_s instead. Returns the world's store (None for one process without a launcher).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # binds nccl to this rank's GPU, no guessing
    if env.world_size == 1 and env.source == "none":
        # One process, no launcher: an in-memory store, no port needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
        return None
    check_master_resolves(env.master_addr)
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
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.global_rank == 0 and not agent_hosts_store, timeout=timeout, wait_for_workers=False)
    except RuntimeError as exc:  # DistStoreError and the timeouts of older torch versions
        if env.global_rank == 0 and not agent_hosts_store:
            raise
        raise RuntimeError(f"could not reach the store of rank 0 at {env.master_addr}:{env.master_port} within {timeout_s:g} s: "
                           f"rank 0 is missing or unreachable ({_one_line(exc)})") from exc
    # Keys are per restart of the elastic agent, whose store may outlive a round.
    prefix = f"dptrain/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{env.global_rank}", "1")
    if env.global_rank == 0:
        deadline = time.monotonic() + timeout_s
        while missing := [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]:
            if time.monotonic() > deadline:
                shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
                raise RuntimeError(f"rank{'s' if len(missing) > 1 else ''} {shown} of {env.world_size} never joined within "
                                   f"{timeout_s:g} s; check that every rank was started with the same MASTER_ADDR:MASTER_PORT")
            time.sleep(0.05)
        store.set(f"{prefix}all", "1")
    else:
        try:
            store.wait([f"{prefix}all"], timeout)
        except RuntimeError as exc:  # DistStoreError and the timeouts of older torch versions
            raise RuntimeError(f"rank 0 did not see every rank join within {timeout_s:g} s (it names the missing ones)") from exc
    return store


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
