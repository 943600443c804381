"""How a process of the world ends: at once, without Python's teardown (leave_now), with the error file a torch
launcher reads (record_for_launcher), and within a bound after a failure (exit_deadline)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
from pathlib import Path
from typing import Any


def leave_now(code: int) -> None:
    """End this process with code, skipping Python's interpreter teardown: freeing torch's objects one by one takes
    0.6 s after a short run (`python perf/micro.py`, teardown), for nothing, since the process ends anyway.
    Callers have closed what is theirs (events, logs, snapshots, TensorBoard's writer, the agent's folder); the log
    handlers and standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def record_for_launcher(exc: BaseException) -> None:
    """The error file a torch launcher (dptrain's agent, torchrun) reads for a failed worker (TORCHELASTIC_ERROR_FILE,
    as torch's @record writes it; nothing without one): the first line of its message is the run's one sentence. Call
    from the except block: the file holds the traceback being handled. A full disk leaves the file unwritten: the
    launcher then says "exited with code 1", and the rank's log says more."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        with contextlib.suppress(OSError):
            ErrorHandler().record_exception(exc)


AGENT_PID = "DPTRAIN_AGENT_PID"
"""Set in every worker that dptrain's own elastic agent started (launch.local.run_then_leave): the agent's pid."""


def agent_restarts_this_worker() -> bool:
    """Whether dptrain's agent that started this worker is alive and starts the workers again once they end without
    success (restarts are left): it then says on its console how the run goes on (after a lost node: with which
    nodes), so a worker's "run the same command" would be wrong there. False under torchrun, srun, in the CLI's own
    process, and once the agent is gone (a worker's parent is then another process)."""
    agent = os.environ.get(AGENT_PID)
    try:  # torch's agent gives each worker these two
        restarts_left = (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
                         - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return agent is not None and os.getppid() == int(agent) and restarts_left > 0
    except ValueError:
        return False


FAILED_RANK_EXIT_S = 30.0
"""How long a failed rank of a multi-process world may take to leave once its failure is logged (see exit_deadline)."""


def exit_deadline(exc: BaseException, log_file: Path | None, seconds: float = FAILED_RANK_EXIT_S) -> None:
    """Bound what is left of a failed rank's life: its teardown (leaving the process group, closing files, the
    interpreter's own) can wait on work still in flight towards a peer that is gone, one timeout after another, and
    its launcher waits for it: once a node's `dptrain train` stayed more than 100 s after a cut link.

    First the launcher's error file (TORCHELASTIC_ERROR_FILE, as torch's @record writes it once the exception has
    left the worker), so that the run's one sentence survives an early end; then, if this process still runs after
    `seconds`, faulthandler appends every thread's stack to log_file (else stderr) and ends it with exit code 1. Its
    own C thread does that, which needs no GIL: a teardown stuck in C++ may hold it. Call from the except block
    (the error file carries the traceback being handled); lift_exit_deadline() takes it back.
    """
    record_for_launcher(exc)
    stream: Any = sys.stderr
    if log_file is not None:
        with contextlib.suppress(OSError):
            stream = open(log_file, "a")  # noqa: SIM115 - open until the process ends or lift_exit_deadline
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
    except (ValueError, OSError):  # a stream without a file descriptor (a captured stderr): the process's own
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    _deadline.append(stream)


_deadline: list[Any] = []  # the armed deadline's stream: faulthandler has one timer a process; lift only ours (not pytest's)


def lift_exit_deadline() -> None:
    """For a process that lives on after a rank's failure (the CLI's caller, in tests): no end at exit_deadline's time."""
    if _deadline:
        faulthandler.cancel_dump_traceback_later()
        for stream in _deadline:
            if stream not in (sys.stderr, sys.__stderr__):
                stream.close()
        _deadline.clear()
