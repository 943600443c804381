"""The world: the backend, the process group with bounded timeouts, the barrier, and leaving it."""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dptrain.distributed.collectives import record_collectives
from dptrain.distributed.env import DistEnv, check_master_resolves
from dptrain.distributed.store import join_store, pin_collective_interface, unpin_collective_interface


def pick_backend(requested: str, device: torch.device) -> str:
    """launch.backend resolved: auto is nccl for CUDA devices and gloo for the CPU."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float, backend: str = "auto") -> dist.Store | None:
    """Join the world with a bounded timeout, on launch.backend (auto: nccl for CUDA, gloo for CPU).

    torch's default waits 30 minutes on a dead peer; here every collective and the rendezvous
    fail after timeout_s instead. Returns the world's store (None for one process without a launcher). The
    interface it pins for the collectives is taken back by destroy_process_group, or here if joining fails.
    """
    backend = pick_backend(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    record_collectives()  # torch's Flight Recorder, read by a hang's verdict (distributed/hangs.py)
    kwargs = {"device_id": device} if backend == "nccl" else {}  # binds nccl to this rank's GPU, no guessing
    try:
        if env.world_size == 1 and env.source == "none":
            # One process, no launcher: an in-memory store, no port needed.
            pin_collective_interface("127.0.0.1")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
            return None
        check_master_resolves(env.master_addr)
        pin_collective_interface(env.master_addr)
        store = join_store(env, timeout_s)
        dist.init_process_group(backend, store=store, rank=env.global_rank, world_size=env.world_size, timeout=timeout,
                                **kwargs)
    except BaseException:
        unpin_collective_interface()
        raise
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


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_name() -> str:
    """The name the ranks of one host share (gloo picks its interface from it too)."""
    return socket.gethostname()


def machine_id() -> str:
    """What the ranks of one machine share even where each host has its own name (the lab cluster's hosts are
    network namespaces of one kernel, containers too): the kernel's boot id, else the host name."""
    try:
        return BOOT_ID.read_text().strip() or host_name()
    except OSError:
        return host_name()


def where_each_rank_runs() -> list[tuple[str, str]]:
    """(host name, machine id) of every rank, by rank (collective: every rank calls it; one process needs no peer)."""
    mine = (host_name(), machine_id())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def placement(everyone: list[tuple[str, str]] | None = None) -> dict[str, int]:
    """How the world's ranks sit: on how many hosts (names) and machines (kernels, whose cores their ranks share),
    and the cores of this one, from where_each_rank_runs() (made here where not given: a collective)."""
    everyone = everyone if everyone is not None else where_each_rank_runs()
    return {"hosts": len({host for host, _ in everyone}), "machines": len({machine for _, machine in everyone}),
            "machine_cores": os.cpu_count() or 1}


def destroy_process_group() -> None:
    """Leave the world. First a short sleep without the GIL: gloo's worker threads free the last finished work,
    whose tensors they can only release holding the GIL; a group destroyed meanwhile (its destructor joins those
    threads while holding the GIL) deadlocks. Seen after a snapshot's final barrier: a rank hung at exit. The
    environment is then as before init_process_group (see pin_collective_interface)."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()
    unpin_collective_interface()
