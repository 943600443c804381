"""`dptrain bench --slurm`: one SLURM job per point. The job's shape for a worker count and the refusals (no
cluster); the queue, resuming with a job still in it, and a sweep end to end, on the private cluster
(tests/slurm_cluster.py).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import re
from pathlib import Path

import pytest

from dptrain_bench import jobs as jobs_mod
from dptrain_bench.collect import RESULT_COLUMNS
from dptrain_bench.folder import BenchFolder
from dptrain_bench.sweep import ERROR_FILE, job_shape, plan, runs_on_cpu, sweep_from_options
from dptrain import config
from dptrain.config import SlurmConfig
from dptrain.errors import ConfigError, LaunchError
from dptrain.slurm import queue as slurm_queue
from tests.ranks import free_port

TINY = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
        "--train.epochs", "2", "--train.global_batch_size", "32", "--train.progress_every_s", "0"]
# Two points side by side on the private cluster: w1 on one node, w2 on both, one core (and thread) per rank.
SWEEP = ["bench", "--slurm", "--workers", "1,2", "--strategies", "ddp", "--nodes", "2", "--cpus-per-node", "1",
         "--output.dir", "out", *TINY]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


LOGGERS = ("dptrain", "dptrain_bench")  # the library's commands log as dptrain, the lab's modules as dptrain_bench.*


def bench(cwd: Path, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`dptrain ARGV` in this process, from cwd: (exit code, its log lines, stderr)."""
    from dptrain.cli import main

    logs, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logs)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err):
            patch.chdir(cwd)
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            code = main(argv)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return code, logs.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------- W -> nodes x ranks

@pytest.mark.parametrize("job, shapes", [
    # CPU job: one rank per node (as dptrain submit), so W workers take W nodes
    (dict(nodes=2), {1: (1, 1, 0, 0), 2: (2, 1, 0, 0)}),
    (dict(nodes=2, cpus_per_node=2), {1: (1, 1, 0, 2), 2: (2, 1, 0, 2)}),
    # one rank per GPU: below a node's GPUs, one node with W ranks and W GPUs (and their share of the cores)
    (dict(nodes=2, gpus_per_node=4, cpus_per_node=32),
     {1: (1, 1, 1, 8), 2: (1, 2, 2, 16), 4: (1, 4, 4, 32), 8: (2, 4, 4, 32)}),
    # --ranks-per-node wins over the GPUs
    (dict(nodes=4, ranks_per_node=2, cpus_per_node=16), {1: (1, 1, 0, 8), 2: (1, 2, 0, 16), 6: (3, 2, 0, 16)}),
    (dict(nodes=2, gpus_per_node=4, ranks_per_node=2), {1: (1, 1, 2, 0), 4: (2, 2, 4, 0)}),
])
def test_workers_map_to_nodes_times_ranks_per_node(job, shapes):
    for workers, expected in shapes.items():
        s = job_shape(workers, SlurmConfig(**job))
        assert (s.nodes, s.ranks_here, s.gpus_per_node, s.cpus_per_node) == expected, workers
        assert s.nodes * s.ranks_here == workers


@pytest.mark.parametrize("workers, job, sentence", [
    (6, dict(nodes=2, gpus_per_node=4), "6 workers do not fill whole nodes of 4 ranks (--ranks-per-node, else "
                                        "--gpus-per-node); give worker counts below 4 or multiples of 4."),
    (16, dict(nodes=2, gpus_per_node=4), "16 workers take 4 nodes of 4 ranks and --nodes is 2; give --nodes 4, or "
                                         "drop 16 from --workers."),
    (2, dict(), "2 workers take 2 nodes of 1 rank and --nodes is 1; give --nodes 2, or drop 2 from --workers."),
])
def test_worker_counts_that_do_not_fit_are_refused(workers, job, sentence):
    with pytest.raises(ConfigError) as refused:
        job_shape(workers, SlurmConfig(**job))
    assert str(refused.value) == sentence


