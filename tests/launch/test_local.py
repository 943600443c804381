"""The local launcher: every socket of a local run (agent, rank 0's store, gloo) listens on loopback only."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

import pytest

from dptrain.distributed.store import listening_store
from tests.conftest import start_cli


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every listening TCP socket on this host (IPv4 and IPv6)."""
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":  # LISTEN
                continue
            host_hex = address.split(":")[0]
            raw = bytes.fromhex(host_hex)
            # /proc writes each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
            out[inode] = str(ipaddress.ip_address(words))
    return out


def _tree(pid: int) -> list[int]:
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for child in Path(f"/proc/{parent}/task").glob("*/children"):
            for token in child.read_text().split():
                pids.append(int(token))
                frontier.append(int(token))
    return pids


def _listening_addresses(pids: list[int]) -> dict[int, set[str]]:
    """pid -> addresses its listening sockets are bound to."""
    listening = _listening_inodes()
    found: dict[int, set[str]] = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, PermissionError):
            continue
        for link in links:
            if link.startswith("socket:["):
                inode = int(link[8:-1])
                if inode in listening:
                    found.setdefault(pid, set()).add(listening[inode])
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket tables of Linux's /proc")
def test_a_local_run_listens_on_loopback_only(tmp_path):
    proc = start_cli(["train", "--nproc-per-node", "2", "--data.name", "synthetic", "--train.epochs", "3",
                      "--output.dir", str(tmp_path / "run"), "--checkpoint.every_epochs", "0"], tmp_path)
    seen: dict[int, set[str]] = {}
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            for pid, addresses in _listening_addresses(_tree(proc.pid)).items():
                seen.setdefault(pid, set()).update(addresses)
            if len(seen) >= 3:  # the agent and both workers listen
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert len(seen) >= 3, f"expected the agent and two workers to listen, saw {seen}"
    addresses = set().union(*seen.values())
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses), seen


def test_a_store_for_a_master_address_that_is_not_this_host_is_one_sentence():
    from dptrain.errors import LaunchError

    with pytest.raises(LaunchError, match=r"rank 0 cannot listen on 192\.0\.2\.1:\d+ .*MASTER_ADDR must be an address of rank 0's host"):
        listening_store("192.0.2.1", 0, 5)  # TEST-NET-1: never an address of this host


def test_a_taken_port_is_one_sentence():
    import socket

    from dptrain.errors import LaunchError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is taken by another program; choose another MASTER_PORT."):
            listening_store("127.0.0.1", port, 5)


def test_auto_workers_are_one_per_gpu_or_one_on_the_cpu():
    from dptrain.config import LaunchConfig
    from dptrain.prestart import local_workers

    assert local_workers(LaunchConfig(nproc_per_node="auto", device="cpu")) == 1
    assert local_workers(LaunchConfig(nproc_per_node=3, device="cpu")) == 3  # a number always wins
    import torch

    expected = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert local_workers(LaunchConfig(nproc_per_node="auto", device="auto")) == max(1, expected)


def test_backend_choice(capsys):
    import torch

    from dptrain.cli import main
    from dptrain.distributed.world import pick_backend

    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"
    if not torch.cuda.is_available():
        assert main(["train", "--data.name", "synthetic", "--launch.backend", "nccl"]) == 2
        assert capsys.readouterr().err == ("dptrain: error: launch.backend = nccl needs CUDA devices, and this run would "
                                           "use the CPU; use --launch.backend gloo or auto.\n")


@pytest.mark.slow
def test_workers_whose_agent_is_killed_stop_with_a_snapshot_instead_of_training_on(tmp_path):
    import signal

    run = tmp_path / "run"
    proc = start_cli(["train", "--nproc-per-node", "2", "--data.name", "synthetic", "--data.synthetic_train_size", "40000",
                      "--train.epochs", "3", "--output.dir", str(run), "--checkpoint.every_epochs", "0"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        events = run / "metrics.jsonl"
        while not (events.exists() and '"run_start"' in events.read_text()) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)  # run_start: both workers are training
        workers = _tree(proc.pid)[1:]
        assert len(workers) >= 2 and proc.poll() is None, "the run did not start training"
        os.kill(proc.pid, signal.SIGKILL)  # the agent, as kill -9 or an OOM killer would end it
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers):
            assert time.monotonic() < deadline, "the workers trained on without their agent"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    log = (run / "logs" / "rank0.log").read_text()
    assert "stopped by SIGTERM after step" in log  # the next step boundary, with a snapshot of it
    assert any(p.name.startswith("step-") for p in (run / "checkpoints").iterdir())


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def _stop_rank_1_fail_rank_0(folder: str) -> None:
    """Rank 1 stops itself; rank 0 fails once it has seen rank 1 stopped (else it fails saying so, and the test with
    it: the scenario never happened)."""
    import signal

    pid_file = Path(folder) / "rank1.pid"
    if os.environ["RANK"] == "1":
        pid_file.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # as a ^Z, a debugger's attach or a frozen node would
        raise RuntimeError("rank 1 was continued")
    deadline = time.monotonic() + 20
    while not (pid_file.is_file() and pid_file.read_text() and _stopped(int(pid_file.read_text()))):
        if time.monotonic() > deadline:
            raise RuntimeError("rank 1 never stopped")
        time.sleep(0.05)
    raise RuntimeError("rank 0 gives up")


