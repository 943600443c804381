"""The job of a run: the sbatch script `dptrain submit` writes, its submission, the check that the partition can hold
it, and its requeue after a stop.

What the script does, in order: ask for the nodes, tasks, GPUs and cores; run the user's set-up lines; take the
first node's address from the scheduler (a node's name need not resolve on the others) and a port from the job
id (two jobs sharing a node never pick the same one); start the ranks with srun, one task per rank (SLURM places
them, dptrain reads SLURM_PROCID and friends) or one task per node running torch's elastic agent. SIGUSR1 some
minutes before the time limit makes every rank write a snapshot at its next step boundary; with requeue, rank 0
then puts the job back in the queue (scontrol requeue, requeue_after_stop) and the rerun resumes from that snapshot.

In a container (slurm.container_image, slurm.container_env_file: container_launch), each srun task starts in it:
pyxis's srun --container-image or --environment, or apptainer exec under srun. The script's own lines (scontrol,
the set-up lines) run on the node as it is; the container sees the folder dptrain submit ran in and the run
directory at their own paths, and has no scontrol, so the script requeues the job itself once srun returns.

Every slurm.<field> of the config is in SBATCH_OPTIONS (the #SBATCH option it becomes) or in NOT_SBATCH_OPTIONS
(where the script uses it instead); the variables the script reads come from env.SLURM_VARS. Every #SBATCH line,
whatever its source (a job option, an --sbatch line, the run directory), is checked in one place, sbatch_options: sbatch
must read it as the one option written, never as more.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dptrain.config import RunConfig, SlurmConfig, read_toml
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
    # passed through as given (AS_GIVEN: one word each, as sbatch_options checks every line)
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
# sbatch reads what follows #SBATCH as words of its command line, as slurm 22.05's sbatch was seen to: split at spaces
# and tabs, quotes (' and ") joining words, a backslash dropped, and # starting a comment that ends the line. So
# `--sbatch 'comment=x --job-name=INJECTED'` ran as INJECTED, and `comment=x#y` lost its y. Every #SBATCH line the
# script holds is one option (sbatch_options checks them all, whatever their source): one word, or an option and its
# value, and none of those characters, whose reading may differ between SLURM versions.
SBATCH_OWN_SYNTAX = "\"'\\#"
SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=\S*)?|-[A-Za-z]\S*")  # one word: --name, --name=value, -G8
SBATCH_OPTION_NAME = re.compile(r"--[A-Za-z][A-Za-z0-9-]*|-[A-Za-z]")  # the first of two: --gres gpu:4, -G 8
# slurm.<field> that no #SBATCH option carries -> where the script uses it instead.
NOT_SBATCH_OPTIONS = {
    "mode": "srun's tasks: one per rank, or one per node running torch's elastic agent",
    "master_addr": "export MASTER_ADDR: the address the ranks reach the first node by",
    "setup": "shell lines run before srun",
    "sbatch": "extra #SBATCH lines, written as given, one option each",
    "python": "the interpreter srun runs dptrain with",
    "container_image": "srun's tasks start in this image: srun --container-image (pyxis), or apptainer exec",
    "container_env_file": "srun's tasks start in the container this file describes: srun --environment",
    "container_engine": "what starts container_image: pyxis (srun's options) or apptainer (apptainer exec)",
}
# Exported by the script: rank 0 requeues the job after a signal's snapshot (requeue_after_stop); in a container, where
# there is no scontrol, the variable names a file that rank 0 writes instead, and the script requeues the job.
REQUEUE_VAR = "DPTRAIN_REQUEUE"
# Where an image option names a file rather than a registry image: pyxis takes a path (/..., ./...) to a squashfs
# file; apptainer takes a path unless a scheme (docker://, library://, oras://, docker-archive:) says otherwise.
PYXIS_IMAGE_FILES = (".sqsh", ".squashfs")
IMAGE_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
CONTAINER_SHOWN = {"pyxis": "in a pyxis container", "edf": "in the container of an environment file",
                   "apptainer": "in an apptainer container"}
SCRIPT_NAME = RunFolder(Path(".")).job_script.name
CONFIG_NAME = RunFolder(Path(".")).job_config.name

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
    job = Job(run_dir, cfg.slurm.nodes, cfg.slurm.ranks_here, cfg.slurm.mode)
    engine = cfg.slurm.container_engine
    if engine != "pyxis" and cfg.slurm.container is None:  # pyxis is the default, which asks for nothing alone
        raise ConfigError(f"slurm.container_engine = {engine} has no image to start; give slurm.container_image too, "
                          f"or drop slurm.container_engine.")
    if cfg.slurm.container is not None:
        check_container(cfg.slurm, job, workdir)
    return job


def check_container(s: SlurmConfig, job: Job, workdir: Path) -> None:
    """ConfigError in one sentence where the job's container cannot start: its image or environment file is a file
    that is not there (or not TOML), or a folder to mount holds a character the engine's mount list splits on."""
    name, value = ("container_env_file", s.container_env_file) if s.container == "edf" else ("container_image",
                                                                                            s.container_image)
    local = container_file(s)
    if local is not None:
        path = container_path(local, workdir)
        if not path.is_file():  # follows a link, as the engine does; reading a device (/dev/zero) would never end
            kind, other = (("environment file (.toml)", "the name of one in ~/.edf") if s.container == "edf" else
                           ("image file", "a registry image as the engine names one"))
            what = (f"{path}, a folder, not a file" if path.is_dir() else
                    f"{path}, which is not a regular file (a device, a pipe or a socket)" if path.exists() else
                    f"a file that is not there ({path})")
            raise ConfigError(f"slurm.{name} = {value!r} names {what}; give the path of the {kind}, absolute or "
                              f"relative to {workdir}, or {other}.")
        if s.container == "edf":
            try:  # bounded, as every TOML read: a planted file may be of any size
                read_toml(path, f"slurm.container_env_file {path}")
            except ConfigError as exc:
                raise ConfigError(f"{str(exc).split('; ')[0]}, so srun --environment cannot read it; fix the file, or "
                                  f"give another.") from None
    if s.container != "edf":  # an environment file names its own mounts
        for folder in container_mounts(job.run_dir, workdir, dptrain_source()):
            if any(c in ",:" for c in str(folder)):
                raise ConfigError(f"{folder} holds a comma or colon, which {s.container}'s list of folders to mount "
                                  f"splits on; run from, and write the run to, folders without them.")


