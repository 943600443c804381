"""Naming what failed: a Phase says "rank R failed during PHASE", and after a failed collective the roll call says
which ranks no longer answer."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from dptrain.dist.env import DistEnv


class WorkerFailure(RuntimeError):
    """A failure inside a worker, already labelled with its rank and phase."""


class Phase:
    """Names what this rank is doing, so that any failure says 'rank R failed during PHASE'.

    Once the world is joined, a failed collective also says which ranks no longer answer (see roll_call).
    """

    def __init__(self, global_rank: int) -> None:
        self.global_rank = global_rank
        self.name = "start-up"
        self.world: tuple[dist.Store, DistEnv, float] | None = None
        """(store, env, seconds to wait) once the world is joined; set by join_store's caller."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        previous, self.name = self.name, name
        try:
            yield
        except WorkerFailure:
            raise
        except Exception as exc:
            silent = roll_call(*self.world) if self.world is not None and _is_peer_failure(exc) else []
            reason = _one_line(exc)
            if silent:  # the cause first; the backend's own words after it
                reason = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer (dead or stuck): {reason}"
            raise WorkerFailure(f"rank {self.global_rank} failed during {name}: {reason}") from exc
        finally:
            self.name = previous


SHARED_MEMORY_PEER_LOST = "shared-memory peer lost"
"""In every error that a peer's death or silence causes in strategies.shared_memory's all-reduce."""


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (gloo raises a plain RuntimeError that says so).

    A rank's own error (a bug in its model, say) is not: a roll call there would name the peers
    that are, correctly, still waiting for it in the collective.
    """
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        mark in text for mark in ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL",
                                  "timeout caused pair closure",  # gloo, when a peer's link goes silent mid-collective
                                  SHARED_MEMORY_PEER_LOST)
    )


def roll_call(store: dist.Store, env: DistEnv, wait_s: float) -> list[int]:
    """After a failed collective: the ranks that do not check in on the store within wait_s.

    The survivors of a failure all fail their collective and check in here at about the same time,
    so the ranks still missing after wait_s are the dead or stuck ones. If the store itself is gone,
    its host, rank 0, is the one missing.
    """
    prefix = f"dptrain/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    # A store whose host is gone: c10d warns with 15 lines of C++ frames before the error this answers with [0].
    with cpp_warnings_off():
        try:
            store.set(f"{prefix}{env.global_rank}", "1")
            deadline = time.monotonic() + wait_s
            while True:
                silent = [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except RuntimeError:
            return [0] if env.global_rank != 0 else []


def _one_line(exc: BaseException) -> str:
    """The first line of the message: ours are one sentence; torch's first line says what broke."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", line)  # gloo's "[.../pair.cc:553] " source prefix


@contextlib.contextmanager
def cpp_warnings_off() -> Iterator[None]:
    """Within: libtorch's C++ warnings are not printed (c10's log level raised to ERROR, as TORCH_CPP_LOG_LEVEL=ERROR
    would at start-up); errors still are. For calls whose failure is expected and answered in a sentence of ours.
    Nothing changes where libc10 does not export the flag (a build logging through glog)."""
    saved = cpp_log_level()
    if saved is None:
        yield
        return
    cpp_log_level(max(saved, 2))  # 2: ERROR
    try:
        yield
    finally:
        cpp_log_level(saved)


def cpp_log_level(level: int | None = None) -> int | None:
    """libtorch's C++ log level (c10's FLAGS_caffe2_log_level: 0 INFO, 1 WARNING, 2 ERROR), set to level where given;
    returns the one before. None (and nothing set) where libc10 does not export the flag."""
    import ctypes

    try:
        flag = ctypes.c_int.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None
    before = flag.value
    if level is not None:
        flag.value = level
    return before
