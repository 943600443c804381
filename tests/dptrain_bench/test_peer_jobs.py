"""`dptrain bench --slurm` with the other engines (tutorial, lightning, deepspeed): each point a job of one torchrun per
node, meeting at the first node. Their scripts and files (one submitted held, as the scheduler reads it); then one
point of each engine, and a sweep over node counts, as real jobs on the private cluster (tests/slurm_cluster.py)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from dptrain_bench import jobs as jobs_mod
from dptrain_bench.collect import run_nodes
from dptrain_bench.sweep import plan, sweep_from_options
from dptrain.errors import ConfigError
from dptrain.slurm import queue as slurm_queue
from tests.dptrain_bench.test_slurm_sweep import TINY, bench, read_rows

IMAGE = "docker://nvcr.io/nvidia/pytorch:25.01-py3"


def test_a_peer_engines_job_runs_torchrun_on_every_node(tmp_path, capsys):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--dry-run", "--engines", "tutorial", "--nodes", "2",
                                    "--strategies", "ddp", "--cpus-per-node", "4", "--time", "00:10:00", "--setup",
                                    "module load x", "--output.dir", "out", *TINY])
    assert code == 0, err
    run_dir = tmp_path / "out" / "runs" / "tutorial-ddp-w2-r1"
    assert capsys.readouterr().out == f"""\
# tutorial-ddp-w2-r1: 2 nodes x 1 rank, would be written to {run_dir}/job.sbatch and submitted
#!/bin/bash
# tutorial engine's training (dptrain bench) of out/runs/tutorial-ddp-w2-r1: 2 nodes x 1 rank (one elastic agent \
per node, gloo on CPUs).
# Written by `dptrain submit`; submit it again with: sbatch {run_dir}/job.sbatch
#SBATCH --job-name=dptrain-tutorial-ddp-w2-r1
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --time=00:10:00
#SBATCH --chdir={tmp_path}
#SBATCH --output={run_dir}/logs/slurm-%j.out
#SBATCH --error={run_dir}/logs/slurm-%j.err
#SBATCH --open-mode=append

set -e

module load x

# The first node hosts the agents' rendezvous, at its address as the scheduler knows it (its name may not resolve on
# the other nodes), on a port derived from the job id, so that two jobs sharing a node never collide.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$(scontrol show node -o "$head_node" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))

# Each rank's share of the node's cores, as dptrain's ranks take theirs from --cpus-per-task (torchrun
# alone gives one thread to each of several ranks, and torch gives one rank every core it sees).
export OMP_NUM_THREADS=4

