"""describe_failure on torch's own failure objects, built here: the launcher's one sentence for a failed run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from dptrain.distributed.failures import WorkerFailure
from dptrain.launch.local import describe_failure


def error_file(tmp_path: Path, name: str, exc: BaseException, monkeypatch, timestamp: int | None = None) -> str:
    """The file torch's ErrorHandler writes for a worker that raised exc (as @record does), at `timestamp` if given."""
    path = tmp_path / f"{name}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise exc
    except type(exc) as raised:
        ErrorHandler().record_exception(raised)
    if timestamp is not None:
        data = json.loads(path.read_text())
        data["message"]["extraInfo"]["timestamp"] = str(timestamp)
        path.write_text(json.dumps(data))
    return str(path)


def failed(**failures: ProcessFailure) -> ChildFailedError:
    """ChildFailedError of failures by global rank, given as rank0=..., rank1=..."""
    return ChildFailedError("dptrain", {int(key.removeprefix("rank")): f for key, f in failures.items()})


def test_a_workers_own_error_is_its_first_line_without_the_exception_type(tmp_path, monkeypatch):
    exc = WorkerFailure("rank 1 failed during step 3: injected failure\nmore detail on the next line")
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=error_file(tmp_path, "r1", exc, monkeypatch))
    assert describe_failure(failed(rank1=failure)) == "rank 1 failed during step 3: injected failure"


def test_a_dotted_exception_type_is_dropped_and_a_colon_in_the_text_kept(tmp_path, monkeypatch):
    class DistBackendError(RuntimeError):
        pass

    DistBackendError.__name__ = "torch.distributed.DistBackendError"  # a qualified type name, whose dots _first_line allows
    exc = DistBackendError("NCCL error: unhandled system error")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=error_file(tmp_path, "r0", exc, monkeypatch))
    assert describe_failure(failed(rank0=failure)) == "NCCL error: unhandled system error"


def test_an_exit_without_error_file_says_the_code(tmp_path):
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=3, error_file=str(tmp_path / "none.json"))
    assert failure.message.startswith("To enable traceback")  # torch's placeholder, not shown
    assert describe_failure(failed(rank1=failure)) == "rank 1 exited with code 3"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_killed_worker_is_named_with_the_signal_and_its_pid(tmp_path, sig):
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-sig, error_file=str(tmp_path / "none.json"))
    assert describe_failure(failed(rank1=failure)) == f"rank 1 was killed by {sig.name} (pid 4242)"


def test_a_killed_worker_is_named_even_when_it_left_an_error_file(tmp_path, monkeypatch):
    """The signal is the cause: an error file from earlier (a caught exception, say) does not win over it."""
    path = error_file(tmp_path, "r2", WorkerFailure("rank 2 failed during step 1: earlier"), monkeypatch)
    failure = ProcessFailure(local_rank=0, pid=77, exitcode=-signal.SIGKILL, error_file=path)
    assert describe_failure(failed(rank2=failure)) == "rank 2 was killed by SIGKILL (pid 77)"


def test_the_first_failure_speaks_and_the_others_are_listed(tmp_path, monkeypatch):
    """Sorted by time, not by rank: rank 2 failed first (its error file's time), ranks 0 and 1 stopped after it."""
    first = error_file(tmp_path, "r2", WorkerFailure("rank 2 failed during step 5: out of memory"), monkeypatch,
                       timestamp=1_000)
    failures = failed(
        rank0=ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(tmp_path / "none.json")),
        rank1=ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none.json")),
        rank2=ProcessFailure(local_rank=2, pid=12, exitcode=1, error_file=first),
    )
    assert describe_failure(failures) == "rank 2 failed during step 5: out of memory (ranks 0, 1 also stopped)"


def test_one_other_failure_is_named_in_the_singular(tmp_path, monkeypatch):
    first = error_file(tmp_path, "r0", WorkerFailure("rank 0 failed during rendezvous: boom"), monkeypatch, timestamp=1_000)
    failures = failed(rank1=ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(tmp_path / "none.json")),
                      rank0=ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=first))
    assert describe_failure(failures) == "rank 0 failed during rendezvous: boom (rank 1 also stopped)"


STORE_SERVER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(120)
"""


def test_a_roll_call_on_a_store_whose_host_is_stopped_names_rank_0_within_its_bound(tmp_path):
    """A store served by a process stopped with SIGSTOP keeps its connection open and never answers: c10d's timeout
    did not bound check(), and a survivor's roll call waited there for minutes (seen in the randomised hang trials)."""
    import datetime
    import os
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from dptrain.distributed.env import DistEnv
    from dptrain.distributed.failures import roll_call
    from dptrain.distributed.hangs import Unanswered, within

    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        env = DistEnv(1, 1, 2, 2, "127.0.0.1", port, "torchrun")
        assert roll_call(store, env, 0.5) == [0]  # rank 0 never checks in: named, the store answering
        os.kill(server.pid, signal.SIGSTOP)
        began = time.monotonic()
        assert roll_call(store, env, 0.5) == [0]
        assert time.monotonic() - began < 5  # its bound is 0.5 s + 1 s
        with pytest.raises(Unanswered):
            within(lambda: store.check(["anything"]), 0.3)
    finally:
        server.kill()
        server.wait()
    assert within(lambda: 3, 1.0) == 3
    with pytest.raises(KeyError):
        within(lambda: {}["missing"], 1.0)
