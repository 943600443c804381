"""run_on_ranks(fn, world_size): fn(rank, world_size, *args) on spawned gloo ranks joined by a file store."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable


def _entry(fn: Callable, rank: int, world_size: int, store: str, args: tuple, results: Any) -> None:
    import torch.distributed as dist

    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        results.put((rank, "ok", fn(rank, world_size, *args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Results by rank; a rank that raises or a run past `timeout` seconds fails with the details."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, args, results)) for r in range(world_size)]
        for p in procs:
            p.start()
        return _collect(procs, results, timeout)


def _collect(procs: list, results: Any, timeout: float) -> list[Any]:
    """Each rank's reported value, by rank; a rank that raised fails the test; stragglers are killed."""
    out: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(len(procs))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_runs_entry(rank: int, world_size: int, runs: list[list[str]], port: Any, ready: Any, cwd: str, results: Any) -> None:
    try:
        os.chdir(cwd)
        from dptrain.cli import main

        codes = []
        for argv in runs:
            # Rank 0 picks each run's store port just before the run: ports picked ahead of time can be
            # taken meanwhile by the ephemeral ports of earlier runs' connections.
            if rank == 0:
                port.value = _free_port()
            ready.wait()
            # What torchrun or srun would set for this rank; the CLI then runs the worker in this process.
            os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.value)})
            ready.wait()  # every rank has read the port before rank 0 may pick the next one
            codes.append(main(argv))
        results.put((rank, "ok", codes))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def run_cli_on_ranks(world_size: int, runs: list[list[str]], cwd: str, timeout: float = 300,
                     env: dict[str, str] | None = None) -> list[int]:
    """`dptrain ARGV` for each ARGV in turn, in one process per rank as under torchrun; rank 0's exit codes.

    The ranks start (and import torch) once for all the runs: a dozen short runs cost a few
    seconds each instead of a launch each. Every run gets its own free port for its store, picked as it starts.
    `env` is added to the environment the rank processes start with.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, ready = ctx.Value("i", 0), ctx.Barrier(world_size)
    procs = [ctx.Process(target=_cli_runs_entry, args=(r, world_size, runs, port, ready, cwd, results))
             for r in range(world_size)]
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        for p in procs:
            p.start()  # a spawned interpreter starts with the environment of this moment
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return _collect(procs, results, timeout)[0]
