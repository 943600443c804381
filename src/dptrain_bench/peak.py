"""A short matmul probe: what W processes of this machine get together from square matmuls, the denominator of
fraction_of_peak (achieved_tflops / peak_tflops). On the CPU each size is multiplied both by torch.matmul and by
oneDNN's inner product (models.layers.Linear's), and the faster counts.

    $ dptrain bench probe matmul --workers 1,2 --dtype bfloat16

`python -m dptrain_bench.peak --json` is the probe's internal entry, which measure() runs in a fresh Python.

W processes at once, as a point's W ranks run: each with the threads a dptrain rank gets here (cores // W on the CPU,
as runtime.set_cpu_threads splits them) or its own GPU. Each multiplies square matrices of a few sizes: a warm-up
call, one timed call that sets how many calls fill MIN_S, then ROUNDS rounds of those calls, each between two
barriers. A round's rate is every process's work over rank 0's wall time between its barriers (the slowest process
bounds it, as the slowest rank bounds an epoch); a size's rate is its best round's, and the peak is the best size's.
Cost: one Python with torch (measure() starts it; the processes are forked from it), then about (ROUNDS + 1) x MIN_S
per size and worker count. The sweep records one probe per worker count in
BENCH/peak.json (record, read_peaks).
Importing this module imports no torch: only the probe's own processes do.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from dptrain.files import written_atomically
from dptrain.reporting.sweep_files import (MAX_PROCESSES, PEAK_FILE, TFLOPS, Probe,  # noqa: F401 (the lab's names)
                                            load_peaks, read_peaks)

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]
Dtype = Literal["float32", "bfloat16"]
# CPU sizes: 2048 fp32 is ~0.2 s on one AVX-512 core, so a probe stays about a second a size; GPUs need bigger ones
SIZES: dict[str, tuple[int, ...]] = {"cpu": (512, 1024, 2048), "cuda": (2048, 4096, 8192)}
MIN_S = 0.1  # seconds of timed calls per round (at least one call)
ROUNDS = 3  # timed rounds per size, the best kept: a peak, so the rounds another program slowed down do not count
WAIT_S = 300.0  # the longest a process waits at a barrier: starting torch on a loaded machine takes seconds


def matmul_flops(n: int) -> int:
    """Multiply-adds of an n x n by n x n product, counted as two operations each."""
    return 2 * n**3


def rate_tflops(n: int, calls: int, processes: int, seconds: float) -> float:
    """TFLOPS of `processes` processes each making `calls` n x n products in `seconds` of wall time."""
    return processes * calls * matmul_flops(n) / seconds / 1e12


def calls_to_fill(one_call_s: float, min_s: float = MIN_S) -> int:
    """Calls of one_call_s seconds each that take at least min_s (at least one)."""
    return max(1, math.ceil(min_s / max(one_call_s, 1e-9)))


def cpu_threads(cores: int, workers: int) -> int:
    """Threads per process when `workers` processes share `cores` (as a dptrain rank gets them; at least one)."""
    return max(1, cores // workers)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _process(rank: int, workers: int, device: str, dtype: str, threads: int, sizes: tuple[int, ...], min_s: float,
             barrier: Any, one_call: Any, results: Any) -> None:
    """One of the probe's processes (forked); rank 0 puts {size: TFLOPS} on `results`, or any rank an error text."""
    try:
        import torch

        if device == "cuda":
            dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
            torch.cuda.set_device(dev)
            sync = torch.cuda.synchronize
        else:
            torch.set_num_threads(threads)
            dev, sync = torch.device("cpu"), (lambda: None)
        # wall time between barriers, not CUDA events: the rate is of every process together, as an epoch's is
        kind = getattr(torch, dtype)
        rates: dict[int, float] = {}
        onednn = None
        if device == "cpu":
            from dptrain.models.layers import ONEDNN_LINEAR as onednn  # models.layers.Linear's products
        for n in sizes:
            a, b = torch.randn(n, n, device=dev).to(kind), torch.randn(n, n, device=dev).to(kind)
            out = torch.empty(n, n, device=dev, dtype=kind)
            # torch.matmul, and on the CPU oneDNN's inner product too: for float32 torch.matmul calls MKL, which runs
            # its AVX2 code on AMD CPUs, where oneDNN (the model's convolutions and linear layers) uses AVX-512.
            kernels = [lambda: torch.matmul(a, b, out=out)]
            if onednn is not None:
                kernels.append(lambda: onednn(a, b, None, "none", [], ""))  # a @ b.T: the same work
            rates[n] = 0.0
            for multiply in kernels:
                multiply()  # warm-up: the library's kernel choice, caches, clocks
                sync()
                start = time.perf_counter()
                multiply()
                sync()
                one_call[rank] = time.perf_counter() - start
                barrier.wait(WAIT_S)  # every process has timed its call: all read the same slowest one
                calls = calls_to_fill(max(one_call[:]), min_s)
                for _ in range(ROUNDS):
                    barrier.wait(WAIT_S)  # start together (the first: no one overwrites one_call before all have read it)
                    start = time.perf_counter()
                    for _ in range(calls):
                        multiply()
                    sync()
                    barrier.wait(WAIT_S)  # the slowest process's end
                    rates[n] = max(rates[n], rate_tflops(n, calls, workers, time.perf_counter() - start))
            del a, b, out
        if rank == 0:
            results.put(rates)
    except BaseException as e:  # any failure, a missing GPU or memory, goes to the parent in one line
        barrier.abort()  # the others stop waiting
        results.put(f"{type(e).__name__}: {e}")


