"""This rank's last collectives and where its main thread stands: what a hang verdict compares over the ranks.

The ring (CollectiveRing) is read, not written, on the hot path: torch's Flight Recorder keeps each process group's
last collectives (operation, sequence number, sizes, when enqueued, whether done), on gloo and nccl alike, once
TORCH_FR_BUFFER_SIZE is set before the group is made (record_collectives); dptrain's own collectives that go through
no process group (the shared-memory sum) enter the ring themselves (enter/leave). The loop's phases leave marks
(Phase: "step 917", "loss reduction of step 917"), so that each collective is placed in the phase it was made in and
counted among that phase's collectives of its group (DDP's gradient buckets of a step). where_main_thread() samples the
main thread's Python stack (sys._current_frames) from another thread: the line it is at and what it is doing (data
loading, forward, backward, the optimizer step).

Reading the recorder costs a few microseconds for the status (status()) and a few milliseconds for the entries with
their stacks (entries(), at a hang only); marking a phase costs a deque append.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

RING_SIZE = 64
"""How many of a group's last collectives the recorder keeps (its buffer, shared by the groups of a process)."""
RECORDER_SIZE_VAR, OLD_RECORDER_SIZE_VAR = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"
"""torch's Flight Recorder's size, by its name since torch 2.7 (gloo and nccl) and its older, NCCL-only name; read
when a group is made."""
WORLD_GROUP = "0"
"""The name torch gives the world's process group (the first one made)."""
OWN_GROUP = "shared memory"
"""The group dptrain's own shared-memory sum is said to be in (strategies/shared_memory.py): no process group."""


def record_collectives() -> None:
    """Before init_process_group: torch's Flight Recorder keeps the last RING_SIZE collectives, unless the user chose
    its size (0 turns it off; the verdict then knows the sequence numbers only)."""
    import torch

    new = hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")  # else an older torch: NCCL's name only
    os.environ.setdefault(RECORDER_SIZE_VAR if new else OLD_RECORDER_SIZE_VAR, str(RING_SIZE))


@dataclass
class Collective:
    """One collective of this rank, as the ring knows it."""

    group: str
    """The process group's name (torch's: WORLD_GROUP for the world's, "1", "2"... for groups made later), or
    OWN_GROUP."""
    seq: int
    """Its number in its group on this rank (torch's collective sequence number, from 1), the same on every rank for
    the same collective while the ranks agree."""
    op: str
    sizes: list = field(default_factory=list)
    """Its tensors' shapes."""
    dtype: str = ""
    entered_ns: int = 0
    """When this rank made it (time.time_ns's clock)."""
    done: bool = False
    phase: str = ""
    """The phase this rank was in when it made it ("" where the marks no longer reach)."""
    index: int = 0
    """Its place among the collectives of its group made in the same phase, from 0 (DDP's bucket in a step)."""

    def as_row(self) -> list:
        return [self.group, self.seq, self.op, self.sizes, self.dtype, self.entered_ns, self.done, self.phase,
                self.index]

    @classmethod
    def from_row(cls, row: list) -> "Collective":
        group, seq, op, sizes, dtype, entered_ns, done, phase, index = row
        return cls(group=str(group), seq=int(seq), op=str(op), sizes=list(sizes), dtype=str(dtype),
                   entered_ns=int(entered_ns), done=bool(done), phase=str(phase), index=int(index))


def _recorder_json(collectives: bool) -> dict[str, Any] | None:
    """torch's Flight Recorder as a dict (None where this torch has none, or it fails): the groups' status, and with
    collectives their entries."""
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return None
    try:
        return json.loads(dump(collectives))
    except (RuntimeError, ValueError, TypeError):
        return None


