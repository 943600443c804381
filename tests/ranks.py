"""Rank processes for the tests: run_on_ranks(fn, world_size) and run_cli_on_ranks(world_size, argvs).

Both run on a pool of rank processes kept for the whole test session (one pool per environment: the float64
runs get processes of their own, see tests/float64): a rank process costs a start of Python and an import of
torch and dptrain (two seconds of CPU each), a job on a started one only its own work. A job on N ranks runs on
N of the pool's processes, the pool growing as needed; they then wait for the next job. A job that fails (a rank
raised, or the job ran past its timeout) ends the pool: its ranks may be stuck in a collective with the failed
one, so the next job starts a fresh pool.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit handler (which joins the children) is registered before ours, so runs after it
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

POOL_SIZE = 4
"""The processes a pool starts for jobs side by side (see run_cli_on_ranks); a job on more ranks gets more."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the tests' one way of picking a port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_job(rank: int, world_size: int, fn: Callable, store: str, args: tuple) -> Any:
    """fn(rank, world_size, *args) in a gloo world joined by a file store, on one CPU thread (as OMP_NUM_THREADS=1)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _cli_job(rank: int, world_size: int, argv: list[str], port: int, cwd: str, per_node: int | None = None) -> int:
    """`dptrain ARGV` in this process with the variables torchrun or srun would set for this rank; its exit code.
    per_node: the ranks each node has, as if the world's nodes were on other hosts (None: one node of every rank).

    A rank that ends with SystemExit (a worker stopped by a signal exits with the documented code) gives its code.
    """
    from dptrain.cli import main

    os.chdir(cwd)
    per_node = per_node or world_size
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % per_node),
                       "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def _serve(jobs: Any, results: Any) -> None:
    """A pool's process: run each job handed to it, as the rank the job names, and report (job id, rank, status, value).

    Each job starts from the state the process started with (environment, working folder, CPU threads). None, or a
    job after which this process is to leave, ends the process.
    """
    import importlib

    import torch

    for module in ("dptrain.cli", "dptrain.worker", "dptrain.train"):  # imported while it waits for its first job
        importlib.import_module(module)

    environ, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    while (job := jobs.get()) is not None:
        job_id, rank, world_size, kind, payload, leave = job
        try:
            value = (_fn_job if kind == "fn" else _cli_job)(rank, world_size, *payload)
            results.put((job_id, rank, "ok", value))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            results.put((job_id, rank, "error", traceback.format_exc()))
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
        if leave:
            return


class _Pool:
    def __init__(self, env: dict[str, str]) -> None:
        self.ctx = mp.get_context("spawn")
        self.env = env
        self.results = self.ctx.Queue()
        self.procs: list[tuple[Any, Any] | None] = []  # (process, its job queue); None: to be started again
        self.jobs_done = 0

    def grow(self, size: int) -> None:
        """At least `size` processes, started now where missing."""
        self.procs += [None] * (size - len(self.procs))
        missing = [i for i, slot in enumerate(self.procs[:size]) if slot is None]
        if not missing:
            return
        saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        try:
            for i in missing:
                jobs = self.ctx.Queue()
                proc = self.ctx.Process(target=_serve, args=(jobs, self.results))
                proc.start()  # a spawned interpreter starts with the environment of this moment
                self.procs[i] = (proc, jobs)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def run(self, world_size: int, kind: str, payloads: list[Any], deadline: float, side_by_side: bool = False,
            leaving: tuple[int, ...] = ()) -> list[list[Any]]:
        """Each payload's job on world_size ranks; their values by rank, in the payloads' order.

        One job after the other; side_by_side, two at once where the pool holds the processes for both (jobs
        independent of each other). A payload may be a function that makes it, called as its job is handed out.
        A rank that raised fails with its traceback, a call past the deadline with queue.Empty. The processes
        of the ranks in `leaving` end after their job (and are started again when a later job needs them).
        """
        # Two runs of one rank each would split the cores that each of them uses already (dptrain gives a rank
        # cores / ranks threads): side by side means two runs of 2 ranks. For 4 runs or more the pool grows to
        # POOL_SIZE for them; else it keeps the size it has (processes that left start again).
        side_by_side = side_by_side and 2 * world_size == POOL_SIZE
        size = max(world_size, POOL_SIZE if side_by_side and len(payloads) >= 4 else min(POOL_SIZE, len(self.procs)))
        self.grow(size)
        lanes = max(1, min(len(payloads), size // world_size)) if side_by_side else 1
        free = [range(lane * world_size, (lane + 1) * world_size) for lane in range(lanes)]
        todo = list(enumerate(payloads))[::-1]
        running: dict[int, tuple[int, range, dict[int, Any]]] = {}  # job id -> (payload index, its processes, values by rank)
        done: dict[int, list[Any]] = {}
        while todo or running:
            while todo and free:
                index, payload = todo.pop()
                procs, self.jobs_done = free.pop(0), self.jobs_done + 1
                made = payload() if callable(payload) else payload
                for rank, i in enumerate(procs):
                    self.procs[i][1].put((self.jobs_done, rank, world_size, kind, made, rank in leaving))
                running[self.jobs_done] = (index, procs, {})
            try:
                job_id, rank, status, value = self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise
                self._fail_on_a_dead_process(running)
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            index, procs, values = running[job_id]
            values[rank] = value
            if len(values) == world_size:
                del running[job_id]
                done[index] = [values[r] for r in range(world_size)]
                for rank in leaving:
                    proc, _ = self.procs[procs[rank]]
                    self.procs[procs[rank]] = None
                    proc.join(timeout=10)
                    if proc.is_alive():
                        proc.kill()
                if not leaving:
                    free.append(procs)
        return [done[i] for i in range(len(payloads))]

    def _fail_on_a_dead_process(self, running: dict[int, tuple[int, range, dict[int, Any]]]) -> None:
        for _, procs, values in running.values():
            for rank, i in enumerate(procs):
                proc = self.procs[i][0]
                if rank not in values and not proc.is_alive() and self.results.empty():  # a result is written atomically first
                    raise AssertionError(f"rank {rank} ended without a result (exit code {proc.exitcode})")

    def kill(self) -> None:
        """End every process at once: idle ones have nothing left to say, busy ones are stuck or past their time."""
        for slot in self.procs:
            if slot is not None:
                slot[0].kill()
        for slot in self.procs:
            if slot is not None:
                slot[0].join(timeout=10)
        self.procs = []


_POOLS: dict[tuple[tuple[str, str], ...], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].kill()


def _on_pool(env: dict[str, str] | None, world_size: int, kind: str, payloads: list[Any], timeout: float,
             **how: Any) -> list[list[Any]]:
    """_Pool.run on the pool of `env`, started if need be; a failure ends that pool."""
    key = tuple(sorted((env or {}).items()))
    pool = _POOLS.get(key) or _POOLS.setdefault(key, _Pool(dict(key)))
    try:
        return pool.run(world_size, kind, payloads, time.monotonic() + timeout, **how)
    except BaseException:
        del _POOLS[key]
        pool.kill()
        raise


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60, leaving: tuple[int, ...] = ()) -> list[Any]:
    """fn(rank, world_size, *args) on world_size gloo ranks joined by a file store; the results by rank.

    A rank that raises, or a run past `timeout` seconds, fails with the details. The processes of the ranks
    in `leaving` end once they have returned, as a rank whose process exits would (they leave the pool).
    """
    with tempfile.TemporaryDirectory() as tmp:
        return _on_pool(None, world_size, "fn", [(fn, os.path.join(tmp, "store"), args)], timeout, leaving=leaving)[0]


def run_cli_on_ranks(world_size: int, runs: list[list[str]], cwd: str, timeout: float = 300,
                     env: dict[str, str] | None = None, side_by_side: bool = False,
                     per_node: int | None = None) -> list[int]:
    """`dptrain ARGV` for each ARGV in turn, on world_size ranks of the pool as under torchrun; rank 0's exit codes.

    side_by_side: the runs are independent of each other, and two may run at once (the ranks of a run wait
    on each other a quarter of the time, or one rank works alone: the other run fills those gaps), on two sets
    of processes where the pool holds them (see POOL_SIZE). A rank that raises (a SystemExit gives its exit code)
    fails the whole call, as does a call past `timeout` seconds in all. Each run gets its own free port for its
    store, picked as it starts. `env` is added to the environment the rank processes start with (their pool is
    another one than that of the plain environment). per_node: the ranks of each node, as if the nodes were other
    hosts on loopback (None: one node).
    """
    # the port picked as the run starts
    payloads = [lambda argv=argv: (argv, free_port(), cwd, per_node) for argv in runs]
    return [by_rank[0] for by_rank in _on_pool(env, world_size, "cli", payloads, timeout, side_by_side=side_by_side)]
