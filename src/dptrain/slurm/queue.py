"""The queue: submitting a job script (sbatch), how submitted jobs are doing (squeue) and waiting until they have
ended, for `dptrain bench sweep --slurm`.

    job_id = submit(Path("runs/fashion-mnist_mnist-cnn_ddp/job.sbatch"))
    states = job_states(["12", "13"])  # {"12": "RUNNING"}: 13 is forgotten, so it has ended
    wait_for(["12"], on_end=lambda job_id, state: print(job_id, state))
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from dptrain.errors import LaunchError
from dptrain.run_folder import RunFolder
from dptrain.slurm.job import Job

# squeue's job states (its long names, %T) of a job that will not run again; every other state (PENDING, RUNNING,
# COMPLETING, REQUEUED, SUSPENDED, ...) may still lead to a run. A requeued job is PENDING again, not ended.
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"})
POLL_S = 2.0  # wait_for asks squeue this often
QUERY_GRACE_S = 600.0  # wait_for retries a failing squeue (a restarting controller, say) this long

log = logging.getLogger(__name__)


def submit(script: Path) -> str:
    """sbatch the script; its job id. LaunchError in one sentence where sbatch is missing or refuses."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError(f"sbatch is not on PATH here; run dptrain submit on a SLURM login node, or submit {script} "
                          f"with sbatch yourself.")
    done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        reason = next((line.strip() for line in done.stderr.splitlines() if line.strip()), f"exit code {done.returncode}")
        raise LaunchError(f"sbatch refused the job ({reason.removeprefix('sbatch: error: ')}); the script is kept in "
                          f"{script}: fix the slurm options and submit again.")
    return done.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def submit_written(job: Job, text: str, config_text: str | None) -> str:
    """Write the job's files (its logs' folders, its job.toml where config_text is given, job.sbatch) and sbatch it:
    its job id."""
    RunFolder(job.run_dir).logs.mkdir(parents=True, exist_ok=True)
    for log_file in (job.output(), job.errors()):  # SLURM writes no file into a folder that is not there
        if "%" not in str(log_file.parent):
            log_file.parent.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        job.config.write_text(config_text)
    job.script.write_text(text)
    return submit(job.script)


def job_record(job_id: str) -> dict[str, str]:
    """scontrol's record of a job (JobState, Restarts, NodeList, ...); empty where scontrol cannot say."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    record = {}
    for word in done.stdout.split():
        key, sep, value = word.partition("=")
        if sep:
            record.setdefault(key, value)
    return record


def require_clients(command: str) -> None:
    """sbatch (to submit) and squeue (to wait) are here; else LaunchError in one sentence naming the missing one."""
    for name in ("sbatch", "squeue"):
        if shutil.which(name) is None:
            raise LaunchError(f"{name} is not on PATH here; run {command} on a SLURM login node.")


def job_states(job_ids: Iterable[str]) -> dict[str, str]:
    """job id -> its state (squeue's long names: PENDING, RUNNING, COMPLETED, FAILED, ...) for the jobs the scheduler
    still knows; one it has forgotten (some minutes after its end, MinJobAge) is left out. LaunchError in one sentence
    where squeue is missing or fails."""
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return {}
    squeue = shutil.which("squeue")
    if squeue is None:
        raise LaunchError("squeue is not on PATH here, so the jobs' states cannot be asked for; run this on a SLURM "
                          "login node.")
    try:  # --states=all: ended jobs too, as long as the scheduler keeps them
        done = subprocess.run([squeue, "--noheader", "--states=all", "--format=%i|%T", f"--jobs={','.join(ids)}"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(f"squeue could not run ({exc}); check that the SLURM controller answers (squeue).") from None
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:  # squeue's answer when it knows none of the ids any more
            return {}
        reason = next((line.strip() for line in done.stderr.splitlines() if line.strip()), f"exit code {done.returncode}")
        raise LaunchError(f"squeue failed ({reason}); check that the SLURM controller answers (squeue).")
    states = {}
    for line in done.stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id in ids and state.strip():
            states[job_id] = state.split()[0]
    return states


def has_ended(state: str | None) -> bool:
    """A job in this state (None: forgotten by the scheduler) will not run again."""
    return state is None or state in ENDED_STATES


def wait_for(job_ids: Iterable[str], on_end: Callable[[str, str | None], None], poll_s: float | None = None) -> None:
    """Ask squeue every poll_s seconds (POLL_S) until every job has ended; on_end(job id, its last state, None where
    the scheduler has forgotten it) once for each, as it ends. A failing squeue is retried for QUERY_GRACE_S, then
    its LaunchError is raised."""
    waiting = list(dict.fromkeys(job_ids))
    failing_since: float | None = None
    while waiting:
        try:
            states = job_states(waiting)
            failing_since = None
        except LaunchError as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                log.warning(f"{exc} Trying again for {QUERY_GRACE_S:g} s.")
            if now - failing_since > QUERY_GRACE_S:
                raise
            time.sleep(POLL_S if poll_s is None else poll_s)
            continue
        for job_id in list(waiting):
            if has_ended(states.get(job_id)):
                waiting.remove(job_id)
                on_end(job_id, states.get(job_id))
        if waiting:
            time.sleep(POLL_S if poll_s is None else poll_s)
