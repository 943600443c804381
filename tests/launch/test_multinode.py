"""Two hosts on one machine (tests/netns_hosts.py): the fixture itself, then multi-node runs across them."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from dptrain.distributed.env import Nodes
from dptrain.errors import ConfigError
from tests.conftest import FLOAT64_ENV, REPO, assert_trained_alike, log_tail, plan_runs, read_events, run_cli
from tests.netns_hosts import TwoHosts
from tests.ranks import free_port

PY = sys.executable
PORT = 5000  # each host is a fresh network stack: no other process can hold a port there


@functools.lru_cache(maxsize=1)
def _unavailable() -> str | None:
    return TwoHosts.unavailable_reason()


@pytest.fixture
def two_hosts():
    """Fresh hosts node1/node2 (TwoHosts), torn down after the test; skipped, with the reason, where impossible."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces: {reason}")
    with TwoHosts() as hosts:
        yield hosts


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of proc's stdout within `timeout` seconds ("" if it exited first)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s from {proc.args[-1]!r}"
    return proc.stdout.readline().strip()


def _finish(proc: subprocess.Popen, timeout: float = 20) -> str:
    """proc's stdout once it exited with 0 (within `timeout`), its stderr in the failure message otherwise."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {out}\nstderr: {err[-3000:]}"
    return out


# A client that retries until the server listens (no readiness signal needed): connect(host, port) or raise.
CONNECT = """
import socket, sys, time
def connect(host, port, deadline=10.0):
    end = time.monotonic() + deadline
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
"""

# Server: one connection; says its hostname, reads the client's and prints it with the client's address.
ECHO_SERVER = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen()
srv.settimeout(20)
conn, peer = srv.accept()
conn.settimeout(10)
conn.sendall(socket.gethostname().encode() + b"\\n")
print(conn.makefile().readline().strip(), peer[0], flush=True)
"""


def test_hosts_have_their_names_and_reach_each_other_by_name(two_hosts):
    hosts = two_hosts
    # each host's own name resolves (hosts file) to its own address
    for i in (0, 1):
        done = hosts.run(i, [PY, "-c", "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))"],
                         timeout=20)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [hosts.names[i], hosts.addresses[i]]
    server = hosts.popen(0, [PY, "-c", ECHO_SERVER, hosts.addresses[0], str(PORT)])
    client = hosts.popen(1, [PY, "-c", CONNECT + """
conn = connect("node1", int(sys.argv[1]))
conn.sendall(socket.gethostname().encode() + b"\\n")
print(conn.makefile().readline().strip(), conn.getpeername()[0])
""", str(PORT)])
    assert _finish(client).split() == ["node1", hosts.addresses[0]]  # node1's reply, from node1's address
    assert _finish(server).split() == ["node2", hosts.addresses[1]]  # node2's name, from node2's address


@pytest.mark.slow
def test_hosts_are_isolated_from_each_other_and_the_machine(two_hosts):
    """A server listening on every address of node1 is reachable as node1:PORT only, no other host's loopback."""
    hosts = two_hosts
    server = hosts.popen(0, [PY, "-c", ECHO_SERVER, "0.0.0.0", str(PORT)])
    client = hosts.popen(1, [PY, "-c", CONNECT + """
import errno
try:  # node2's loopback is node2's own: nothing listens there
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
    print("loopback reached node1's server")
except ConnectionRefusedError:
    print("loopback refused")
conn = connect("node1", int(sys.argv[1]))  # the server was up all along
conn.sendall(b"node2\\n")
print(conn.makefile().readline().strip())
""", str(PORT)])
    assert _finish(client).splitlines() == ["loopback refused", "node1"]
    _finish(server)
    # the machine's own (root namespace) stack reaches neither: its loopback refuses; node1's address goes out
    # the machine's default route (here a sandbox egress proxy accepts any TCP connection), never to node1
    server = hosts.popen(0, [PY, "-c", ECHO_SERVER, "0.0.0.0", str(PORT)])
    _wait_listening(hosts, 0, PORT)  # the connects below must fail although it listens
    assert server.poll() is None, server.communicate()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", PORT), timeout=1).close()
    assert _greeting(hosts.addresses[0], PORT) != b"node1\n"


def _wait_listening(hosts: TwoHosts, host: int, port: int, timeout: float = 20) -> None:
    """Return once a socket listens on port in host's network stack (ss there); fail the test if none comes."""
    deadline = time.monotonic() + timeout
    while not hosts.run(host, ["ss", "-ltnH", f"sport = :{port}"], timeout=10).stdout.strip():
        assert time.monotonic() < deadline, f"nothing listened on port {port} of {hosts.names[host]} within {timeout} s"
        time.sleep(0.1)


