"""`dptrain submit` on a real SLURM cluster (tests/slurm_cluster.py: slurmctld and two slurmd nodes, n1 and n2).
These jobs are also the cluster's own tests: tasks on both nodes, two jobs sharing a node, a requeue, and
`scancel --signal=USR1` reaching every srun task.

Every job of this module is submitted at once, on first use, and the scheduler runs them as the nodes' CPUs
allow: a job costs its own Python and torch starts, not a wait for the job before it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from dptrain import config
from dptrain.errors import ConfigError
from dptrain.slurm import job as slurm_job, partition as slurm_partition
from tests.conftest import FLOAT64_ENV, assert_trained_alike, read_events
from tests.launch.test_multinode import MULTINODE

pytestmark = pytest.mark.slow

# fp32, long enough (60 steps) for a signal to land mid-run; a snapshot only at the end (or on the signal).
LONG = ["--data.name", "synthetic", "--data.synthetic_train_size", "1920", "--data.synthetic_test_size", "64",
        "--train.global_batch_size", "32", "--train.epochs", "1", "--train.log_every", "1", "--launch.timeout_s", "60"]
SHORT = [*LONG, "--train.max_steps", "20"]
# One core per rank (--cpus-per-task 1, so 1 thread each): the jobs run side by side on this machine's 2 cores.
TWO_NODES = ["--nodes", "2", "--cpus-per-node", "1"]
TUTORIAL_SCRIPT = Path(__file__).parent / "tutorial_ddp.py"
LIGHTNING_SCRIPT = Path(__file__).parent / "tutorial_lightning.py"
SLURM_VARS_SCRIPT = Path(__file__).parent / "slurm_vars_script.py"
# name -> (options of `dptrain submit`, environment of the submission; sbatch passes it on to the job)
JOBS: dict[str, tuple[list[str], dict[str, str]]] = {
    "per-rank": ([*MULTINODE[1:], *TWO_NODES], FLOAT64_ENV),
    # two jobs of 2 ranks on node n1 at once, each with its own port
    **{f"shared-{x}": ([*SHORT, "--ranks-per-node", "2", "--cpus-per-node", "2", "--sbatch", "nodelist=n1"], {})
       for x in "ab"},
    "unresolvable": ([*SHORT, *TWO_NODES, "--master-addr", "no-such-host.invalid"], {}),
    # held (sbatch --hold): its script is resubmitted at another size, as the tutorials' users resize a job
    "resized": (["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "32",
                 "--train.epochs", "1", "--batch_size", "16", "--nodes", "1", "--cpus-per-node", "1",
                 "--sbatch", "hold"], {}),
    # the tutorials' own DDP script (tests/slurm/tutorial_ddp.py), under one torchrun per node: dptrain submit -- ...
    "user-script": ([*TWO_NODES, "--", str(TUTORIAL_SCRIPT), "--epochs", "2", "--model_dir", "saved-user-script"], {}),
    # a script that takes its rank from SLURM_PROCID and SLURM_NTASKS, one srun task per rank: 2 ranks on each node
    "slurm-vars-script": (["--nodes", "2", "--ranks-per-node", "2", "--cpus-per-node", "2", "--mode", "per-rank", "--",
                           str(SLURM_VARS_SCRIPT), "seen-by-slurm-vars-script"], {}),
}


# The nightly tier's: the default run keeps the per-rank job of the same run (the default mode) and the tutorials' DDP
# script across both nodes; their Lightning script trains on 2 local workers there (tests/launch/test_user_script.py).
NIGHTLY_JOBS: dict[str, tuple[list[str], dict[str, str]]] = {
    "agent": ([*MULTINODE[1:], *TWO_NODES, "--mode", "agent"], FLOAT64_ENV),
    # the tutorials' Lightning script (tests/slurm/tutorial_lightning.py): its own --gpus and --nodes after the --
    "lightning-script": ([*TWO_NODES, "--", str(LIGHTNING_SCRIPT), "--gpus", "1", "--nodes", "2", "--epochs", "2",
                          "--model_dir", "saved-lightning-script"], {}),
}


def submit(cluster, workdir: Path, name: str, options: list[str], env: dict[str, str]) -> int:
    """`dptrain submit --output.name NAME OPTIONS` in this process, from workdir, on the cluster: the job id."""
    from dptrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(workdir)
        for key, value in {**cluster.env, **env}.items():
            patch.setenv(key, value)
        code = main(["submit", "--output.name", name, *options])
    assert code == 0, err.getvalue()
    return int(re.search(r"submitted job (\d+)", out.getvalue()).group(1))


# The nightly tier's: a signalled job and its uninterrupted twin (the requeued job waits for SLURM's credential to
# expire before it runs again, some 30 s here).
REQUEUE_JOBS: dict[str, tuple[list[str], dict[str, str]]] = {
    "requeued": ([*LONG, *TWO_NODES, "--requeue"], {}),
    "uninterrupted": ([*LONG, *TWO_NODES], {}),
}


def submitted(cluster, workdir: Path, jobs: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, tuple[int, Path]]:
    """name -> (job id, run folder) of every job of jobs, submitted together from workdir."""
    return {name: (submit(cluster, workdir, name, options, env), workdir / "runs" / name)
            for name, (options, env) in jobs.items()}


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """name -> (job id, run folder) of every job of JOBS, submitted together."""
    return submitted(slurm_cluster, tmp_path_factory.mktemp("jobs"), JOBS)


@pytest.fixture(scope="module")
def nightly_jobs(slurm_cluster, tmp_path_factory):
    """The jobs of NIGHTLY_JOBS, as jobs()."""
    return submitted(slurm_cluster, tmp_path_factory.mktemp("nightly-jobs"), NIGHTLY_JOBS)


@pytest.fixture(scope="module")
def requeue_jobs(slurm_cluster, tmp_path_factory):
    """The jobs of REQUEUE_JOBS, as jobs(); the requeued one is signalled (scancel --signal=USR1, as SLURM's --signal
    would) once it has trained a few steps."""
    made = submitted(slurm_cluster, tmp_path_factory.mktemp("requeue"), REQUEUE_JOBS)
    job_id, run_dir = made["requeued"]
    deadline = time.monotonic() + 120
    while not steps_done(run_dir) >= 3:
        job = slurm_cluster.job(job_id)
        assert time.monotonic() < deadline and job["JobState"] in ("PENDING", "RUNNING"), (job, job_output(run_dir))
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", str(job_id)).returncode == 0
    return made


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(read_events(run_dir, "step")) if metrics.is_file() else 0


def job_output(run_dir: Path) -> str:
    """The job's .out and .err files, for a failure message."""
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("slurm-*")))


