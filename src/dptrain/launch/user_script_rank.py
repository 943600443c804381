"""One rank of a program that dptrain's elastic agent starts (a training script of the user's, launch/user_script.py): it
asks the kernel for SIGTERM when the agent dies, as dptrain's own ranks do (launch.local.stop_with_the_agent), then
runs the program. A Python script (or -m module) run by this very Python runs in this process, as `python -u` would
run it (sys.argv, sys.path[0], __main__, unbuffered output, its exit code and signals as they were), after a thread is
started that watches its collectives once it has joined its world (distributed.hangs.watch_user_script): a collective
that overruns launch.timeout_s then ends the run with which rank stopped and at which Python line. Any other program
(another Python, a binary) becomes this process instead (exec: the same pid and environment), unwatched.

torch's agent starts a program with subprocess, in a session of its own, and nothing ended it with the agent: after a
kill -9 of `dptrain train -- my_train.py`, its ranks ran on for ever, re-parented to PID 1. SIGTERM is what the agent
itself sends its ranks when it ends them: a script that catches it may save, one that does not ends at once.

Run as `python -m dptrain.launch.user_script_rank AGENT_PID PROGRAM ARGS...` by the agent. It imports the standard library
only (a rank's start costs one more Python start-up, some 20 ms, and no torch; the watch imports dptrain's hang module
once the script has imported torch.distributed): keep it so.
"""

import ctypes
import os
import runpy
import shutil
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with(parent_pid: int, signum: int = signal.SIGTERM) -> None:
    """Ask the kernel for signum when parent_pid, this process's parent, dies; signum at once if it already has. Linux
    only (prctl); elsewhere nothing changes. The request outlives exec, but not a fork: each process asks for its own."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # the C library this Python runs on
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signum)


WATCH_TIMEOUT = "DPTRAIN_SCRIPT_TIMEOUT_S"
"""launch.timeout_s, for the watch on a script's collectives (set by launch/user_script.py); none: no watch."""


def in_this_python(program: list[str]) -> list[str] | None:
    """What follows `python -u` in program where that Python is this one (the same executable, or one of the same
    folder: this environment's), else None."""
    python = shutil.which(program[0]) or program[0]
    same = os.path.abspath(python) == os.path.abspath(sys.executable) or (
        os.path.dirname(os.path.abspath(python)) == os.path.dirname(os.path.abspath(sys.executable))
        and os.path.basename(python).startswith("python"))
    rest = program[1:]
    if not same or rest[:1] != ["-u"] or len(rest) < 2 or (rest[1] == "-m" and len(rest) < 3):
        return None
    return rest[1:]


def run_here(target: list[str]) -> None:
    """The script (or -m module) with its arguments, in this process, as `python -u` runs it."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr] - text streams of a CPython process
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")  # the Flight Recorder the watch reads, before any group
    if os.environ.get(WATCH_TIMEOUT):
        threading.Thread(target=_watch, name="dptrain-script-watch", daemon=True).start()
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")


def _watch() -> None:
    """Once the script has joined its world (torch.distributed imported and initialised), the hang watch."""
    while True:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and getattr(dist, "is_initialized", lambda: False)():
            break
        threading.Event().wait(0.2)
    from dptrain.distributed.hangs import watch_user_script  # torch is imported by now

    watch_user_script(float(os.environ[WATCH_TIMEOUT]))


def main(argv: list[str]) -> None:
    agent_pid, program = int(argv[0]), argv[1:]
    stop_with(agent_pid)
    target = in_this_python(program)
    if target is not None:
        sys.path.pop(0)  # this module's folder (python -m puts the working folder first): the script's instead
        run_here(target)
        return
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        sys.exit(f"dptrain: cannot run {program[0]} ({exc.strerror}); name a Python that exists before the script, or "
                 f"none to use dptrain's own.")


if __name__ == "__main__":
    main(sys.argv[1:])
