"""logs/gpu_rank<R>.log: each GPU rank's device sampled through NVML every few seconds, as `nvidia-smi dmon` logs it.

    # dptrain GPU log: rank 1, cuda:1 (NVIDIA H100 80GB HBM3), NVML every 5 s
    # time                   sm   mem       fb    pwr  temp
    # YYYY-mm-dd HH:MM:SS     %     %      MiB      W     C
    2026-11-25 13:22:48      97    41   12,034    313    61

From the rank joining the world to its leaving (evaluation and snapshots included, unlike the per-epoch utilisation
fields). sm: the time a kernel ran, mem: the time device memory was read or written (NVML's utilisation rates, the
columns of `dmon`), fb: used device memory (every process on it), pwr: board power draw, temp: the GPU's temperature;
`-` where the board does not report it. Without a GPU or NVML there is no file and nothing is said (the utilisation
fields say it once already). A write that fails (a full disk) stops the log with one warning; the run goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dptrain.metrics.utilisation import MIB, nvml_handle, nvml_release
from dptrain.run_folder import RunFolder

log = logging.getLogger("dptrain")

INTERVAL_S = 5.0
"""Seconds between samples: a 10-hour job writes some 7,200 lines (about 350 KB); a sample costs ~1 ms of a thread."""

COLUMNS = f"# {'time':<19}  {'sm':>4}  {'mem':>4}  {'fb':>7}  {'pwr':>5}  {'temp':>4}"
UNITS = f"# {'YYYY-mm-dd HH:MM:SS':<19}  {'%':>4}  {'%':>4}  {'MiB':>7}  {'W':>5}  {'C':>4}"


@dataclass(frozen=True)
class GpuReading:
    """One sample of a device; None where the board does not report the value."""

    sm_pct: float
    mem_pct: float
    fb_used_mib: float
    power_w: float | None = None
    temp_c: float | None = None


def reading_line(when: float, reading: GpuReading) -> str:
    """One row under COLUMNS: local time, then the values right-aligned, integers, `-` for an absent one."""
    def cell(value: float | None, width: int, spec: str = ".0f") -> str:
        return f"{'-' if value is None else format(value, spec):>{width}}"

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return (f"{stamp:<21}  {cell(reading.sm_pct, 4)}  {cell(reading.mem_pct, 4)}  {cell(reading.fb_used_mib, 7, ',.0f')}  "
            f"{cell(reading.power_w, 5)}  {cell(reading.temp_c, 4)}")


class GpuLog:
    """Appends one reading every interval_s to `path` on a daemon thread: the header and a first row on start(), then
    one row per interval, each flushed (a killed job keeps what it sampled); close() stops the thread and the file."""

    def __init__(self, path: Path, read: Callable[[], GpuReading], title: str, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.path, self.read, self.title, self.interval_s, self.clock = path, read, title, interval_s, clock
        self.file: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", buffering=1)  # "a": a resumed run continues its file
        self.file.write(f"# {self.title}, NVML every {self.interval_s:g} s\n{COLUMNS}\n{UNITS}\n")
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="dptrain-gpu-log", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> bool:
        """One row now; False (and one warning) once sampling or writing has failed: the log stops there."""
        try:
            self.file.write(reading_line(self.clock(), self.read()) + "\n")
            return True
        except Exception as exc:  # a full disk or an NVML error never fails the run
            log.warning("the GPU log %s stopped: %s", self.path, exc)
            return False

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.sample():
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
        if self.file is not None:
            with contextlib.suppress(OSError):  # the last row could not be written either; said already
                self.file.close()
            self.file = None


def nvml_reader(handle: Any) -> Callable[[], GpuReading]:
    """A GpuReading from NVML; power and temperature are left out once the board refuses them."""
    import pynvml

    optional = {"power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,  # milliwatts
                "temp_c": lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))}

    def read() -> GpuReading:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        extra = {}
        for name, get in list(optional.items()):
            try:
                extra[name] = get()
            except pynvml.NVMLError:
                del optional[name]
        return GpuReading(float(rates.gpu), float(rates.memory), pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB, **extra)

    return read


@contextlib.contextmanager
def gpu_log(run: RunFolder | None, global_rank: int, device: torch.device) -> Iterator[GpuLog | None]:
    """logs/gpu_rank<R>.log while the block runs, on a CUDA rank with NVML and a run folder; else nothing, silently."""
    handle = nvml_handle(device)[0] if run is not None and device.type == "cuda" else None
    if handle is None:
        yield None
        return
    assert run is not None
    title = f"dptrain GPU log: rank {global_rank}, {device} ({torch.cuda.get_device_name(device)})"
    writer = GpuLog(run.gpu_log(global_rank), nvml_reader(handle), title)
    try:
        try:
            writer.start()
        except OSError as exc:  # the run goes on without its GPU log
            log.warning("no GPU log: could not write %s (%s)", writer.path, exc.strerror or exc)
        yield writer
    finally:
        writer.close()
        nvml_release()