# One torchrun per node, as the engine's users run it on a cluster: the agents meet at MASTER_ADDR:MASTER_PORT
# (c10d rendezvous, hosted by the first node), each starts its node's ranks, which read RUN_DIR/config.toml.
# --kill-on-bad-exit: a node that fails stops the others at once, instead of at their timeout.
srun --kill-on-bad-exit=1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" -m dptrain_bench.tutorial {run_dir}
"""
    assert not (tmp_path / "out").exists()


def test_a_gpu_peer_job_gives_each_node_its_gpus_and_ranks(tmp_path, capsys):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--dry-run", "--engines", "dptrain,lightning", "--nodes", "1,2",
                                    "--strategies", "ddp", "--gpus-per-node", "4", "--output.dir", "out", *TINY])
    assert code == 0, err
    lightning = {name: text for name, text in scripts_by_point(capsys.readouterr().out).items()
                 if name.startswith("lightning-")}
    assert sorted(lightning) == ["lightning-ddp-w4-r1", "lightning-ddp-w8-r1"]
    w8 = lightning["lightning-ddp-w8-r1"]
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n" in w8
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in w8
    assert "-m dptrain_bench.lightning_engine " in w8 and "--signal" not in w8
    assert "OMP_NUM_THREADS" not in w8  # no --cpus-per-node: the threads are torchrun's and torch's choice


def test_a_peer_engines_job_in_a_container_starts_torchrun_in_it(tmp_path, capsys):
    code, _, err = bench(tmp_path, ["bench", "--slurm", "--dry-run", "--engines", "deepspeed", "--nodes", "2",
                                    "--strategies", "ddp", "--container-image", IMAGE, "--container-engine",
                                    "apptainer", "--output.dir", "out", *TINY])
    assert code == 0, err
    lines = capsys.readouterr().out.splitlines()
    srun = lines[-1]
    assert srun.startswith(f"srun --kill-on-bad-exit=1 apptainer exec --bind {tmp_path},")
    assert f" {IMAGE} " in srun
    assert srun.endswith(" python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
                         "--rdzv-endpoint \"$MASTER_ADDR:$MASTER_PORT\" --rdzv-id \"$SLURM_JOB_ID\" -m "
                         f"dptrain_bench.deepspeed_engine {tmp_path / 'out' / 'runs' / 'deepspeed-ddp-w2-r1'}")
    # the container's comments are kept, dptrain's agents' are not
    assert any(line.startswith("# Each task starts in the image (apptainer)") for line in lines)
    assert not any(line.startswith("# Each node's agent") for line in lines)


def scripts_by_point(dry_run: str) -> dict[str, str]:
    """A dry run's output as point name -> what follows its comment line (its script)."""
    parts = re.split(r"^# ([a-z0-9_]+-[a-z0-9_]+-w\d+-r\d+): .*\n", dry_run, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_gpus_per_task_for_a_peer_engine_is_one_sentence(tmp_path):
    pairs = [("data.name", "synthetic"), ("output.dir", str(tmp_path / "b"))]
    sweep, _ = sweep_from_options(config_path=None, pairs=pairs, workers=None, strategies="ddp", repeats=1,
                                  warmup_epochs=None, engines="tutorial", run_timeout_s=60.0, nodes="1",
                                  job_pairs=[("slurm.ranks_per_node", "2")],
                                  job_lines={"sbatch": ("gpus-per-task=1",)})
    with pytest.raises(ConfigError) as refused:
        jobs_mod.point_config(sweep, plan(sweep)[0])
    assert str(refused.value) == ("slurm.sbatch's --gpus-per-task=1 gives each task its GPUs, and the other engines "
                                  "run one task per node (torchrun); ask for the GPUs per node (--gpus-per-node N) "
                                  "instead.")


@pytest.mark.timeout(60)
def test_a_submitted_peer_point_holds_the_config_its_engine_trains_and_its_nodes(slurm_cluster, tmp_path, monkeypatch):
    """Submitted to the private cluster held (sbatch's SBATCH_HOLD), so that the scheduler's record of the job can be
    read without training it, then cancelled."""
    monkeypatch.chdir(tmp_path)
    for key, value in {**slurm_cluster.env, "SBATCH_HOLD": "1"}.items():
        monkeypatch.setenv(key, value)
    pairs = [("data.name", "synthetic"), ("train.epochs", "2"), ("output.dir", "b")]
    sweep, _ = sweep_from_options(config_path=None, pairs=pairs, workers=None, strategies="fsdp", repeats=1,
                                  warmup_epochs=None, engines="tutorial", run_timeout_s=60.0, nodes="2",
                                  job_pairs=[("slurm.ranks_per_node", "2"), ("slurm.requeue", "true")])
    [point] = plan(sweep)
    job_id, job = jobs_mod.submit_point(sweep, point)
    try:
        record = slurm_cluster.job(int(job_id))
    finally:
        slurm_cluster.run("scancel", job_id)
    run_dir = sweep.run_dir(point)
    assert (job.shape, point.workers) == ("2 nodes x 2 ranks", 4)
    # what sbatch read: one task (torchrun) on each of 2 nodes (NumNodes: min-max while pending), the point's script
    assert (record["JobState"], record["NumNodes"], record["NumTasks"]) == ("PENDING", "2-2", "2"), record
    assert (record["Command"], record["JobName"]) == (str(run_dir.resolve() / "job.sbatch"), f"dptrain-{point.name}")
    trains = tomllib.loads((run_dir / "config.toml").read_text())
    assert (trains["strategy"]["name"], trains["launch"]["nproc_per_node"]) == ("fsdp", 2)
    assert Path(trains["output"]["dir"]) == run_dir.resolve()
    assert run_nodes(run_dir) == 2  # collect's nodes column, from job.toml
    script = (run_dir / "job.sbatch").read_text()
    assert "--requeue" not in script and "--signal" not in script  # the plain loops write no snapshot to resume
    assert (run_dir / jobs_mod.JOB_ID_FILE).read_text() == job_id + "\n"


# ---------------------------------------------------------------------------------------------- on the cluster

def peer_sweep(cwd: Path, env: dict[str, str], engines: str, nodes: str, probes: Path) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slurm_queue, "POLL_S", 0.2)
        return bench(cwd, ["bench", "--slurm", "--engines", engines, "--nodes", nodes, "--strategies", "ddp",
                           "--cpus-per-node", "1", "--probes-from", str(probes), "--output.dir", "out", *TINY], env)


