"""Every SLURM variable dptrain reads, in one table, and the two rules built on them: the port a job's ranks meet on
(the job script and every task derive the same one from the job id) and the expansion of SLURM's node lists.

SLURM sets these variables in the batch shell and in every srun task. The rest of dptrain looks them up here by what
they are to it (slurm_value("global_rank")), never by name: a variable is spelled in this table and nowhere else.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

# What a variable is to dptrain -> its name; beside each, what SLURM puts in it.
SLURM_VARS = {
    "global_rank": "SLURM_PROCID",  # the task's rank among the job step's tasks
    "world_size": "SLURM_NTASKS",  # tasks of the job step
    "local_rank": "SLURM_LOCALID",  # the task's index on its node
    "local_world_size": "SLURM_NTASKS_PER_NODE",  # tasks per node: '4', or '4(x2)' for two nodes of 4
    "step_id": "SLURM_STEP_ID",  # set in srun's tasks only: the batch shell has SLURM_PROCID=0 too, but no step
    "node_rank": "SLURM_NODEID",  # the task's node, 0 to nodes - 1
    "node_list": "SLURM_JOB_NODELIST",  # the job's nodes, compressed: 'gpu[01-03,07]'
    "node_count": "SLURM_JOB_NUM_NODES",  # nodes of the job
    "job_id": "SLURM_JOB_ID",  # the job's id, the same after a requeue
    "task_cpus": "SLURM_CPUS_PER_TASK",  # cores of each task (sbatch --cpus-per-task); unset without that option
    "restarts": "SLURM_RESTART_COUNT",  # times the job was requeued; unset before its first requeue
}

# Under srun without MASTER_PORT, every task derives the same port from the job id, as the job script does, so two
# jobs sharing a node do not collide on a hard-coded port.
PORT_BASE = 20000
PORT_SPAN = 20000


def slurm_value(what: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the SLURM variable that is `what` (a key of SLURM_VARS) in environ (default: this process's);
    None where it is unset."""
    env = os.environ if environ is None else environ
    return env.get(SLURM_VARS[what])


def slurm_count(what: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A SLURM variable that holds a count (task_cpus, node_rank, restarts), as a number; None where it is unset or
    not an integer."""
    value = slurm_value(what, environ) or ""
    return int(value) if value.isdigit() else None


def in_srun_task(environ: Mapping[str, str]) -> bool:
    """This process is a task that srun started: its rank and world are SLURM's (not so in the batch shell)."""
    return all(SLURM_VARS[what] in environ for what in ("global_rank", "world_size", "step_id"))


def job_port(job_id: str | None) -> int:
    """The port the ranks of job job_id meet on, where MASTER_PORT is not set (the job script's job_port_shell)."""
    return PORT_BASE + int(job_id or 0) % PORT_SPAN


def job_port_shell() -> str:
    """job_port in bash, for the job script: the same number from the same job id."""
    return f"$(( {PORT_BASE} + {SLURM_VARS['job_id']} % {PORT_SPAN} ))"


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, e.g. 'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
    return hosts