def _stopped(pid: int) -> bool:
    """Whether process pid is stopped by a signal (state T)."""
    return _state(pid).strip().startswith("t (stopped)")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stopped_worker_does_not_hold_the_failed_run_for_torchs_30_s_grace(tmp_path):
    # The agent ends the others with SIGTERM, which a stopped process takes only once continued: torch waited 30 s
    # before its SIGKILL, so the run ended its timeout + 30 s after the stop.
    from dptrain.errors import LaunchError
    from dptrain.launch.local import launch_local

    started = time.monotonic()
    with pytest.raises(LaunchError) as failed:
        launch_local(_stop_rank_1_fail_rank_0, (str(tmp_path),), nproc_per_node=2, timeout_s=10, log_file=tmp_path / "launcher.log", on_cuda=False)
    assert "rank 0 gives up" in str(failed.value)
    assert time.monotonic() - started < 20  # the grace it waited was 30 s; this run takes about 1 s


def _fail_counting_attempts(tally: str, refuse: bool) -> None:
    from dptrain.errors import SnapshotError
    from dptrain.distributed.failures import WorkerFailure

    if os.environ["RANK"] == "0":
        with open(tally, "a") as f:
            f.write("attempt\n")
        if refuse:
            raise WorkerFailure("rank 0 failed during resume: no snapshot can be used") from SnapshotError("damaged")
        raise RuntimeError("rank 0 crashed")  # what a restart is for


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("refuse, attempts", [(True, 1), (False, 3)])
def test_a_refusal_no_restart_can_change_is_not_restarted(tmp_path, capsys, refuse, attempts):
    # Every snapshot damaged was refused once per launch.max_restarts: 101 attempts and 405 lines at 100 restarts.
    from dptrain.errors import LaunchError
    from dptrain.launch.local import launch_local

    tally = tmp_path / "attempts"
    with pytest.raises(LaunchError) as failed:
        launch_local(_fail_counting_attempts, (str(tally), refuse), nproc_per_node=2, timeout_s=10, max_restarts=2,
                     log_file=tmp_path / "launcher.log", on_cuda=False)
    assert tally.read_text().count("attempt") == attempts
    restarts = [line for line in capsys.readouterr().err.splitlines() if "starting the workers again" in line]
    # a refusal ends the launch with its sentence and says no restart; a crash says each restart, not the last failure
    assert restarts == ([] if refuse else [f"dptrain: rank 0 crashed; starting the workers again, attempt {n} of 3 "
                                           f"(--launch.max_restarts 2)." for n in (2, 3)])
    assert str(failed.value) == ("rank 0 failed during resume: no snapshot can be used" if refuse else "rank 0 crashed")


def _rank_1_fails_then_is_killed_then_succeeds() -> None:
    import signal

    if os.environ["RANK"] == "1":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0:
            raise RuntimeError("disk full")
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_restart_says_on_the_console_which_rank_failed_why_and_which_attempt_comes(tmp_path, capsys):
    # The console showed only the restarted rank 0's `world size 2` line again; the agent's own words
    # ("3/3 attempts left; will restart worker group") went to logs/launcher.log.
    from dptrain.launch.local import launch_local

    log = tmp_path / "launcher.log"
    launch_local(_rank_1_fails_then_is_killed_then_succeeds, (), nproc_per_node=2, timeout_s=10, max_restarts=3,
                 log_file=log, on_cuda=False)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dptrain: ")]
    assert said[0] == "dptrain: rank 1 failed: disk full; starting the workers again, attempt 2 of 4 (--launch.max_restarts 3)."
    assert said[1].startswith("dptrain: rank 1 was killed by SIGKILL (pid ")
    assert said[1].endswith("); starting the workers again, attempt 3 of 4 (--launch.max_restarts 3).")
    assert len(said) == 2, said  # the third attempt succeeded: nothing more
    assert "rank 1 failed: disk full; starting the workers again, attempt 2 of 4" in log.read_text()  # the run's logs keep it too