def test_a_gres_line_makes_whole_nodes_gpu_points_and_refuses_part_of_a_node(tmp_path):
    # A sweep whose GPUs an --sbatch gres=gpu:N line asks for ran its points as CPU jobs (gloo, no GPU checks).
    job = SlurmConfig(nodes=2, sbatch=("gres=gpu:4",))
    full = job_shape(8, job)
    assert (full.nodes, full.ranks_here, full.gpus_here) == (2, 4, 4)
    cfg = config.load(None, [("slurm.nodes", "2"), ("slurm.sbatch", "gres=gpu:4")])
    assert not runs_on_cpu(cfg, slurm=True)
    with pytest.raises(ConfigError) as refused:
        job_shape(2, job)
    assert str(refused.value) == ("2 workers take part of a node of 4 ranks, but slurm.sbatch's --gres=gpu:4 asks for a "
                                  "whole node's GPUs; ask for them with --gpus-per-node N instead, which a point on "
                                  "part of a node shares out, or give worker counts of 4 or more.")


def make(tmp_path: Path, workers: str | None, job: list[tuple[str, str]], **kw):
    pairs = [("data.name", "synthetic"), ("train.epochs", "2"), ("output.dir", str(tmp_path / "b"))]
    return sweep_from_options(config_path=None, pairs=pairs, workers=workers, strategies="ddp", repeats=1,
                              warmup_epochs=None, engines="dptrain", run_timeout_s=60.0, job_pairs=job, **kw)


def test_default_workers_are_those_the_nodes_hold(tmp_path):
    sweep, notes = make(tmp_path, None, [("slurm.nodes", "2"), ("slurm.gpus_per_node", "4")])
    assert sweep.workers == (1, 2, 4, 8) and notes == []
    sweep, notes = make(tmp_path, None, [("slurm.gpus_per_node", "4")])
    assert sweep.workers == (1, 2, 4)
    assert notes == ["dropped workers 8: --nodes 1 x 4 ranks per node do not hold them; ask for them with --workers "
                     "and --nodes"]
    sweep, _ = make(tmp_path, None, [])
    assert sweep.workers == (1,) and sweep.job == SlurmConfig()


def test_a_sweep_of_node_counts_runs_each_point_on_whole_nodes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep, notes = make(tmp_path, None, [("slurm.ranks_per_node", "2")], nodes="4,1,2")
    assert (sweep.workers, sweep.job.nodes, notes) == ((2, 4, 8), 4, [])  # nodes x 2 ranks; the most nodes is 4
    shapes = [(cfg.slurm.nodes, cfg.slurm.ranks_here) for cfg, _ in jobs_mod.checks(sweep)]
    assert shapes == [(1, 2), (2, 2), (4, 2)]
    # with --workers, --nodes keeps its meaning: the most nodes a point may take
    sweep, _ = make(tmp_path, "1,2", [], nodes="2")
    assert (sweep.workers, sweep.job.nodes) == ((1, 2), 2)
    assert [cfg.slurm.nodes for cfg, _ in jobs_mod.checks(sweep)] == [1, 2]


def test_the_job_options_and_lines_reach_every_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep, _ = make(tmp_path, "1,4", [("slurm.nodes", "2"), ("slurm.ranks_per_node", "2"), ("slurm.partition", "p")],
                    job_lines={"setup": ("module load x",)})
    w4 = next(p for p in plan(sweep) if p.workers == 4)
    cfg = jobs_mod.point_config(sweep, w4)
    assert (cfg.slurm.nodes, cfg.slurm.ranks_here, cfg.slurm.partition, cfg.slurm.setup) == (2, 2, "p", ("module load x",))
    assert (cfg.strategy.name, cfg.checkpoint.every_epochs) == ("ddp", 0)
    assert cfg.output.run_dir == (tmp_path / "b" / "runs" / "dptrain-ddp-w4-r1").resolve()


