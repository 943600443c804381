"""A short link probe: how long the collectives of the strategies take between W processes, fitted to a latency and
a bandwidth (the alpha-beta model), the link half of the scaling model (dptrain_bench/scaling_model.py) as peak.json is its compute
half.

    $ dptrain bench probe link --world 2,4                     # processes of this machine, gloo on the CPU
    $ dptrain bench probe link --world 2 --device cuda         # nccl, one GPU each
    $ srun -N 2 dptrain bench probe link --launched            # across hosts: one process per task (torchrun too)

`python -m dptrain_bench.link` is the probe's internal entry: measure() runs it (--json) in a fresh Python, and a
--slurm sweep's link job runs it (--launched --record) on every node.

Collectives, each at a few buffer sizes: all_reduce (ddp, zero1, the hooks), reduce_scatter and all_gather (fsdp,
zero1's parameters), broadcast (DDP's buffers and first parameters). Each collective and size: a warm-up call, one
timed call that sets how many calls fill MIN_S (the slowest rank's, agreed by an all_reduce), then ROUNDS rounds of
those calls, each after a barrier and timed by its slowest rank; its time per call is the best round's, so a round
another program slowed down does not count.

The fit (fit(), pure) assumes the ring algorithms of the bandwidth-optimal textbook: for a buffer of S bytes on N
processes, with a per-message latency alpha and a link bandwidth B (bytes/s),
    all_reduce      t = 2(N-1) alpha + 2(N-1)/N S / B     (reduce-scatter then all-gather around the ring)
    reduce_scatter  t =  (N-1) alpha +  (N-1)/N S / B     (S: the whole input, of which each rank keeps S/N)
    all_gather      t =  (N-1) alpha +  (N-1)/N S / B     (S: the whole output)
    broadcast       t = ceil(log2 N) (alpha + S / B)      (a binomial tree, each level sending the whole buffer)
(ring_terms). alpha and 1/B are one weighted least-squares fit over every timing (weights 1/t^2: relative errors, so
that the small sizes that set alpha count as much as the large ones that set B); each collective also gets its own
alpha and B from its timings alone (per_collective; LinkFit.line gives its t = a + b S, the ring factors folded into
a and b). At a world the probe timed, LinkFit.seconds reads the collective along its timings instead (a straight line
between two sizes): one alpha and B for every world and size can be 20% off at the large sizes (on the lab at 100
Mbit/s the fit gave 4.8 MB on 4 hosts 0.50 s where the probe took 0.62), and the scaling model's steps are mostly
large buffers. gloo and nccl pick other algorithms at some
sizes (trees, halving-doubling): the fitted alpha and B are then what a ring would need to take as long, which is what
the model multiplies by the same factors.

Cost: one Python with torch (measure() starts it; the probe's processes are forked from it), then about
(ROUNDS + 1) x MIN_S per collective, size and world: a few seconds per world on the CPU. The sweep records it in
BENCH/link.json (record, read_link). Importing this module imports no torch: only the probe's own processes do.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Iterable, Literal

from dptrain import read_back
from dptrain_bench.folder import LINK_FILE
from dptrain_bench.peak import MAX_PROCESSES, first_report, probe_in_fresh_python
from dptrain.files import written_atomically
from dptrain.read_back import BadValue, UnreadableFile, field

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
Device = Literal["cpu", "cuda"]
# Buffer sizes in bytes: from where latency dominates to where bandwidth does (on loopback gloo the turn is near
# 100 KiB; a GPU's nccl link needs tens of MiB to reach its bandwidth)
SIZES: dict[str, tuple[int, ...]] = {"cpu": (4 << 10, 64 << 10, 1 << 20, 8 << 20),
                                     "cuda": (64 << 10, 1 << 20, 16 << 20, 128 << 20)}
MIN_S = 0.05  # seconds of timed calls per round (at least one call)
ROUNDS = 3
WAIT_S = 300.0  # the longest a process waits for the others: starting torch on a loaded machine takes seconds
# What a link.json read back may hold: a call from a nanosecond to an hour, a buffer up to a TiB. The model multiplies
# and sums these (a step's seconds, 256 nodes' fits): with 1e308 s or 1e-320 s it overflowed or divided by zero.
TIMING_S = (1e-9, 3600.0)
MAX_BUFFER_BYTES = 1 << 40


def ring_terms(collective: str, world: int) -> tuple[float, float]:
    """(latency terms, bandwidth fraction) of one collective on `world` processes: its time is
    latency_terms x alpha + fraction x bytes / bandwidth (the formulas of this module's docstring)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} is not one of {', '.join(COLLECTIVES)}")
    if world <= 1:
        return 0.0, 0.0  # nothing leaves a lone process
    if collective == "all_reduce":
        return 2.0 * (world - 1), 2.0 * (world - 1) / world
    if collective in ("reduce_scatter", "all_gather"):
        return float(world - 1), (world - 1) / world
    levels = float(math.ceil(math.log2(world)))
    return levels, levels


def collective_seconds(collective: str, world: int, nbytes: float, latency_s: float, bandwidth_bps: float) -> float:
    """The alpha-beta time of one collective of a `nbytes` buffer on `world` processes."""
    hops, fraction = ring_terms(collective, world)
    return hops * latency_s + fraction * nbytes / bandwidth_bps


@dataclass(frozen=True)
class Timing:
    """One measured collective: seconds per call of `collective` on a buffer of `nbytes` between `world` processes."""

    collective: str
    world: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """alpha (latency_s, per message) and B (bandwidth_bps, bytes/s) of the ring formulas fitted on all the timings
    together; and each collective's own alpha and B (per_collective), fitted on its timings alone, since gloo's
    reduce-scatter, say, takes longer than its ring formula with the all-reduce's alpha and B."""

    latency_s: float
    bandwidth_bps: float
    per_collective: dict[str, tuple[float, float]]
    """collective -> (alpha, B) of its timings alone (over every world probed)."""
    worst_relative_error: float
    """The largest |fitted - measured| / measured over the timings, each by its collective's own alpha and B."""
    measured: dict[tuple[str, int], tuple[tuple[float, float], ...]] = dataclass_field(default_factory=dict)
    """(collective, world) -> its timings' (bytes, seconds) by size, where 2 sizes or more were timed: seconds()
    reads a collective at a probed world from them. Not written to link.json: read_link fits its timings again."""

    def seconds(self, collective: str, world: int, nbytes: float) -> float:
        """One collective's time: at a world it was probed on, along its timings (between two sizes the straight line
        through them; beyond the largest or below the smallest, the line through the two nearest); elsewhere by the
        ring formulas (ring_seconds)."""
        points = self.measured.get((collective, world))
        if points is None:
            return self.ring_seconds(collective, world, nbytes)
        (s0, t0), (s1, t1) = _nearest_pair(points, nbytes)
        if not s0 <= nbytes <= s1 and t1 <= t0:  # no line to carry on: times that do not grow with the size
            return self.ring_seconds(collective, world, nbytes)
        return max(0.0, t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0))

    def ring_seconds(self, collective: str, world: int, nbytes: float) -> float:
        """One collective's time by the ring formulas: its own alpha and B where it was probed, else all of them's."""
        latency, bandwidth = self.per_collective.get(collective, (self.latency_s, self.bandwidth_bps))
        return collective_seconds(collective, world, nbytes, latency, bandwidth)

    def line(self, collective: str, world: int) -> tuple[float, float]:
        """(a, b) of t = a + b x bytes for one collective on `world` processes: the ring factors folded in."""
        latency, bandwidth = self.per_collective.get(collective, (self.latency_s, self.bandwidth_bps))
        hops, fraction = ring_terms(collective, world)
        return hops * latency, fraction / bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "bandwidth_bps": self.bandwidth_bps,
                "bandwidth_gbit_s": self.bandwidth_bps * 8 / 1e9, "worst_relative_error": self.worst_relative_error,
                "per_collective": {k: {"latency_s": a, "bandwidth_bps": b}
                                   for k, (a, b) in self.per_collective.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkFit:
        return cls(latency_s=float(data["latency_s"]), bandwidth_bps=float(data["bandwidth_bps"]),
                   worst_relative_error=float(data.get("worst_relative_error", 0.0)),
                   per_collective={k: (float(v["latency_s"]), float(v["bandwidth_bps"]))
                                   for k, v in data.get("per_collective", {}).items()})


def _nearest_pair(points: tuple[tuple[float, float], ...], nbytes: float) -> tuple[tuple[float, float], ...]:
    """The two timings, by size, whose sizes hold nbytes between them; beyond them, the two smallest or largest."""
    above = next((i for i, (size, _) in enumerate(points) if size >= nbytes), len(points) - 1)
    first = min(max(above - 1, 0), len(points) - 2)
    return points[first], points[first + 1]


def _weighted_line(xs: list[float], ys: list[float], zs: list[float], weights: list[float]) -> tuple[float, float]:
    """(p, q) minimising sum w (p x + q y - z)^2, both kept at zero or more: a fit that wants a negative latency
    (noise on a fast link) gets zero latency and the best bandwidth alone, and the other way round."""
    sxx = sum(w * x * x for w, x in zip(weights, xs))
    syy = sum(w * y * y for w, y in zip(weights, ys))
    sxy = sum(w * x * y for w, x, y in zip(weights, xs, ys))
    sxz = sum(w * x * z for w, x, z in zip(weights, xs, zs))
    syz = sum(w * y * z for w, y, z in zip(weights, ys, zs))
    det = sxx * syy - sxy * sxy
    if det > 1e-12 * max(sxx * syy, 1e-300):
        p, q = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
        if p >= 0 and q >= 0:
            return p, q
    # one term alone: the better of the two (each clamped at zero)
    only_p = (max(sxz / sxx, 0.0), 0.0) if sxx > 0 else (0.0, 0.0)
    only_q = (0.0, max(syz / syy, 0.0)) if syy > 0 else (0.0, 0.0)

    def cost(pq: tuple[float, float]) -> float:
        return sum(w * (pq[0] * x + pq[1] * y - z) ** 2 for w, x, y, z in zip(weights, xs, ys, zs))

    return min(only_p, only_q, key=cost)


def _ring_fit(timings: list[Timing]) -> tuple[float, float] | None:
    """(alpha, B) of the ring formulas over these timings, weighted by 1/t^2; None when they give no bandwidth."""
    terms = [ring_terms(t.collective, t.world) for t in timings]
    volumes = [f * t.nbytes for (_, f), t in zip(terms, timings)]
    latency, inverse_bandwidth = _weighted_line([h for h, _ in terms], volumes, [t.seconds for t in timings],
                                                [1.0 / t.seconds**2 for t in timings])
    return (latency, 1.0 / inverse_bandwidth) if inverse_bandwidth > 0 else None


def fit(timings: Iterable[Timing]) -> LinkFit:
    """alpha and B of the ring formulas (ring_terms) over all the timings, and each collective's own; ValueError
    when the timings give no bandwidth (none between two processes or more, or none growing with the size)."""
    usable = [t for t in timings if t.world > 1 and t.seconds > 0 and math.isfinite(t.seconds) and t.nbytes >= 0]
    if not usable:
        raise ValueError("no timing of a collective between two processes or more to fit a link on")
    joint = _ring_fit(usable)
    if joint is None:
        raise ValueError("the timings do not grow with the buffer size, so they give no bandwidth; probe larger sizes")
    per_collective = {}
    for collective in COLLECTIVES:
        own = _ring_fit([t for t in usable if t.collective == collective]) if any(
            t.collective == collective for t in usable) else None
        if own is not None:  # a collective whose times do not grow with the size keeps the joint fit
            per_collective[collective] = own
    fitted = LinkFit(latency_s=joint[0], bandwidth_bps=joint[1], per_collective=per_collective,
                     worst_relative_error=0.0)
    worst = max(abs(fitted.ring_seconds(t.collective, t.world, t.nbytes) - t.seconds) / t.seconds for t in usable)
    best: dict[tuple[str, int, int], float] = {}  # a size timed twice (two probes of one world): the faster
    for t in usable:
        key = (t.collective, t.world, t.nbytes)
        best[key] = min(best.get(key, math.inf), t.seconds)
    measured: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for (collective, world, nbytes), seconds in sorted(best.items()):
        measured.setdefault((collective, world), []).append((float(nbytes), seconds))
    return replace(fitted, worst_relative_error=worst,
                   measured={key: tuple(points) for key, points in measured.items() if len(points) >= 2})


@dataclass(frozen=True, kw_only=True)
class LinkProbe:
    """One probe: `world` processes on `hosts` hosts over `backend`, its timings and their fit."""

    backend: str
    device: str
    world: int
    hosts: int
    timings: list[Timing]

    @property
    def fitted(self) -> LinkFit:
        return fit(self.timings)

    def to_dict(self) -> dict[str, Any]:
        data = {"backend": self.backend, "device": self.device, "world": self.world, "hosts": self.hosts,
                "timings": [asdict(t) for t in self.timings]}
        try:  # the timings are kept even when noise left them without a fit: with other probes' they may give one
            return data | {"fit": self.fitted.to_dict()}
        except ValueError as e:
            return data | {"fit": None, "fit_error": str(e)}

    @classmethod
    def from_dict(cls, data: Any, name: str = "a probe") -> LinkProbe:
        """A probe as link.json holds it, each value checked (BadValue naming it)."""
        data = read_back.mapping(data, name)
        world = read_back.integer(field(data, "world", name), f"{name}.world", 1, MAX_PROCESSES)
        timings = read_back.sequence(field(data, "timings", name), f"{name}.timings", 10_000)
        return cls(backend=read_back.text(field(data, "backend", name), f"{name}.backend", 20),
                   device=read_back.text(field(data, "device", name), f"{name}.device", 20),
                   world=world, hosts=read_back.integer(data.get("hosts", 1), f"{name}.hosts", 1, world),
                   timings=[_timing(t, f"{name}.timings[{i}]") for i, t in enumerate(timings)])


def _timing(data: Any, name: str) -> Timing:
    data = read_back.mapping(data, name)
    collective = field(data, "collective", name)
    if collective not in COLLECTIVES:
        raise BadValue(f"{name}.collective = {read_back.shown(collective)}, not one of {', '.join(COLLECTIVES)}")
    return Timing(collective, read_back.integer(field(data, "world", name), f"{name}.world", 1, MAX_PROCESSES),
                  read_back.integer(field(data, "nbytes", name), f"{name}.nbytes", 1, MAX_BUFFER_BYTES),
                  read_back.number(field(data, "seconds", name), f"{name}.seconds", *TIMING_S))


def _elements(nbytes: int, world: int) -> int:
    """float32 elements of a buffer of about nbytes that splits evenly into `world` chunks (at least one each)."""
    return max(world, -(-nbytes // 4 // world) * world)


def _time_collectives(rank: int, world: int, device: str, sizes: tuple[int, ...], min_s: float) -> list[Timing]:
    """Every collective at every size, in an initialised process group; every rank must call it alike."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames the *_tensor collectives
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    def slowest_since(start: float) -> float:
        """The seconds since `start` of the slowest rank (an all_reduce, after the clock stopped): a broadcast's root
        returns once its sends sit in the socket buffers (a MiB at 100 Mbit/s "took" 1 ms there), its receivers once
        the data came."""
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    timings = []
    for collective in COLLECTIVES:
        for nbytes in sizes:
            whole = torch.ones(_elements(nbytes, world), device=dev)
            part = torch.ones(whole.numel() // world, device=dev)
            call = {"all_reduce": lambda: dist.all_reduce(whole),
                    "reduce_scatter": lambda: scatter(part, whole),  # the whole input in, a rank's chunk out
                    "all_gather": lambda: gather(whole, part),  # a rank's chunk in, the whole output out
                    "broadcast": lambda: dist.broadcast(whole, 0)}[collective]
            call()  # warm-up: connections, buffers, the algorithm's choice
            sync()
            start = time.perf_counter()
            call()
            sync()
            calls = max(1, math.ceil(min_s / max(slowest_since(start), 1e-9)))  # every rank runs as many calls
            best = math.inf
            for _ in range(ROUNDS):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                sync()
                best = min(best, slowest_since(start) / calls)
            timings.append(Timing(collective, world, whole.numel() * whole.element_size(), best))
    return timings


def _process(rank: int, world: int, device: str, store: str, sizes: tuple[int, ...], min_s: float,
             threads: int, results: Any) -> None:
    """One of the probe's processes (forked); rank 0 puts its timings on `results`, or any rank an error text."""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=WAIT_S))
        try:
            timings = _time_collectives(rank, world, device, sizes, min_s)
        finally:
            from dptrain.distributed.world import destroy_process_group

            destroy_process_group()  # after a pause: gloo's threads may still hold the last call's tensors
        if rank == 0:
            results.put(timings)
    except BaseException as e:  # any failure goes to the parent in one line
        results.put(f"{type(e).__name__}: {e}")


def probe(world: int, device: Device = "cpu", sizes: tuple[int, ...] | None = None, min_s: float = MIN_S) -> LinkProbe:
    """The collectives between `world` processes of this machine, forked from this one (gloo on the CPU, one thread
    each; nccl on the GPUs, one each); RuntimeError in one sentence when it could not. As peak.probe: call it from a
    process that has imported torch and run nothing (measure() starts one)."""
    import importlib
    import multiprocessing

    importlib.import_module("torch")  # once here, before the fork, instead of in every process
    if world < 2:
        raise ValueError(f"world {world} is below 2: a link needs two processes")
    sizes = SIZES[device] if sizes is None else sizes
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dptrain-link-") as folder:
        store = str(Path(folder) / "store")
        # one thread each: a collective's time is the link's, and W processes must not fight over the cores for it
        procs = [ctx.Process(target=_process, args=(rank, world, device, store, sizes, min_s, 1, results), daemon=True)
                 for rank in range(world)]
        outcome = first_report(procs, results, WAIT_S + len(sizes) * len(COLLECTIVES) * 10)
    if isinstance(outcome, str):
        raise RuntimeError(f"the link probe ({world} processes, {device}) failed: {outcome}")
    return LinkProbe(backend="nccl" if device == "cuda" else "gloo", device=device, world=world, hosts=1,
                     timings=outcome)


def probe_launched(sizes: tuple[int, ...] | None = None, min_s: float = MIN_S) -> LinkProbe | None:
    """The probe in the world a launcher started (torchrun's or srun's variables, dist.env.DistEnv): this process is
    one rank of it, joined as `dptrain train` joins (dist.world: the launcher's store, the interface toward the
    master). Rank 0 gets the probe, the others None."""
    import torch

    from dptrain.distributed.env import DistEnv
    from dptrain.distributed.world import destroy_process_group, init_process_group

    env = DistEnv.from_environ()
    if env.world_size < 2:
        raise RuntimeError("--launched found no world of two processes or more (no torchrun or srun variables); "
                           "start it under torchrun or srun, or give --world instead.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if device == "cuda" else torch.device("cpu")
    init_process_group(env, dev, WAIT_S)
    try:
        timings = _time_collectives(env.global_rank, env.world_size, device, SIZES[device] if sizes is None else sizes,
                                    min_s)
    finally:
        destroy_process_group()
    hosts = max(1, env.world_size // max(env.local_world_size, 1))
    return LinkProbe(backend="nccl" if device == "cuda" else "gloo", device=device, world=env.world_size, hosts=hosts,
                     timings=timings) if env.is_main else None


def measure(worlds: tuple[int, ...], device: Device = "cpu", timeout_s: float = 2 * WAIT_S,
            sizes: tuple[int, ...] | None = None, min_s: float = MIN_S) -> dict[int, LinkProbe]:
    """One probe per world size, in a fresh Python (`python -m dptrain_bench.link --json`), as peak.measure."""
    args = ["--world", ",".join(map(str, worlds)), "--device", device, "--min-s", repr(min_s), "--json"]
    if sizes is not None:
        args += ["--sizes", ",".join(map(str, sizes))]
    probes = probe_in_fresh_python(__name__, args, "the link probe", timeout_s)
    return {int(w): LinkProbe.from_dict(p) for w, p in probes.items()}


@dataclass(frozen=True)
class LinkRecord:
    """What BENCH/link.json holds: probes by (hosts, world), and the fit of those within one host and across hosts."""

    probes: dict[tuple[int, int], LinkProbe]

    def _fit_of(self, across_hosts: bool) -> LinkFit | None:
        timings = [t for (hosts, _), p in self.probes.items() if (hosts > 1) == across_hosts for t in p.timings]
        try:
            return fit(timings)
        except ValueError:
            return None

    @property
    def within_host(self) -> LinkFit | None:
        """The fit of every probe whose processes shared one host (shared memory or loopback)."""
        return self._fit_of(across_hosts=False)

    @property
    def across_hosts(self) -> LinkFit | None:
        """The fit of every probe that crossed hosts (a real link), None when none did."""
        return self._fit_of(across_hosts=True)

    def for_nodes(self, nodes: int) -> LinkFit | None:
        """The link a run on `nodes` nodes sends over: across hosts for two or more when probed there, else within."""
        return (self.across_hosts or self.within_host) if nodes > 1 else (self.within_host or self.across_hosts)


def _write(bench_dir: Path, probes: dict[tuple[int, int], LinkProbe]) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:  # the version next to the numbers, from the installed package: importing torch would take seconds
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = ""
    record_ = LinkRecord(probes)
    text: dict[str, Any] = {
        "host": platform.node(), "torch": torch_version,
        "model": "ring: all_reduce 2(N-1) alpha + 2(N-1)/N S/B; reduce_scatter, all_gather (N-1) alpha + (N-1)/N S/B; "
                 "broadcast ceil(log2 N) (alpha + S/B); S the whole buffer in bytes",
        "probes": [probes[k].to_dict() for k in sorted(probes)]}
    for name, fitted in (("within_host", record_.within_host), ("across_hosts", record_.across_hosts)):
        if fitted is not None:
            text[name] = fitted.to_dict()
    bench_dir.mkdir(parents=True, exist_ok=True)
    with written_atomically(bench_dir / LINK_FILE) as tmp:  # a link planted there is replaced, never written through
        tmp.write_text(json.dumps(text, indent=2) + "\n")


def record(bench_dir: Path, device: Device = "cpu", worlds: tuple[int, ...] = (2,),
           launched: LinkProbe | None = None) -> tuple[LinkRecord, list[int]]:
    """BENCH/link.json holds a probe of this machine for every world of `worlds` (those below 2 are left out: one
    process sends nothing) on `device`: the missing ones are run, and a probe made under a launcher (`launched`,
    from probe_launched) is added or replaces the one of its hosts and world. (Every probe in it, the worlds probed
    now.) As peak.record, a probe of another device makes the file start afresh."""
    path = bench_dir / LINK_FILE
    old = read_link(bench_dir)
    probes = {k: p for k, p in (old.probes if old else {}).items() if p.device == device}
    missing = [w for w in worlds if w >= 2 and (1, w) not in probes]
    if missing:
        probes |= {(1, w): p for w, p in measure(tuple(missing), device).items()}
    if launched is not None:
        probes[(launched.hosts, launched.world)] = launched
    if missing or launched is not None or not path.is_file():
        _write(bench_dir, probes)
    return LinkRecord(probes), missing


def load_link(bench_dir: Path) -> LinkRecord | None:
    """BENCH/link.json's probes; None when it is missing or holds none; UnreadableFile in one sentence where it is
    not what record writes (too large, not a regular file, not JSON, a value out of its range)."""
    def take(data: Any) -> list[LinkProbe]:
        probes = read_back.sequence(field(read_back.mapping(data, "the file"), "probes", "the file"), "probes", 1024)
        return [LinkProbe.from_dict(p, f"probes[{i}]") for i, p in enumerate(probes)]

    try:
        probes = read_back.read_json(bench_dir / LINK_FILE, take)
    except FileNotFoundError:
        return None
    return LinkRecord({(p.hosts, p.world): p for p in probes}) if probes else None


def read_link(bench_dir: Path) -> LinkRecord | None:
    """load_link, with a file it refuses taken as none (one log line says why): the sweep probes again, the report
    draws no scaling model."""
    try:
        return load_link(bench_dir)
    except UnreadableFile as exc:
        log.warning(f"{exc.path} {exc.problem}; it is left out.")
        return None


def _where(p: LinkProbe) -> str:
    return f"{p.world} processes on {p.hosts} host{'s' if p.hosts > 1 else ''}, {p.backend} ({p.device})"


def table(probes: Iterable[LinkProbe]) -> str:
    """The timings as text, one line per collective and size, with each probe's fit under it."""
    lines = []
    for p in probes:
        try:
            fitted = p.fitted
        except ValueError as e:
            lines.append(f"{_where(p)}: no fit: {e}")
            continue
        lines.append(f"{_where(p)}: latency {fitted.latency_s * 1e6:.1f} us per message, bandwidth "
                     f"{fitted.bandwidth_bps / 1e9:.3g} GB/s ({fitted.bandwidth_bps * 8 / 1e9:.3g} Gbit/s), worst fit "
                     f"error {fitted.worst_relative_error:.0%}")
        lines.append(f"  {'collective':<15}{'bytes':>12}{'time (us)':>12}{'model (us)':>12}{'bus GB/s':>10}")
        for t in p.timings:
            _, fraction = ring_terms(t.collective, t.world)
            modelled = fitted.seconds(t.collective, t.world, t.nbytes)
            # bus bandwidth: the bytes each rank's link carried per second, comparable across collectives and N
            lines.append(f"  {t.collective:<15}{t.nbytes:>12}{t.seconds * 1e6:>12.1f}{modelled * 1e6:>12.1f}"
                         f"{fraction * t.nbytes / t.seconds / 1e9:>10.3g}")
    return "\n".join(lines)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The probe's options: `dptrain bench probe link`'s, and those of its internal entry (main)."""
    parser.add_argument("--world", default="2", help="comma-separated process counts of this machine, one probe each "
                        "(default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default: gloo), or cuda (nccl, "
                        "one GPU per process)")
    parser.add_argument("--sizes", help="comma-separated buffer sizes in bytes (default: the device's)")
    parser.add_argument("--min-s", type=float, default=MIN_S, help=f"seconds of calls per round (default {MIN_S})")
    parser.add_argument("--launched", action="store_true",
                        help="be one rank of the world torchrun or srun started (one per host: the link between "
                             "hosts), instead of starting --world processes here")
    parser.add_argument("--record", metavar="BENCH", help="also add the probes to BENCH/link.json (a sweep's or a tune "
                        "folder), replacing those of the same hosts and world")
    parser.add_argument("--json", action="store_true", help="print the probes as one JSON line instead of a table")


def record_probes(bench_dir: Path, probes: list[LinkProbe]) -> None:
    """--record: each probe into BENCH/link.json, replacing the one of its hosts and world."""
    for p in probes:
        record(bench_dir, p.device, worlds=(), launched=p)


def show(probes: list[LinkProbe], as_json: bool) -> str:
    return json.dumps({str(p.world): p.to_dict() for p in probes}) if as_json else table(probes)


def main(argv: list[str] | None = None) -> None:
    """The internal entry that measure() runs in a fresh Python and a --slurm sweep's link job runs on every node
    (the command is `dptrain bench probe link`)."""
    parser = argparse.ArgumentParser(prog="python -m dptrain_bench.link", description="The link probe's internal "
                                     "entry, run by measure() in a fresh Python and by a --slurm sweep's link job; the "
                                     "command is dptrain bench probe link.")
    add_options(parser)
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip()) if args.sizes else None
    try:
        if args.launched:
            launched = probe_launched(sizes, args.min_s)
            probes = [launched] if launched is not None else []
        else:
            probes = [probe(int(w), args.device, sizes, args.min_s) for w in args.world.split(",") if w.strip()]
    except (RuntimeError, ValueError) as e:
        sys.exit(str(e))
    if not probes:  # a rank other than 0 of a launched world
        return
    if args.record:
        record_probes(Path(args.record), probes)
    print(show(probes, args.json))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the probe's processes use one thread each
    main()
