"""A failed rank whose teardown never ends still leaves, with the run's one sentence and its stacks in its log."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

import pytest

from dptrain.distributed.ending import exit_deadline, lift_exit_deadline
from tests.conftest import REPO

# Two local workers through dptrain's agent; each fails in "step 3", then its teardown (leaving the process group)
# hangs for an hour, as one waiting on a peer that is gone may. The deadline is 2 s here (30 s in a run).
HANGING_TEARDOWN = """
import functools, sys, time
from pathlib import Path
from dptrain import config, worker
from dptrain.distributed import ending
from dptrain.errors import LaunchError
from dptrain.launch.local import launch_local

run_dir = Path(sys.argv[1])

def teardown_that_hangs():
    time.sleep(3600)

worker.destroy_process_group = teardown_that_hangs
worker.exit_deadline = functools.partial(ending.exit_deadline, seconds=2)

def failing_rank(tree):
    with worker.rank_life(config.from_dict(tree), run_dir) as (env, phase, device, threads):
        with phase("step 3"):
            raise RuntimeError("injected failure")

start = time.monotonic()
try:
    launch_local(failing_rank, ({"output": {"dir": str(run_dir)}},), 2, timeout_s=30, log_file=run_dir / "logs" / "launcher.log",
                 on_cuda=False)
except LaunchError as exc:
    print(round(time.monotonic() - start, 1))
    print(exc)
"""


@pytest.mark.slow
def test_a_failed_rank_whose_teardown_hangs_leaves_by_its_deadline(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", HANGING_TEARDOWN, str(run_dir)], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    took, message = done.stdout.split("\n")[:2]
    # start-up (a few seconds), the failure, then 2 s of teardown; without the deadline: the hour of the sleep
    assert float(took) < 30, took
    # the error file was written before the teardown: the launcher still says what failed, not just an exit code
    assert re.fullmatch(r"rank [01] failed during step 3: injected failure( \(rank [01] also stopped\))?", message), message
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} failed during step 3: injected failure" in log
        # faulthandler's dump: where the rank was stuck when it was ended
        assert "Timeout (0:00:02)!" in log and "in teardown_that_hangs" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("to_log_file", [True, False])
def test_a_lifted_deadline_never_ends_the_process(tmp_path, monkeypatch, to_log_file):
    """A caller that lives on after a failed run (tests call the CLI in-process) takes the deadline back; without a
    log file the stacks would go to stderr, also where that is captured (no file descriptor)."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    try:
        raise RuntimeError("a failed run")
    except RuntimeError as exc:
        exit_deadline(exc, tmp_path / "rank0.log" if to_log_file else None, seconds=0.5)
    lift_exit_deadline()
    time.sleep(1.0)  # past the deadline: this process, pytest's, is still here
    assert not to_log_file or not (tmp_path / "rank0.log").read_text()


@pytest.mark.parametrize("agent, restart_count, max_restarts, restarts", [
    ("parent", "0", "2", True),  # an elastic run that lost a node: the agent goes on, and says so
    ("parent", "2", "2", False),  # no restart left: the run ends here
    ("other", "0", "2", False),  # the agent is gone (the worker's parent is another process now)
    (None, "0", "2", False),  # torchrun's worker, or srun's: no agent of dptrain's to speak for the stop
])
def test_a_worker_knows_whether_its_agent_restarts_it(monkeypatch, agent, restart_count, max_restarts, restarts):
    import os

    from dptrain.distributed.ending import AGENT_PID, agent_restarts_this_worker

    if agent is None:
        monkeypatch.delenv(AGENT_PID, raising=False)
    else:
        monkeypatch.setenv(AGENT_PID, str(os.getppid() if agent == "parent" else os.getppid() + 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
    assert agent_restarts_this_worker() is restarts
