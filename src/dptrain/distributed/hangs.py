"""A hang said in one sentence: when a collective overruns, every rank says on the world's store what it knows (its
last collectives, the line its main thread is at), and the run ends with what they compare to:

    rank 1 (node2) never entered all_reduce #12 (bucket 0 of step 5); rank 0 waited 8 s in it; rank 1 was in data
    loading at my_dataset.py:88; its stack is in its rank log

A HangWatch thread runs on every rank. Each period it reads the ring's status (collectives.RING: torch's Flight
Recorder and dptrain's own collectives); a collective made and not done for hang_after_s (launch.timeout_s less a
margin, so that the verdict comes before the backend's own timeout error, or NCCL's watchdog, ends the rank
unnamed) makes it ask the others. Every rank's watch answers within a period with its report (report()); the asking
rank waits a few periods for them, composes the verdict (verdict(), pure) and writes it under one key, the first one
written winning; every rank's watch reads it there and ends its rank with it, as a failed collective ends it
(failures.end_with_failure: the rank's log, the launcher's error file, exit code 1). The writer appends the verdict
to metrics.jsonl as a hang event. A rank that does not answer (stopped by SIGSTOP, dead unseen, its process stuck in
C while holding the GIL) is named as such.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dptrain.distributed.collectives import OWN_GROUP, RING, WORLD_GROUP, Collective, CollectiveRing, where_main_thread
from dptrain.events import (COLLECTIVE, DOING, EVENT, HANG_EVENT, HANG_RANKS, LINE, MESSAGE, STEP, TIME, WAITED_S)

log = logging.getLogger("dptrain")

STEP_PHASE = re.compile(r"\bstep (\d+)$")


def margin_s(timeout_s: float) -> float:
    """How long before launch.timeout_s the watch asks: detection, the others' answers and the end fit in it."""
    return 8 * period_s(timeout_s) + 1.0


def period_s(timeout_s: float) -> float:
    """How often a rank's watch looks: a fortieth of the timeout, within 0.05 s and 2 s."""
    return min(2.0, max(0.05, timeout_s / 40))


def hang_after_s(timeout_s: float) -> float:
    """How long a collective may stay unfinished before the ranks compare: the timeout less margin_s."""
    return max(period_s(timeout_s), timeout_s - margin_s(timeout_s))


# ---- a rank's report ----------------------------------------------------------------------------------------------

def report(global_rank: int, host: str, ring: CollectiveRing = RING, phase: str = "") -> dict[str, Any]:
    """What this rank says of itself at a hang: where its main thread is, its phase and step, its collectives."""
    here = where_main_thread()
    step = None
    for _, name in reversed(ring.marks):
        if (found := STEP_PHASE.search(name)) is not None:
            step = int(found.group(1))
            break
    return {"rank": global_rank, "host": host, "doing": here.doing or phase, "line": here.line,
            "function": here.function, "phase": phase,
            "step": step, "marks": [name for _, name in list(ring.marks)[-32:]],
            "status": {g: list(s) for g, s in ring.status().items()},
            "collectives": [c.as_row() for c in ring.entries()], "now_ns": time.time_ns()}


# ---- the verdict (pure) -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """The run's one sentence at a hang, and what it names (the hang event's fields)."""

    sentence: str
    ranks: list[int]
    """The ranks it blames (never entered, did not answer, made another collective); [] where none."""
    collective: str
    """The collective overrun ("all_reduce #12"), "" where none was seen."""
    waited_s: float
    step: int | None
    doing: str = ""
    line: str = ""


def ranks_words(ranks: Sequence[int]) -> str:
    """rank 3, ranks 0-2, ranks 0, 2 and 5."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def named(c: Collective, shape: bool = False) -> str:
    """all_reduce #12 (bucket 0 of step 5); with shape, its tensors' shapes and type too."""
    name = f"{c.op} #{c.seq}"
    if c.group == OWN_GROUP:
        name += " through shared memory"
    elif c.group != WORLD_GROUP:
        name += f" of group {c.group}"
    if shape:
        name += f" of {'+'.join(str(list(s)) for s in c.sizes) or 'no tensor'}{' ' + c.dtype if c.dtype else ''}"
    found = STEP_PHASE.fullmatch(c.phase) if c.phase.startswith("step ") else None
    if found is not None:
        place = f"bucket {c.index} of step {found.group(1)}" if c.op in ("all_reduce", "allreduce") else c.phase
    else:
        place = c.phase if c.phase not in ("", "start-up") else ""
    return f"{name} ({place})" if place else name