class CollectiveRing:
    """This rank's last collectives (the recorder's and its own) and its phase marks. Process-wide: RING."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.own: collections.deque[Collective] = collections.deque(maxlen=size)
        self.own_seq = 0
        self.marks: collections.deque[tuple[int, str]] = collections.deque(maxlen=4 * size)
        """(time.time_ns(), the phase entered) for the last phases entered and returned to."""
        self._lock = threading.Lock()

    def mark(self, phase: str) -> None:
        """The main thread enters (or returns to) phase now."""
        self.marks.append((time.time_ns(), phase))

    def enter(self, op: str, sizes: list, dtype: str, group: str = OWN_GROUP) -> Collective:
        """One of dptrain's own collectives starts on this rank (the caller calls leave() once it is done)."""
        with self._lock:
            self.own_seq += 1
            entry = Collective(group=group, seq=self.own_seq, op=op, sizes=sizes, dtype=dtype,
                               entered_ns=time.time_ns())
            self.own.append(entry)
        return entry

    @staticmethod
    def leave(entry: Collective) -> None:
        entry.done = True

    def status(self) -> dict[str, tuple[int, int]]:
        """Each group's (last collective made, last done) on this rank: the recorder's status, and the own ring's."""
        found: dict[str, tuple[int, int]] = {}
        record = _recorder_json(collectives=False)
        for pg, status in (record or {}).get("pg_status", {}).items():
            made, done = int(status.get("last_enqueued_collective", -1)), int(status.get("last_completed_collective", -1))
            if made > 0:
                found[str(pg)] = (made, max(done, 0))
        own = list(self.own)
        if own:
            open_ = [e.seq for e in own if not e.done]
            found[OWN_GROUP] = (own[-1].seq, min(open_) - 1 if open_ else own[-1].seq)
        return found

    def entries(self) -> list[Collective]:
        """Every collective the ring holds, oldest first in each group, each placed in its phase."""
        found = []
        record = _recorder_json(collectives=True) or {}
        for e in record.get("entries", []):
            if e.get("is_p2p"):
                continue
            op = str(e.get("profiling_name", "collective")).rpartition(":")[2]
            state = e.get("state")
            found.append(Collective(group=str(e["process_group"][0]), seq=int(e["collective_seq_id"]), op=op,
                                    sizes=e.get("input_sizes") or [], dtype=",".join(e.get("input_dtypes") or []),
                                    entered_ns=int(e.get("time_created_ns") or 0),
                                    done=bool(e.get("retired")) or state == "completed"))
        found += [Collective(**{**e.__dict__}) for e in list(self.own)]
        self._place(found)
        return sorted(found, key=lambda c: (c.group, c.seq))

    def _place(self, found: list[Collective]) -> None:
        marks = list(self.marks)
        counts: dict[tuple[str, int], int] = collections.Counter()
        for entry in sorted(found, key=lambda c: c.entered_ns):
            i = _last_at_or_before(marks, entry.entered_ns)
            if i < 0:
                continue
            entry.phase = marks[i][1]
            entry.index = counts[(entry.group, i)]
            counts[(entry.group, i)] += 1


def _last_at_or_before(marks: list[tuple[int, str]], t: int) -> int:
    lo, hi = 0, len(marks)
    while lo < hi:
        mid = (lo + hi) // 2
        if marks[mid][0] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


RING = CollectiveRing()
"""This process's ring: the Phase marks it, the shared-memory sum enters it, the hang watch reads it."""


# ---- where the main thread is ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Where:
    """Where a thread stands: what it is doing, and the line of its innermost frame outside Python and torch."""

    doing: str
    """data loading, forward, backward, the optimizer step, a collective, saving a snapshot, evaluation; "" unknown."""
    line: str
    """file.py:88 ("" where no frame is one's own)."""
    function: str = ""


_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}threading.py", f"{os.sep}contextlib.py", f"{os.sep}runpy.py",
                  f"{os.sep}selectors.py", f"{os.sep}queue.py", f"{os.sep}multiprocessing{os.sep}")
_STDLIB = os.path.dirname(os.__file__)


def _is_library(filename: str) -> bool:
    """A frame of Python's own library or of torch: not where a user (or dptrain) would look."""
    return (filename.startswith(_STDLIB) and "site-packages" not in filename) or filename.startswith("<") or any(
        part in filename for part in _LIBRARY_PARTS)


def _doing(frames: list[FrameType]) -> str:
    """What a stack (outermost first) is doing, by the innermost frame that says so."""
    doing = ""
    for frame in frames:
        code = frame.f_code
        path, name = code.co_filename, code.co_name
        if f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}" in path or f"dptrain{os.sep}data{os.sep}" in path or (
                name in ("__getitem__", "__getitems__") and not _is_library(path)):
            doing = "data loading"
        elif f"{os.sep}torch{os.sep}autograd{os.sep}" in path or name == "backward":
            doing = "backward"
        elif f"{os.sep}torch{os.sep}optim{os.sep}" in path or name == "optimizer_step":
            doing = "the optimizer step"
        elif name == "forward" or (name == "_call_impl" and doing not in ("forward",)):
            doing = "forward" if doing in ("", "forward") else doing
        elif f"dptrain{os.sep}snapshots{os.sep}" in path:
            doing = "saving a snapshot"
        elif path.endswith(f"dptrain{os.sep}evaluate.py"):
            doing = "evaluation"
        elif path.endswith("distributed_c10d.py") or path.endswith(f"strategies{os.sep}shared_memory.py"):
            doing = "a collective"
    return doing


def where(frame: FrameType | None) -> Where:
    """Where the stack ending in frame stands (Where("", "") for none)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    own = [f for f in frames if not _is_library(f.f_code.co_filename)]
    innermost = own[-1] if own else (frames[-1] if frames else None)
    line = f"{os.path.basename(innermost.f_code.co_filename)}:{innermost.f_lineno}" if innermost is not None else ""
    return Where(doing=_doing(frames), line=line, function=innermost.f_code.co_name if innermost is not None else "")


def where_main_thread() -> Where:
    """Where the main thread stands now (sampled from any thread)."""
    return where(sys._current_frames().get(threading.main_thread().ident))  # noqa: SLF001 - the one way to sample it
