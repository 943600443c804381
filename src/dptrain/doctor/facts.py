"""What one node can say about itself before it meets the others: names and addresses, the interface the
collectives would use, software versions, the run folder, the dataset's files, free disk, /dev/shm, devices.

Each fact is gathered within a bound (a name lookup or a subprocess that hangs is cut off) and kept as plain JSON
data: the nodes exchange these dictionaries through the run's store, never as pickles.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from dptrain.config import RunConfig, is_import_path
from dptrain.distributed.store import address_towards, interface_of, is_loopback

LOOKUP_S = 3.0  # a name lookup that takes longer is as good as failed: c10d and gloo would wait on it the same way
HEADER_BYTES = 1 << 16  # the part of each dataset file whose checksum is compared across the nodes
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def bounded(call: Callable[[], Any], seconds: float = LOOKUP_S) -> tuple[Any, str | None]:
    """(call's result, None), or (None, why not) when it raised or took longer than `seconds`. A thread that hangs
    in the resolver is left behind (it holds nothing); the doctor goes on."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    try:
        return future.result(timeout=seconds), None
    except concurrent.futures.TimeoutError:
        return None, f"no answer within {seconds:g} s"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        pool.shutdown(wait=False)


def resolve(name: str) -> tuple[list[str], str | None]:
    """The IPv4/IPv6 addresses `name` resolves to on this node, sorted, or the reason it does not resolve."""
    found, problem = bounded(lambda: socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))
    if problem is not None:
        return [], problem
    return sorted({entry[4][0] for entry in found}), None


def collective_address(master_addr: str) -> dict[str, Any]:
    """The address and interface this node's ranks would use for the collectives: the one a user's
    GLOO_SOCKET_IFNAME names, else the one on the route to the master (dptrain pins that interface), as the
    distributed floor picks it."""
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    if named:
        addresses = interface_addresses().get(named, [])
        return {"interface": named, "address": addresses[0] if addresses else None, "chosen_by": "GLOO_SOCKET_IFNAME"}
    address, problem = bounded(lambda: address_towards(master_addr))
    if problem is not None:
        return {"interface": None, "address": None, "chosen_by": "route", "problem": problem}
    if is_loopback(master_addr):
        return {"interface": interface_of("127.0.0.1"), "address": "127.0.0.1", "chosen_by": "loopback master"}
    return {"interface": interface_of(address), "address": address, "chosen_by": "route to the master"}


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface of this node and its IPv4 addresses."""
    import psutil

    return {name: [e.address for e in entries if e.family == socket.AF_INET]
            for name, entries in psutil.net_if_addrs().items()}


def software() -> dict[str, Any]:
    """Python, torch, CUDA, nccl and dptrain versions, and dptrain's git revision where it runs from a checkout."""
    import torch

    import dptrain

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "dptrain": getattr(dptrain, "__version__", ""), "git": git_revision()}


def git_revision() -> str | None:
    """dptrain's git revision when it runs from a checkout (the same on every node, or the nodes run other code)."""
    source = Path(__file__).resolve().parents[3]
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=LOOKUP_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def dataset_files(cfg: RunConfig) -> dict[str, Any]:
    """The dataset's files this node finds: each one's size and the sha256 of its first HEADER_BYTES; or why none
    (synthetic data and a user's Dataset have no files dptrain knows), or why the run would refuse them here (a
    file that is a FIFO, a device, a link to /dev/zero, truncated, another dataset's): read and checked as the run
    reads them (catalog.load), the one reader, which opens regular files only, so this never waits on a FIFO."""
    import dataclasses

    from dptrain.data.catalog import DATASETS, idx_file, load, locate
    from dptrain.data.formats import open_data_file
    from dptrain.errors import DataError

    name = cfg.data.name
    if name == "synthetic" or is_import_path(name):
        return {"kind": "none", "why": "synthetic data" if name == "synthetic" else "your own Dataset"}
    spec = DATASETS[name]
    try:
        folder = locate(spec, Path(cfg.data.root))
    except DataError as exc:
        return {"kind": "missing", "why": str(exc), "download": bool(cfg.data.download)}
    try:
        load(dataclasses.replace(cfg.data, download=False))  # what the run would read there, and refuse
        files = {}
        for path in (idx_file(folder, required) for required in spec.required):  # the raw file, else its .gz
            with open_data_file(path) as handle:
                head = handle.read(HEADER_BYTES)
                size = os.fstat(handle.fileno()).st_size
            files[path.name] = {"bytes": size, "head_sha256": hashlib.sha256(head).hexdigest()}
    except DataError as exc:
        return {"kind": "refused", "folder": str(folder), "why": str(exc)}
    return {"kind": "files", "folder": str(folder), "files": files}


def disk_and_shm(run_dir: Path) -> dict[str, Any]:
    """Free bytes where the run folder is (or would be), and the size and free bytes of /dev/shm."""
    place = run_dir
    while not place.exists() and place != place.parent:
        place = place.parent
    usage = shutil.disk_usage(place)
    facts: dict[str, Any] = {"run_folder_free_bytes": usage.free, "run_folder_checked_at": str(place.resolve())}
    try:
        shm = shutil.disk_usage("/dev/shm")
        facts |= {"shm_bytes": shm.total, "shm_free_bytes": shm.free}
    except OSError:
        facts |= {"shm_bytes": None, "shm_free_bytes": None}
    return facts


def devices() -> dict[str, Any]:
    """The GPUs this node's processes see and its usable cores."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    return {"cores": cores, "gpus": gpus, "gpu_names": names}


def node_facts(cfg: RunConfig, master_addr: str, run_dir: Path) -> dict[str, Any]:
    """Everything this node says about itself, for checks.judge."""
    host = socket.gethostname()
    master, master_problem = resolve(master_addr)
    own, own_problem = resolve(host)
    return {
        "host": host,
        "master_addr": master_addr, "master_resolves_to": master, "master_problem": master_problem,
        "own_name_resolves_to": own, "own_name_problem": own_problem,
        "collective": collective_address(master_addr),
        "interface_variables": {name: os.environ.get(name) for name in INTERFACE_VARIABLES},
        "interfaces": interface_addresses(),
        "software": software(),
        "dataset": dataset_files(cfg),
        "disk": disk_and_shm(run_dir),
        "devices": devices(),
        "executable": sys.executable,
    }
