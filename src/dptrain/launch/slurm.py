"""SLURM jobs: the sbatch script `dptrain submit` writes for a run, and its submission.

What the script does, in order: ask for the nodes, tasks, GPUs and cores; run the user's set-up lines; take the
first node's address from the scheduler (a node's name need not resolve on the others) and a port from the job
id (two jobs sharing a node never pick the same one); start the ranks with srun, one task per rank (SLURM places
them, dptrain reads SLURM_PROCID and friends) or one task per node running torch's elastic agent. SIGUSR1 some
minutes before the time limit makes every rank write a snapshot at its next step boundary; with requeue, rank 0
then puts the job back in the queue (scontrol requeue) and the rerun resumes from that snapshot.

Everything the script knows about SLURM (option names, variables) sits in the tables below. After the submission,
job_states and wait_for ask the scheduler (squeue) how jobs are doing, for `dptrain bench --slurm`.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from dptrain.run_folder import RunFolder
from dptrain.config import ConfigError, RunConfig, SlurmConfig
from dptrain.dist.env import SLURM_PORT_BASE, SLURM_PORT_SPAN
from dptrain.errors import LaunchError

# slurm.<field> -> the sbatch option it becomes, for the options passed through as given.
SBATCH_OPTIONS = {
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "mem": "--mem",
}
# Variables the job reads (set by SLURM in the batch shell and in every srun task).
JOB_ID = "SLURM_JOB_ID"
NODE_LIST = "SLURM_JOB_NODELIST"
NODE_COUNT = "SLURM_JOB_NUM_NODES"
# Exported by the script: rank 0 requeues the job after a signal's snapshot (see worker.requeue_after_stop).
REQUEUE_VAR = "DPTRAIN_REQUEUE"
SCRIPT_NAME = "job.sbatch"
CONFIG_NAME = "job.toml"
# squeue's job states (its long names, %T) of a job that will not run again; every other state (PENDING, RUNNING,
# COMPLETING, REQUEUED, SUSPENDED, ...) may still lead to a run. A requeued job is PENDING again, not ended.
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"})
POLL_S = 2.0  # wait_for asks squeue this often
QUERY_GRACE_S = 600.0  # wait_for retries a failing squeue (a restarting controller, say) this long

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One run's job: its script's path, its config's path, and the shape of its world."""

    run_dir: Path
    nodes: int
    ranks_per_node: int
    mode: str

    @property
    def script(self) -> Path:
        return self.run_dir / SCRIPT_NAME

    @property
    def config(self) -> Path:
        return self.run_dir / CONFIG_NAME

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def output(self, job_id: str = "%j") -> Path:
        return RunFolder(self.run_dir).job_output(job_id, "out")

    def errors(self, job_id: str = "%j") -> Path:
        return RunFolder(self.run_dir).job_output(job_id, "err")


def job_for(cfg: RunConfig, workdir: Path) -> Job:
    """The job of cfg's run, with its run directory made absolute against workdir (where the job will run)."""
    run_dir = cfg.output.run_dir if cfg.output.run_dir.is_absolute() else workdir / cfg.output.run_dir
    for what, path in (("the run directory", run_dir), ("the folder dptrain submit runs in", workdir)):
        if any(c.isspace() or c in "\"'$`\\%" for c in str(path)):
            raise ConfigError(f"{what} {str(path)!r} holds a space, quote or other character that #SBATCH lines cannot "
                              f"carry; choose a plain path (--output.dir, or submit from another folder).")
    return Job(run_dir, cfg.slurm.nodes, cfg.slurm.ranks_here, cfg.slurm.mode)


