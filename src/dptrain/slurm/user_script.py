"""A job that runs a training script of the user's own, as torchrun runs it (`dptrain submit --nodes 2 --gres gpu:4
-- my_train.py --epochs 5`): the job of dptrain's own trainer (its #SBATCH lines, set-up lines, the first node's
address and a port from the job id, the container, GPUs asked per node), with one torchrun per node in the srun line
in place of dptrain's agent. torchrun's static rendezvous at MASTER_ADDR:MASTER_PORT with each node's rank from
SLURM_NODEID puts global rank 0 on the job's first node, whose address MASTER_ADDR is; each rank finds its GPU at
LOCAL_RANK, as the tutorials' scripts read it.

A script that takes its rank from SLURM's own variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID: the tutorials'
`srun python my_train.py` habit) would read there the one task of its node's torchrun, and each rank run as a world
of its own: with --mode per-rank (per_rank_command) srun starts one task per rank instead, which runs the script
itself, with torchrun's variables set from SLURM's, so that both kinds of script read the same ranks.

What follows `--` is read by dptrain/user_script.py. A leading python (srun python my_train.py, the tutorials' sbatch habit)
names the interpreter: torchrun runs the script with the Python that runs it, so that python is the job's
(slurm.python).
"""

from __future__ import annotations

import dataclasses
import shlex
import textwrap
from pathlib import Path

from dptrain.config import RunConfig, SlurmConfig
from dptrain.errors import ConfigError
from dptrain.slurm.env import SLURM_VARS
from dptrain.slurm.job import Job, python_for
from dptrain.slurm.requeue import REQUEUE_VAR
from dptrain.slurm.script import TaskCommand
from dptrain.user_script import UserScript, from_words, refuse_trainer_options

EXAMPLE = "dptrain submit --nodes 2 -- my_train.py --epochs 5"
# The sections of a run's options that still mean something when the job runs the user's script: where the job's
# files go (output: the run folder, which holds job.sbatch and the job's logs) and the job itself (slurm).
USER_SCRIPT_SECTIONS = ("output", "slurm")
# torchrun's signals that end its workers (its default), and SIGUSR1, which it then passes on to them instead of
# dying of it: slurm.signal_lead_s's warning reaches the script, as it reaches dptrain's ranks.
SIGNALS_TO_PASS_ON = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def job_script(words: list[str], workdir: Path) -> UserScript:
    """The user's command after submit's `--`, its script looked for from workdir, where the job runs."""
    return from_words(words, workdir, EXAMPLE, "the job")


def refuse_options_of_the_trainer(pairs: list[tuple[str, str]]) -> None:
    refuse_trainer_options(pairs, USER_SCRIPT_SECTIONS, "this job")


def user_script_shape(slurm: SlurmConfig, given: set[str]) -> SlurmConfig:
    """The job's shape for a user's script: one srun task per node (torchrun), which starts the node's ranks (one
    per GPU unless slurm.ranks_per_node says otherwise), so that sbatch's --cpus-per-task is per node. given:
    the slurm.* fields set on the command line. No snapshot signal unless asked for (slurm.signal_lead_s or
    slurm.requeue, on the command line or another lead than the default in the file): the default's SIGUSR1 would
    reach a script that may not expect it. One torchrun per node unless --mode per-rank is given (per_rank_command):
    a mode from a config file is the trainer's, not the script's."""
    mode = slurm.mode if "mode" in given else "agent"
    default_lead = {f.name: f.default for f in dataclasses.fields(SlurmConfig)}["signal_lead_s"]
    signal_asked = bool({"signal_lead_s", "requeue"} & given) or slurm.requeue or slurm.signal_lead_s != default_lead
    lead = slurm.signal_lead_s if signal_asked else 0
    shaped = dataclasses.replace(slurm, mode=mode, signal_lead_s=lead)
    asked = slurm.sbatch_gpus_per_node()
    if asked is not None and shaped.gpus_here != slurm.gpus_here:  # gpus-per-task: one task per node gets fewer
        raise ConfigError(f"slurm.sbatch's {asked[0]} gives each task its GPUs, and a script of yours runs one task "
                          f"per node (torchrun); ask for the GPUs per node (--gpus-per-node N) instead.")
    return shaped


def script_command(cfg: RunConfig, job: Job, script: UserScript) -> TaskCommand:
    """What each task of the job runs: torchrun on each node (torchrun_command), or in per-rank mode the script itself
    as each rank (per_rank_command)."""
    return (per_rank_command if job.mode == "per-rank" else torchrun_command)(cfg, job, script)