def _greeting(address: str, port: int) -> bytes | None:
    """The first bytes a server at address:port sends within a second of connecting; None if none connects."""
    try:
        with socket.create_connection((address, port), timeout=1) as conn:
            return conn.recv(100)
    except OSError:
        return None


# ------------------------------------------------------------------ dptrain across the two hosts

# SGD without dropout in float64 (tests/float64's sitecustomize): the two hosts' run and the one-host run differ
# only in the order of float64 sums (each host's rank uses both cores, the one-host ranks one each).
MULTINODE = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
             "--model.dropout", "false", "--train.max_steps", "8", "--train.global_batch_size", "32", "--train.log_every", "1",
             "--optim.name", "sgd", "--optim.lr", "0.01", "--train.channels_last", "false", "--launch.timeout_s", "60"]
plan_runs({"multinode/one-host": (MULTINODE, (2,))}, precision="float64")


def start_node(hosts: TwoHosts, index: int, argv: list[str], cwd, extra_env: dict[str, str] | None = None,
               node_rank: int | None = None, master: str = "node1") -> subprocess.Popen:
    """`dptrain ARGV --nnodes 2 --node-rank NODE_RANK (default INDEX) --master-addr MASTER` on host INDEX, one worker."""
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    nodes = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(index if node_rank is None else node_rank),
             "--master-addr", master, "--master-port", "29500"]
    return hosts.popen(index, [PY, "-m", "dptrain", *argv, *nodes], env=env, cwd=cwd)


@pytest.mark.slow
def test_two_hosts_train_as_one_host_with_two_workers(two_hosts, planned_run, tmp_path):
    run_dir = tmp_path / "run"  # one folder both hosts see, as an NFS share would be
    argv = [*MULTINODE, "--output.dir", str(run_dir)]
    procs = [start_node(two_hosts, i, argv, tmp_path, FLOAT64_ENV) for i in (0, 1)]
    for proc in procs:
        _finish(proc, timeout=120)
    reference = planned_run("multinode/one-host", 2)
    start = read_events(run_dir, "run_start")[0]
    assert start["world_size"] == 2
    assert json_env(run_dir)["host"] == "node1"  # rank 0 ran on the host of the rendezvous
    # two hosts by name, one machine by kernel (network namespaces of this one): the cores they share, for the model
    assert (json_env(run_dir)["hosts"], json_env(run_dir)["machines"]) == (2, 1)
    assert_trained_alike(run_dir, reference, steps=8)


@pytest.mark.nightly
@pytest.mark.slow
def test_global_rank_0_runs_on_node_0_whatever_the_addresses(two_hosts, tmp_path):
    # torch ranks the agents by the sorted order of their addresses: with node 0 on node2, rank 0 (its console, its
    # metrics, env.json) ran on node1, whose address sorts first, and the node the user started as node 0 said nothing.
    run_dir = tmp_path / "run"
    argv = [*MULTINODE, "--output.dir", str(run_dir)]
    node0 = start_node(two_hosts, 1, argv, tmp_path, node_rank=0, master="node2")
    node1 = start_node(two_hosts, 0, argv, tmp_path, node_rank=1, master="node2")
    said = {"node 0 (node2)": _finish(node0, timeout=120), "node 1 (node1)": _finish(node1, timeout=120)}
    assert json_env(run_dir)["host"] == "node2"
    assert "[METRIC]" in said["node 0 (node2)"] and "[METRIC]" not in said["node 1 (node1)"], said


