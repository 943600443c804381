"""What a run's card reads of the `dptrain bench` sweep a run may belong to: a sweep point's folder name
(BENCH/runs/<engine>-<strategy>-w<W>-r<R>) and the sweep's matmul probe (BENCH/peak.json, the denominator of a
fraction of peak). The measuring lab (dptrain_bench) writes both and takes these definitions from here, so the
library reads what the lab writes without importing it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dptrain import read_back
from dptrain.read_back import BadValue, UnreadableFile, field

log = logging.getLogger(__name__)

PEAK_FILE = "peak.json"
POINT_NAME = re.compile(r"^(?P<engine>[a-z0-9_]+)-(?P<strategy>[a-z0-9_]+)-w(?P<workers>\d+)-r(?P<repeat>\d+)$")
# What a peak.json read back may hold: no machine of today has a million processes, an exaFLOPS, or computes at less
# than a MFLOPS (a peak of 1e-320 TFLOPS made the fraction of peak inf%)
MAX_PROCESSES = 1 << 20
TFLOPS = (1e-6, 1e6)



@dataclass(frozen=True, kw_only=True)
class Probe:
    """One probe: W processes at once on `device` in `dtype`, and the TFLOPS of every size over all of them."""

    device: str
    dtype: str
    workers: int
    threads: int
    """Threads per process (CPU), 0 on GPUs."""
    tflops_by_size: dict[int, float]
    """Matrix size -> TFLOPS of all the processes together."""

    @property
    def peak_tflops(self) -> float:
        return max(self.tflops_by_size.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tflops_by_size": {str(n): t for n, t in self.tflops_by_size.items()},
                               "peak_tflops": self.peak_tflops}

    @classmethod
    def from_dict(cls, data: Any, name: str = "a probe") -> Probe:
        """A probe as peak.json holds it, each value checked (BadValue naming it): a peak of 0, -1, NaN or 1e308
        TFLOPS, or none at all, would become a fraction of peak of inf, a negative one, nan or 0 downstream."""
        data = read_back.mapping(data, name)
        sizes = read_back.mapping(field(data, "tflops_by_size", name), f"{name}.tflops_by_size", max_items=64)
        if not sizes:
            raise BadValue(f"{name}.tflops_by_size holds no size")
        return cls(device=_choice(field(data, "device", name), f"{name}.device", ("cpu", "cuda")),
                   dtype=_choice(field(data, "dtype", name), f"{name}.dtype", ("float32", "bfloat16")),
                   workers=read_back.integer(field(data, "workers", name), f"{name}.workers", 1, MAX_PROCESSES),
                   threads=read_back.integer(field(data, "threads", name), f"{name}.threads", 0, MAX_PROCESSES),
                   tflops_by_size={read_back.integer(n, f"{name}.tflops_by_size key", 1, 1 << 20):
                                   read_back.number(t, f"{name}.tflops_by_size[{n!r}]", *TFLOPS)
                                   for n, t in sizes.items()})


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise BadValue(f"{name} = {read_back.shown(value)}, not one of {', '.join(choices)}")
    return value


def load_peaks(bench_dir: Path) -> dict[int, Probe]:
    """The probes of BENCH/peak.json by worker count; none when it is missing; UnreadableFile in one sentence where
    it is not what record writes (too large, not a regular file, not JSON, a value out of its range)."""
    def take(data: Any) -> dict[int, Probe]:
        probes = read_back.mapping(field(read_back.mapping(data, "the file"), "probes", "the file"), "probes", 1024)
        return {read_back.integer(w, "a probes key", 1, MAX_PROCESSES): Probe.from_dict(p, f"probes[{w!r}]")
                for w, p in probes.items()}

    try:
        return read_back.read_json(bench_dir / PEAK_FILE, take)
    except FileNotFoundError:
        return {}


def read_peaks(bench_dir: Path) -> dict[int, Probe]:
    """load_peaks, with a file it refuses taken as no probe (one log line says why): the sweep probes again, the
    report and the run card go on without a fraction of peak."""
    try:
        return load_peaks(bench_dir)
    except UnreadableFile as exc:
        log.warning(f"{exc.path} {exc.problem}; it is left out.")
        return {}
