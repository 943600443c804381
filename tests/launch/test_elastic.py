"""Elastic membership (--nnodes MIN:MAX): one of two nodes' agents dies and the run goes on with the node left, at the
smaller world size, from its last snapshot, with the same math."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from dptrain.distributed.env import Nodes, node_range
from dptrain.errors import ConfigError
from dptrain.faults import SIGNAL_AT
from dptrain.launch.rendezvous import (KEEP_ALIVE_ENV, LAST_CALL_ENV, NodeInOrder, RefusalAware, nodes_lost,
                                       rendezvous_times, seconds_from_env)
from tests.conftest import FLOAT64_ENV, assert_trained_alike, log_tail, read_events
from tests.ranks import free_port
from tests.launch.test_multinode import MULTINODE


def start_agent(node_rank: int, port: int, run_dir, cwd, extra_env: dict[str, str]) -> subprocess.Popen:
    """This machine as node NODE_RANK of a --nnodes 1:2 run whose rendezvous is on loopback, one worker."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **FLOAT64_ENV, **extra_env}
    argv = [sys.executable, "-m", "dptrain", *MULTINODE, "--output.dir", str(run_dir), "--checkpoint.every_steps", "4",
            "--launch.max_restarts", "2", "--nproc-per-node", "1", "--nnodes", "1:2", "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.nightly  # 12 s; the default run keeps the elastic refusals and a worker killed and restarted
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
    # Node 0's console says which node went and how the run goes on (it said "stopped ... run the same command").
    assert ("dptrain: node 1 left the run (its `dptrain train` ended, or its host stopped answering); the run goes on "
            "with 1 node (node 0; 1 rank) from its last snapshot.") in err0.splitlines(), err0
    assert "run the same command" not in out0 + err0, (out0, err0)
    # and which of its ranks ended, how, and which attempt comes (it showed only a second `world size` line); the
    # rank stops on its peers' signal, with a snapshot, or fails on the lost peer: either way it is named
    restarts = [line for line in err0.splitlines() if "starting the workers again" in line]
    assert len(restarts) == 1 and restarts[0].startswith("dptrain: rank 0 ") and restarts[0].endswith(
        "; starting the workers again, attempt 2 of 3 (--launch.max_restarts 2)."), err0

    starts = read_events(run_dir, "run_start")
    assert [s["world_size"] for s in starts] == [2, 1], starts  # two ranks, then the one left
    resumed = (run_dir / "logs" / "rank0.log").read_text()
    assert "resharding snapshot" in resumed and "from world size 2 to 1" in resumed, resumed[-2000:]

    # The same math as two ranks all along (tests/launch/test_multinode.py's one-host run, float64): each step's loss
    # (as last computed: steps 5 and after ran again from the snapshot) and the final weights.
    assert_trained_alike(run_dir, planned_run("multinode/one-host", 2), steps=8)


SLOW_NODE_RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "640", "--data.synthetic_test_size",
                 "64", "--train.global_batch_size", "32", "--train.epochs", "3", "--train.log_every", "10",
                 "--launch.max_restarts", "1", "--launch.leave_slow_node", "1", "--nproc-per-node", "1",
                 "--nnodes", "1:2"]


