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
