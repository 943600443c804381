"""N local workers through torch's elastic agent: the machinery torchrun runs, on a free port."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from dptrain.config import RunConfig
from dptrain.distributed.ending import AGENT_PID, leave_now, record_for_launcher
from dptrain.distributed.env import DistEnv, Nodes
from dptrain.distributed.failures import cpp_log_level, cpp_warnings_off
from dptrain.distributed.store import address_towards, loopback_interface
from dptrain.errors import ConfigError, DataError, LaunchError, SnapshotError, UnsafeFileError
from dptrain.launch import user_script_rank
from dptrain.launch.rendezvous import (REFUSAL_FILE, RENDEZVOUS, Refused, forget_the_rendezvous, register_rendezvous,
                                       rendezvous_host_gone, rendezvous_timeout, rendezvous_times)
from dptrain.prestart import local_workers
from dptrain.runtime import wants_cuda
from dptrain.stopping import EXIT_LEFT, EXIT_STOPPED, FEWEST_NODES_VAR, Stopped

# With gloo, a restarted rank can read a dead rank's address from the agent's shared store and fail
# to connect (pytorch/pytorch#135712); a store of the workers' own avoids that. Set for the launch only.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

log = logging.getLogger(__name__)


# What every training rank imports, imported once by the agent before it forks the workers (see start_method).
WORKER_IMPORTS = ("dptrain.train", "torch.nn.parallel", "torch._dynamo")


def launch_local(entrypoint: Callable[..., Any] | str, args: tuple, nproc_per_node: int, timeout_s: float,
                 max_restarts: int = 0, log_file: Path | None = None, nodes: Nodes | None = None,
                 on_cuda: bool = True) -> None:
    """Run `entrypoint(*args)` on nproc_per_node workers; raise LaunchError naming the failed ranks. An entrypoint
    that is a program's path (a Python running a script of the user's: launch/user_script.py) runs as a process of its
    own in each worker, as torchrun runs it, with the same rendezvous, restarts and messages; each gets SIGTERM when
    the agent dies, as dptrain's own workers do (launch/user_script_rank.py). On one node its ranks open nothing beyond
    loopback: the agent serves them a store of its own on loopback (torch's rank 0 would host one on every
    interface), and gloo's and nccl's sockets are pinned to the loopback interface where the user has not chosen one.

    On the CPU (on_cuda False) the agent forks the workers, which then start with everything already imported
    (WORKER_IMPORTS): a 1-step run of 2 workers on 2 cores takes 1.6 s instead of 2.9 s with fresh interpreters
    (`python perf/micro.py`, launch), and the pages of the imported code stay shared. CUDA cannot be used in a
    forked child of a process that has touched it, so GPU workers are spawned.

    With nodes, this node's agent first meets the other nodes' agents at nodes.endpoint (hosted by node 0, which
    listens on that address only; without a node rank, by the node whose address that is); without, everything
    listens on loopback. The agent's own log (restarts,
    tracebacks of failed workers) goes to log_file (the run's logs/launcher.log), not to the console: the user sees the one
    sentence of the LaunchError, the details stay in the run's logs. The agent's C++ warnings (its rendezvous store's:
    a block of C++ frames for each call that a node 0 that is gone does not answer) are off; the workers keep theirs.
    The calling process's environment is left as it was.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nodes is None:  # port 0: a free port, no hard-coded MASTER_PORT; rank 0's store listens on loopback too
        nodes = Nodes(count=1, rank=0, host="127.0.0.1", port=0)
    program = isinstance(entrypoint, str)
    serves_the_ranks_store = program and nodes.count == 1  # dptrain's own ranks host their store on loopback already
    if program:  # the agent's pid: its child's parent, whose death the kernel then signals
        entrypoint, args = sys.executable, ("-m", user_script_rank.__name__, str(os.getpid()), entrypoint, *args)
    # The launch sets variables for its workers (ours, below; torch's launcher and imports their own): all taken back.
    kept = dict(os.environ)
    times = rendezvous_times(timeout_s, nodes)  # a bad DPTRAIN_RDZV_* refused here, not later inside the agent
    register_rendezvous()
    # The agent's own per-worker folders (error files, maybe logs) in a folder of ours, removed after the
    # run: by default torch leaves a /tmp/torchelastic_* folder behind for every launch.
    agent_dir = tempfile.TemporaryDirectory(prefix="dptrain-agent-")
    config = LaunchConfig(
        min_nodes=nodes.fewest,
        max_nodes=nodes.count,
        nproc_per_node=nproc_per_node,
        run_id="dptrain",  # the rendezvous store serves this run alone
        rdzv_backend=RENDEZVOUS,
        rdzv_endpoint=nodes.endpoint,
        # node_rank None: the rendezvous numbers the nodes, the node at the endpoint's host hosting it as node 0
        rdzv_configs={"join_timeout": timeout_s, "is_host": nodes.rank == 0, "node_rank": nodes.rank,
                      "keep_alive_s": times.keep_alive_s, "last_call_s": times.last_call_s,
                      "ranks_per_node": nproc_per_node, "serves_the_ranks_store": serves_the_ranks_store},
        # The workers' MASTER_ADDR, where the node that gets global rank 0 is this one: this node's address on the
        # route to node 0, which every node reaches (the host name may resolve to 127.0.1.1 or another network).
        local_addr=address_towards(nodes.host),
        max_restarts=max_restarts,
        monitor_interval=0.1,  # how soon the end (or a failure) of a worker is seen; the poll costs nothing noticeable
        start_method="spawn" if on_cuda else "fork",
        logs_specs=DefaultLogsSpecs(log_dir=agent_dir.name),
    )
    # The agent forwards SIGTERM to the workers by itself; SIGUSR1 (SLURM's --signal) it must be
    # taught: raising SignalException here makes it send SIGUSR1 on to the workers and wait for them.
    def forward(signum: int, frame: Any) -> None:  # noqa: ARG001 - the signal module's signature
        raise SignalException(f"process {os.getpid()} got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    if not on_cuda and not program:
        for module in WORKER_IMPORTS:
            importlib.import_module(module)
    previous = signal.signal(signal.SIGUSR1, forward)
    continuer = ContinueStoppedWorkers()
    # The workers' own C++ log level: a forked worker would otherwise inherit the agent's, raised below.
    worker = entrypoint if program else functools.update_wrapper(
        functools.partial(run_then_leave, entrypoint, os.getpid(), cpp_log_level()), entrypoint)  # its name in logs
    for key, value in AGENT_ENV.items():  # the workers inherit the agent's environment
        os.environ.setdefault(key, value)
    if serves_the_ranks_store:  # every rank on this host: the collectives' sockets too on loopback (a user's choice wins)
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(key, loopback_interface())
    os.environ[REFUSAL_FILE] = str(Path(agent_dir.name) / "refused")
    try:
        with _agent_log_to(log_file), continuer, cpp_warnings_off(), restarts_said_on_the_console(max_restarts):
            try:
                elastic_launch(config, worker)(*args)
            except RendezvousConnectionError:
                log.error("the rendezvous store at %s stopped answering", nodes.endpoint, exc_info=True)  # launcher.log
                raise
    except RendezvousTimeoutError:
        raise LaunchError(rendezvous_timeout(nodes, timeout_s)) from None
    except RendezvousConnectionError:
        raise LaunchError(rendezvous_host_gone(nodes)) from None
    except Refused as exc:
        raise LaunchError(str(exc)) from None
    except node_left_exception():  # launch.leave_slow_node: its rank said so on the console
        return
    except SignalException as exc:
        if program:
            raise Stopped(f"stopped by {exc.sigval.name}, which went on to every rank of the script.") from None
        raise Stopped(f"stopped by {exc.sigval.name}: the workers were asked to write a snapshot at their next step "
                      f"boundary (workers still starting up stop without one); run the same command to resume.") from None
    except ChildFailedError as exc:
        if all(f.exitcode == EXIT_STOPPED for f in exc.failures.values()):  # the workers themselves were signalled
            raise Stopped(f"stopped by a signal to the workers, with a snapshot (exit code {EXIT_STOPPED}); "
                          f"run the same command to resume.") from None
        raise LaunchError(describe_failure(exc)) from None
    finally:
        signal.signal(signal.SIGUSR1, previous)
        forget_the_rendezvous()
        _restore_environment(kept)
        agent_dir.cleanup()


@contextlib.contextmanager
def restarts_said_on_the_console(max_restarts: int) -> Iterator[None]:
    """Within: before the agent starts its workers again after a failure, the console says which rank failed, why,
    and which attempt comes (restart_sentence). torch's agent logs only "N/M attempts left; will restart worker group"
    (to logs/launcher.log), and the console showed nothing but the restarted rank 0's `world size` line again. Not
    said where no restart follows: the last failure (the launch's LaunchError says it) and a worker's refusal that no
    restart changes (the launch ends with its sentence). A torch whose agent has no _monitor_workers says nothing."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    torchs = LocalElasticAgent.__dict__.get("_monitor_workers")
    if torchs is None:
        yield
        return

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = torchs(agent, worker_group)
        if result.state == WorkerState.FAILED and result.failures and all(
                f.exitcode == EXIT_LEFT for f in result.failures.values()):
            raise node_left_exception()("this node's workers left the run (launch.leave_slow_node)",
                                        sigval=signal.SIGTERM)
        restarts_left = getattr(agent, "_remaining_restarts", 0)  # the agent restarts while some are left
        if result.state == WorkerState.FAILED and result.failures and restarts_left > 0 and not _refused():
            attempt = max_restarts - restarts_left + 2  # the first start is attempt 1
            sentence = restart_sentence(_failure_naming_its_rank(result), attempt, max_restarts)
            log.warning("%s", sentence)  # logs/launcher.log too
            print(f"dptrain: {sentence}", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = torchs


@functools.cache
def node_left_exception() -> type[Exception]:
    """The exception the agent's monitor raises once this node's workers have left the run (exit code EXIT_LEFT,
    launch.leave_slow_node): a SignalException, because torch's launch_agent keeps the rendezvous open for the
    nodes that go on after one (any other exception closes it for good, and every node's agent would end)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    class NodeLeft(SignalException):
        pass

    return NodeLeft


def restart_sentence(failure: str, attempt: int, max_restarts: int) -> str:
    """The console's sentence for a restart: the failure (describe_failure's words) and the attempt that comes, the
    first start being attempt 1 of launch.max_restarts + 1."""
    return (f"{failure}; starting the workers again, attempt {attempt} of {max_restarts + 1} "
            f"(--launch.max_restarts {max_restarts}).")


def _failure_naming_its_rank(result: Any) -> str:
    """describe_failure's words, with the first failed rank named where its own message does not (a script's bare
    exception: "disk full"); ranks that stopped on a signal, with a snapshot, said so (not "exited with code 75")."""
    rank = min(result.failures.items(), key=lambda kv: kv[1].timestamp)[0]
    if all(f.exitcode == EXIT_STOPPED for f in result.failures.values()):  # a lost node's peers stop this way too
        return (f"rank {rank} stopped at a step boundary with a snapshot (exit code {EXIT_STOPPED}: a signal to it or "
                f"to another rank, or a slow node that leaves)")
    said = describe_failure(result)
    return said if said.startswith(f"rank {rank} ") else f"rank {rank} failed: {said}"


def _refused() -> bool:
    """Whether a worker left a refusal that no restart changes (note_refusal): the launch then ends instead."""
    path = os.environ.get(REFUSAL_FILE)
    return bool(path) and os.path.exists(path)


def _restore_environment(kept: dict[str, str]) -> None:
    """os.environ as it was (kept): a run in the caller's process, or a later launch, sees none of this one's."""
    for key in set(os.environ) - set(kept):
        del os.environ[key]
    os.environ.update(kept)


class ContinueStoppedWorkers:
    """Continue (SIGCONT) each of this agent's workers that is stopped (SIGSTOP, ^Z of one) while a SIGTERM waits for
    it.

    When a worker fails, torch's agent ends the others with SIGTERM, which a stopped process takes only once
    continued; torch then waited 30 s before its SIGKILL, so a run with a stopped rank ended its timeout + 30 s after
    the stop instead of within the timeout. A thread of the agent looks at its children four times a second (Linux's
    /proc; nothing happens where it has none). The pending SIGTERM, not a worker's end, says the agent is ending the
    group: a worker that failed within a quarter of a second of its start left no trace for the thread to see. A
    stopped worker that nobody asked to end (a debugger's, a ^Z the user will undo) is left stopped.
    """

    POLL_S = 0.25

    def __init__(self) -> None:
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="dptrain-continue-stopped", daemon=True)

    def __enter__(self) -> "ContinueStoppedWorkers":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.done.wait(self.POLL_S):
            for pid in _children():
                if _state(pid) == "T" and _sigterm_pending(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)


def _children() -> set[int]:
    """This process's child processes (of all its threads), from /proc; empty where there is none."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
    return pids


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits to be delivered to process pid (its status' pending-signal masks, bit 15 - 1)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return False
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


def _state(pid: int) -> str:
    """A process's state letter (T: stopped by a signal, t: stopped by a debugger, which is left alone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def run_then_leave(entrypoint: Callable[..., Any], agent_pid: int, cpp_level: int | None, *args: Any) -> Any:
    """A worker's life: entrypoint(*args), then the worker process skips Python's interpreter teardown.

    After a success that saves 0.6 s of freeing torch's objects (`python perf/micro.py`, teardown), which the
    agent, and so the user, would wait for; the exit hook runs first of all (the last one registered), once the
    agent has read the result, which it waits for before the worker may exit. After a failure, see leave_after_failure.
    """
    # A forked worker starts with the agent's signal handlers and C++ log level: give it a fresh interpreter's.
    for sig, handler in ((signal.SIGUSR1, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGINT, signal.default_int_handler)):
        signal.signal(sig, handler)
    if cpp_level is not None:
        cpp_log_level(cpp_level)
    os.environ[AGENT_PID] = str(agent_pid)  # this worker's own environment (dist.ending.agent_restarts_this_worker)
    stop_with_the_agent(agent_pid)
    try:
        result = entrypoint(*args)
    except Exception as exc:
        if no_restart_changes(exc):
            note_refusal(exc)
        leave_after_failure(exc)
    atexit.register(leave_now, 0)
    return result


def no_restart_changes(exc: BaseException) -> bool:
    """A failure that a restart would meet again, unchanged: the configuration, a snapshot or the data refused, or a
    loss that diverged (it resumes from the last snapshot and diverges again). With launch.max_restarts 100, every
    snapshot damaged was refused 101 times in 405 lines. A lost peer, a full disk or a crash still restarts."""
    from dptrain.train import Diverged  # train is a layer below; imported when a worker fails, not at start-up

    refusals = (ConfigError, SnapshotError, DataError, UnsafeFileError, Diverged)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, refusals):
            return True
        seen = seen.__cause__
    return False


def note_refusal(exc: BaseException) -> None:
    """Leave the refusal's sentence for the agent (the first rank's stays); nothing where no agent asked for it."""
    path = os.environ.get(REFUSAL_FILE)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "x") as f:  # "x": a second rank's does not replace the first's
        f.write(_first_line(str(exc)) or type(exc).__name__)


