"""One rank of a program that dptrain's elastic agent starts (a training script of the user's, launch/user_script.py): it
asks the kernel for SIGTERM when the agent dies, as dptrain's own ranks do (launch.local.stop_with_the_agent), then
becomes the program (exec: the same process, pid and environment).

torch's agent starts a program with subprocess, in a session of its own, and nothing ended it with the agent: after a
kill -9 of `dptrain train -- my_train.py`, its ranks ran on for ever, re-parented to PID 1. SIGTERM is what the agent
itself sends its ranks when it ends them: a script that catches it may save, one that does not ends at once.

Run as `python -m dptrain.launch.user_script_rank AGENT_PID PROGRAM ARGS...` by the agent. It imports the standard library
only (a rank's start costs one more Python start-up, some 20 ms, and no torch): keep it so.
"""

import ctypes
import os
import signal
import sys

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


def main(argv: list[str]) -> None:
    agent_pid, program = int(argv[0]), argv[1:]
    stop_with(agent_pid)
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        sys.exit(f"dptrain: cannot run {program[0]} ({exc.strerror}); name a Python that exists before the script, or "
                 f"none to use dptrain's own.")


if __name__ == "__main__":
    main(sys.argv[1:])
