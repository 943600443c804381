"""What each rank used over an epoch's training: its process's CPU and resident memory, its GPU's load and power.

Per rank, over the window from the start of an epoch's training to its metrics reduction (evaluation excluded):

- `cpu_util_pct`: this process's CPU time (user + system, every thread) / wall time, in percent of one core,
  so up to 100 x its threads. Exact (two clock reads), not sampled. DataLoader worker processes are not counted.
- `rss_max_mb`: the largest resident set of this process seen by the sampler, MiB (2^20 bytes).
- on a GPU with NVML (nvidia-ml-py): `gpu_util_mean_pct` / `gpu_util_max_pct` (NVML's utilisation.gpu: the
  percentage of time a kernel ran, as `nvidia-smi dmon` shows it), `gpu_mem_used_max_mb` (the device's used
  memory, every process on it, MiB), `gpu_power_mean_w` / `gpu_power_max_w` (board power draw, watts).

A daemon thread samples every `interval_s` (0.5 s, as `nvidia-smi dmon` does by default), and once more at each
window's ends so that a short epoch still has a sample. Without NVML the gpu_* fields are absent and one info
line says why.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import threading
import time
from typing import Any, Callable

import torch

from dptrain.events import (CPU_UTIL_PCT, CPU_UTILISATION, GPU_MEM_USED_MAX_MB, GPU_POWER_MAX_W, GPU_POWER_MEAN_W,
                            GPU_UTIL_MAX_PCT, GPU_UTIL_MEAN_PCT, GPU_UTILISATION, RSS_MAX_MB, UTILISATION)

log = logging.getLogger("dptrain")

CPU_FIELDS, GPU_FIELDS, FIELDS = CPU_UTILISATION, GPU_UTILISATION, UTILISATION
"""Every utilisation field an epoch event may hold (events.UTILISATION), each a list with one value per rank."""

MIB = 2**20


def nvml_handle(device: torch.device) -> tuple[Any | None, str]:
    """NVML's handle of this CUDA device, or (None, why not): no driver, no library, a device it cannot find.
    A handle holds one nvmlInit, which nvml_release gives back (NVML counts them: several users may hold one)."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / _DriverNotLoaded on machines without a driver
        return None, f"NVML is not available here ({exc})"
    try:
        # By UUID: CUDA_VISIBLE_DEVICES renumbers devices, NVML does not.
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), ""
    except Exception as exc:
        nvml_release()
        return None, f"NVML does not find {device} ({exc})"


def nvml_release() -> None:
    """Gives back one nvml_handle's nvmlInit; best effort: the process ends soon after."""
    try:
        import pynvml

        pynvml.nvmlShutdown()
    except Exception:
        pass


def open_nvml(device: torch.device) -> Any | None:
    """nvml_handle for the utilisation fields: without one, one info line says why they are absent."""
    handle, why_not = nvml_handle(device)
    if handle is None:
        log.info("no GPU utilisation fields: %s", why_not)
    return handle


class UtilisationSampler:
    """Samples this process (psutil) and its GPU (NVML) on a daemon thread; `take()` closes a window, `restart()`
    opens one, `close()` stops the thread (joined with a timeout: never holds up the end of a run)."""

    def __init__(self, device: torch.device, interval_s: float = 0.5) -> None:
        import psutil  # here: importing dptrain.metrics stays cheap

        self.interval_s = interval_s
        self._process = psutil.Process()
        self._gpu = open_nvml(device) if device.type == "cuda" else None
        self._power = self._gpu is not None  # turned off if the board does not report its power
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.restart()
        self._thread = threading.Thread(target=self._loop, name="dptrain-utilisation", daemon=True)
        self._thread.start()

    def restart(self) -> None:
        """Open a new window: the CPU clocks' start, and empty maxima and sums."""
        with self._lock:
            self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
            self._rss_max, self._samples = 0, 0
            self._util_sum, self._util_max, self._mem_max, self._power_sum, self._power_max = 0.0, 0.0, 0, 0.0, 0.0
        self._sample()

    def take(self) -> dict[str, float]:
        """The window so far (see the module's docstring for the fields and units); then a new window opens."""
        self._sample()
        with self._lock:
            wall = time.perf_counter() - self._wall0
            cpu = time.process_time() - self._cpu0  # every thread of this process, user + system
            values = {CPU_UTIL_PCT: round(100 * cpu / wall, 1) if wall > 0 else 0.0,
                      RSS_MAX_MB: round(self._rss_max / MIB, 1)}
            if self._gpu is not None and self._samples:
                values |= {GPU_UTIL_MEAN_PCT: round(self._util_sum / self._samples, 1),
                           GPU_UTIL_MAX_PCT: self._util_max, GPU_MEM_USED_MAX_MB: round(self._mem_max / MIB, 1)}
                if self._power:
                    values |= {GPU_POWER_MEAN_W: round(self._power_sum / self._samples, 1),
                               GPU_POWER_MAX_W: self._power_max}
        self.restart()
        return values

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)
        if self._gpu is not None:
            self._gpu = None
            nvml_release()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as exc:  # a sampler failure never fails the run: the fields keep what they had
                log.warning("utilisation sampling stopped: %s", exc)
                return

    def _sample(self) -> None:
        rss = self._process.memory_info().rss
        gpu = self._gpu
        util = mem = power = None
        if gpu is not None:
            import pynvml

            util = float(pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu)
            mem = int(pynvml.nvmlDeviceGetMemoryInfo(gpu).used)
            if self._power:
                try:
                    power = pynvml.nvmlDeviceGetPowerUsage(gpu) / 1000  # milliwatts
                except pynvml.NVMLError:
                    self._power = False
        with self._lock:
            self._rss_max = max(self._rss_max, rss)
            if util is not None and mem is not None:
                self._samples += 1
                self._util_sum, self._util_max = self._util_sum + util, max(self._util_max, util)
                self._mem_max = max(self._mem_max, mem)
                if power is not None:
                    self._power_sum, self._power_max = self._power_sum + power, max(self._power_max, power)


def per_rank(values: dict[str, float], world_size: int, global_rank: int,
             all_reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> dict[str, list[float]]:
    """Every rank's values as one list per field (index = global rank), through one all-reduce of a table in which
    each rank fills its own row. A field that some rank lacks (no NVML there) is left out. Collective: every rank calls it."""
    table = torch.zeros(world_size, len(FIELDS), dtype=torch.float64)  # other ranks' rows 0: the sum is their values
    table[global_rank] = torch.tensor([values.get(name, math.nan) for name in FIELDS], dtype=torch.float64)
    columns = all_reduce(table.to(device)).cpu().t().tolist()
    return {name: column for name, column in zip(FIELDS, columns) if not any(math.isnan(v) for v in column)}


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident memory of this process on CPU (its whole life)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss_kb / 1024 if sys.platform != "darwin" else rss_kb / MIB
