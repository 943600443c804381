"""Naming what failed: a Phase says "rank R failed during PHASE", and after a failed collective the roll call says
which ranks no longer answer; on nccl, whose collectives fail in no Python call, a PeerWatch names a lost peer."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from dptrain.distributed.collectives import RING
from dptrain.distributed.ending import leave_now, record_for_launcher
from dptrain.distributed.hangs import named, within
from dptrain.distributed.env import DistEnv

log = logging.getLogger("dptrain")


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
        self.watch: PeerWatch | None = None
        """The watch on the peers' heartbeats, where the backend needs one (needs_peer_watch); set with world."""
        self.hang: Any = None
        """The watch on this rank's collectives (distributed.hangs.HangWatch) once the world is joined; else None."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        previous, self.name = self.name, name
        RING.mark(name)  # the collectives made from here on are placed in this phase
        try:
            yield
        except WorkerFailure:
            raise
        except Exception as exc:
            peer = _is_peer_failure(exc)
            silent = roll_call(*self.world) if self.world is not None and peer else []
            reason = _one_line(exc)
            if silent:  # the cause first; the backend's own words after it
                reason = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer (dead or stuck): {reason}"
            raise WorkerFailure(f"rank {self.global_rank} failed during {name}{_in_collective(name) if peer else ''}: {reason}") from exc
        finally:
            self.name = previous
            RING.mark(previous)


def _in_collective(phase: str) -> str:
    """" in all_reduce #12 (bucket 0 of step 5)": this rank's collective left unfinished by the failure, else the last
    one it made in the failing phase (a failed work may count as finished), if any."""
    try:
        entries = RING.entries()
    except Exception:  # noqa: BLE001 - a failure's sentence must not fail on the ring
        return ""
    open_ = [c for c in entries if not c.done]
    if open_:
        return f" in {named(min(open_, key=lambda c: c.entered_ns))}"
    made_here = [c for c in entries if c.phase == phase]
    return f" in {named(max(made_here, key=lambda c: c.entered_ns))}" if made_here else ""


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

    def call() -> list[int]:
        store.set(f"{prefix}{env.global_rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(env.world_size) if not store.check([f"{prefix}{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)

    # A store whose host is gone: c10d warns with 15 lines of C++ frames before the error this answers with [0]. One
    # whose host is stopped (SIGSTOP) never answers, whatever the store's timeout: bounded here.
    with cpp_warnings_off():
        try:
            return within(call, wait_s + 1.0)
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


def needs_peer_watch(backend: str) -> bool:
    """Whether a lost peer would go unnamed on this backend without a PeerWatch. nccl's collectives return before they
    run: with a peer gone, the host waits at its next sync until NCCL's own watchdog aborts the process after
    launch.timeout_s (or at once, where NCCL sees the peer's connection drop), with no Python exception to name the
    phase or the rank. gloo's collectives raise in the call, and Phase names both."""
    return backend == "nccl"


PULSE_DONE = 1 << 40
"""Added to a rank's pulse when it leaves the world on purpose (finished, or stopped with the others by a signal): its
silence from then on is no loss."""


class PeerWatch:
    """Every rank's pulse on the world's store, and a watch on one peer's, so that a lost peer is named as a failed
    collective names it on gloo: "rank R failed during PHASE: rank X did not answer (dead or stuck): ...".

    A thread of the rank adds 1 to its own pulse every period_s and reads the pulse of the next rank (in rank order,
    around; a rank that finished on purpose is passed over): one watcher a rank, so the store sees 3 operations per rank
    and period whatever the world size. A pulse that does not move for silence_s (the worker sets half of
    launch.timeout_s: before NCCL's own timeout aborts the process unnamed) marks that rank lost: the watcher writes it
    under one key, which every rank's thread reads each period, so all of them end within a period of each other, each
    with the same sentence (the first rank written there wins). A rank whose own work fails writes itself there (stop),
    so that its peers, blocked in a collective towards it, end at once. Where the store no longer answers, its host,
    rank 0, is the one lost (as roll_call says), once that has lasted silence_s. The thread cannot raise into the
    rank's main thread, which may be blocked in CUDA: it ends the process itself (end), as a failed rank leaves (the
    error file for the launcher, exit code 1). The store is best a client of its own (own_client): the world's shared
    client serves one operation at a time, and a main thread blocked in a store wait would hold up the pulse.
    """

    LOST = "lost"

    def __init__(self, store: dist.Store, env: DistEnv, phase: Phase, silence_s: float,
                 end: Callable[[WorkerFailure], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.env, self.phase, self.silence_s = store, env, phase, silence_s
        self.period_s = max(0.05, silence_s / 10)
        self.end = end_with_failure if end is None else end
        self.clock = clock
        self.prefix = f"dptrain/pulse/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # per restart, as roll_call
        self.watched = (env.global_rank + 1) % env.world_size
        self.heard = (-1, clock())  # (the watched rank's pulse as last read, when it last moved)
        self._store_failing_since: float | None = None
        self._done = threading.Event()

    def start(self) -> "PeerWatch":
        self.beat()  # the first pulse before the first period: a slow start is no silence
        threading.Thread(target=self._run, name="dptrain-peer-watch", daemon=True).start()
        return self

    def stop(self, finished: bool) -> None:
        """End the watch (the first call counts): finished, this rank leaves on purpose and its silence is no loss; else
        its own work failed, and its peers are told at once (call it once its failure is recorded for the launcher)."""
        if self._done.is_set():
            return
        self._done.set()
        with contextlib.suppress(RuntimeError):  # a store that is gone: the peers find out by themselves
            if finished:
                self.store.add(self._pulse_key(self.env.global_rank), PULSE_DONE)
            else:
                self.store.compare_set(self.prefix + self.LOST, "", f"{self.env.global_rank}:failed")

    def beat(self) -> None:
        self.store.add(self._pulse_key(self.env.global_rank), 1)

    def lost(self) -> tuple[int, str] | None:
        """(the lost rank, why it counts as lost) once one is known here or written by a peer; None while every
        watched pulse moves. Marks a newly silent rank for the others."""
        if self.store.check([self.prefix + self.LOST]):
            return self._named(self.store.get(self.prefix + self.LOST).decode())
        while self.watched != self.env.global_rank:
            pulse = self.store.add(self._pulse_key(self.watched), 0)  # adding 0 reads it, without waiting for the key
            if pulse < PULSE_DONE:
                break
            self.watched, self.heard = (self.watched + 1) % self.env.world_size, (-1, self.clock())
        else:
            return None  # every other rank has finished
        now = self.clock()
        if pulse != self.heard[0]:
            self.heard = (pulse, now)
            return None
        if now - self.heard[1] < self.silence_s:
            return None
        first = self.store.compare_set(self.prefix + self.LOST, "", f"{self.watched}:silent")
        return self._named(first.decode() if isinstance(first, bytes) else str(first))

    def failure(self, rank: int, why: str) -> WorkerFailure:
        me = f"rank {self.env.global_rank} failed during {self.phase.name}"
        if rank == self.env.global_rank:  # alive after all (its pulse thread held up): the others are ending
            return WorkerFailure(f"{me}: the other ranks took it for lost ({why})")
        return WorkerFailure(f"{me}: rank {rank} did not answer (dead or stuck): {why}")

    def _named(self, record: str) -> tuple[int, str]:
        rank, _, how = record.partition(":")
        why = {"silent": f"no heartbeat from it on the world's store for {self.silence_s:g} s",
               "failed": "it failed (its own line says why) and left the world"}.get(how, how)
        return int(rank), why

    def _pulse_key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def tick(self) -> tuple[int, str] | None:
        """One period's work: beat, then lost(). A store that fails (its host, rank 0, gone: DistStoreError is a
        RuntimeError) counts as rank 0's silence, named once it has lasted silence_s: at the end of a run rank 0 may
        leave, and its store with it, moments before a peer has stopped its own watch."""
        try:
            self.beat()
            found = self.lost()
        except RuntimeError:
            now = self.clock()
            self._store_failing_since = self._store_failing_since if self._store_failing_since is not None else now
            if self.env.global_rank == 0 or now - self._store_failing_since < self.silence_s:
                return None
            return 0, "the world's store, which it hosts, no longer answers"
        self._store_failing_since = None
        return found

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            found = self.tick()
            if found is not None and not self._done.is_set():
                self.end(self.failure(*found))
                return


def own_client(env: DistEnv, timeout_s: float) -> dist.Store:
    """A client of the world's store (at MASTER_ADDR:MASTER_PORT, rank 0's or the agent's) of this thread's own."""
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def end_with_failure(failure: WorkerFailure) -> None:
    """How a PeerWatch ends its rank, as a failed collective ends it: the sentence in the rank's log, in the launcher's
    error file (or on stderr where no launcher reads one: under srun), and exit code 1, at once (the main thread may be
    blocked in CUDA, and unwinding would wait on collectives towards the lost peer)."""
    log.error("%s", failure, extra={"file_only": True})
    record_for_launcher(failure)
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        print(f"dptrain: error: {failure}", file=sys.stderr, flush=True)
    leave_now(1)
