"""The job of a run: the sbatch script `dptrain submit` writes, its submission, the check that the partition can hold
it, and its requeue after a stop.

What the script does, in order: ask for the nodes, tasks, GPUs and cores; run the user's set-up lines; take the
first node's address from the scheduler (a node's name need not resolve on the others) and a port from the job
id (two jobs sharing a node never pick the same one); start the ranks with srun, one task per rank (SLURM places
them, dptrain reads SLURM_PROCID and friends) or one task per node running torch's elastic agent. SIGUSR1 some
minutes before the time limit makes every rank write a snapshot at its next step boundary; with requeue, rank 0
then puts the job back in the queue (scontrol requeue, requeue_after_stop) and the rerun resumes from that snapshot.

Every slurm.<field> of the config is in SBATCH_OPTIONS (the #SBATCH option it becomes) or in NOT_SBATCH_OPTIONS
(where the script uses it instead); the variables the script reads come from env.SLURM_VARS.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dptrain.config import RunConfig, SlurmConfig
from dptrain.errors import ConfigError, LaunchError
from dptrain.run_folder import RunFolder
from dptrain.slurm.env import SLURM_VARS, job_port_shell, slurm_value

# slurm.<field> -> the #SBATCH option it becomes, in the script's order. A new field goes here or in
# NOT_SBATCH_OPTIONS (tests/slurm/test_job.py fails otherwise); `dptrain submit --help` shows it from the config.
SBATCH_OPTIONS = {
    # worked out by render() from the job's shape
    "nodes": "--nodes",
    "ranks_per_node": "--ntasks-per-node",  # per-rank mode: the ranks; agent mode: 1, the agent
    "gpus_per_node": "--gpus-per-node",  # left out where an --sbatch line asks for the GPUs (gres=gpu:4, ...)
    "cpus_per_node": "--cpus-per-task",  # the node's cores shared out among its tasks
    # passed through as given (AS_GIVEN: one word each, SlurmConfig refuses a space)
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "mem": "--mem",
    # the rest
    "exclusive": "--exclusive",  # a flag
    "signal_lead_s": "--signal",  # USR1@<seconds>: the snapshot signal
    "requeue": "--requeue",  # a flag
}
AS_GIVEN = ("time", "partition", "account", "qos", "constraint", "mem")
# slurm.<field> that no #SBATCH option carries -> where the script uses it instead.
NOT_SBATCH_OPTIONS = {
    "mode": "srun's tasks: one per rank, or one per node running torch's elastic agent",
    "master_addr": "export MASTER_ADDR: the address the ranks reach the first node by",
    "setup": "shell lines run before srun",
    "sbatch": "extra #SBATCH lines, written as given",
    "python": "the interpreter srun runs dptrain with",
}
# Exported by the script: rank 0 requeues the job after a signal's snapshot (requeue_after_stop).
REQUEUE_VAR = "DPTRAIN_REQUEUE"
SCRIPT_NAME = "job.sbatch"
CONFIG_NAME = "job.toml"

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

    @property
    def shape(self) -> str:
        """'2 nodes x 4 ranks', as the script's first line, `dptrain submit` and the sweep's log say it."""
        return f"{counted(self.nodes, 'node')} x {counted(self.ranks_per_node, 'rank')}"

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
    node_list, node_count = SLURM_VARS["node_list"], SLURM_VARS["node_count"]  # read by the script's shell
    gpus = s.gpus_here  # --gpus-per-node, or an --sbatch line's gres=gpu:4, gpus=8, gpus-per-task=1
    lines = [
        "#!/bin/bash",
        f"# dptrain training of {shown(job.run_dir, workdir)}: {job.shape} ("
        f"{'one srun task per rank' if per_rank else 'one elastic agent per node'}, "
        f"{'nccl on GPUs' if gpus else 'gloo on CPUs'}).",
        "# Written by `dptrain submit`; submit it again with: sbatch " + shlex.quote(str(job.script)),
        f"#SBATCH --job-name={job_name(job.run_dir.name)}",
        sbatch_line("nodes", job.nodes),
        sbatch_line("ranks_per_node", tasks_per_node),
    ]
    if s.gpus_per_node and s.sbatch_gpus_per_node() is None:  # else the user's line asks for them, once
        lines.append(sbatch_line("gpus_per_node", s.gpus_per_node))
    if s.cpus_per_node:
        lines.append(sbatch_line("cpus_per_node", s.cpus_per_node // tasks_per_node))
    lines += [sbatch_line(name, getattr(s, name)) for name in AS_GIVEN if getattr(s, name) is not None]
    if s.exclusive:
        lines.append(sbatch_line("exclusive"))
    lines += [
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={job.output()}",
        f"#SBATCH --error={job.errors()}",
        "#SBATCH --open-mode=append",  # a requeued job keeps writing to the same files
    ]
    if s.signal_lead_s:
        lines.append(sbatch_line("signal_lead_s", f"USR1@{s.signal_lead_s}"))
    if s.requeue:
        lines.append(sbatch_line("requeue"))
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
            f'head_node=$(scontrol show hostnames "${node_list}" | head -n 1)',
            "export MASTER_ADDR=$(scontrol show node -o \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        ]
    lines.append(f"export MASTER_PORT={job_port_shell()}")
    if s.requeue:
        lines.append(f"export {REQUEUE_VAR}=1  # after a signal's snapshot, rank 0 runs: scontrol requeue "
                     f"${SLURM_VARS['job_id']}")
    train = [python, "-m", "dptrain", "train", "--config", str(job.config)]
    lines += ["", "# --kill-on-bad-exit: a rank that fails stops the others at once, instead of at their timeout."]
    if per_rank:
        lines.append("srun --kill-on-bad-exit=1 " + shlex.join(train))
    else:
        lines += [
            "# Each node's agent starts its ranks; the agents meet at MASTER_ADDR:MASTER_PORT, hosted by node 0",
            f"# (--node-rank defaults to the task's {SLURM_VARS['node_rank']}).",
            "srun --kill-on-bad-exit=1 " + shlex.join(train) + f' --nnodes "${node_count}" --nproc-per-node '
            f'{job.ranks_per_node} --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        ]
    return "\n".join(lines) + "\n"


def sbatch_line(field: str, value: object = None) -> str:
    """The #SBATCH line of slurm.<field> (SBATCH_OPTIONS): its option with the value, or alone (a flag)."""
    option = SBATCH_OPTIONS[field]
    return f"#SBATCH {option}" if value is None else f"#SBATCH {option}={value}"


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
    return tasks * (s.cpus_per_node // tasks if s.cpus_per_node else 1), s.gpus_here


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


def requeue_after_stop(step: int, emit: Callable[..., object]) -> None:
    """In a job that `dptrain submit` wrote with requeue: put it back in the queue once the stop's snapshot is whole
    (every rank has passed its last barrier); the rerun resumes from it. SLURM then ends this job's processes.
    emit(event, **fields) records the requeue, and a refusal, in the run's event log."""
    job_id = slurm_value("job_id")
    if os.environ.get(REQUEUE_VAR) != "1" or not job_id:
        return
    # Said first: once the job is requeued, SLURM ends this process at once, before any line written after.
    log.warning("requeueing job %s: it resumes from the snapshot of step %d when it runs again", job_id, step)
    emit("requeue", step=step, job_id=job_id)
    refused = requeue(job_id)
    if refused is not None:
        log.error("could not requeue job %s (%s); resubmit its job.sbatch to resume", job_id, refused)
        emit("requeue_failed", step=step, job_id=job_id, reason=refused)
