"""The lab cluster (tests/lab_cluster.py): hosts in network namespaces on a bridge, links shaped with tc tbf, a
slurmd per host. Its links carry their rate; a SLURM job across two hosts trains as one host does (float64); the
script starts and stops one leaving nothing behind, also when the process that started it is killed."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import FLOAT64_ENV, REPO, assert_trained_alike, plan_runs, read_events
from tests.lab_cluster import LabCluster, LabNetwork, _links, _namespaces, rate_bits_per_s
from tests.launch.test_multinode import MULTINODE, json_env
from tests.slurm.test_slurm_jobs import LIGHTNING_SCRIPT, TUTORIAL_SCRIPT, job_output, submit
from tests.slurm_cluster import SlurmClusterError, _cmdline

PY = sys.executable
SCRIPT = REPO / "scripts" / "slurm-cluster"
PORT = 5000  # each host is a fresh network stack: nothing else listens there


@functools.lru_cache(maxsize=1)
def _unavailable() -> str | None:
    return LabCluster.unavailable_reason()


def _skip_where_impossible() -> None:
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"no lab cluster here: {reason}")


def _leftovers(network: LabNetwork) -> list[str]:
    """What of `network` still exists on this machine: namespaces, links, hosts files."""
    hosts = network.host_numbers
    names = {network.bridge, *map(network.namespace, hosts), *map(network.bridge_end, hosts)}
    files = [str(p) for k in network.host_numbers if (p := Path("/etc/netns") / network.namespace(k)).exists()]
    return sorted(names & {*_links(), *_namespaces()}) + files


# ------------------------------------------------------------------ rates and sizes, refused in one sentence

def test_rates_are_read_in_tcs_units():
    assert rate_bits_per_s("1gbit") == 1e9
    assert rate_bits_per_s("100mbit") == 1e8
    assert rate_bits_per_s("2.5Gbit") == 2.5e9
    for wrong in ("1gb", "fast", "0mbit", "100 mbit", ""):
        with pytest.raises(SlurmClusterError, match="is not one tc's tbf takes; write .* e.g. 100mbit or 1gbit"):
            rate_bits_per_s(wrong)


@pytest.mark.parametrize("options, message", [
    (["--rate", "1gb"], "slurm-cluster: the rate '1gb' is not one tc's tbf takes; write a number of bits per second "
                        "with its unit, e.g. 100mbit or 1gbit"),
    (["--hosts", "0"], "slurm-cluster: a lab cluster has 1 to 250 hosts, not 0; choose --hosts in that range"),
], ids=["rate", "hosts"])
def test_the_script_refuses_a_lab_it_cannot_make_before_making_anything(tmp_path, options, message):
    done = subprocess.run([PY, str(SCRIPT), "start", str(tmp_path / "lab"), *options], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (1, "", message)
    assert not (tmp_path / "lab").exists()


# ------------------------------------------------------------------ the links

# Host2 receives one connection and prints the bytes per second from its first byte to its end; host1 sends.
RECEIVE = """
import socket, sys, time
srv = socket.socket()
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen()
srv.settimeout(30)
conn, _ = srv.accept()
got, began = 0, None
while chunk := conn.recv(1 << 20):
    began = began or time.monotonic()
    got += len(chunk)
print(got, got / (time.monotonic() - began))
"""
SEND = """
import socket, sys, time
end = time.monotonic() + 10
while True:  # until host2 listens
    try:
        conn = socket.create_connection(("host2", int(sys.argv[1])), timeout=30)
        break
    except ConnectionRefusedError:
        assert time.monotonic() < end, "host2 never listened"
        time.sleep(0.05)
block = bytes(1 << 20)
for _ in range(int(sys.argv[2]) >> 20):
    conn.sendall(block)
