"""One process's runtime: its device, CPU threads and memory allocator, seeds, determinism and autocast.

The distributed world (the process group, its store, failure naming, how a process ends) is distributed/."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from typing import Any

import numpy as np
import torch

from dptrain.distributed.env import DistEnv
from dptrain.slurm.env import slurm_count

log = logging.getLogger(__name__)


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


def available_cores() -> int:
    """The cores this process may use: its CPU set, within its SLURM task's --cpus-per-task where one is given."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    task_cpus = slurm_count("task_cpus")  # None without --cpus-per-task; 0 is no count either
    return min(cores, task_cpus) if task_cpus else cores


def set_cpu_threads(env: DistEnv) -> int:
    """Split the cores this process may use across the ranks sharing them; oversubscribed ranks slow each other down.

    Under SLURM the cores are the task's (--cpus-per-task; the CPU set may show the whole node where the cluster
    does not bind tasks): a task per rank keeps them all, an agent's task shares them among its node's ranks.
    """
    task_cpus = slurm_count("task_cpus")
    cores = available_cores()
    sharing = 1 if env.source == "slurm" and task_cpus else env.local_world_size
    threads = max(1, cores // sharing)
    torch.set_num_threads(threads)
    return threads


def bf16_autocast(device: torch.device, enabled: bool, cache: bool = True,
                  dtype: torch.dtype = torch.bfloat16) -> contextlib.AbstractContextManager:
    """The forward pass's bfloat16 autocast on device where enabled (train.bf16), else a context that does nothing.
    cache False where a CUDA graph replays the step: it cannot keep autocast's cache of cast weights between replays.
    dtype float16: train.fp16's (with a loss scaler: train.LossScaler)."""
    return torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=cache)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