@pytest.mark.nightly  # about 25 s; the default run keeps SlowNode's rule and the option's refusals
@pytest.mark.timeout(240)
def test_a_node_that_stays_slow_leaves_and_the_run_goes_on_without_it(tmp_path):
    """Node 1's rank computes twice its share (DPTRAIN_TEST_SLOW, real busy work): epoch 1 names it, and with
    launch.leave_slow_node 1 node 1 leaves after a snapshot of epoch 1's end; node 0 goes on alone to epoch 3."""
    run_dir, port = tmp_path / "run", free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DPTRAIN_TEST_SLOW": "1:1.0", KEEP_ALIVE_ENV: "1", LAST_CALL_ENV: "2"}
    agents = [subprocess.Popen([sys.executable, "-m", "dptrain", *SLOW_NODE_RUN, "--output.dir", str(run_dir),
                                "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True) for rank in (0, 1)]
    try:
        _, err1 = agents[1].communicate(timeout=150)
        _, err0 = agents[0].communicate(timeout=150)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    assert agents[1].returncode == 0, (err1[-2000:], log_tail(run_dir))
    assert agents[0].returncode == 0, (err0[-2000:], log_tail(run_dir))
    [epoch1, *later] = read_events(run_dir, "epoch")
    assert epoch1["straggler_rank"] == 1 and [e["epoch"] for e in later] == [2, 3]
    assert all("straggler_rank" not in e for e in later)  # one rank left: nobody to compare with
    step = epoch1["step"]
    said = [line for line in err1.splitlines() if line.startswith("dptrain: node 1 (")]
    assert said == [f"dptrain: node 1 ({epoch1['straggler_host']}) leaves the run: one of its ranks was the slowest, "
                    f"more than 20% above the others, 1 epoch in a row (launch.leave_slow_node 1); the other nodes go "
                    f"on without it from the snapshot of step {step}."], err1
    assert "node 1 left the run" in err0 and "the run goes on with 1 node" in err0, err0
    assert [s["world_size"] for s in read_events(run_dir, "run_start")] == [2, 1]
    [stopped] = read_events(run_dir, "stopped")
    assert stopped["step"] == step and "leaves the run" in stopped["message"]
    assert f"checkpoints/step-{step:08d} at step {step} (epoch 2, 0 batches into it)" in (
        run_dir / "logs" / "rank0.log").read_text()  # node 0 resumed from the snapshot of the leave
    assert (run_dir / "model.pt").is_file()
    assert read_events(run_dir, "run_end")[-1]["step"] == 3 * 20


@pytest.mark.parametrize("options, says", [
    ([], "launch.leave_slow_node = 2 needs a run that may go on with fewer nodes, and this one has no --nnodes; give "
         "--nnodes MIN:MAX with MIN below MAX (dptrain train on each node), or set launch.leave_slow_node 0."),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
     "launch.leave_slow_node = 2 needs a run that may go on with fewer nodes, and this one has --nnodes 2; give"),
    (["--nnodes", "1:2", "--master-addr", "127.0.0.1", "--launch.max_restarts", "1", "--launch.watch", "false"],
     "launch.leave_slow_node = 2 needs launch.watch true: the ranks' own clocks name the slow node; set launch.watch "
     "true, or launch.leave_slow_node 0."),
])
def test_leaving_a_slow_node_is_refused_in_one_sentence_where_the_run_cannot_go_on_without_it(options, says, capsys):
    from dptrain.cli import main

    assert main(["train", "--dry-run", "--data.name", "synthetic", "--launch.leave_slow_node", "2", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dptrain: error: {says}") and len(err.strip().splitlines()) == 1, err


def test_leaving_a_slow_node_is_refused_for_a_script_of_the_users(tmp_path, monkeypatch, capsys):
    from dptrain.cli import main

    (tmp_path / "train.py").write_text("print('never run')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--launch.leave_slow_node", "1", "--", "train.py"]) == 2
    assert capsys.readouterr().err == ("dptrain: error: launch.leave_slow_node = 1 needs dptrain's own training loop, "
                                       "which names the slow node; a script of yours is not timed that way: drop it.\n")


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
    with pytest.raises(ConfigError) as refused:
        node_range(nnodes)
    assert sentence in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("nodes, sentence", [
    (["--nnodes", "a:b"], "--nnodes 'a:b' is not a node count"),
    (["--nnodes", "3:2"], "--nnodes 3:2 needs 1 <= MIN <= MAX"),
    (["--nnodes", "2", "--node-rank", "5", "--master-addr", "127.0.0.1"], "--node-rank 5 is outside 0 to 1"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node1"], "--rdzv-endpoint 'node1' is not HOST:PORT"),
    (["--node-rank", "1"], "--node-rank is for a run over several nodes"),
])
def test_a_bad_node_option_is_an_option_error_exit_2(tmp_path, capsys, nodes, sentence):
    # They exited 1, where argparse's own option errors (and every other one of dptrain's) exit 2.
    from dptrain.cli import main

    code = main(["train", "--data.name", "synthetic", "--output.dir", str(tmp_path / "run"), *nodes])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"dptrain: error: {sentence}") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


ELASTIC = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--nnodes", "1:2",
           "--node-rank", "0", "--master-addr", "127.0.0.1", "--dry-run"]


@pytest.mark.parametrize("extra, sentence", [
    ([], "--nnodes 1:2 goes on after losing a node by restarting the workers of the nodes left, from the last snapshot; "
         "give --launch.max_restarts 1 (one per node it may lose; more to restart after other failures too)."),
    (["--launch.max_restarts", "3", "--train.batch_size_per_rank", "16"],
     "train.batch_size_per_rank would change the global batch (and so the math) each time a node leaves a --nnodes 1:2 "
     "run; give train.global_batch_size instead."),
    # 3 splits over the 3 ranks of 3 nodes, not over the 2 left after losing one
    (["--launch.max_restarts", "3", "--nnodes", "1:3", "--nproc-per-node", "1", "--train.global_batch_size", "3"],
     "train.global_batch_size 3 is not divisible by the world size 2"),
])
def test_an_elastic_run_is_refused_before_start_where_it_could_not_go_on(tmp_path, capsys, extra, sentence):
    from dptrain.cli import main

    code = main([*ELASTIC, "--output.dir", str(tmp_path / "run"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert sentence in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_an_elastic_dry_run_says_how_small_the_run_may_get(tmp_path, capsys):
    from dptrain.cli import main

    code = main([*ELASTIC, "--launch.max_restarts", "2", "--nproc-per-node", "2", "--output.dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ("4 ranks, 2 local workers on each of 2 nodes (this is node 0); it goes on with 2 ranks on 1 nodes or more "
            "after losing nodes") in out


def test_deepspeed_cannot_run_elastic():
    from dptrain import config
    from dptrain.prestart import check_elastic

    cfg = config.load(None, [("strategy.name", "deepspeed"), ("launch.max_restarts", "2"), ("data.name", "synthetic")])
    with pytest.raises(ConfigError, match="strategy deepspeed's snapshots resume on as many processes only"):
        check_elastic(cfg, 1, 2, 1)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf", "nan", "1e-9", "0.09", "1e308", "604801"])
@pytest.mark.parametrize("name", [LAST_CALL_ENV, KEEP_ALIVE_ENV])
def test_a_rendezvous_time_from_the_environment_out_of_its_range_is_one_sentence(monkeypatch, name, value):
    # 1e308 overflowed torch's timedelta, 1e-9 made one of 0 s: 32-36-line tracebacks; 1e-9 beats lost every node.
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^{name}='{value}' is not a number of seconds from 0.1 to 604800 \\(a "
                                          f"week\\); .*unset it for 10\\.$"):
        seconds_from_env(name, 10)
    for edge in ("0.1", "604800"):
        monkeypatch.setenv(name, edge)
        assert seconds_from_env(name, 10) == float(edge)
    monkeypatch.setenv(name, " 2.5 ")
    assert seconds_from_env(name, 10) == 2.5
    monkeypatch.delenv(name)
    assert seconds_from_env(name, 10) == 10


ELASTIC_NODES = Nodes(count=2, rank=0, host="127.0.0.1", port=29500, min_count=1)


@pytest.mark.parametrize("keep_alive, last_call, total", [("1", "1e5", "100003"), ("1000", "10", "3010"),
                                                          (None, "294", "300")])
def test_an_elastic_run_whose_lost_node_would_outlast_the_timeout_is_refused(monkeypatch, keep_alive, last_call, total):
    # Last call 1e6 s (now out of range too): the nodes left timed out before meeting again, saying a node never came.
    for name, value in ((KEEP_ALIVE_ENV, keep_alive), (LAST_CALL_ENV, last_call)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        rendezvous_times(300, ELASTIC_NODES)
    message = str(refused.value)
    assert message.startswith("a --nnodes 1:2 run notices a lost node after 3 missed heart beats of ")
    assert f"{total} s in all, which must stay below launch.timeout_s (300 s)" in message, message
    assert message.endswith("lower those or raise --launch.timeout_s.") and len(message.splitlines()) == 1
    fixed = Nodes(count=2, rank=0, host="127.0.0.1", port=29500)  # no node may leave it: no lost node to wait for
    assert rendezvous_times(300, fixed).last_call_s == float(last_call)


def test_the_rendezvous_times_that_fit_are_taken(monkeypatch):
    monkeypatch.setenv(KEEP_ALIVE_ENV, "1")
    monkeypatch.setenv(LAST_CALL_ENV, "2")
    times = rendezvous_times(60, ELASTIC_NODES)
    assert (times.keep_alive_s, times.last_call_s, times.lost_after_s) == (1, 2, 5)
    monkeypatch.delenv(KEEP_ALIVE_ENV)
    monkeypatch.delenv(LAST_CALL_ENV)
    assert rendezvous_times(300, ELASTIC_NODES).lost_after_s == 16  # the defaults: 3 beats of 2 s, 10 s


def test_an_elastic_dry_run_refuses_a_rendezvous_time_out_of_range_in_one_sentence(tmp_path, capsys, monkeypatch):
    from dptrain.cli import main

    monkeypatch.setenv(LAST_CALL_ENV, "1e5")
    code = main([*ELASTIC, "--launch.max_restarts", "2", "--output.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("dptrain: error: a --nnodes 1:2 run notices a lost node after 3 missed heart beats")
    assert len(err.strip().splitlines()) == 1, err


def test_the_lost_node_and_the_nodes_left_in_one_sentence():
    assert nodes_lost([1], [0], 1) == ("node 1 left the run (its `dptrain train` ended, or its host stopped "
                                       "answering); the run goes on with 1 node (node 0; 1 rank) from its last "
                                       "snapshot.")
    assert nodes_lost([1, 3], [0, 2], 4) == ("nodes 1, 3 left the run (their `dptrain train` ended, or their hosts "
                                             "stopped answering); the run goes on with 2 nodes (nodes 0, 2; 8 ranks) "
                                             "from its last snapshot.")


class _Rounds:
    """torch's rendezvous handler as RefusalAware sees it: each next_rendezvous meets the next round's nodes."""

    def __init__(self, *rounds: list[int]) -> None:
        self.rounds = list(rounds)
        self._state_holder = type("Holder", (), {"state": type("State", (), {"participants": {}})()})()

    def next_rendezvous(self) -> str:
        nodes = self.rounds.pop(0)
        self._state_holder.state.participants = {NodeInOrder(f"10.0.0.{r + 1}", 100 + r, 0, node_rank=r): r
                                                   for r in nodes}
        return f"round of {len(nodes)}"


def test_a_round_without_a_node_of_the_one_before_names_it_on_the_console(capsys):
    handler = RefusalAware(_Rounds([0, 1, 2], [0, 1, 2], [0, 2], [0, 2, 1]), ranks_per_node=2)
    said = []
    for _ in range(4):
        assert handler.next_rendezvous().startswith("round of")
        said.append(capsys.readouterr().err)
    # the first round and a restart with the same nodes say nothing; a node that joins again starts nothing to say
    assert said[0] == said[1] == said[3] == "", said
    assert said[2] == ("dptrain: node 1 left the run (its `dptrain train` ended, or its host stopped answering); the "
                       "run goes on with 2 nodes (nodes 0, 2; 4 ranks) from its last snapshot.\n")


def test_nodes_the_rendezvous_numbered_are_named_by_their_address_when_lost(capsys):
    # Started without --node-rank, a node's number is the rendezvous' (the order it came in), which the user never
    # saw: "node 2 left" named no node they know. Its address does.
    handler = RefusalAware(_Rounds([0, 1, 2], [0, 2]), ranks_per_node=1, by_address=True)
    handler.next_rendezvous(), handler.next_rendezvous()
    assert capsys.readouterr().err == ("dptrain: node at 10.0.0.2 left the run (its `dptrain train` ended, or its "
                                       "host stopped answering); the run goes on with 2 nodes (nodes at 10.0.0.1, "
                                       "10.0.0.3; 2 ranks) from its last snapshot.\n")
