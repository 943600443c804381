"""The sbatch script of a job, as text: render(cfg, job, command), the same for the same inputs (golden tests
compare it). command is what each srun task runs (TaskCommand): dptrain's training (dptrain_training, the default),
or what the measuring lab runs in the same job (another engine's torchrun, a probe).

What the script does, in order: ask for the nodes, tasks, GPUs and cores (its #SBATCH lines: sbatch_lines.py); run
the user's set-up lines; take the first node's address from the scheduler (a node's name need not resolve on the
others) and a port from the job id (two jobs sharing a node never pick the same one); start the tasks with srun, one
per rank (SLURM places them, dptrain reads SLURM_PROCID and friends) or one per node running torch's elastic agent,
in the job's container if it has one (containers.py). With requeue, it exports REQUEUE_VAR for rank 0 (requeue.py).
The variables the script reads come from env.SLURM_VARS.
"""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import dataclass

from dptrain.config import RunConfig
from dptrain.run_folder import RunFolder
from dptrain.slurm.containers import CONTAINER_SHOWN, container_launch
from dptrain.slurm.env import SLURM_VARS, job_port_shell
from dptrain.slurm.job import Job, python_for, shown
from dptrain.slurm.requeue import REQUEUE_VAR
from dptrain.slurm.sbatch_lines import sbatch_options


@dataclass(frozen=True)
class TaskCommand:
    """What each srun task of a job runs, and what the script says of it."""

    title: str
    """What the job does, as the script's first line names it: dptrain training."""
    words: tuple[str, ...]
    """The command, quoted as each word needs (after a container's words): python -m dptrain train --config JOB."""
    shell_words: str = ""
    """Words after those, written as they are, for the task's shell to expand: --nnodes "$SLURM_JOB_NUM_NODES"."""
    each: str = "rank"
    """What one task is to the job: one that fails stops the others (srun --kill-on-bad-exit)."""
    environment: tuple[str, ...] = ()
    """Lines (comments and exports) the tasks need, before the launch."""
    said_first: tuple[str, ...] = ()
    """Comment lines on the command, at the head of the launch."""
    said_last: tuple[str, ...] = ()
    """Comment lines on the command, right above the srun line."""
    written_by: str = "dptrain submit"
    """The command that writes the script, as its second line names it."""


def dptrain_training(cfg: RunConfig, job: Job, python: str | None = None) -> TaskCommand:
    """`python -m dptrain train --config JOB` in each task (python: python_for the job), the ranks' own in per-rank
    mode; in agent mode each node's elastic agent, which starts that node's ranks, meeting the others on node 0."""
    return dptrain_command(cfg, job, "train", "dptrain training", python)


def dptrain_command(cfg: RunConfig, job: Job, command: str, title: str, python: str | None = None) -> TaskCommand:
    """`python -m dptrain COMMAND --config JOB` in each task, started as dptrain_training starts training (a command
    that starts its ranks as `dptrain train` does: train, doctor); title: what the script's first line calls it."""
    words = (python or python_for(cfg.slurm), "-m", "dptrain", command, "--config", str(job.config))
    if job.mode == "per-rank":
        return TaskCommand(title, words)
    return TaskCommand(
        title, words,
        f'--nnodes "${SLURM_VARS["node_count"]}" --nproc-per-node {job.ranks_per_node} --master-addr "$MASTER_ADDR" '
        f'--master-port "$MASTER_PORT"',
        said_last=("# Each node's agent starts its ranks; the agents meet at MASTER_ADDR:MASTER_PORT, hosted by node 0",
                   f"# (--node-rank defaults to the task's {SLURM_VARS['node_rank']})."))


def render(cfg: RunConfig, job: Job, command: TaskCommand | None = None) -> str:
    """The sbatch script of job, as text: readable, commented, and the same for the same inputs. command: what each
    task runs (default: dptrain_training)."""
    s = cfg.slurm
    command = command or dptrain_training(cfg, job)
    per_rank = s.mode == "per-rank"
    host_role = "rank 0" if per_rank else "the agents' rendezvous"
    gpus = s.gpus_here  # --gpus-per-node, or an --sbatch line's gres=gpu:4, gpus=8, gpus-per-task=1
    launch = container_launch(s, job.run_dir, job.workdir)
    lines = [
        "#!/bin/bash",
        f"# {command.title} of {shown(job.run_dir, job.workdir)}: {job.shape} ("
        f"{'one srun task per rank' if per_rank else 'one elastic agent per node'}, "
        f"{'nccl on GPUs' if gpus else 'gloo on CPUs'}"
        f"{', ' + CONTAINER_SHOWN[s.container] if s.container else ''}).",
        f"# Written by `{command.written_by}`; submit it again with: sbatch " + shlex.quote(str(job.script)),
    ]
    lines += [f"#SBATCH {option.text}" for option in sbatch_options(s, job)]
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
            f'head_node=$(scontrol show hostnames "${SLURM_VARS["node_list"]}" | head -n 1)',
            "export MASTER_ADDR=$(scontrol show node -o \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        ]
    lines.append(f"export MASTER_PORT={job_port_shell()}")
    lines += requeue_lines(cfg, job)
    lines.append("")
    if command.environment:
        lines += [*command.environment, ""]
    task = shlex.join([*launch.command, *command.words]) + (" " + command.shell_words if command.shell_words else "")
    lines += [
        *command.said_first,
        f"# --kill-on-bad-exit: a {command.each} that fails stops the others at once, instead of at their timeout.",
        *(f"# {part}" for line in launch.said for part in textwrap.wrap(line, 115)),
        *command.said_last,
        f"{shlex.join(['srun', '--kill-on-bad-exit=1', *launch.srun_options])} {task}",
    ]
    return "\n".join(lines) + "\n"


def requeue_lines(cfg: RunConfig, job: Job) -> list[str]:
    """What the script exports for rank 0's requeue after a signal's snapshot (requeue.requeue_after_stop): 1 (rank 0
    runs scontrol requeue), or in a container, which has no scontrol, a file rank 0 writes and the script reads."""
    s = cfg.slurm
    if not s.requeue:
        return []
    job_id = f"${SLURM_VARS['job_id']}"
    if not s.container:
        return [f"export {REQUEUE_VAR}=1  # after a signal's snapshot, rank 0 runs: scontrol requeue {job_id}"]
    request = f"{RunFolder(job.run_dir).logs}/requeue-{job_id}"
    return [
        "# The container has no scontrol: after a signal's snapshot rank 0 writes this file, and this script",
        "# requeues the job as it ends (srun returned, or failed under set -e).",
        f'export {REQUEUE_VAR}="{request}"',
        "requeue_if_asked() {",
        f'  if [ -e "${REQUEUE_VAR}" ]; then',
        f'    rm -f "${REQUEUE_VAR}"',
        f'    scontrol requeue "{job_id}" || echo "dptrain: could not requeue job {job_id}; submit this script '
        f'again to resume" >&2',
        "  fi",
        "}",
        "trap requeue_if_asked EXIT",
    ]
