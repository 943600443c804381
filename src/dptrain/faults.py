"""Faults on purpose, for the tests: a crash while saving, a signal or SIGKILL at a chosen step.

Inert unless the environment names a fault; a real run never sets these variables.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

CRASH_BEFORE_RENAME = "DPTRAIN_TEST_CRASH_BEFORE_RENAME"
"""Names a snapshot (step-00000010): rank 0 exits with CRASH_EXIT_CODE after writing its files, before the rename."""
CRASH_EXIT_CODE = 97
SIGNAL_AT = "DPTRAIN_TEST_SIGNAL_AT"
"""'RANK:STEP:SIGNAL:TARGET[:MARKER]': after step STEP, rank RANK sends SIGNAL (SIGTERM, SIGUSR1, SIGKILL)
to itself (TARGET self) or to its parent, the elastic agent (TARGET parent). With MARKER, only while
that file does not exist (it is created first), so that a restarted group is not hit again. Several
such faults separated by commas each strike once their step comes."""


def crash_before_rename(snapshot_name: str) -> None:
    if os.environ.get(CRASH_BEFORE_RENAME) == snapshot_name:
        os._exit(CRASH_EXIT_CODE)


def signal_if_due(rank: int, step: int) -> None:
    specs = os.environ.get(SIGNAL_AT)
    if not specs:
        return
    for spec in specs.split(","):
        on_rank, at_step, name, target, *marker = spec.split(":")
        if int(on_rank) != rank or int(at_step) != step:
            continue
        if marker:
            if Path(marker[0]).exists():
                continue
            Path(marker[0]).touch()
        os.kill(os.getpid() if target == "self" else os.getppid(), getattr(signal, name))


SLOW = "DPTRAIN_TEST_SLOW"
"""'RANK:FRACTION[:PHASE]': global rank RANK is FRACTION slower a step (0.3: 30%), measured on its own compute
(metrics.stragglers.OwnClock). PHASE compute (the default): busy work at the start of each training forward, sized on
the CPU time of its previous step's compute (a slower CPU); data: a sleep before each batch, sized on its previous
step's compute (a slower disk); link: a sleep before each of its sends of the link probe, FRACTION of the probe's time
at 100 Mbit/s (metrics.link_probe.FAULT_BASE_S; a slower link, on loopback)."""


def slow_fraction(phase: str) -> float:
    """FRACTION where SLOW names this rank (the RANK variable) and this phase, else 0."""
    spec = os.environ.get(SLOW)
    if not spec:
        return 0.0
    on_rank, fraction, *named = spec.split(":")
    return float(fraction) if on_rank == os.environ.get("RANK", "0") and (named or ["compute"])[0] == phase else 0.0


FAULT = "DPTRAIN_TEST_FAULT"
"""'KIND:RANK:CALL[:SECONDS]', several separated by commas: on global rank RANK (the RANK variable), at the CALL-th
time that KIND comes (counted from 1 in this process):
- forward, data: stall_seconds(KIND) gives SECONDS there (a user's model or Dataset of the tests sleeps that long in
  its forward or its __getitem__: a rank stuck in its own code);
- skip: the CALL-th Strategy.all_reduce is skipped on that rank (a collective one rank does not make);
- mismatch: the CALL-th Strategy.all_reduce sends one element more on that rank (another shape).
Only the kinds named are armed; nothing happens without the variable."""

_calls: dict[str, int] = {}


def _due(kind: str, count: bool = True) -> list[str] | None:
    """The fields of a fault of this kind due now on this rank (this call counted), else None."""
    specs = os.environ.get(FAULT)
    if not specs:
        return None
    if count:
        _calls[kind] = _calls.get(kind, 0) + 1
    for spec in specs.split(","):
        on_kind, on_rank, at_call, *rest = spec.split(":")
        if on_kind == kind and on_rank == os.environ.get("RANK", "0") and int(at_call) == _calls.get(kind, 0):
            return rest
    return None


def stall_seconds(place: str) -> float:
    """How long a test's model (place forward) or Dataset (place data) sleeps at this call: 0 unless due."""
    rest = _due(place)
    return float(rest[0]) if rest else 0.0


def collective_fault() -> str | None:
    """'skip' or 'mismatch' where Strategy.all_reduce is to make its collective wrongly at this call; else None."""
    if not os.environ.get(FAULT):
        return None
    _calls["all_reduce"] = _calls.get("all_reduce", 0) + 1
    for kind in ("skip", "mismatch"):
        _calls[kind] = _calls["all_reduce"]
        if _due(kind, count=False) is not None:
            return kind
    return None