def _who(rank: int, reports: dict[int, dict | None], hosts: dict[int, str]) -> str:
    host = (reports.get(rank) or {}).get("host") or hosts.get(rank)
    return f"rank {rank} ({host})" if host else f"rank {rank}"


def _collectives(rep: dict) -> list[Collective]:
    return [Collective.from_row(row) for row in rep.get("collectives", [])]


def _mismatch(alive: dict[int, dict], group: str) -> tuple[int, dict[int, Collective]] | None:
    """The first sequence number of group at which the ranks' collectives differ (operation, shapes, or the phase
    they were made in), with each rank's collective there; None where all agree on what they all still hold."""
    held = {r: {c.seq: c for c in _collectives(rep) if c.group == group} for r, rep in alive.items()}
    common = set.intersection(*(set(h) for h in held.values())) if held else set()
    for seq in sorted(common):
        at = {r: h[seq] for r, h in held.items()}
        signature = {r: (c.op, json.dumps(c.sizes), c.dtype) for r, c in at.items()}
        phases = {r: c.phase for r, c in at.items()}
        if len(set(signature.values())) > 1 or (all(phases.values()) and len(set(phases.values())) > 1):
            return seq, at
    return None


def _as_before(rep: dict, made: Collective) -> bool:
    """Whether this rank made the same collective (operation, shapes, type) at the same place before: in the same
    phase with another step's number (the loss reduction of the step before)."""
    place = re.sub(r"\d+", "#", made.phase)
    same = (made.op, made.sizes, made.dtype)
    return any(c.seq < made.seq and c.group == made.group and (c.op, c.sizes, c.dtype) == same
               and re.sub(r"\d+", "#", c.phase) == place for c in _collectives(rep))


RANK_LOG_STACKS = "in {its} rank log"
"""Where a blamed rank's stack is (HangWatch logs it): a rank's log of dptrain's; a script's rank prints it."""