def leave_after_failure(exc: Exception) -> NoReturn:
    """A failed worker ends here, with exit code 1 and the error file torch's @record writes (whose first line the
    launcher reports; worker.rank_life has logged its traceback). Not through Python's unwinding: freeing a failed run's
    objects (its model, DDP's reducer, its process groups) can block for good while collectives towards a lost peer
    are still in flight. Seen after a cut link: rank 0 still in multiprocessing's _bootstrap, in C code, 30 s after its
    failure (dist.ending.exit_deadline ended it). Call it from the except block: the error file holds that traceback."""
    record_for_launcher(exc)
    leave_now(1)


def stop_with_the_agent(agent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the agent dies (kill -9 of `dptrain train`, say): the worker then stops at
    its next step boundary with a snapshot, as on any SIGTERM, instead of training on as an orphan that holds
    the run folder and the terminal. Linux only; elsewhere nothing changes. (A script's ranks ask the same, in
    launch/user_script_rank.py.)"""
    user_script_rank.stop_with(agent_pid, signal.SIGTERM)


AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing", "dptrain.launch")


@contextlib.contextmanager
def _agent_log_to(log_file: Path | None) -> Iterator[None]:
    """Send the elastic agent's log records to log_file (or nowhere) instead of the console."""
    handler: logging.Handler = logging.NullHandler()
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        from dptrain.worker import LogFile  # quiet on a full disk, as the ranks' own logs

        handler = LogFile(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = []
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.propagate = False  # torch's own console handler sits on the "torch" logger above these
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


def describe_failure(exc: Any) -> str:
    """The first failure's own message (they say 'rank R failed during PHASE: ...'), plus who else died. exc: torch's
    ChildFailedError, or its agent's RunResult of a failed round (both hold .failures)."""
    failures = sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp)  # {global rank: ProcessFailure}
    rank, first = failures[0]
    raw = first.message.get("message", "") if isinstance(first.message, dict) else first.message
    message = _first_line(raw) if isinstance(raw, str) else ""
    if first.exitcode < 0:  # killed by a signal: the agent's text names only a pid
        message = f"rank {rank} was killed by {first.signal_name()} (pid {first.pid})"
    elif not message or message.startswith("To enable traceback"):
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


def run_ranks(entrypoint: Callable[..., Any], args: tuple, cfg: RunConfig, world_size: int, launched_outside: bool,
              log_file: Path | None = None, nodes: Nodes | None = None) -> None:
    """Run `entrypoint(*args)` here when a launcher (torchrun, srun) started this process or one process suffices;
    else start this node's workers through the elastic agent (which restarts them, if asked), meeting the other
    nodes' agents where nodes says."""
    if launched_outside or (world_size == 1 and cfg.launch.max_restarts == 0):  # restarts need the agent
        entrypoint(*args)
        return
    per_node = world_size // (nodes.count if nodes else 1)
    on_cuda = wants_cuda(cfg.launch.device)
    if on_cuda:  # before the agent starts anything: nccl's own refusal comes once every worker has started
        import torch

        from dptrain.prestart import check_gpus_for_workers

        check_gpus_for_workers(cfg.launch.backend, per_node, torch.cuda.device_count())
    leaving = bool(cfg.launch.leave_slow_node) and nodes is not None and nodes.elastic
    if leaving:  # the workers' SlowNode: how few nodes the run may go on with (the agent's environment is theirs)
        os.environ[FEWEST_NODES_VAR] = str(nodes.fewest)
    try:
        launch_local(entrypoint, args, per_node, cfg.launch.timeout_s, cfg.launch.max_restarts, log_file, nodes,
                     on_cuda=on_cuda)
    finally:
        if leaving:
            os.environ.pop(FEWEST_NODES_VAR, None)


def world_size_here(cfg: RunConfig, nodes: Nodes | None = None) -> tuple[int, bool]:
    """(the world size, whether a launcher outside dptrain started this process)."""
    if nodes is not None:  # dptrain's agent starts the ranks, even inside an srun task (one agent per node)
        return nodes.count * local_workers(cfg.launch, cfg.strategy), False
    env = DistEnv.from_environ()
    launched_outside = env.source != "none"
    return (env.world_size if launched_outside else local_workers(cfg.launch, cfg.strategy)), launched_outside