@pytest.mark.nightly
@pytest.mark.slow
def test_torchruns_line_without_node_ranks_trains_with_rank_0_on_the_endpoints_host(two_hosts, tmp_path):
    # The same torchrun-style line on both hosts, no --node-rank: it was refused ("--node-rank is needed"). The node
    # at the endpoint's host (node2, whose address sorts last) hosts the rendezvous and is node 0, global rank 0.
    run_dir = tmp_path / "run"
    line = [*MULTINODE, "--train.max_steps", "2", "--output.dir", str(run_dir), "--nproc_per_node", "1",
            "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "node2:29500", "--rdzv_id", "job1"]
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    other = two_hosts.popen(0, [PY, "-m", "dptrain", *line], env=env, cwd=tmp_path)  # the first to start
    endpoints = two_hosts.popen(1, [PY, "-m", "dptrain", *line], env=env, cwd=tmp_path)
    said = {"node2": _finish(endpoints, timeout=120), "node1": _finish(other, timeout=120)}
    assert read_events(run_dir, "run_start")[0]["world_size"] == 2
    assert json_env(run_dir)["host"] == "node2"
    assert "[METRIC]" in said["node2"] and "[METRIC]" not in said["node1"], said


def json_env(run_dir) -> dict:
    import json

    return json.loads((run_dir / "env.json").read_text())


@pytest.mark.nightly
@pytest.mark.slow
def test_a_cut_link_fails_the_other_host_within_the_timeout_naming_the_lost_rank(two_hosts, tmp_path):
    run_dir = tmp_path / "run"
    timeout_s = 8
    argv = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "100000", "--train.epochs", "1",
            "--train.global_batch_size", "32", "--train.log_every", "1", "--launch.timeout_s", str(timeout_s),
            "--output.dir", str(run_dir)]
    procs = [start_node(two_hosts, i, argv, tmp_path) for i in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "metrics.jsonl").is_file() or not read_events(run_dir, "step"):
            assert time.monotonic() < deadline and procs[0].poll() is None, log_tail(run_dir)
            time.sleep(0.2)
        two_hosts.cut_link()
        cut = time.time()
        try:  # the agent's exit: the failure, then its shutdown (slow when busy); not the pipes' end, which a
            procs[0].wait(timeout=timeout_s + 90)  # worker still tearing down holds open
        except subprocess.TimeoutExpired:
            launcher = run_dir / "logs" / "launcher.log"  # the agents' side: what they did after the failure
            pytest.fail(f"node 0's agent did not exit within {timeout_s + 90} s of the cut: {log_tail(run_dir)}\n"
                        f"launcher.log: {launcher.read_text()[-3000:] if launcher.is_file() else '(none)'}")
    finally:
        for proc in procs:  # the whole process group: the agent's workers hold its output pipes open
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    err = procs[0].communicate(timeout=30)[1]
    procs[1].communicate(timeout=30)
    assert procs[0].returncode == 1, err
    lines = err.strip().splitlines()
    # during the step, or the reduction of its loss (train.log_every 1): wherever the cut caught it; either the
    # collective's own failure with the roll call, or the hang verdict where the collective overran first
    # (distributed/hangs.py), each naming rank 1 as silent
    assert (re.match(r"dptrain: error: rank 0 failed during (loss reduction of )?step \d+( in all_reduce #\d+ \([^)]*\))?: ",
                     lines[-1]) and "rank 1 did not answer (dead or stuck)" in lines[-1]
            or re.match(r"dptrain: error: rank 1 \(node2\) did not answer \(stopped, or dead unseen\); rank 0 waited \d+ s "
                        r"in all_reduce #\d+ \((bucket \d+ of )?(loss reduction of )?step \d+\)", lines[-1])), err
    # When rank 0 knew: its log line of the failure, timed by its own clock (the process's exit comes later, after
    # the agent's shutdown, which a busy machine slows down): the collective's timeout plus the roll call's wait.
    # (its first such line; the traceback under it, which ends with the same words, is not timed)
    failed = next(line for line in (run_dir / "logs" / "rank0.log").read_text().splitlines() if "did not answer" in line)
    known = datetime.datetime.strptime(failed[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert known - cut <= timeout_s + timeout_s / 4 + 5, (known - cut, failed)


# ------------------------------------------------------------------ the options, checked together

def test_the_multinode_options_read_as_torchrun_reads_them():
    assert Nodes.from_options(None, None, None, None, None, {}) is None  # this node alone
    assert Nodes.from_options(1, None, None, None, None, {}) is None
    assert Nodes.from_options(2, 1, "127.0.0.1", None, None, {}) == Nodes(2, 1, "127.0.0.1", 29500)
    assert Nodes.from_options(2, 0, None, None, "localhost:1234", {}) == Nodes(2, 0, "localhost", 1234)
    # under srun, one agent per node: the node's index is the task's
    assert Nodes.from_options(4, None, "127.0.0.1", 20017, None, {"SLURM_NODEID": "3"}) == Nodes(4, 3, "127.0.0.1", 20017)


def test_without_a_node_rank_the_rendezvous_numbers_the_nodes():
    # torchrun's multi-node line (--rdzv_endpoint, no --node_rank) on every node: the same command everywhere
    assert Nodes.from_options(2, None, None, None, "localhost:1234", {}) == Nodes(2, None, "localhost", 1234)
    assert Nodes.from_options(2, None, "127.0.0.1", None, None, {}) == Nodes(2, None, "127.0.0.1", 29500)
    assert Nodes.from_options("1:3", None, None, None, "127.0.0.1:29400", {}) == Nodes(3, None, "127.0.0.1", 29400, 1)


@pytest.mark.parametrize("options, environ, sentence", [
    ((None, 1, None, None, None), {}, "--node-rank is for a run over several nodes; give --nnodes too"),
    ((2, None, None, None, None), {}, "--master-addr is needed with --nnodes 2"),
    ((2, 2, "127.0.0.1", None, None), {}, "--node-rank 2 is outside 0 to 1 (--nnodes 2)."),
    ((2, 0, None, None, None), {}, "--master-addr is needed with --nnodes 2"),
    ((2, 0, "127.0.0.1", None, "h:1"), {}, "give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port"),
    ((2, 0, None, None, "node1"), {}, "--rdzv-endpoint 'node1' is not HOST:PORT"),
    ((2, 0, "127.0.0.1", 70000, None), {}, "--master-port 70000 is not a TCP port"),
    ((2, 0, "no-such-host.invalid", None, None), {}, "master address 'no-such-host.invalid' does not resolve"),
    ((2, 0, "127.0.0.1", None, None), {"RANK": "0", "WORLD_SIZE": "2"}, "a launcher (torchrun) already started this process"),
])
def test_bad_multinode_options_are_refused_in_one_sentence(options, environ, sentence):
    with pytest.raises(ConfigError) as refused:  # an option error: exit 2
        Nodes.from_options(*options, environ)
    assert sentence in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_node_0_whose_peer_never_starts_names_it_in_one_sentence(tmp_path):
    # It was a 46-line traceback ending in RendezvousTimeoutError, with no word of which node was missing.
    port = free_port()
    done = run_cli(["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--nnodes", "2",
                    "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--launch.timeout_s", "3", "--output.dir", str(tmp_path / "run")], tmp_path, timeout=50)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"dptrain: error: node 1 of 2 never came to the rendezvous at 127.0.0.1:{port} within 3 s; start `dptrain "
        f"train` on every node with --nnodes 2 and the same --master-addr and --master-port, each with its own "
        f"--node-rank from 0 to 1, or give them longer (--launch.timeout_s).")


@pytest.mark.nightly  # the default run keeps a gone rendezvous host named when nodes have no rank
@pytest.mark.timeout(60)
def test_the_endpoints_node_without_a_node_rank_says_how_many_came(tmp_path):
    # Without --node-rank, nodes are numbered as they come: the host counts them (it cannot name a missing number).
    port = free_port()
    done = run_cli(["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--nnodes", "2",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--launch.timeout_s", "3",
                    "--output.dir", str(tmp_path / "run")], tmp_path, timeout=50)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"dptrain: error: only 1 of 2 nodes came to the rendezvous at 127.0.0.1:{port} within 3 s; start `dptrain "
        f"train` on every node with --nnodes 2 and the same rendezvous endpoint 127.0.0.1:{port}, whose host must be "
        f"one of the nodes, or give them longer (--launch.timeout_s).")