def test_a_restart_after_ranks_that_stopped_with_a_snapshot_says_so_not_their_exit_code(tmp_path):
    # A lost node's peers stop at a step boundary with a snapshot (exit code 75): "rank 0 exited with code 75" said
    # nothing a user could read.
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dptrain.launch.local import _failure_naming_its_rank, restart_sentence
    from dptrain.stopping import EXIT_STOPPED

    stopped = RunResult(state=WorkerState.FAILED, failures={
        0: ProcessFailure(local_rank=0, pid=11, exitcode=EXIT_STOPPED, error_file=str(tmp_path / "none.json"))})
    assert restart_sentence(_failure_naming_its_rank(stopped), 2, 2) == (
        "rank 0 stopped at a step boundary with a snapshot (exit code 75: a signal to it or to another rank, or a slow "
        "node that leaves); starting the workers again, attempt 2 of 3 (--launch.max_restarts 2).")


class _HostGone:
    """A rendezvous whose store, on node 0, stops answering (node 0 is gone): what node 1's agent meets then."""

    def __init__(self, params, cpp_levels: list) -> None:
        self.params, self.cpp_levels = params, cpp_levels

    def get_backend(self) -> str:
        from dptrain.launch.rendezvous import RENDEZVOUS

        return RENDEZVOUS

    def get_run_id(self) -> str:
        return self.params.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        from dptrain.distributed.failures import cpp_log_level

        self.cpp_levels.append(cpp_log_level())
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as exc:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from exc

    def shutdown(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0


def test_a_rendezvous_host_that_is_gone_is_one_sentence_with_the_details_in_the_launcher_log(tmp_path, monkeypatch):
    # Node 1, after node 0's agent was killed: 92-100 lines of C++ frames and a RendezvousConnectionError traceback.
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from dptrain.distributed.env import Nodes
    from dptrain.distributed.failures import cpp_log_level
    from dptrain.errors import LaunchError
    from dptrain.launch import local
    from dptrain.launch.rendezvous import RENDEZVOUS

    seen: list[int | None] = []
    monkeypatch.setattr(local, "register_rendezvous", lambda: None)
    monkeypatch.setitem(rendezvous_handler_registry._registry, RENDEZVOUS, lambda params: _HostGone(params, seen))
    before = cpp_log_level()
    log = tmp_path / "logs" / "launcher.log"
    node_1 = Nodes(count=2, rank=1, host="127.0.0.1", port=29500, min_count=1)
    with pytest.raises(LaunchError) as failed:
        local.launch_local(print, (), nproc_per_node=1, timeout_s=60, max_restarts=1, log_file=log, nodes=node_1,
                           on_cuda=False)
    assert str(failed.value) == (
        "node 0, which hosts the run's rendezvous at 127.0.0.1:29500, is gone (its `dptrain train` ended, or its host "
        "or the network failed) and the run cannot go on without it; run the same command again on every node, node 0 "
        "included, to resume from the last snapshot.")
    details = log.read_text()
    assert "the rendezvous store at 127.0.0.1:29500 stopped answering" in details
    assert "ConnectionResetError: Connection reset by peer" in details and "RendezvousConnectionError" in details
    if before is not None:  # the agent's C++ warnings (its store's frames) were off, and are back as they were
        assert seen and all(level >= 2 for level in seen) and cpp_log_level() == before


def _what_a_worker_sees(out: str) -> None:
    import json

    from dptrain.distributed.ending import AGENT_PID
    from dptrain.distributed.failures import cpp_log_level
    from dptrain.launch.rendezvous import REFUSAL_FILE

    Path(out).write_text(json.dumps({"cpp_level": cpp_log_level(), "agent_pid": os.environ.get(AGENT_PID),
                                     "parent": os.getppid(), "refusal_file": REFUSAL_FILE in os.environ,
                                     "own_store": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_launch_leaves_the_callers_environment_as_it_was_and_the_workers_their_cpp_warnings(tmp_path, monkeypatch):
    import json

    from dptrain.distributed.failures import cpp_log_level
    from dptrain.launch.local import AGENT_ENV, launch_local
    from dptrain.launch.rendezvous import REFUSAL_FILE

    for key in (*AGENT_ENV, REFUSAL_FILE):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    out = tmp_path / "seen.json"
    launch_local(_what_a_worker_sees, (str(out),), nproc_per_node=1, timeout_s=10, max_restarts=1,
                 log_file=tmp_path / "launcher.log", on_cuda=False)
    assert dict(os.environ) == before  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE stayed set in the caller
    seen = json.loads(out.read_text())
    assert seen["refusal_file"] and seen["own_store"] == "1"  # the workers had them
    assert seen["agent_pid"] == str(seen["parent"])  # dist.ending.agent_restarts_this_worker reads it
    assert seen["cpp_level"] == cpp_log_level()  # not the agent's, raised while it runs