def first_report(procs: list[Any], results: Any, timeout_s: float) -> Any:
    """Start a probe's processes, wait for the first report one of them puts on `results` (the probe's numbers, or
    one sentence of why it failed), then reap them all, killing any still there after 30 s; "no result" where
    none reported within timeout_s."""
    for p in procs:
        p.start()
    try:
        return results.get(timeout=timeout_s)
    except Exception:  # queue.Empty: no process reported
        return "no result"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def probe(workers: int, device: Device = "cpu", dtype: Dtype = "float32", sizes: tuple[int, ...] | None = None,
          min_s: float = MIN_S, threads: int | None = None) -> Probe:
    """Run the probe in `workers` processes at once, forked from this one; RuntimeError in one sentence when it could
    not. Call it from a process that has imported torch and run nothing (measure() starts one): forked children
    share torch's imported code, but would inherit a thread pool or CUDA state the parent had started."""
    import importlib
    import multiprocessing

    importlib.import_module("torch")  # once here, before the fork, instead of in every process

    if workers < 1:
        raise ValueError(f"workers {workers} is below 1")
    sizes = SIZES[device] if sizes is None else sizes
    threads = (cpu_threads(usable_cores(), workers) if threads is None else threads) if device == "cpu" else 0
    ctx = multiprocessing.get_context("fork")
    barrier, one_call, results = ctx.Barrier(workers), ctx.Array("d", workers), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(rank, workers, device, dtype, threads, sizes, min_s, barrier,
                                                one_call, results), daemon=True) for rank in range(workers)]
    outcome = first_report(procs, results, WAIT_S + len(sizes) * 60)
    if isinstance(outcome, str):
        raise RuntimeError(f"the matmul probe ({workers} processes, {device}, {dtype}) failed: {outcome}")
    return Probe(device=device, dtype=dtype, workers=workers, threads=threads, tflops_by_size=outcome)


def measure(workers: tuple[int, ...], device: Device = "cpu", dtype: Dtype = "float32",
            timeout_s: float = 2 * WAIT_S, threads: int | None = None) -> dict[int, Probe]:
    """One probe per worker count, one after the other, in a fresh Python (`python -m dptrain_bench.peak --json`):
    torch is imported once for all of them, and nothing this process ran reaches the probe's processes."""
    args = ["--workers", ",".join(map(str, workers)), "--device", device, "--dtype", dtype, "--json"]
    probes = probe_in_fresh_python(__name__, args + (["--threads", str(threads)] if threads is not None else []),
                                   "the matmul probe", timeout_s)
    return {int(w): Probe.from_dict(p) for w, p in probes.items()}