@pytest.mark.parametrize("options, sentence", [
    (["--nodes", "2"], "--nodes is a job option; add --slurm to run every point as a SLURM job, or drop it."),
    (["--setup", "module load x"], "--setup is a job option; add --slurm"),
    (["--requeue"], "--requeue is a job option; add --slurm"),
    (["--slurm.partition", "debug"], "--slurm.partition is a job option; add --slurm"),
    (["--dry-run"], "--dry-run prints the jobs a --slurm sweep would submit; add --slurm, or drop it."),
    (["--one-at-a-time"], "--one-at-a-time submits a --slurm sweep's jobs one after another"),
    (["--slurm", "--run-timeout-s", "10"], "--run-timeout-s limits runs on this machine; with --slurm each job's --time"),
    (["--slurm", "--workers", "1,2", "--nodes", "1,2"], "--nodes 1,2 sweeps node counts and --workers 1,2 sweeps "
     "worker counts; give one of them (with --workers, --nodes is one number: the most nodes a point may take)."),
    (["--slurm", "--nodes", "0,2"], "--nodes 0,2 holds a count below 1; give node counts of 1 or more."),
    (["--slurm", "--nodes", "1,3"], "train.global_batch_size 32 is not divisible by 3 workers; choose a multiple of "
     "3, or drop 3 from --nodes."),
    (["--slurm", "--nodes", "two"], "--nodes two is not a comma-separated list of integers; for example --nodes "
     "1,2,4."),
    (["--slurm", "--workers", "1,2"], "2 workers take 2 nodes of 1 rank and --nodes is 1; give --nodes 2"),
    (["--slurm", "--workers", "4,6", "--gpus-per-node", "4", "--nodes", "2"], "6 workers do not fill whole nodes of 4"),
    (["--slurm", "--workers", "1", "--time", "2h"], "slurm.time = '2h' is not a time sbatch reads"),
])
def test_options_that_make_no_sense_are_one_sentence(tmp_path, options, sentence):
    code, _, err = bench(tmp_path, ["bench", *options, "--output.dir", "out", *TINY])
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"dptrain: error: {sentence}"), line
    assert not (tmp_path / "out").exists()


def test_without_sbatch_on_path_nothing_is_written(tmp_path):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--workers", "1", "--output.dir", "out", *TINY],
                         env={"PATH": str(tmp_path / "nothing")})
    assert (code, err) == (1, "dptrain: error: sbatch is not on PATH here; run dptrain bench --slurm on a SLURM login "
                              "node.\n")
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_every_job_and_writes_nothing(tmp_path, capsys):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--dry-run", "--workers", "1,2", "--strategies", "ddp",
                                    "--nodes", "2", "--cpus-per-node", "2", "--output.dir", "out", *TINY])
    assert code == 0, err
    assert not (tmp_path / "out").exists()
    out = capsys.readouterr().out
    runs = tmp_path / "out" / "runs"
    w1, w2 = out.split("#!/bin/bash\n")[1:]
    assert out.startswith(f"# dptrain-ddp-w1-r1: 1 node x 1 rank, would be written to {runs / 'dptrain-ddp-w1-r1'}/"
                          f"job.sbatch and submitted\n")
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n" in w1
    assert f"# dptrain-ddp-w2-r1: 2 nodes x 1 rank, would be written to {runs / 'dptrain-ddp-w2-r1'}/job.sbatch" in w1
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n" in w2
    assert w2.endswith(f"--config {runs / 'dptrain-ddp-w2-r1' / 'job.toml'}\n")


def test_dry_run_of_node_counts_prints_a_job_per_node_count(tmp_path, capsys):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--dry-run", "--nodes", "1,2", "--strategies", "ddp",
                                    "--output.dir", "out", *TINY])
    assert code == 0, err
    out = capsys.readouterr().out
    assert [line.split(",")[0] for line in out.splitlines() if line.startswith("# dptrain-")] == [
        "# dptrain-ddp-w1-r1: 1 node x 1 rank", "# dptrain-ddp-w2-r1: 2 nodes x 1 rank"]
    assert "#SBATCH --nodes=1\n" in out and "#SBATCH --nodes=2\n" in out