def test_a_gone_rendezvous_host_is_named_by_its_address_when_the_nodes_have_no_rank():
    from dptrain.launch.rendezvous import rendezvous_host_gone

    assert rendezvous_host_gone(Nodes(2, None, "node1", 29500)) == (
        "the node at node1, which hosts the run's rendezvous at node1:29500, is gone (its `dptrain train` ended, or "
        "its host or the network failed) and the run cannot go on without it; run the same command again on every "
        "node, the node at node1 included, to resume from the last snapshot.")
    assert rendezvous_host_gone(Nodes(2, 1, "node1", 29500)).startswith("node 0, which hosts")


@pytest.mark.nightly  # the default run keeps a master that does not resolve, as a SLURM job
def test_a_master_the_network_does_not_lead_to_fails_soon_naming_it(two_hosts):
    """No route to node1 (the link is down): not the whole timeout of a refused port, but half of it (30 s at most)."""
    two_hosts.cut_link()
    timeout_s = 6
    code = ("import time; from dptrain.distributed.store import reach_store; from dptrain.errors import LaunchError\n"
            "start = time.monotonic()\n"
            f"try:\n    reach_store('node1', 29500, {timeout_s}, 'the store of rank 0', 'rank 0')\n"
            "except LaunchError as exc:\n    print(time.monotonic() - start); print(exc)\n")
    out = two_hosts.run(1, [PY, "-c", code], env={"PYTHONPATH": str(REPO)}, timeout=60).stdout.splitlines()
    took, message = float(out[0]), out[1]
    # It gives up once the host has been unreachable for half the timeout, never sooner; a refused port's wait (the
    # fault this is not) would take the whole timeout (margin: the other half, 3 s).
    assert timeout_s / 2 <= took < timeout_s, took
    assert message.startswith("node1:29500 (the store of rank 0) is not reachable from node2 (")
    assert "check that rank 0's host is up" in message