def verdict(reports: dict[int, dict | None], world_size: int, hosts: dict[int, str] | None = None,
            now_ns: int | None = None, stacks: str = RANK_LOG_STACKS) -> Verdict:
    """The one sentence a hang ends with, from every rank's report (None: it did not answer)."""
    hosts = hosts or {}
    now_ns = now_ns if now_ns is not None else time.time_ns()
    alive = {r: rep for r, rep in reports.items() if rep}
    silent = [r for r in range(world_size) if r not in alive]
    open_ = [(c, r) for r, rep in alive.items() for c in _collectives(rep) if not c.done]
    if not open_:
        words = f"{ranks_words(silent)} did not answer" if silent else "no rank is in a collective"
        return Verdict(f"a collective overran and {words}; every rank's log has what it was doing", silent, "", 0.0,
                       _step(alive))
    stuck = _root(open_, alive)
    waiting = sorted({r for c, r in open_ if c.group == stuck.group and c.seq == stuck.seq})
    waited = max((now_ns - c.entered_ns) / 1e9 for c, r in open_ if c.group == stuck.group and c.seq == stuck.seq)
    step = _step(alive)
    made = {r: int(rep.get("status", {}).get(stuck.group, [0, 0])[0]) for r, rep in alive.items()}
    never = sorted(r for r in alive if made[r] < stuck.seq)
    it = "it" if never else named(stuck)
    waited_words = f"{ranks_words(waiting)} waited {waited:.0f} s in {it}"
    odd = _mismatch(alive, stuck.group)
    if odd is not None:
        seq, at = odd
        groups: dict[tuple, list[int]] = {}
        for r, c in sorted(at.items()):
            groups.setdefault((c.op, json.dumps(c.sizes), c.dtype, c.phase), []).append(r)
        # the most ranks made the reference; in a tie (2 ranks), the side whose collective is the one it made
        # before at the same place (an earlier step's): the other side's changed
        reference = max(groups.values(), key=lambda rs: (len(rs), sum(_as_before(alive[r], at[r]) for r in rs),
                                                         -rs[0]))
        others = [r for rs in groups.values() if rs is not reference for r in rs]
        shape = len({(c.op, json.dumps(c.sizes), c.dtype) for c in at.values()}) > 1
        theirs = "; ".join(f"{_who(r, alive, hosts)} made {named(at[r], shape)}" for r in others)
        sentence = (f"the ranks' collectives no longer match: {theirs} where {ranks_words(reference)} made "
                    f"{named(at[reference[0]], shape)} (a collective skipped or added on some rank, or another "
                    f"shape); {ranks_words(waiting)} waited {waited:.0f} s in {named(stuck)}; make every rank call "
                    f"the same collectives in the same order")
        first = others[0]
        return Verdict(sentence, others, f"{at[first].op} #{seq}", waited, step,
                       alive[first].get("doing", ""), alive[first].get("line", ""))
    parts = []
    skipped = [r for r in never if _passed(alive[r], stuck.phase)]
    if skipped:
        parts.append(f"{', '.join(_who(r, alive, hosts) for r in skipped)} skipped {named(stuck)}: "
                     f"{'it' if len(skipped) == 1 else 'they'} left that phase without making it")
        never = [r for r in never if r not in skipped]
    if never:
        parts.append(f"{', '.join(_who(r, alive, hosts) for r in never)} never entered {named(stuck)}")
    if silent:
        parts.append(f"{', '.join(_who(r, alive, hosts) for r in silent)} did not answer (stopped, or dead unseen)")
    parts.append(waited_words)
    never = skipped + never
    for r in never:
        rep = alive[r]
        inside = [c for c in _collectives(rep) if not c.done]
        doing = named(min(inside, key=lambda c: c.entered_ns)) if inside else rep.get("doing")
        at = f"at {rep.get('line') or '?'}"
        if doing:
            parts.append(f"rank {r} was in {doing} {at}")
        else:
            parts.append(f"rank {r} was {at}" + (f" (in {rep['function']})" if rep.get("function") else ""))
    if never:
        its = "its" if len(never) == 1 else "their"
        parts.append(f"{its} stack is {stacks.format(its=its)}")
    elif silent:
        parts.append("look at that host")
    else:
        parts.append("every rank entered it, so the link or the backend is stuck, not a rank")
    blamed = never + silent
    first = alive.get(blamed[0], {}) if blamed else {}
    return Verdict("; ".join(parts), blamed, f"{stuck.op} #{stuck.seq}", waited, step, first.get("doing", ""),
                   first.get("line", ""))


def _passed(rep: dict, phase: str) -> bool:
    """Whether a rank's phase marks show it entered phase and went on to another (it left that phase)."""
    marks = rep.get("marks", [])
    return bool(phase) and phase in marks[:-1] and marks[-1] != phase


def _root(open_: list[tuple[Collective, int]], alive: dict[int, dict]) -> Collective:
    """The collective the hang started from: one that a rank skipped (it left the phase the collective was made in,
    without making it) if any, else the one made first."""
    def skipped_by_some(c: Collective) -> bool:
        return any(int(rep.get("status", {}).get(c.group, [0, 0])[0]) < c.seq and _passed(rep, c.phase)
                   for rep in alive.values())

    candidates = [c for c, _ in open_ if skipped_by_some(c)] or [c for c, _ in open_]
    return min(candidates, key=lambda c: c.entered_ns)


def _step(alive: dict[int, dict]) -> int | None:
    steps = [rep["step"] for rep in alive.values() if rep.get("step") is not None]
    return max(steps) if steps else None


def hang_event(v: Verdict) -> dict[str, Any]:
    """The hang event of metrics.jsonl (events.HANG_EVENT's fields, in its order)."""
    record: dict[str, Any] = {EVENT: HANG_EVENT.name, TIME: round(time.time(), 3), STEP: v.step or 0,
                              MESSAGE: v.sentence, HANG_RANKS: v.ranks, WAITED_S: round(v.waited_s, 3)}
    if v.collective:
        record[COLLECTIVE] = v.collective
    if v.doing:
        record[DOING] = v.doing
    if v.line:
        record[LINE] = v.line
    return record


def append_event(path: Path, record: dict[str, Any]) -> None:
    """One line appended to metrics.jsonl, in one write (rank 0's own lines are whole lines too)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- the watch ----------------------------------------------------------------------------------------------------

class Unanswered(RuntimeError):
    """A call to the world's store that did not return within its bound (within())."""


