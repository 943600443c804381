"""N local workers through torch's elastic agent: the machinery torchrun runs, on a free port."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any, Callable

from dptrain.launch.env import LaunchError
from dptrain.stopping import EXIT_STOPPED, Stopped

# With gloo, a restarted rank can read a dead rank's address from the agent's shared store and fail
# to connect (pytorch/pytorch#135712); a store of the workers' own avoids that.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch_local(entrypoint: Callable[..., Any], args: tuple, nproc_per_node: int, timeout_s: float, max_restarts: int = 0) -> None:
    """Run `entrypoint(*args)` on nproc_per_node workers; raise LaunchError naming the failed ranks."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for key, value in AGENT_ENV.items():
        os.environ.setdefault(key, value)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # port 0: the agent picks a free port; no hard-coded MASTER_PORT
        rdzv_configs={"join_timeout": timeout_s},
        max_restarts=max_restarts,
        monitor_interval=0.1,  # how soon the end (or a failure) of a worker is seen; the poll costs nothing noticeable
        start_method="spawn",
    )
    # The agent forwards SIGTERM to the workers by itself; SIGUSR1 (SLURM's --signal) it must be
    # taught: raising SignalException here makes it send SIGUSR1 on to the workers and wait for them.
    def forward(signum: int, frame: Any) -> None:  # noqa: ARG001 - the signal module's signature
        raise SignalException(f"process {os.getpid()} got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    previous = signal.signal(signal.SIGUSR1, forward)
    try:
        elastic_launch(config, entrypoint)(*args)
    except SignalException as exc:
        raise Stopped(f"stopped by {exc.sigval.name}: the workers were asked to write a snapshot at their next step "
                      f"boundary (workers still starting up stop without one); run the same command to resume.") from None
    except ChildFailedError as exc:
        if all(f.exitcode == EXIT_STOPPED for f in exc.failures.values()):  # the workers themselves were signalled
            raise Stopped(f"stopped by a signal to the workers, with a snapshot (exit code {EXIT_STOPPED}); "
                          f"run the same command to resume.") from None
        raise LaunchError(describe_failure(exc)) from None
    finally:
        signal.signal(signal.SIGUSR1, previous)


def describe_failure(exc: Any) -> str:
    """The first failure's own message (they say 'rank R failed during PHASE: ...'), plus who else died."""
    failures = sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp)  # {global rank: ProcessFailure}
    rank, first = failures[0]
    raw = first.message.get("message", "") if isinstance(first.message, dict) else first.message
    message = _first_line(raw) if isinstance(raw, str) else ""
    if not message or message.startswith("To enable traceback"):
        message = f"rank {rank} exited with code {first.exitcode}"
    others = [str(r) for r, _ in failures[1:]]
    if others:
        message += f" (rank{'s' if len(others) > 1 else ''} {', '.join(others)} also stopped)"
    return message


def _first_line(message: str) -> str:
    """The error file holds 'ExcType: text' and maybe a traceback; keep the text of the last exception."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    prefix, sep, rest = line.partition(": ")
    return rest if sep and prefix.replace(".", "").isidentifier() else line