def render(cfg: RunConfig, job: Job, workdir: Path, python: str, program: list[str] | None = None) -> str:
    """The sbatch script, as text: readable, commented, and the same for the same inputs (golden tests compare it).
    program: what each task runs after `python` (default: `-m dptrain train --config JOB`), for the benchmark's
    probes in the same job."""
    s = cfg.slurm
    per_rank = s.mode == "per-rank"
    tasks_per_node = job.ranks_per_node if per_rank else 1
    host_role = "rank 0" if per_rank else "the agents' rendezvous"
    node_list, node_count = SLURM_VARS["node_list"], SLURM_VARS["node_count"]  # read by the script's shell
    gpus = s.gpus_here  # --gpus-per-node, or an --sbatch line's gres=gpu:4, gpus=8, gpus-per-task=1
    launch = container_launch(s, job, workdir)
    lines = [
        "#!/bin/bash",
        f"# dptrain training of {shown(job.run_dir, workdir)}: {job.shape} ("
        f"{'one srun task per rank' if per_rank else 'one elastic agent per node'}, "
        f"{'nccl on GPUs' if gpus else 'gloo on CPUs'}"
        f"{', ' + CONTAINER_SHOWN[s.container] if s.container else ''}).",
        "# Written by `dptrain submit`; submit it again with: sbatch " + shlex.quote(str(job.script)),
    ]
    lines += [f"#SBATCH {option.text}" for option in sbatch_options(s, job, workdir, tasks_per_node)]
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
    job_id = f"${SLURM_VARS['job_id']}"
    request = f"{RunFolder(job.run_dir).logs}/requeue-{job_id}"  # rank 0 writes it where scontrol is not at hand
    if s.requeue and s.container:
        lines += [
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
    elif s.requeue:
        lines.append(f"export {REQUEUE_VAR}=1  # after a signal's snapshot, rank 0 runs: scontrol requeue {job_id}")
    train = [*launch.command, python, *(program or ["-m", "dptrain", "train", "--config", str(job.config)])]
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", *launch.srun_options])
    lines += ["", "# --kill-on-bad-exit: a rank that fails stops the others at once, instead of at their timeout."]
    lines += [f"# {part}" for line in launch.said for part in textwrap.wrap(line, 115)]
    if per_rank:
        lines.append(f"{srun} {shlex.join(train)}")
    else:
        lines += [
            "# Each node's agent starts its ranks; the agents meet at MASTER_ADDR:MASTER_PORT, hosted by node 0",
            f"# (--node-rank defaults to the task's {SLURM_VARS['node_rank']}).",
            f'{srun} {shlex.join(train)} --nnodes "${node_count}" --nproc-per-node {job.ranks_per_node} '
            f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ContainerLaunch:
    """How srun starts each task in the job's container: srun's own options, the words before the Python command,
    and the script's comment lines saying so. All empty where the job has no container."""

    srun_options: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    said: tuple[str, ...] = ()


def container_launch(s: SlurmConfig, job: Job, workdir: Path) -> ContainerLaunch:
    """The job's ContainerLaunch (the same for the same inputs: render's golden tests compare it). pyxis and apptainer
    mount the folder dptrain submit runs in (the project: its data, and the run directory where it lies inside) at
    its own path, and the run directory where it lies outside, and start the ranks in that folder, as the script's
    --chdir does outside a container; an environment file names its own mounts and workdir."""
    if s.container is None:
        return ContainerLaunch()
    source = dptrain_source()
    command: tuple[str, ...] = ()
    said: list[str] = []
    if source is not None:  # the job.toml this dptrain wrote is read by the same dptrain, whatever the image holds
        command = ("env", f"PYTHONPATH={source}")
        said.append(f"PYTHONPATH: the dptrain that wrote this job (its source, {source}), ahead of any in the image.")
    if s.container == "edf":
        path = container_file(s)
        env_file = str(container_path(path, workdir)) if path is not None else s.container_env_file
        said.insert(0, "Each task starts in the container this environment file describes: its image, mounts, workdir.")
        return ContainerLaunch((f"--environment={env_file}",), command, tuple(said))
    image = s.container_image
    assert image is not None, "a container of an image"
    path = container_file(s)
    if path is not None:
        image = str(container_path(path, workdir))
    folders = container_mounts(job.run_dir, workdir, source)
    mounts = ",".join(map(str, folders))
    said.insert(0, f"Each task starts in the image ({s.container}) with {' and '.join(map(str, folders))} mounted at "
                   f"{'its own path' if len(folders) == 1 else 'their own paths'}, the ranks in {workdir}.")
    if s.container == "pyxis":
        return ContainerLaunch((f"--container-image={image}", f"--container-mounts={mounts}",
                                f"--container-workdir={workdir}"), command, tuple(said))
    gpu = ("--nv",) if s.gpus_here else ()  # the host's NVIDIA driver and devices, inside the container
    return ContainerLaunch((), ("apptainer", "exec", *gpu, "--bind", mounts, "--pwd", str(workdir), image, *command),
                           tuple(said))


def container_file(s: SlurmConfig) -> str | None:
    """The local file that the container option names, as given; None where it names a registry image (pyxis:
    nvcr.io#nvidia/pytorch:TAG; apptainer: docker://..., library://...) or an environment file in ~/.edf by name."""
    if s.container == "edf":
        value = s.container_env_file or ""
        return value if "/" in value or value.endswith(".toml") else None
    image = s.container_image or ""
    if s.container == "apptainer":
        return None if IMAGE_SCHEME.match(image) else image
    if s.container == "pyxis" and (image.startswith(("/", ".", "~")) or image.endswith(PYXIS_IMAGE_FILES)):
        return image
    return None


def container_path(value: str, workdir: Path) -> Path:
    """A container file's path as the job names it: absolute (a relative one is the submit folder's)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else workdir / path


def container_mounts(run_dir: Path, workdir: Path, source: Path | None) -> list[Path]:
    """The folders a container of an image mounts: the submit folder, then the run directory and dptrain's source
    where they lie outside the folders before them."""
    folders = [workdir]
    for folder in (run_dir, source):
        if folder is not None and not any(folder.is_relative_to(f) for f in folders):
            folders.append(folder)
    return folders


def dptrain_source() -> Path | None:
    """The folder holding this dptrain package where it runs from a source checkout (pip install -e): a container
    job mounts it and puts it on PYTHONPATH. None where dptrain is installed in site-packages: the host's packages
    are built for the host's Python, and the image must hold its own dptrain then."""
    root = Path(__file__).resolve().parents[2]  # <root>/dptrain/slurm/job.py
    return None if root.name in ("site-packages", "dist-packages") else root


@dataclass(frozen=True)
class SbatchOption:
    """What one #SBATCH line of the script carries (--partition=gpu), where it comes from as an error names it, and
    what to do where sbatch would not read it as that one option."""

    text: str
    source: str
    remedy: str = "choose a plain path (--output.dir, or submit from another folder)"


def sbatch_options(s: SlurmConfig, job: Job, workdir: Path, tasks_per_node: int) -> list[SbatchOption]:
    """The script's #SBATCH options, in its order, each checked (check_sbatch_option) before anything is written."""
    word = ("give one word, as sbatch takes it, without spaces, quotes, backslashes or # (other sbatch options go in "
            "slurm.sbatch)")
    line = ("give each option its own --sbatch line, as --sbatch NAME=VALUE with no space, quote, backslash or # in "
            "VALUE")
    options = [
        SbatchOption(f"--job-name={job_name(job.run_dir.name)}",
                     f"the job's name (from the run directory {job.run_dir})"),
        sbatch_option("nodes", job.nodes),
        sbatch_option("ranks_per_node", tasks_per_node),
    ]
    if s.gpus_per_node and s.sbatch_gpus_per_node() is None:  # else the user's line asks for them, once
        options.append(sbatch_option("gpus_per_node", s.gpus_per_node))
    if s.cpus_per_node:
        options.append(sbatch_option("cpus_per_node", s.cpus_per_node // tasks_per_node))
    options += [sbatch_option(name, getattr(s, name), f"slurm.{name} = {getattr(s, name)!r}", word)
                for name in AS_GIVEN if getattr(s, name) is not None]
    if s.exclusive:
        options.append(sbatch_option("exclusive"))
    options += [
        SbatchOption(f"--chdir={workdir}", f"the folder dptrain submit runs in ({workdir})"),
        SbatchOption(f"--output={job.output()}", f"the job's output file (in the run directory {job.run_dir})"),
        SbatchOption(f"--error={job.errors()}", f"the job's error file (in the run directory {job.run_dir})"),
        SbatchOption("--open-mode=append", "the job's --open-mode"),  # a requeued job keeps writing to the same files
    ]
    if s.signal_lead_s:
        options.append(sbatch_option("signal_lead_s", f"USR1@{s.signal_lead_s}"))
    if s.requeue:
        options.append(sbatch_option("requeue"))
    options += [SbatchOption(extra if extra.startswith("-") else "--" + extra, f"slurm.sbatch's line {extra!r}", line)
                for extra in s.sbatch]
    for option in options:
        check_sbatch_option(option)
    return options


def sbatch_option(field: str, value: object = None, source: str | None = None,
                  remedy: str = "give one word, as sbatch takes it") -> SbatchOption:
    """The #SBATCH option of slurm.<field> (SBATCH_OPTIONS): its option with the value, or alone (a flag)."""
    option = SBATCH_OPTIONS[field]
    return SbatchOption(option if value is None else f"{option}={value}", source or f"slurm.{field}", remedy)


def check_sbatch_option(option: SbatchOption) -> None:
    """ConfigError in one sentence where sbatch would not read `#SBATCH <option.text>` as the one option written."""
    reading = sbatch_reading(option.text)
    if reading is not None:
        raise ConfigError(f"{option.source} would be written as {'#SBATCH ' + option.text!r}, which sbatch {reading}; "
                          f"{option.remedy}.")


def sbatch_reading(text: str) -> str | None:
    """None where sbatch reads `#SBATCH <text>` as one option: one word (--partition=gpu, --exclusive, -G8) or an
    option and its value (--gres gpu:4, -G 8, as a user's --sbatch line may write them); else how sbatch reads it
    instead, as the end of a sentence."""
    if any(not c.isprintable() and c != "\t" for c in text):  # a tab parts words, as a space does
        return "reads as more than one line or option (it holds a line break or another control character)"
    if any(c in SBATCH_OWN_SYNTAX for c in text):
        return "reads otherwise than written (quotes and backslashes are its own syntax there, and # starts a comment)"
    words = text.split()
    if len(words) == 1 and SBATCH_OPTION.fullmatch(words[0]):
        return None
    if len(words) == 2 and SBATCH_OPTION_NAME.fullmatch(words[0]) and not words[1].startswith("-"):
        return None
    return "reads as more than one option" if len(words) > 1 else "does not read as an option"


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
    """The interpreter the job runs: as configured; python when set-up lines or a container provide one (this one is
    not inside a container); else this one."""
    if s.python:
        return s.python
    return "python" if s.setup or s.container else sys.executable


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


def ask_the_script_to_requeue(request: Path, step: int) -> str | None:
    """Write the file the job's script looks for after srun (a container job's requeue); None, or why it failed."""
    try:
        request.write_text(f"{step}\n")
    except OSError as exc:
        return f"could not write {request} ({exc.strerror or exc})"
    return None


def requeue_after_stop(step: int, emit: Callable[..., object]) -> None:
    """In a job that `dptrain submit` wrote with requeue: put it back in the queue once the stop's snapshot is whole
    (every rank has passed its last barrier); the rerun resumes from it. SLURM then ends this job's processes.
    In a container, which has no scontrol, REQUEUE_VAR names a file instead: written here, the job's script requeues
    the job once srun returns. emit(event, **fields) records the requeue, and a refusal, in the run's event log."""
    job_id = slurm_value("job_id")
    request = os.environ.get(REQUEUE_VAR, "")
    if not (request == "1" or request.startswith("/")) or not job_id:
        return
    # Said first: once the job is requeued, SLURM ends this process at once, before any line written after.
    log.warning("requeueing job %s: it resumes from the snapshot of step %d when it runs again", job_id, step)
    emit("requeue", step=step, job_id=job_id)
    refused = requeue(job_id) if request == "1" else ask_the_script_to_requeue(Path(request), step)
    if refused is not None:
        log.error("could not requeue job %s (%s); resubmit its job.sbatch to resume", job_id, refused)
        emit("requeue_failed", step=step, job_id=job_id, reason=refused)