def within(call: Callable[[], Any], seconds: float) -> Any:
    """call()'s result, made on a daemon thread and waited for at most `seconds`; else Unanswered, the thread left
    blocked. A store whose host is stopped (SIGSTOP) keeps its connection open and never answers, and c10d's own
    timeout does not bound check() or set(): a survivor's watch and roll call waited there for minutes."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            box["error"] = exc

    thread = threading.Thread(target=run, name="dptrain-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Unanswered(f"the world's store did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class HangWatch:
    """This rank's watch on its collectives and its part in the comparison (see the module's docstring)."""

    def __init__(self, store: Any, global_rank: int, world_size: int, host: str, timeout_s: float,
                 end: Callable[[str], None], metrics: Path | None = None, phase: Callable[[], str] = lambda: "",
                 clock: Callable[[], float] = time.monotonic, ring: CollectiveRing = RING,
                 stacks: str = RANK_LOG_STACKS) -> None:
        self.store, self.rank, self.world_size, self.host = store, global_rank, world_size, host
        self.hang_after_s, self.period_s = hang_after_s(timeout_s), period_s(timeout_s)
        self.end, self.metrics, self.phase, self.clock, self.ring = end, metrics, phase, clock, ring
        self.stacks = stacks
        self.prefix = f"dptrain/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.first_seen: dict[tuple[str, int], float] = {}
        self.reported = self.compared = self.store_lost = False
        self._done = threading.Event()

    def start(self) -> "HangWatch":
        self.store.set(f"{self.prefix}host/{self.rank}", self.host)
        threading.Thread(target=self._run, name="dptrain-hang-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()

    def overran(self) -> bool:
        """Whether a collective of this rank has been made and not done for hang_after_s (seen at this call or
        earlier ones)."""
        now, open_ = self.clock(), set()
        for group, (made, done) in self.ring.status().items():
            if made > done:
                open_.add((group, done + 1))
        self.first_seen = {k: self.first_seen.get(k, now) for k in open_}
        return any(now - t >= self.hang_after_s for t in self.first_seen.values())

    def tick(self) -> str | None:
        """One period's look; the verdict once there is one."""
        key = f"{self.prefix}verdict"
        if self.store.check([key]):
            return self._said(json.loads(self.store.get(key)), wrote=False, zero_silent=False)
        overran = self.overran()
        if overran:
            self.store.set(f"{self.prefix}asked", str(self.rank))
        if not self.reported and (overran or self.store.check([f"{self.prefix}asked"])):
            self._report()
        if not overran:
            return None
        return self.compare()

    def _report(self) -> None:
        mine = report(self.rank, self.host, self.ring, self.phase())
        self.store.set(f"{self.prefix}report/{self.rank}", json.dumps(mine))
        self.reported = True
        log.warning("a collective overran (on this rank or another): this rank was in %s at %s, phase %s; the ranks "
                    "compare", mine["doing"] or "?", mine["line"] or "?", mine["phase"] or "?", extra={"file_only": True})
        frame = _main_frame()
        if frame is not None:
            log.warning("the main thread's stack:\n%s", "".join(traceback.format_stack(frame)),
                        extra={"file_only": True})

    def compare(self) -> str:
        """Wait for every rank's report (a few periods at most), write the verdict (the first written wins), return
        the one written."""
        deadline = self.clock() + 3 * self.period_s + 0.25
        keys = [f"{self.prefix}report/{r}" for r in range(self.world_size)]
        while not self.store.check(keys) and self.clock() < deadline:
            time.sleep(self.period_s / 4)
        reports: dict[int, dict | None] = {}
        hosts: dict[int, str] = {}
        for r, k in enumerate(keys):
            reports[r] = json.loads(self.store.get(k)) if self.store.check([k]) else None
            if self.store.check([f"{self.prefix}host/{r}"]):
                hosts[r] = self.store.get(f"{self.prefix}host/{r}").decode()
        self.compared = True
        mine = json.dumps(hang_event(verdict(reports, self.world_size, hosts, stacks=self.stacks)))
        written = self.store.compare_set(f"{self.prefix}verdict", "", mine)
        written = written.decode() if isinstance(written, bytes) else str(written)
        return self._said(json.loads(written), wrote=written == mine, zero_silent=reports.get(0) is None)

    def _said(self, record: dict[str, Any], wrote: bool, zero_silent: bool) -> str:
        """The verdict's sentence, its event appended to metrics.jsonl by rank 0 (or by its writer where rank 0 did
        not answer)."""
        if self.metrics is not None and (self.rank == 0 or (wrote and zero_silent)):
            append_event(self.metrics, record)
        return str(record[MESSAGE])

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            try:
                if self.store_lost:
                    raise Unanswered("the world's store did not answer before")  # not one more blocked thread
                found = within(self.tick, 3 * self.period_s + 0.75)  # a comparison waits 3 periods for reports
            except RuntimeError as exc:  # the store does not answer: its host is gone, or stopped
                self.store_lost = self.store_lost or isinstance(exc, Unanswered)
                found = self.without_store()
                if found is None:
                    continue
            if found is not None and not self._done.is_set():
                if not self.store_lost:  # where it is, a stopped host's store would hold this thread for ever
                    self._acknowledge()
                if self.compared:  # the others read the verdict before this rank's end ends the run
                    self._wait_for_readers()
                    time.sleep(2 * self.period_s)  # and write it in their logs
                self.end(found)
                return

    def without_store(self) -> str | None:
        """Where the world's store does not answer while a collective of this rank overran: its host, rank 0 (whose
        process serves it where dptrain's ranks were not started by its agent), stopped or died where no agent saw
        it, and no rank can compare. This rank's own sentence, or None while nothing has overrun."""
        if not self.overran():
            return None
        mine = report(self.rank, self.host, self.ring, self.phase())
        open_ = [c for c in _collectives(mine) if not c.done]
        first = min(open_, key=lambda c: c.entered_ns) if open_ else None
        waited = (time.time_ns() - first.entered_ns) / 1e9 if first is not None else self.hang_after_s
        sentence = (f"rank 0 did not answer (stopped, or dead unseen), nor did the world's store it serves; rank "
                    f"{self.rank} waited {waited:.0f} s in {named(first) if first else 'a collective'}; look at rank "
                    f"0's host")
        found = Verdict(sentence, [0], f"{first.op} #{first.seq}" if first else "", waited, mine.get("step"))
        if self.metrics is not None and self.rank == 1:  # one writer: rank 1 is the first that may be left
            append_event(self.metrics, hang_event(found))
        return sentence

    def _acknowledge(self) -> None:
        try:
            self.store.set(f"{self.prefix}read/{self.rank}", "1")
        except RuntimeError:  # the store's host is gone: nobody waits for this
            pass

    def _wait_for_readers(self) -> None:
        """Until every rank that reported has read the verdict, within 2 periods and 0.5 s: a loaded machine may not
        run a reader's watch within a period, and its rank is ended once this one's end ends the run. The bound keeps
        verdict, wait and end inside the margin before the backend's own timeout (margin_s)."""
        deadline = self.clock() + 2 * self.period_s + 0.5
        try:
            readers = [f"{self.prefix}read/{r}" for r in range(self.world_size)
                       if r != self.rank and self.store.check([f"{self.prefix}report/{r}"])]
            while readers and not self.store.check(readers) and self.clock() < deadline:
                time.sleep(self.period_s / 4)
        except RuntimeError:
            pass


def _main_frame() -> Any:
    return sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001


def watch_user_script(timeout_s: float) -> HangWatch:
    """A HangWatch in a rank of a user's script (launch/user_script_rank.py), once the script has joined its world:
    the world's store at MASTER_ADDR:MASTER_PORT (the agent's), no phases and no metrics.jsonl; the verdict ends the
    rank with the launcher's error file (its one sentence on the console)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return HangWatch(store, rank, world, socket.gethostname(), timeout_s, end=_end_script,
                     stacks="on {its} output, above").start()


def _end_script(sentence: str) -> None:
    """A script's rank ends with the verdict: in the launcher's error file (else on stderr), exit code 1, at once."""
    from dptrain.distributed.ending import leave_now, record_for_launcher

    record_for_launcher(RuntimeError(sentence))
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        print(f"dptrain: error: {sentence}", flush=True, file=sys.stderr)
    leave_now(1)
