"""The private SLURM cluster itself (tests/slurm_cluster.py): real multi-node jobs, sharing a node, requeue, signals."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.slurm_cluster import parse_scontrol_record

pytestmark = pytest.mark.slow


def write_script(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text("#!/bin/bash\n" + body)
    return script


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.1)


def test_a_batch_job_runs_one_task_on_each_of_two_nodes(slurm_cluster, tmp_path):
    script = write_script(tmp_path, "two-nodes.sh", f"""\
#SBATCH -N 2 --ntasks-per-node=1
srun bash -c 'echo "$SLURM_PROCID $SLURM_NODEID $SLURM_JOB_NODELIST" > {tmp_path}/task-$SLURM_PROCID.txt'
""")
    job = slurm_cluster.wait(slurm_cluster.sbatch(script), timeout=60)
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]")
    tasks = sorted((tmp_path / f"task-{rank}.txt").read_text().split() for rank in (0, 1))
    assert tasks == [["0", "0", "n[1-2]"], ["1", "1", "n[1-2]"]]


def test_two_jobs_of_two_tasks_run_together_on_one_node(slurm_cluster, tmp_path):
    """Each node declares 4 CPUs (more than the machine has), so both jobs run on n1 at once."""
    release = tmp_path / "release"
    script = write_script(tmp_path, "hold.sh", f"""\
for _ in $(seq 600); do [[ -e {release} ]] && exit 0; sleep 0.1; done
exit 1
""")
    first, second = (slurm_cluster.sbatch(script, "-w", "n1", "-n", "2") for _ in range(2))
    try:
        running = [slurm_cluster.wait_running(job_id, timeout=20) for job_id in (first, second)]
        assert slurm_cluster.job(first)["JobState"] == "RUNNING"  # still, now that the second one runs too
        assert [(job["NodeList"], job["NumTasks"]) for job in running] == [("n1", "2"), ("n1", "2")]
    finally:
        release.touch()
    assert [slurm_cluster.wait(job_id, timeout=30)["JobState"] for job_id in (first, second)] == ["COMPLETED"] * 2


def test_a_job_that_requeues_itself_once_reruns_and_completes(slurm_cluster, tmp_path):
    """The rerun waits for the job credential to expire (cred_expire, here the least slurm accepts)."""
    script = write_script(tmp_path, "requeue.sh", f"""\
#SBATCH -N 1 -n 1
echo "${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N)" >> {tmp_path}/starts.txt
if [[ "${{SLURM_RESTART_COUNT:-0}}" == 0 ]]; then
  scontrol requeue "$SLURM_JOB_ID"
  sleep 120
  exit 3
fi
""")
    job = slurm_cluster.wait(slurm_cluster.sbatch(script), timeout=90)
    assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0")
    starts = [line.split() for line in (tmp_path / "starts.txt").read_text().splitlines()]
    assert [count for count, _ in starts] == ["0", "1"]
    rerun_after = float(starts[1][1]) - float(starts[0][1])
    print(f"requeue: the rerun started {rerun_after:.1f} s after the first start")
    # ~6 s here; with slurm's default scheduling intervals it is 27-41 s, and with its default cred_expire 2 min
    assert rerun_after < 20, f"the requeued job reran only after {rerun_after:.0f} s"


def test_scancel_signal_reaches_srun_tasks_but_not_the_batch_shell(slurm_cluster, tmp_path):
    """`scancel --signal=USR1 JOB` (no --batch/--full) signals the job's steps, i.e. every srun task."""
    script = write_script(tmp_path, "usr1.sh", f"""\
#SBATCH -N 2 --ntasks-per-node=1
trap 'touch {tmp_path}/batch-got-usr1' USR1
srun bash -c 'trap "touch {tmp_path}/task-$SLURM_PROCID-got-usr1; exit 0" USR1
              touch {tmp_path}/task-$SLURM_PROCID-ready
              for _ in $(seq 300); do sleep 0.1; done; exit 1' &
wait $!
""")
    job_id = slurm_cluster.sbatch(script)
    for rank in (0, 1):
        wait_for_file(tmp_path / f"task-{rank}-ready", timeout=30)
    assert slurm_cluster.run("scancel", "--signal=USR1", str(job_id)).returncode == 0
    job = slurm_cluster.wait(job_id, timeout=30)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0")
    assert sorted(p.name for p in tmp_path.glob("*got-usr1")) == ["task-0-got-usr1", "task-1-got-usr1"]


def test_parse_scontrol_record_keeps_values_with_equals_signs_and_spaces():
    line = ("JobId=7 JobName=x JobState=PENDING Reason=BeginTime Dependency=(null) TRES=cpu=2,node=1 Comment=a b c "
            "Restarts=1")
    record = parse_scontrol_record(line)
    assert record["TRES"] == "cpu=2,node=1"
    assert record["Comment"] == "a b c"
    assert record["Restarts"] == "1"
