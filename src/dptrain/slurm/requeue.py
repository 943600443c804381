"""A job's requeue after a stop: SIGUSR1 some minutes before the time limit makes every rank write a snapshot at its
next step boundary; in a job written with slurm.requeue, rank 0 then puts the job back in the queue (scontrol
requeue) and the rerun resumes from that snapshot. In a container, which has no scontrol, rank 0 writes a file
instead, and the job's script requeues the job once srun returns (script.py writes those lines).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Callable

from dptrain.events import JOB_ID, REASON, REQUEUE_EVENT, REQUEUE_FAILED_EVENT, STEP
from dptrain.slurm.env import slurm_value

# Exported by the script: rank 0 requeues the job after a signal's snapshot (requeue_after_stop); in a container, where
# there is no scontrol, the variable names a file that rank 0 writes instead, and the script requeues the job.
REQUEUE_VAR = "DPTRAIN_REQUEUE"

log = logging.getLogger(__name__)


def requeue(job_id: str) -> str | None:
    """Put a running job back in the queue; None, or why it could not be done (one line)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"scontrol could not run ({exc})"
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"scontrol exited with {done.returncode}"
    return None


def ask_the_script_to_requeue(request: Path, step: int) -> str | None:
    """Write the file the job's script looks for after srun (a container job's requeue); None, or why it failed."""
    try:
        request.write_text(f"{step}\n")
    except OSError as exc:
        return f"could not write {request} ({exc.strerror or exc})"
    return None


def requeue_after_stop(step: int, emit: Callable[..., object]) -> None:
    """In a job that `dptrain submit` wrote with requeue: put it back in the queue once the stop's snapshot is written
    (every rank has passed its last barrier); the rerun resumes from it. SLURM then ends this job's processes.
    In a container, which has no scontrol, REQUEUE_VAR names a file instead: written here, the job's script requeues
    the job once srun returns. emit(event, **fields) records the requeue, and a refusal, in the run's event log."""
    job_id = slurm_value("job_id")
    request = os.environ.get(REQUEUE_VAR, "")
    if not (request == "1" or request.startswith("/")) or not job_id:
        return
    # Said first: once the job is requeued, SLURM ends this process at once, before any line written after.
    log.warning("requeueing job %s: it resumes from the snapshot of step %d when it runs again", job_id, step)
    emit(REQUEUE_EVENT.name, **{STEP: step, JOB_ID: job_id})
    refused = requeue(job_id) if request == "1" else ask_the_script_to_requeue(Path(request), step)
    if refused is not None:
        log.error("could not requeue job %s (%s); resubmit its job.sbatch to resume", job_id, refused)
        emit(REQUEUE_FAILED_EVENT.name, **{STEP: step, JOB_ID: job_id, REASON: refused})