conn.close()
"""


def transfer(network: LabNetwork, megabytes: int) -> float:
    """Bytes per second of `megabytes` MiB sent from host1 to host2 over one TCP connection, as host2 received them."""
    receiver = network.popen(2, [PY, "-c", RECEIVE, str(PORT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    sender = network.run(1, [PY, "-c", SEND, str(PORT), str(megabytes << 20)], timeout=60)
    out, err = receiver.communicate(timeout=30)
    assert sender.returncode == 0 and receiver.returncode == 0, (sender.stderr, err)
    received, rate = out.split()
    assert int(received) == megabytes << 20
    return float(rate)


@pytest.mark.slow
def test_a_shaped_link_carries_its_rate_within_10_percent():
    """100 Mbit/s each way on both hosts' links: host1 -> host2 gets 12.5 MB/s less the headers (tbf counts whole
    frames: 1448 bytes of data in 1514 on the wire, 4.4% less), so within 10% of the rate."""
    _skip_where_impossible()
    rate = "100mbit"
    with LabNetwork.create(2) as network:
        unshaped = transfer(network, 100)
        print(f"unshaped host1 -> host2: {unshaped / 1e6:.0f} MB/s")
        if unshaped < 3 * rate_bits_per_s(rate) / 8:
            pytest.skip(f"this machine copies only {unshaped / 1e6:.0f} MB/s between namespaces: too little to "
                        f"measure a {rate} link")
        network.shape(rate)
        shaped = transfer(network, 24)  # ~2 s at 12.5 MB/s
        print(f"shaped to {rate}: {shaped / 1e6:.2f} MB/s")
    expected = rate_bits_per_s(rate) / 8
    assert abs(shaped - expected) <= 0.10 * expected, f"{shaped / 1e6:.2f} MB/s on a {rate} link"
    assert _leftovers(network) == []


# ------------------------------------------------------------------ SLURM jobs across the links

@pytest.mark.slow
def test_a_two_host_job_over_shaped_links_trains_as_one_host(tmp_path, planned_run):
    """`dptrain submit` with 2 nodes x 1 rank on host1 and host2, links of 1 Gbit/s: the same float64 curve and
    weights as 2 workers on one host (the run planned by test_multinode), its gradients crossing the links."""
    _skip_where_impossible()
    with LabCluster.start(tmp_path / "lab", hosts=2, rate="1gbit") as lab:
        job_id = submit(lab, tmp_path, "across", [*MULTINODE[1:], "--nodes", "2", "--cpus-per-node", "1"],
                        FLOAT64_ENV)
        run_dir = tmp_path / "runs" / "across"
        job = lab.wait(job_id, timeout=120)
        assert job["JobState"] == "COMPLETED", (job, job_output(run_dir))
        sent = [lab.network.bytes_sent(k) for k in (1, 2)]
    assert job["NodeList"] == "host[1-2]"
    assert json_env(run_dir)["host"] == "host1"  # rank 0 on the first node, by its hostname there
    ref_weights = assert_trained_alike(run_dir, planned_run("multinode/one-host", 2), steps=8)
    # each step's all-reduce sends about the gradients' size from each host: 8 steps' worth went over each link
    gradient_bytes = sum(t.numel() * t.element_size() for t in ref_weights.values() if t.is_floating_point())
    assert min(sent) >= 8 * gradient_bytes, (sent, gradient_bytes)
    assert read_events(run_dir, "run_start")[0]["world_size"] == 2


# 2 epochs of 16 steps on each of 2 ranks; one thread a rank
def synthetic_job(nodes: int, batch: int) -> list[str]:
    """`dptrain submit`'s options for a job of `nodes` nodes x 1 rank (one core each): 2 epochs of 16 steps of `batch`
    synthetic samples, a log step every 8."""
    return ["--data.name", "synthetic", "--data.synthetic_train_size", str(16 * batch), "--data.synthetic_test_size",
            str(batch), "--train.global_batch_size", str(batch), "--train.epochs", "2", "--train.log_every", "8",
            "--nodes", str(nodes), "--cpus-per-node", "1"]


QUOTA_RUN = synthetic_job(nodes=2, batch=64)


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_held_to_a_cpu_quota_is_named_the_straggler_of_each_epoch(tmp_path):
    """host2 held to 0.3 of a core (LabCluster.cpu_quota, as a throttled node or a neighbour's job holds one), a job of
    2 nodes x 1 rank: each epoch names rank 1 on host2, in compute, by its own time (the wall clock: the quota leaves
    its compute's CPU time as it was), and the others' own time is not what grew."""
    from dptrain.events import OWN_COMPUTE_CPU_MS_PER_STEP, OWN_COMPUTE_MS_PER_STEP

    _skip_where_impossible()
    with LabCluster.start(tmp_path / "lab", hosts=2, rate="1gbit") as lab, lab.cpu_quota(2, 0.3) as group:
        job_id = submit(lab, tmp_path, "quota", QUOTA_RUN, {})
        run_dir = tmp_path / "runs" / "quota"
        job = lab.wait(job_id, timeout=240)
        throttled = int(dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())["nr_throttled"])
    assert job["JobState"] == "COMPLETED", (job, job_output(run_dir))
    assert throttled > 0  # the quota held host2's processes back
    epochs = read_events(run_dir, "epoch")
    assert [(e["straggler_rank"], e["straggler_host"], e["straggler_phase"]) for e in epochs] == [
        (1, "host2", "compute")] * 2, epochs
    for epoch in epochs:
        wall, cpu = epoch[OWN_COMPUTE_MS_PER_STEP], epoch[OWN_COMPUTE_CPU_MS_PER_STEP]
        assert wall[1] > 1.3 * wall[0] and epoch["straggler_slower_pct"] > 30, epoch
        assert wall[1] > 1.3 * cpu[1]  # held back, not computing more
    rank1_log = (run_dir / "logs" / "rank1.log").read_text()
    assert "rank 1 (host2) was" in rank1_log and "slower than the other ranks in epoch 2, in compute" in rank1_log


LINK_RUN = synthetic_job(nodes=3, batch=60)  # a global batch of 3 ranks' shares


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_whose_link_is_slower_is_named_the_straggler_of_each_epoch_in_the_link_phase(tmp_path):
    """3 hosts at 1 Gbit/s each way, host3's link then shaped to 300 Mbit/s both ways, a job of 3 nodes x 1 rank: no
    rank's own time shows it (every rank of the ring waits as long), the link probe at each epoch's end does: each
    epoch names rank 2 on host3, in the link phase, its link time about 1 Gbit/s / 300 Mbit/s of the others'."""
    from dptrain.events import LINK_PROBE_MS
    from dptrain.metrics.link_probe import PROBE_BYTES

    _skip_where_impossible()
    with LabCluster.start(tmp_path / "lab", hosts=3, rate="1gbit") as lab:
        lab.network.shape("300mbit", hosts=[3])
        job_id = submit(lab, tmp_path, "link", LINK_RUN, {})
        run_dir = tmp_path / "runs" / "link"
        job = lab.wait(job_id, timeout=240)
    assert job["JobState"] == "COMPLETED", (job, job_output(run_dir))
    epochs = read_events(run_dir, "epoch")
    assert [(e["straggler_rank"], e["straggler_host"], e["straggler_phase"]) for e in epochs] == [
        (2, "host3", "link")] * 2, epochs
    # host3's transfers at 300 Mbit/s: 7.0 ms, less the bucket tbf lets through at once (37.5 KB: 1 ms of the rate)
    wire_ms = (PROBE_BYTES - 300e6 / 8 / 1000) * 8 / 300e6 * 1e3
    for epoch in epochs:
        link = epoch[LINK_PROBE_MS]
        assert link[2] > wire_ms and link[2] > 2 * max(link[:2]), link
    rank0_log = (run_dir / "logs" / "rank0.log").read_text()
    assert "the link of host3 (the node of rank 2) was" in rank0_log, rank0_log[-2000:]


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tutorials_ddp_and_lightning_scripts_train_as_jobs_across_two_lab_hosts(tmp_path):
    """`dptrain submit --nodes 2 -- SCRIPT ...` with the tutorials' DDP script and their Lightning script, side by
    side on host1 and host2 (1 Gbit/s): one torchrun per host, rank 0 on host1, each model saved by rank 0, and each
    step's gradients over the links."""
    _skip_where_impossible()
    pytest.importorskip("lightning")
    scripts = {"ddp": [str(TUTORIAL_SCRIPT), "--epochs", "2", "--model_dir", "saved-ddp"],
               "lightning": [str(LIGHTNING_SCRIPT), "--gpus", "1", "--nodes", "2", "--epochs", "2",
                             "--model_dir", "saved-lightning"]}
    with LabCluster.start(tmp_path / "lab", hosts=2, rate="1gbit") as lab:
        before = [lab.network.bytes_sent(k) for k in (1, 2)]
        ids = {name: submit(lab, tmp_path, name, ["--nodes", "2", "--cpus-per-node", "1", "--", *words], {})
               for name, words in scripts.items()}
        jobs = {name: lab.wait(job_id, timeout=240) for name, job_id in ids.items()}
        sent = [lab.network.bytes_sent(k) - b for k, b in zip((1, 2), before)]
    for name, job in jobs.items():
        assert job["JobState"] == "COMPLETED", (job, job_output(tmp_path / "runs" / name))
        assert job["NodeList"] == "host[1-2]"
        ranks = json.loads((tmp_path / f"saved-{name}" / "ranks.json").read_text())
        assert [(r["rank"], r["host"]) for r in ranks] == [(0, "host1"), (1, "host2")]
        assert {k: tuple(v.shape) for k, v in torch.load(tmp_path / f"saved-{name}" / "model.pt").items()} == {
            "1.weight": (10, 784), "1.bias": (10,)}
    # each script: 2 epochs of 256 samples in batches of 16 a rank, 16 steps, each sending about the 7,850 float32
    # gradients from each host (a ring of two sends half of them twice)
    assert min(sent) >= 2 * 16 * 7850 * 4, sent


plan_runs({"lab/one-host-4-ranks": (MULTINODE, (4,))}, precision="float64", nightly_worlds=(4,))


@pytest.mark.nightly  # the default run keeps tests/strategies/test_two_step.py (the two steps on one machine)
@pytest.mark.slow
def test_two_hosts_of_two_ranks_sum_within_each_host_then_once_across_the_links(tmp_path, planned_run):
    """2 nodes x 2 ranks over 1 Gbit/s links: the gradients are summed within each host (shared memory), then by one
    rank a host across the links (strategies/two_step.py): the float64 curve and weights of 4 ranks on one host, and
    one gradient's worth over each host's link a step, where a flat ring of the 4 ranks sends 1.5 of it there."""
    _skip_where_impossible()
    with LabCluster.start(tmp_path / "lab", hosts=2, rate="1gbit") as lab:
        job_id = submit(lab, tmp_path, "two-step", [*MULTINODE[1:], "--nodes", "2", "--ranks-per-node", "2",
                                                    "--cpus-per-node", "2"], FLOAT64_ENV)
        run_dir = tmp_path / "runs" / "two-step"
        job = lab.wait(job_id, timeout=150)
        assert job["JobState"] == "COMPLETED", (job, job_output(run_dir))
        sent = [lab.network.bytes_sent(k) for k in (1, 2)]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "gradients are summed in two steps: within each of 2 hosts (2,2 ranks)" in log, log[-3000:]
    ref_weights = assert_trained_alike(run_dir, planned_run("lab/one-host-4-ranks", 4), steps=8)
    # Each link: a gradient's worth a step (the leaders' ring of 2 hosts: 2(2-1)/2 of it each way), and on host1's
    # up to 2 more for DDP's start, which sends rank 0's weights to the others; a flat ring of the 4 ranks would
    # carry 1.5 a step, 12 or more in all (seen: 96 and 77 MB here, 10.0 and 8.0 gradients of 9.6 MB).
    gradient_bytes = sum(t.numel() * t.element_size() for t in ref_weights.values() if t.is_floating_point())
    assert all(8 * gradient_bytes <= link <= 10.5 * gradient_bytes for link in sent), (sent, gradient_bytes)


# ------------------------------------------------------------------ the script, for people

def _script(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_script_starts_three_shaped_hosts_and_stops_them_leaving_nothing(tmp_path):
    _skip_where_impossible()
    state = tmp_path / "lab"
    started = _script("start", str(state), "--hosts", "3", "--rate", "1gbit")
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout == f"export SLURM_CONF={state / 'slurm.conf'}\n"
        assert "hosts host1..host3" in started.stderr and "links of 1gbit each way" in started.stderr
        network = LabCluster(state).network
        nodes = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], capture_output=True, text=True,
                               env={**os.environ, "SLURM_CONF": str(state / "slurm.conf")}, timeout=30)
        assert nodes.stdout.split() == ["host1", "idle", "host2", "idle", "host3", "idle"], nodes.stderr
        on_host3 = _script("exec", str(state), "3", "sh", "-c", "hostname; tc qdisc show dev eth0")
        assert on_host3.returncode == 0, on_host3.stderr
        hostname, qdisc = on_host3.stdout.splitlines()[:2]
        assert hostname == "host3" and re.search(r"\btbf\b.* rate 1Gbit", qdisc), on_host3.stdout
        assert _leftovers(network) != []
    finally:
        stopped = _script("stop", str(state))
    assert stopped.returncode == 0 and f"stopped the cluster in {state}" in stopped.stderr, stopped.stderr
    assert _leftovers(network) == []
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(state) in _cmdline(int(pid))]


STARTER = """
import sys, time
from tests.lab_cluster import LabCluster
LabCluster.start(sys.argv[1], hosts=1)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_starter_leaves_no_network_behind(tmp_path):
    """The test process that started a lab dies (SIGKILL): its supervisor stops the daemons and removes the network."""
    _skip_where_impossible()
    state = tmp_path / "lab"
    starter = subprocess.Popen([PY, "-c", STARTER, str(state)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert starter.stdout.readline() == "ready\n"
        network = LabCluster(state).network
        assert _leftovers(network) != []
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 30
    while _leftovers(network) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(network) == []
