"""Elastic membership (--nnodes MIN:MAX): one of two nodes' agents dies and the run goes on with the node left, at the
smaller world size, from its last snapshot, with the same math."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from dptrain.dist.env import Nodes, node_range
from dptrain.errors import ConfigError, LaunchError
from dptrain.faults import SIGNAL_AT
from dptrain.launch.rendezvous import KEEP_ALIVE_ENV, LAST_CALL_ENV, seconds_from_env
from tests.conftest import FLOAT64_ENV, assert_trained_alike, log_tail, read_events, run_cli
from tests.distributed import free_port
from tests.launch.test_multinode import MULTINODE


def start_agent(node_rank: int, port: int, run_dir, cwd, extra_env: dict[str, str]) -> subprocess.Popen:
    """This machine as node NODE_RANK of a --nnodes 1:2 run whose rendezvous is on loopback, one worker."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **FLOAT64_ENV, **extra_env}
    argv = [sys.executable, "-m", "dptrain", *MULTINODE, "--output.dir", str(run_dir), "--checkpoint.every_steps", "4",
            "--launch.max_restarts", "2", "--nproc-per-node", "1", "--nnodes", "1:2", "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_a_lost_node_leaves_the_run_going_on_smaller_from_its_last_snapshot_with_the_same_math(planned_run, tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    # After its step 5 (a snapshot of step 4 is whole), rank 1 kills its own agent: node 1 is lost, agent and worker.
    lose_node_1 = {SIGNAL_AT: f"1:5:SIGKILL:parent:{tmp_path / 'struck'}",
                   # noticed after 3 missed beats of 1 s, the rendezvous then waiting 2 s more (defaults: 6 s and 10 s)
                   KEEP_ALIVE_ENV: "1", LAST_CALL_ENV: "2"}
    agents = [start_agent(rank, port, run_dir, tmp_path, lose_node_1) for rank in (0, 1)]
    try:
        out0, err0 = agents[0].communicate(timeout=150)
        agents[1].communicate(timeout=30)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    assert agents[1].returncode == -signal.SIGKILL
    assert agents[0].returncode == 0, (err0[-2000:], log_tail(run_dir))

    starts = read_events(run_dir, "run_start")
    assert [s["world_size"] for s in starts] == [2, 1], starts  # two ranks, then the one left
    resumed = (run_dir / "logs" / "rank0.log").read_text()
    assert "resharding snapshot" in resumed and "from world size 2 to 1" in resumed, resumed[-2000:]

    # The same math as two ranks all along (tests/launch/test_multinode.py's one-host run, float64): each step's loss
    # (as last computed: steps 5 and after ran again from the snapshot) and the final weights.
    assert_trained_alike(run_dir, planned_run("multinode/one-host", 2), steps=8)


def test_the_node_range_reads_as_torchrun_writes_it():
    assert node_range("2") == (2, 2) and node_range(3) == (3, 3) and node_range(None) == (None, None)
    assert node_range("1:4") == (1, 4)
    nodes = Nodes.from_options("1:2", 1, "127.0.0.1", 29500, None, {})
    assert (nodes.fewest, nodes.count, nodes.elastic, nodes.spelled) == (1, 2, True, "1:2")
    fixed = Nodes.from_options("2", 1, "127.0.0.1", 29500, None, {})
    assert (fixed.fewest, fixed.elastic, fixed.spelled) == (2, False, "2")


@pytest.mark.parametrize("nnodes, sentence", [
    ("two", "--nnodes 'two' is not a node count; write N (e.g. 2) or MIN:MAX"),
    ("1:", "--nnodes '1:' is not a node count"),
    ("3:2", "--nnodes 3:2 needs 1 <= MIN <= MAX"),
    ("0:2", "--nnodes 0:2 needs 1 <= MIN <= MAX"),
])
def test_a_bad_node_range_is_one_sentence(nnodes, sentence):
    with pytest.raises(LaunchError) as refused:
        node_range(nnodes)
    assert sentence in str(refused.value) and len(str(refused.value).splitlines()) == 1


ELASTIC = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--nnodes", "1:2",
           "--node-rank", "0", "--master-addr", "127.0.0.1", "--dry-run"]


@pytest.mark.parametrize("extra, sentence", [
    ([], "--nnodes 1:2 goes on after losing a node by restarting the workers of the nodes left, from the last snapshot; "
         "give --launch.max_restarts 3"),
    (["--launch.max_restarts", "3", "--train.batch_size_per_rank", "16"],
     "train.batch_size_per_rank would change the global batch (and so the math) each time a node leaves a --nnodes 1:2 "
     "run; give train.global_batch_size instead."),
    # 3 splits over the 3 ranks of 3 nodes, not over the 2 left after losing one
    (["--launch.max_restarts", "3", "--nnodes", "1:3", "--nproc-per-node", "1", "--train.global_batch_size", "3"],
     "train.global_batch_size 3 is not divisible by the world size 2"),
])
def test_an_elastic_run_is_refused_before_start_where_it_could_not_go_on(tmp_path, extra, sentence):
    done = run_cli([*ELASTIC, "--output.dir", str(tmp_path / "run"), *extra], tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    assert sentence in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()


def test_an_elastic_dry_run_says_how_small_the_run_may_get(tmp_path):
    done = run_cli([*ELASTIC, "--launch.max_restarts", "2", "--nproc-per-node", "2", "--output.dir", str(tmp_path / "run")],
                   tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("4 ranks, 2 local workers on each of 2 nodes (this is node 0); it goes on with 2 ranks on 1 nodes or more "
            "after losing nodes") in done.stdout


def test_deepspeed_cannot_run_elastic():
    from dptrain import config
    from dptrain.prestart import check_elastic

    cfg = config.load(None, [("strategy.name", "deepspeed"), ("launch.max_restarts", "2"), ("data.name", "synthetic")])
    with pytest.raises(ConfigError, match="strategy deepspeed's snapshots resume on as many processes only"):
        check_elastic(cfg, 1, 2, 1)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan"])
def test_a_rendezvous_time_from_the_environment_that_is_no_positive_number_is_one_sentence(monkeypatch, value):
    monkeypatch.setenv(LAST_CALL_ENV, value)
    with pytest.raises(LaunchError, match=f"^{LAST_CALL_ENV}='{value}' is not a number of seconds above 0; .*unset it "
                                          f"for 10\\.$"):
        seconds_from_env(LAST_CALL_ENV, 10)
    monkeypatch.setenv(LAST_CALL_ENV, " 2.5 ")
    assert seconds_from_env(LAST_CALL_ENV, 10) == 2.5
    monkeypatch.delenv(LAST_CALL_ENV)
    assert seconds_from_env(LAST_CALL_ENV, 10) == 10