def probe_in_fresh_python(module: str, args: list[str], what: str, timeout_s: float) -> dict[str, Any]:
    """`python -m MODULE ARGS`, whose last line of output is its probes as one JSON object; RuntimeError with one
    line (its last line of errors) where it fails or takes longer than timeout_s."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} took more than {timeout_s:g} s") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise RuntimeError(lines[-1] if lines else f"{what} exited with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record(bench_dir: Path, device: Device, dtype: Dtype, workers: tuple[int, ...]) -> tuple[dict[int, Probe], list[int]]:
    """BENCH/peak.json holds a probe for every worker count of `workers` on this device and dtype: the missing ones
    are run (all of them when the file is of another device or dtype); (every probe in it by worker count, the worker
    counts probed now)."""
    path = bench_dir / PEAK_FILE
    probes = {w: p for w, p in read_peaks(bench_dir).items() if (p.device, p.dtype) == (device, dtype)}
    missing = [w for w in workers if w not in probes]
    if missing:
        probes |= measure(tuple(missing), device, dtype)
    if missing or not path.is_file():
        import torch  # the versions next to the numbers

        text = {"cpu": cpu_model(), "cores": usable_cores(), "torch": torch.__version__, "host": platform.node(),
                "probes": {str(w): probes[w].to_dict() for w in sorted(probes)}}
        bench_dir.mkdir(parents=True, exist_ok=True)
        with written_atomically(path) as tmp:  # a link planted at path is replaced, never written through
            tmp.write_text(json.dumps(text, indent=2) + "\n")
    return probes, missing


def describe(probes: dict[int, Probe]) -> str:
    """The probes as text, one line per worker count: the peak and each size's TFLOPS."""
    lines = []
    for w, p in sorted(probes.items()):
        each = f"{p.threads} thread{'s' if p.threads != 1 else ''} each" if p.device == "cpu" else "one GPU each"
        sizes = ", ".join(f"{n}: {t:.3g}" for n, t in sorted(p.tflops_by_size.items()))
        lines.append(f"{w} process{'es' if w > 1 else ''} ({p.device}, {p.dtype}, {each}): peak {p.peak_tflops:.3g} "
                     f"TFLOPS together; by size: {sizes}")
    return "\n".join(lines)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The probe's options: `dptrain bench probe matmul`'s, and those of its internal entry (main)."""
    parser.add_argument("--workers", default="1", help="comma-separated process counts, one probe each, run at once "
                        "as a point's ranks run (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default), or cuda: one GPU "
                        "per process")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the matrices' type (default float32; bfloat16 as a run with --train.bf16 true)")
    parser.add_argument("--threads", type=int, help="threads per process on the CPU (default cores // workers, as a "
                        "dptrain rank gets)")
    parser.add_argument("--json", action="store_true", help="print the probes as one JSON line instead of a line each")


def main(argv: list[str] | None = None) -> None:
    """The internal entry that measure() runs in a fresh Python (the command is `dptrain bench probe matmul`)."""
    parser = argparse.ArgumentParser(prog="python -m dptrain_bench.peak", description="The matmul probe's internal "
                                     "entry, run by measure() in a fresh Python; the command is dptrain bench probe "
                                     "matmul.")
    add_options(parser)
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",") if w.strip()]
    try:
        probes = {w: probe(w, args.device, args.dtype, threads=args.threads) for w in counts}
    except RuntimeError as e:
        sys.exit(str(e))
    print(json.dumps({str(w): p.to_dict() for w, p in probes.items()}) if args.json else describe(probes))


if __name__ == "__main__":
    main()