@pytest.mark.slow
@pytest.mark.timeout(120)  # 15-55 s here: two jobs side by side on 2 shared cores, mostly Lightning's and DeepSpeed's
# imports
@pytest.mark.nightly
def test_lightning_and_deepspeed_run_a_point_as_a_job_across_two_nodes(slurm_cluster, slurm_link_probes, tmp_path):
    # the tutorial engine's 2-node job is in the sweep over node counts below
    code, logs, err = peer_sweep(tmp_path, slurm_cluster.env, "lightning,deepspeed", "2", slurm_link_probes)
    assert code == 0, logs + err
    rows = read_rows(tmp_path / "out" / "results.csv")
    assert [(r["engine"], r["nodes"], r["workers"], r["status"]) for r in rows] == [
        ("deepspeed", "2", "2", "ok"), ("lightning", "2", "2", "ok")]
    for row in rows:
        run_dir = tmp_path / "out" / row["run_dir"]
        assert float(row["epoch_time_s"]) > 0 and float(row["eval_loss"]) > 0
        start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert (start["event"], start["engine"], start["world_size"]) == ("run_start", row["engine"], 2)
        env_record = json.loads((run_dir / "env.json").read_text())
        # one thread per rank, as dptrain's ranks have with --cpus-per-node 1
        assert (env_record["launched_by"], env_record["world_size"], env_record["cpu_threads_per_rank"]) == (
            "torchrun", 2, 1)
        job_id = (run_dir / jobs_mod.JOB_ID_FILE).read_text().strip()
        assert "-m torch.distributed.run --nnodes 2 " in (run_dir / "job.sbatch").read_text()
        assert (run_dir / "logs" / f"slurm-{job_id}.out").is_file()


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(120)  # 15-50 s here: four jobs side by side on 2 shared cores
def test_a_sweep_over_node_counts_writes_a_row_per_engine_and_node_count(slurm_cluster, slurm_link_probes, tmp_path):
    code, logs, err = peer_sweep(tmp_path, slurm_cluster.env, "dptrain,tutorial", "1,2", slurm_link_probes)
    assert code == 0, logs + err
    assert "4 points (2 engines x 1 strategies x workers 1,2 x 1 repeats)" in logs
    rows = read_rows(tmp_path / "out" / "results.csv")
    assert [(r["engine"], r["nodes"], r["workers"], r["status"]) for r in rows] == [
        ("dptrain", "1", "1", "ok"), ("dptrain", "2", "2", "ok"), ("tutorial", "1", "1", "ok"),
        ("tutorial", "2", "2", "ok")]
    summary = read_rows(tmp_path / "out" / "summary.csv")
    assert [(s["engine"], s["workers"]) for s in summary] == [("dptrain", "1"), ("dptrain", "2"), ("tutorial", "1"),
                                                               ("tutorial", "2")]