def finished(cluster, jobs, name: str, state: str = "COMPLETED") -> tuple[dict[str, str], Path]:
    job_id, run_dir = jobs[name]
    job = cluster.wait(job_id, timeout=240)
    assert job["JobState"] == state, (job, job_output(run_dir))
    return job, run_dir


def losses_and_weights(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    return [e["loss"] for e in read_events(run_dir, "step")], torch.load(run_dir / "model.pt")


@pytest.mark.parametrize("mode", ["per-rank", pytest.param("agent", marks=pytest.mark.nightly)])
def test_two_nodes_train_as_the_local_two_worker_run(slurm_cluster, request, planned_run, mode):
    """Through dptrain submit, 2 nodes x 1 rank, gloo: the same curve and weights as 2 local workers (float64)."""
    jobs = request.getfixturevalue("jobs" if mode in JOBS else "nightly_jobs")
    job, run_dir = finished(slurm_cluster, jobs, mode)
    assert job["NodeList"] == "n[1-2]"
    start = read_events(run_dir, "run_start")[0]
    assert (start["world_size"], start["slurm_restarts"]) == (2, 0)
    assert "1 CPU threads per rank" in (run_dir / "logs" / "rank0.log").read_text()  # --cpus-per-task 1
    # who started the ranks: dptrain's elastic agent (which gives them torchrun's variables), or srun a task a rank
    launcher = "(dptrain's elastic agent)" if mode == "agent" else "(srun)"
    assert f"world size 2 {launcher}" in (run_dir / "logs" / "rank0.log").read_text()
    assert_trained_alike(run_dir, planned_run("multinode/one-host", 2), steps=8)


@pytest.mark.nightly  # the default run keeps a requeue on the private cluster (test_containers.py) and the signals (test_stopping.py)
def test_a_signalled_job_requeues_resumes_and_ends_equal_to_an_uninterrupted_one(slurm_cluster, requeue_jobs):
    jobs = requeue_jobs
    job, run_dir = finished(slurm_cluster, jobs, "requeued")
    assert job["Restarts"] == "1"
    starts = read_events(run_dir, "run_start")
    assert [(s["slurm_restarts"], s["step"] > 0) for s in starts] == [(0, False), (1, True)], starts
    [stopped] = read_events(run_dir, "stopped")
    [requeued] = read_events(run_dir, "requeue")
    assert read_events(run_dir, "requeue_failed") == []
    assert stopped["step"] == requeued["step"] == starts[1]["step"]  # resumed from the signal's snapshot
    assert "stopped by SIGUSR1" in stopped["message"]
    _, reference = finished(slurm_cluster, jobs, "uninterrupted")
    weights, expected = torch.load(run_dir / "model.pt"), torch.load(reference / "model.pt")
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    assert [e["loss"] for e in read_events(run_dir, "step")][-1] == [e["loss"] for e in read_events(reference, "step")][-1]


def test_two_jobs_on_one_node_at_once_do_not_collide(slurm_cluster, jobs):
    """Each job's world lives from rank 0's first line (written once its process group, and so its store's port, is
    up) to its run_end; the two lives overlap. (Their training alone need not: on a loaded machine one job's set-up
    took 4 s longer than the other's 20 steps.)"""
    spans, curves = [], []
    for name in ("shared-a", "shared-b"):
        job, run_dir = finished(slurm_cluster, jobs, name)
        assert job["NodeList"] == "n1"
        first = (run_dir / "logs" / "rank0.log").read_text().splitlines()[0]
        assert " world size 2 (srun)" in first, first
        up = datetime.strptime(first[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the local time logging writes
        spans.append((up, read_events(run_dir, "run_end")[0]["time"]))
        curves.append(losses_and_weights(run_dir)[0])
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, spans  # both worlds were up at the same time
    assert curves[0] == curves[1]  # each in its own world: the same run, the same losses


def test_a_master_that_does_not_resolve_fails_within_30_s_naming_it(slurm_cluster, jobs):
    job, run_dir = finished(slurm_cluster, jobs, "unresolvable", state="FAILED")
    took = (datetime.fromisoformat(job["EndTime"]) - datetime.fromisoformat(job["StartTime"])).total_seconds()
    assert took <= 30, job
    errors = (run_dir / "logs" / f"slurm-{jobs['unresolvable'][0]}.err").read_text()
    assert re.search(r"^dptrain: error: rank \d failed during rendezvous: master address 'no-such-host.invalid' does "
                     r"not resolve on \S+; set MASTER_ADDR", errors, re.M), errors


@pytest.mark.timeout(60)
def test_a_job_no_node_of_the_partition_can_hold_is_refused_naming_what_sinfo_says(slurm_cluster, monkeypatch):
    # --ranks-per-node 64 on the cluster's 8-CPU nodes was submitted and pended for ever (reason PartitionConfig).
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)

    def refusal(*overrides: tuple[str, str]) -> str:
        with pytest.raises(ConfigError) as err:
            slurm_partition.check_nodes_fit(config.load(None, list(overrides)).slurm)
        return str(err.value)

    assert refusal(("slurm.ranks_per_node", "64")) == (
        "the job asks for 64 CPUs per node, but no node of the default partition has as many (sinfo: 8 CPUs and 0 GPUs "
        "at most), so it would wait in the queue for ever; ask for fewer ranks or cores per node (--ranks-per-node, "
        "--cpus-per-node, --gpus-per-node), or another --partition.")
    assert refusal(("slurm.gpus_per_node", "1"), ("slurm.partition", "debug")).startswith(
        "the job asks for 1 CPU and 1 GPU per node, but no node of partition debug has as many (sinfo: 8 CPUs and 0 GPUs")
    assert refusal(("slurm.nodes", "3")) == ("the job asks for 3 nodes, but the default partition has 2 nodes (sinfo), so "
                                             "it would wait in the queue for ever; ask for 2 or fewer (--nodes), or "
                                             "another --partition.")
    slurm_partition.check_nodes_fit(config.load(None, [("slurm.nodes", "2"), ("slurm.ranks_per_node", "8")]).slurm)  # fits
    # sbatch, not this check, names a partition the cluster does not have
    slurm_partition.check_nodes_fit(config.load(None, [("slurm.partition", "nosuch"), ("slurm.ranks_per_node", "64")]).slurm)


@pytest.mark.timeout(60)
def test_submit_refuses_a_job_that_would_pend_for_ever_before_writing_anything(slurm_cluster, monkeypatch, tmp_path, capsys):
    from dptrain.cli import main

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    for dry_run in ([], ["--dry-run"]):  # the dry run makes the same check (it printed the script of such a job)
        assert main(["submit", *SHORT, "--output.name", "too-wide", "--ranks-per-node", "64",
                     "--train.global_batch_size", "128", *dry_run]) == 2
        out, err = capsys.readouterr()
        assert "would wait in the queue for ever" in err and "#SBATCH" not in out
        assert not (tmp_path / "runs").exists()


def test_a_job_submitted_with_a_batch_per_rank_trains_that_batch_per_rank_when_resized(slurm_cluster, jobs):
    """`dptrain submit --batch_size 16 --nodes 1`, then `sbatch --nodes=2 runs/NAME/job.sbatch`: 2 ranks of 16 each
    (job.toml wrote both the per-rank batch and the global batch it made of it, so every rank of the resized job
    refused its batch: '... give one of the two')."""
    held, run_dir = jobs["resized"]
    assert slurm_cluster.job(held)["JobState"] == "PENDING"
    assert slurm_cluster.run("scancel", str(held)).returncode == 0
    given = config.load(run_dir / slurm_job.CONFIG_NAME)
    assert given.train.batch_size_per_rank == 16
    assert given.train.global_batch_size == config.TrainConfig.global_batch_size  # the default, which gives way
    job_id = slurm_cluster.sbatch(run_dir / slurm_job.SCRIPT_NAME, "--nodes=2")
    assert slurm_cluster.run("scontrol", "release", str(job_id)).returncode == 0  # its #SBATCH --hold
    job = slurm_cluster.wait(job_id, timeout=240)
    assert job["JobState"] == "COMPLETED", (job, job_output(run_dir))
    [start] = read_events(run_dir, "run_start")
    assert (start["world_size"], start["global_batch_size"]) == (2, 32)
    errors = (run_dir / "logs" / f"slurm-{job_id}.err").read_text()
    assert errors.count("global batch 32 = train.batch_size_per_rank 16 x 2 ranks") == 1, errors  # said once


def test_a_users_ddp_script_trains_across_both_nodes_with_rank_0_on_the_first_and_saves_its_model(slurm_cluster, jobs):
    job, run_dir = finished(slurm_cluster, jobs, "user-script")
    assert job["NodeList"] == "n[1-2]" and job["NumTasks"] == "2"  # one torchrun on each node
    saved = run_dir.parent.parent / "saved-user-script"  # --model_dir, from the folder the job ran in
    weights = torch.load(saved / "model.pt")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {"1.weight": (10, 784), "1.bias": (10,)}
    assert [(r["rank"], r["node"]) for r in json.loads((saved / "ranks.json").read_text())] == [(0, 0), (1, 1)]
    output = job_output(run_dir)
    assert "Epoch 02/02 | loss" in output and "| world 2" in output  # rank 0's lines, in the job's output


@pytest.mark.nightly
def test_the_tutorials_lightning_script_trains_across_both_nodes_and_saves_its_model(slurm_cluster, nightly_jobs):
    """Lightning under the job's torchrun on each node (its TorchElasticEnvironment): 1 device a node x 2 nodes, rank 0
    on the first node, the model saved by rank 0 where --model_dir says, its epoch lines in the job's output."""
    job, run_dir = finished(slurm_cluster, nightly_jobs, "lightning-script")
    assert job["NodeList"] == "n[1-2]" and job["NumTasks"] == "2"
    saved = run_dir.parent.parent / "saved-lightning-script"
    weights = torch.load(saved / "model.pt")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {"1.weight": (10, 784), "1.bias": (10,)}
    assert [(r["rank"], r["node"]) for r in json.loads((saved / "ranks.json").read_text())] == [(0, 0), (1, 1)]
    output = job_output(run_dir)
    assert "Epoch 02 | loss" in output and "| world 2" in output, output


def test_a_script_that_reads_slurms_variables_is_one_world_of_every_rank_with_mode_per_rank(slurm_cluster, jobs):
    """Issue 42: under one torchrun per node such a script read its node's one task, and each rank ran as a world of
    its own (rank 0/1 printed twice); one srun task per rank gives every rank its own SLURM_PROCID."""
    job, run_dir = finished(slurm_cluster, jobs, "slurm-vars-script")
    assert job["NumTasks"] == "4"  # a task per rank
    seen = [json.loads((run_dir.parent.parent / "seen-by-slurm-vars-script" / f"rank{r}.json").read_text())
            for r in range(4)]
    assert [(s["rank"], s["world"], s["node"]) for s in seen] == [(0, 4, 0), (1, 4, 0), (2, 4, 1), (3, 4, 1)]
    assert {s["sum"] for s in seen} == {10.0}  # 1 + 2 + 3 + 4: one world of the four
    assert [(s["RANK"], s["WORLD_SIZE"]) for s in seen] == [(str(r), "4") for r in range(4)]  # torchrun's agree
