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
        out: dict[int, Any] = {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world_size)]