def render(cfg: RunConfig, job: Job, workdir: Path, python: str) -> str:
    """The sbatch script, as text: readable, commented, and the same for the same inputs (golden tests compare it)."""
    s = cfg.slurm
    per_rank = s.mode == "per-rank"
    tasks_per_node = job.ranks_per_node if per_rank else 1
    host_role = "rank 0" if per_rank else "the agents' rendezvous"
    lines = [
        "#!/bin/bash",
        f"# dptrain training of {shown(job.run_dir, workdir)}: {job.nodes} node{'s' if job.nodes > 1 else ''} x {job.ranks_per_node} "
        f"rank{'s' if job.ranks_per_node > 1 else ''} ({'one srun task per rank' if per_rank else 'one elastic agent per node'}"
        f", {'nccl on GPUs' if s.gpus_per_node else 'gloo on CPUs'}).",
        "# Written by `dptrain submit`; submit it again with: sbatch " + shlex.quote(str(job.script)),
        f"#SBATCH --job-name={job_name(job.run_dir.name)}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    if s.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={s.cpus_per_node // tasks_per_node}")
    for name, option in SBATCH_OPTIONS.items():
        value = getattr(s, name)
        if value is not None:
            lines.append(f"#SBATCH {option}={value}")
    if s.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={job.output()}",
        f"#SBATCH --error={job.run_dir / 'logs' / 'slurm-%j.err'}",
        "#SBATCH --open-mode=append",  # a requeued job keeps writing to the same files
    ]
    if s.signal_lead_s:
        lines.append(f"#SBATCH --signal=USR1@{s.signal_lead_s}")
    if s.requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {extra if extra.startswith('-') else '--' + extra}" for extra in s.sbatch]
    lines += ["", "set -e"]
    if s.setup:
        lines += ["", *s.setup]
    lines += [
        "",
        f"# The first node hosts {host_role}, at its address as the scheduler knows it (its name may not resolve on",
        "# the other nodes), on a port derived from the job id, so that two jobs sharing a node never collide.",
    ]
    if s.master_addr:
        lines.append(f"export MASTER_ADDR={shlex.quote(s.master_addr)}")
    else:
        lines += [
            f'head_node=$(scontrol show hostnames "${NODE_LIST}" | head -n 1)',
            "export MASTER_ADDR=$(scontrol show node -o \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        ]
    lines.append(f"export MASTER_PORT=$(( {SLURM_PORT_BASE} + {JOB_ID} % {SLURM_PORT_SPAN} ))")
    if s.requeue:
        lines.append(f"export {REQUEUE_VAR}=1  # after a signal's snapshot, rank 0 runs: scontrol requeue ${JOB_ID}")
    train = [python, "-m", "dptrain", "train", "--config", str(job.config)]
    lines += ["", "# --kill-on-bad-exit: a rank that fails stops the others at once, instead of at their timeout."]
    if per_rank:
        lines.append("srun --kill-on-bad-exit=1 " + shlex.join(train))
    else:
        lines += [
            "# Each node's agent starts its ranks; the agents meet at MASTER_ADDR:MASTER_PORT, hosted by node 0",
            "# (--node-rank defaults to the task's SLURM_NODEID).",
            "srun --kill-on-bad-exit=1 " + shlex.join(train) + f' --nnodes "${NODE_COUNT}" --nproc-per-node '
            f'{job.ranks_per_node} --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        ]
    return "\n".join(lines) + "\n"


def job_name(run_name: str) -> str:
    """The job's name in squeue: the run's, marked as dptrain's (bench points' names say so already)."""
    return run_name if run_name.startswith("dptrain") else f"dptrain-{run_name}"


def shown(path: Path, workdir: Path) -> str:
    """path relative to workdir where it lies inside it (as the user named the run), else as it is."""
    try:
        return str(path.relative_to(workdir))
    except ValueError:
        return str(path)


def python_for(s: SlurmConfig) -> str:
    """The interpreter the job runs: as configured; python when set-up lines provide one; else this one."""
    if s.python:
        return s.python
    return "python" if s.setup else sys.executable


SINFO_TIMEOUT_S = 5.0  # a login node's sinfo answers in well under a second; one with no controller retries for 9-60 s
SINFO_FORMAT = "%N|%P|%c|%G"  # one line per node and partition: name, partition (* marks the default), CPUs, GRES


@dataclass(frozen=True)
class Node:
    """A node of a partition as sinfo describes it."""

    name: str
    cpus: int
    gpus: int


def partition_nodes(sinfo_output: str, partition: str | None) -> list[Node]:
    """The nodes of the partition (None: the default one, which sinfo marks with *; 'a,b': those of either, as sbatch
    reads it) in the output of `sinfo --noheader --Node --format=SINFO_FORMAT`; lines it cannot read are left out."""
    nodes = {}
    for line in sinfo_output.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4 or not fields[2].isdigit():
            continue
        name, part, cpus, gres = fields
        wanted = part.endswith("*") if partition is None else part.rstrip("*") in partition.split(",")
        if wanted:
            nodes[name] = Node(name, int(cpus), gpu_count(gres))
    return list(nodes.values())


def gpu_count(gres: str) -> int:
    """GPUs in sinfo's GRES of a node: 'gpu:4', 'gpu:a100:4(S:0-1)', 'gpu:a100:2,gpu:v100:2,nvme:1', '(null)'."""
    count = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        kind, *rest = item.split(":")
        if kind == "gpu" and rest and rest[-1].isdigit():
            count += int(rest[-1])
    return count


def per_node_request(s: SlurmConfig) -> tuple[int, int]:
    """(CPUs, GPUs) that one node of the job must have, as render() asks for them."""
    tasks = s.ranks_here if s.mode == "per-rank" else 1
    return tasks * (s.cpus_per_node // tasks if s.cpus_per_node else 1), s.gpus_per_node


def counted(number: int, word: str) -> str:
    return f"{number} {word}{'' if number == 1 else 's'}"


def check_nodes_fit(s: SlurmConfig) -> None:
    """ConfigError in one sentence where the job asks for more nodes, or more CPUs or GPUs per node, than the
    partition has: SLURM queues such a job, which then waits for ever (reason PartitionConfig, PartitionNodeLimit).
    Where sinfo is missing, fails, is slow or names no node, nothing is checked and sbatch decides."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return
    argv = [sinfo, "--noheader", "--Node", f"--format={SINFO_FORMAT}"]
    if s.partition is not None:
        argv.append(f"--partition={s.partition}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return
    nodes = partition_nodes(done.stdout, s.partition) if done.returncode == 0 else []
    if not nodes:
        return
    where = f"partition {s.partition}" if s.partition is not None else "the default partition"
    cpus, gpus = per_node_request(s)
    if not any(node.cpus >= cpus and node.gpus >= gpus for node in nodes):
        asked = counted(cpus, "CPU") + (f" and {counted(gpus, 'GPU')}" if gpus else "")
        most = f"{counted(max(n.cpus for n in nodes), 'CPU')} and {counted(max(n.gpus for n in nodes), 'GPU')} at most"
        raise ConfigError(f"the job asks for {asked} per node, but no node of {where} has as many (sinfo: {most}), so it "
                          f"would wait in the queue for ever; ask for fewer ranks or cores per node (--ranks-per-node, "
                          f"--cpus-per-node, --gpus-per-node), or another --partition.")
    if s.nodes > len(nodes):
        raise ConfigError(f"the job asks for {s.nodes} nodes, but {where} has {counted(len(nodes), 'node')} (sinfo), so "
                          f"it would wait in the queue for ever; ask for {len(nodes)} or fewer (--nodes), or another "
                          f"--partition.")


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


def requeue(job_id: str) -> str | None:
    """Put a running job back in the queue; None, or why it could not be done (one line)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"scontrol could not run ({exc})"
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"scontrol exited with {done.returncode}"
    return None


def require_clients(command: str) -> None:
    """sbatch and squeue are here; else LaunchError in one sentence naming the missing one."""
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