def _threads(cfg: RunConfig, job: Job) -> list[str]:
    """The lines that give each rank its share of the node's cores, where the job asks for cores."""
    if not cfg.slurm.cpus_per_node:
        return []
    return ["# Each rank's share of the node's cores, as dptrain's ranks take theirs from --cpus-per-task (torchrun",
            "# alone gives one thread to each of several ranks, and torch gives one rank every core it sees).",
            f"export OMP_NUM_THREADS={max(1, cfg.slurm.cpus_per_node // job.ranks_per_node)}"]


def per_rank_command(cfg: RunConfig, job: Job, script: UserScript) -> TaskCommand:
    """What each task runs in per-rank mode: the user's script, as one rank, with torchrun's variables (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) set by the task's bash from SLURM's, which the task has too; rank 0, on
    the first node, hosts the script's store at MASTER_ADDR:MASTER_PORT, as its init_process_group makes it."""
    s = cfg.slurm
    python = script.python or python_for(s)
    v = SLURM_VARS
    in_the_task = (f'export RANK="${v["global_rank"]}" LOCAL_RANK="${v["local_rank"]}" WORLD_SIZE="${v["world_size"]}" '
                   f'LOCAL_WORLD_SIZE={job.ranks_per_node}; exec {shlex.join([python, *script.target, *script.args])}')
    said_signal: tuple[str, ...] = ()
    if s.signal_lead_s:
        said = f"SIGUSR1 {s.signal_lead_s} s before the time limit reaches each rank of the script"
        if s.requeue:
            said += (f"; to requeue the job, rank 0 then runs scontrol requeue \"${v['job_id']}\" where "
                     f"{REQUEUE_VAR}=1, or writes the file {REQUEUE_VAR} names (in a container)")
        said_signal = tuple(f"# {part}" for part in textwrap.wrap(said + ".", 113))
    return TaskCommand(
        f"{script.target[-1]}'s training", ("bash", "-c", in_the_task), each="rank", environment=tuple(_threads(cfg, job)),
        said_first=(f"# Each srun task is one rank of the script, which reads {v['global_rank']}, {v['world_size']} and "
                    f"{v['local_rank']}, or",
                    "# torchrun's RANK, WORLD_SIZE and LOCAL_RANK, set from them by the task's bash; rank 0, on the "
                    "first node, hosts",
                    "# the script's store at MASTER_ADDR:MASTER_PORT.",
                    *said_signal))


def torchrun_command(cfg: RunConfig, job: Job, script: UserScript) -> TaskCommand:
    """What each task of the job runs: torchrun, starting the node's ranks of the user's script; the node's rank is
    its SLURM_NODEID, so that rank 0 is on the first node, at MASTER_ADDR."""
    s = cfg.slurm
    python = script.python or python_for(s)
    environment = _threads(cfg, job)
    signals = ("--signals-to-handle", SIGNALS_TO_PASS_ON) if s.signal_lead_s else ()
    said_signal: tuple[str, ...] = ()
    if s.signal_lead_s:
        said = (f"SIGUSR1 {s.signal_lead_s} s before the time limit: torchrun passes it on to the script's ranks and "
                f"gives them 30 s to save and stop")
        if s.requeue:
            said += (f"; to requeue the job, rank 0 then runs scontrol requeue \"${SLURM_VARS['job_id']}\" where "
                     f"{REQUEUE_VAR}=1, or writes the file {REQUEUE_VAR} names (in a container)")
        said_signal = tuple(f"# {part}" for part in textwrap.wrap(said + ".", 113))
    torchrun = shlex.join((python, "-m", "torch.distributed.run", "--nnodes", str(job.nodes), "--nproc-per-node",
                           str(job.ranks_per_node), *signals))
    # in the task's own shell: the batch shell's SLURM_NODEID is the first node's, every task's would be 0
    in_the_task = (f'exec {torchrun} --node-rank "${SLURM_VARS["node_rank"]}" --master-addr "$MASTER_ADDR" '
                   f'--master-port "$MASTER_PORT" {shlex.join([*script.target, *script.args])}')
    return TaskCommand(
        f"{script.target[-1]}'s training (torchrun)", ("bash", "-c", in_the_task),
        each="node", environment=tuple(environment),
        said_first=("# One torchrun per node starts the node's ranks of the script; the nodes meet at "
                    "MASTER_ADDR:MASTER_PORT, on the",
                    f"# first node, whose ranks come first (--node-rank: the task's own {SLURM_VARS['node_rank']}, "
                    "read by its bash); each rank",
                    "# reads RANK, LOCAL_RANK and WORLD_SIZE (a script that reads SLURM_PROCID and SLURM_NTASKS instead "
                    "wants",
                    "# --mode per-rank: one srun task per rank).",
                    *said_signal))