# ---------------------------------------------------------------------------------------------- resuming

def stand_in_job(cluster, folder: Path, name: str, body: str, *sbatch_args: str) -> str:
    """A real job on the private cluster whose script runs `body` (the job a point's first submission made, in its
    stead: what it leaves is what the test is about, not a training); its id."""
    folder.mkdir(exist_ok=True)
    script = folder / f"{name}.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    return str(cluster.sbatch(script, *sbatch_args))


NEVER_GIVEN = "60000000"  # a job id far above any the session's cluster gives (it counts from 1)


@pytest.mark.timeout(60)
def test_job_states_asks_squeue_about_ended_jobs_too(slurm_cluster, tmp_path, monkeypatch):
    """The private cluster's own squeue: a held job, one that completed and one that failed (kept MinJobAge, 300 s),
    an id it never gave; then a cluster whose controller does not answer."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    jobs = tmp_path / "jobs"
    held = stand_in_job(slurm_cluster, jobs, "held", "true", "--hold")
    try:
        completed = stand_in_job(slurm_cluster, jobs, "completed", "true")
        failed = stand_in_job(slurm_cluster, jobs, "failed", "exit 3")
        for job_id in (completed, failed):
            slurm_cluster.wait(int(job_id))
        assert slurm_queue.job_states([held, completed, failed, NEVER_GIVEN]) == {
            held: "PENDING", completed: "COMPLETED", failed: "FAILED"}
        assert slurm_queue.job_states([NEVER_GIVEN]) == {}  # squeue's "Invalid job id": forgotten, so ended
    finally:
        slurm_cluster.run("scancel", held)
    assert [slurm_queue.has_ended(s) for s in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED", "TIMEOUT", None)] == [
        False, False, False, True, True, True]
    # The same cluster's configuration, its controller's port one where nothing listens; MessageTimeout=1 makes
    # squeue give up after 1 s instead of 18 s of retries.
    conf = re.sub(r"^(SlurmctldPort=\d+|MessageTimeout=.*)$\n?", "", slurm_cluster.conf_path.read_text(), flags=re.M)
    silent = tmp_path / "silent.conf"
    silent.write_text(f"{conf}SlurmctldPort={free_port()}\nMessageTimeout=1\n")
    monkeypatch.setenv("SLURM_CONF", str(silent))
    with pytest.raises(LaunchError, match=r"^squeue failed \(slurm_load_jobs error: Unable to contact slurm "
                                          r"controller \(connect failure\)\); check that the SLURM controller answers"):
        slurm_queue.job_states([completed])


def finishing(run_dir: Path) -> str:
    """A stand-in job's script line that leaves in run_dir what a finished point's run does (its run_end event)."""
    events = "".join(json.dumps({"event": kind}) + "\n" for kind in ("run_start", "run_end"))
    (run_dir.parent / f"{run_dir.name}.jsonl").write_text(events)
    return f"cp {run_dir.parent / run_dir.name}.jsonl {run_dir / 'metrics.jsonl'}"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_resumed_sweep_submits_only_points_neither_done_nor_queued(slurm_cluster, tmp_path, monkeypatch, caplog):
    """On the private cluster, as a first run of the sweep left it: w1-r1 done; w1-r2's job held in the queue (not
    submitted again, waited for, released once the sweep waits); w1-r3's job failed and w1-r4 never started (both
    submitted, in plan order, their real jobs failing in their set-up line, recorded with its output)."""
    monkeypatch.chdir(tmp_path)
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(slurm_queue, "POLL_S", 0.2)
    sweep, _ = sweep_from_options(config_path=None, pairs=[("data.name", "synthetic"), ("output.dir", "b")],
                                  workers="1", strategies="ddp", repeats=4, warmup_epochs=None, engines="dptrain",
                                  run_timeout_s=60.0, job_pairs=[("slurm.nodes", "1")],
                                  job_lines={"setup": ("ls /no/such/dir",)})  # one node: no link to probe
    names = {p.name: p for p in plan(sweep)}
    run_dirs = {name: sweep.run_dir(point).resolve() for name, point in names.items()}
    for run_dir in run_dirs.values():
        run_dir.mkdir(parents=True)
    jobs = tmp_path / "jobs"
    done = stand_in_job(slurm_cluster, jobs, "done", finishing(run_dirs["dptrain-ddp-w1-r1"]))
    failed = stand_in_job(slurm_cluster, jobs, "failed", "exit 3")
    held = stand_in_job(slurm_cluster, jobs, "held", finishing(run_dirs["dptrain-ddp-w1-r2"]), "--hold")
    try:
        for job_id in (done, failed):
            slurm_cluster.wait(int(job_id))
        for name, job_id in (("dptrain-ddp-w1-r1", done), ("dptrain-ddp-w1-r2", held), ("dptrain-ddp-w1-r3", failed)):
            (run_dirs[name] / jobs_mod.JOB_ID_FILE).write_text(job_id + "\n")
        (run_dirs["dptrain-ddp-w1-r3"] / "stale").write_text("from the failed job")
        real_wait_for, waited = slurm_queue.wait_for, []

        def released_then_waited_for(job_ids, on_end):  # the scheduler's own waiting, once the hold is lifted
            waited.append(list(job_ids))
            slurm_cluster.run("scontrol", "release", held, check=True)
            real_wait_for(job_ids, on_end)

        monkeypatch.setattr(slurm_queue, "wait_for", released_then_waited_for)
        with caplog.at_level(logging.INFO, logger="dptrain"), caplog.at_level(logging.INFO, logger="dptrain_bench"):
            failures = jobs_mod.run_jobs(sweep)
    finally:
        slurm_cluster.run("scancel", held)
    resubmitted = {name: (run_dirs[name] / jobs_mod.JOB_ID_FILE).read_text().strip()
                   for name in ("dptrain-ddp-w1-r3", "dptrain-ddp-w1-r4")}
    assert waited == [[held, *resubmitted.values()]]  # the held job and the two submitted, in plan order
    assert slurm_cluster.job(int(held))["JobState"] == "COMPLETED"
    assert [p.name for p, _ in failures] == list(resubmitted)
    for (name, job_id), (_, error) in zip(resubmitted.items(), failures):
        assert slurm_cluster.job(int(job_id))["Command"] == str(run_dirs[name] / "job.sbatch")
        assert (run_dirs[name] / "job.toml").is_file()
        assert error.startswith(f"job {job_id} ended FAILED; last output: ls: cannot access '/no/such/dir'"), error
        assert (run_dirs[name] / ERROR_FILE).read_text() == error + "\n"
    assert not (run_dirs["dptrain-ddp-w1-r3"] / "stale").exists()
    text = caplog.text
    assert "4 points (1 engines x 1 strategies x workers 1 x 4 repeats) in b as SLURM jobs; 1 done already, " \
           "1 queued or running, 2 to submit" in text
    assert f"bench: dptrain-ddp-w1-r1: done already (job {done}), not submitted" in text
    assert f"bench: dptrain-ddp-w1-r2: job {held} is PENDING, not submitted again; waiting for it" in text
    assert re.search(rf"bench: \[[123]/3\] dptrain-ddp-w1-r2: job {held} COMPLETED after ", text), text
    assert f"bench: submitted job {resubmitted['dptrain-ddp-w1-r3']} for dptrain-ddp-w1-r3 (1 node x 1 rank)" in text


def test_a_failed_jobs_error_is_its_first_error_line_else_its_end(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    assert jobs_mod.job_error(tmp_path, "5", None) == "job 5 ended (the scheduler no longer knows it); no output"
    (logs / "slurm-5.out").write_text("INFO starting\n")
    (logs / "slurm-5.err").write_text("slurmstepd: error: *** JOB 5 ON n1 CANCELLED AT 2026-11-23T15:32 DUE TO TIME "
                                      "LIMIT ***\n")
    assert jobs_mod.job_error(tmp_path, "5", "TIMEOUT") == (
        "job 5 ended TIMEOUT; last output: INFO starting")  # .err first, then .out: the last line of both
    assert jobs_mod.job_error(tmp_path, "5", "COMPLETED") == "job 5 ended COMPLETED without a run_end event in metrics.jsonl"
    (logs / "slurm-5.out").write_text("Traceback (most recent call last):\nRuntimeError: out of memory\n")
    assert jobs_mod.job_error(tmp_path, "5", "FAILED") == "RuntimeError: out of memory"


# ---------------------------------------------------------------------------------------------- on the cluster

@pytest.fixture(scope="module")
def cluster_sweep(slurm_cluster, tmp_path_factory):
    """A 2-point sweep on the private cluster, its waiting interrupted (as by Ctrl-C) right after the submission,
    then run again: (working folder, the cluster's environment, the two runs' outputs)."""
    cwd = tmp_path_factory.mktemp("bench-slurm")
    env = slurm_cluster.env
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slurm_queue, "POLL_S", 0.2)

        def interrupted(job_ids, on_end):
            raise KeyboardInterrupt

        with patch.context() as ctrl_c:
            ctrl_c.setattr(slurm_queue, "wait_for", interrupted)
            first = bench(cwd, SWEEP, env)
        second = bench(cwd, SWEEP, env)
    return cwd, env, first, second


def job_ids(cluster) -> list[str]:
    return cluster.run("squeue", "--noheader", "--states=all", "--format=%i").stdout.split()


@pytest.mark.nightly  # a sweep of jobs (12 s); the default run keeps the private cluster's jobs (tests/slurm)
@pytest.mark.timeout(120)
def test_a_sweep_of_jobs_writes_the_rows_of_the_local_sweep_with_their_nodes(slurm_cluster, cluster_sweep):
    cwd, _, (code, logs, err), (code2, logs2, err2) = cluster_sweep
    assert code == 130 and "2 to submit" in logs and "the jobs go on: run the same command again" in logs, logs + err
    assert code2 == 0, logs2 + err2
    # the second run found both jobs queued or running and waited for them instead of submitting them again
    assert "0 done already, 2 queued or running, 0 to submit" in logs2 and "submitted job" not in logs2, logs2
    assert logs2.count("not submitted again; waiting for it") == 2
    bench_dir = cwd / "out"
    rows = read_rows(bench_dir / "results.csv")
    assert tuple(rows[0]) == RESULT_COLUMNS
    assert [(r["engine"], r["strategy"], r["nodes"], r["workers"], r["status"]) for r in rows] == [
        ("dptrain", "ddp", "1", "1", "ok"), ("dptrain", "ddp", "2", "2", "ok")]
    for row in rows:
        assert row["epochs_timed"] == "1" and float(row["epoch_time_s"]) > 0 and float(row["eval_loss"]) > 0
        run_dir = bench_dir / row["run_dir"]
        script = (run_dir / "job.sbatch").read_text()
        assert f"#SBATCH --nodes={row['nodes']}\n" in script and "#SBATCH --cpus-per-task=1\n" in script
        job_id = (run_dir / jobs_mod.JOB_ID_FILE).read_text().strip()
        start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert (start["event"], start["world_size"], start["slurm_job_id"]) == ("run_start", int(row["workers"]), job_id)
        assert (run_dir / "logs" / f"slurm-{job_id}.out").is_file()
    assert [s["workers"] for s in read_rows(bench_dir / "summary.csv")] == ["1", "2"]
    # the link between the 2 nodes, probed by one job once the points' had ended, for the report's scaling model
    from dptrain_bench.link import read_link

    record = read_link(bench_dir)
    assert record is not None and record.across_hosts is not None and record.across_hosts.bandwidth_bps > 0, logs2
    assert "#SBATCH --nodes=2\n" in (BenchFolder(bench_dir).link_probe(2) / "job.sbatch").read_text()
    assert sorted(record.probes) == [(2, 2)]  # the 1-node point needs no probe across nodes


@pytest.mark.nightly
@pytest.mark.timeout(60)
def test_running_it_again_submits_nothing(slurm_cluster, cluster_sweep):
    cwd, env, _, _ = cluster_sweep
    before = job_ids(slurm_cluster)
    kept = (cwd / "out" / "results.csv").read_text()
    code, logs, err = bench(cwd, SWEEP, env)
    assert code == 0, logs + err
    assert "2 done already, 0 queued or running, 0 to submit" in logs
    assert logs.count("done already (job ") == 2 and "waiting for" not in logs
    assert job_ids(slurm_cluster) == before
    assert (cwd / "out" / "results.csv").read_text() == kept


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_job_that_fails_is_recorded_with_its_error_line(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_queue, "POLL_S", 0.2)
    code, logs, err = bench(tmp_path, ["bench", "--slurm", "--workers", "1", "--strategies", "ddp", "--cpus-per-node",
                                       "1", "--setup", "ls /no/such/dir", "--output.dir", "out", *TINY],
                            slurm_cluster.env)
    assert code == 1, logs + err
    [row] = read_rows(tmp_path / "out" / "results.csv")
    assert row["status"] == "failed" and row["nodes"] == "1"
    assert row["error"].startswith("job ") and "ended FAILED; last output: ls: cannot access '/no/such/dir'" in row["error"]
    assert err.startswith("dptrain: 1 of the sweep's runs failed: dptrain-ddp-w1-r1: job ")
    assert (tmp_path / "out" / "runs" / "dptrain-ddp-w1-r1" / ERROR_FILE).read_text().strip() == row["error"]


@pytest.mark.nightly  # jobs one after another (9 s); the default run keeps its refusals and the private cluster's jobs
@pytest.mark.timeout(90)
def test_one_at_a_time_submits_each_job_after_the_one_before_ended(slurm_cluster, slurm_link_probes, tmp_path,
                                                                   monkeypatch):
    # Two points that fit side by side (w1 on one node, w2 on both, a core each): each job's set-up writes when it
    # began and ended (then fails, to be quick). One at a time, the second began after the first had ended.
    monkeypatch.setattr(slurm_queue, "POLL_S", 0.2)
    times = tmp_path / "times"
    setup = f"echo begin $(date +%s.%N) >> {times}; sleep 2; echo end $(date +%s.%N) >> {times}; false"
    code, logs, err = bench(tmp_path, ["bench", "--slurm", "--one-at-a-time", "--workers", "1,2", "--strategies", "ddp",
                                       "--nodes", "2", "--cpus-per-node", "1", "--setup", setup, "--output.dir", "out",
                                       "--probes-from", str(slurm_link_probes), *TINY], slurm_cluster.env)
    assert code == 1 and "submitted one at a time" in logs, logs + err
    marks = [line.split() for line in times.read_text().splitlines()]  # the two points' (the link already probed)
    assert [kind for kind, _ in marks] == ["begin", "end"] * 2, marks
    assert all(float(marks[i][1]) >= float(marks[i - 1][1]) for i in range(2, len(marks), 2)), marks


def test_the_link_is_probed_once_for_each_node_count_of_two_or_more():
    assert jobs_mod.nodes_to_probe({1, 2, 4}, set()) == [2, 4]
    assert jobs_mod.nodes_to_probe({1, 2, 4}, {1, 2}) == [4]  # 2 nodes were probed by an earlier run of the sweep
    assert jobs_mod.nodes_to_probe({1}, set()) == [] and jobs_mod.nodes_to_probe({2, 4}, {2, 4}) == []
