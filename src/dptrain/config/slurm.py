"""[slurm]: SlurmConfig, the job options of `dptrain submit` and `bench sweep --slurm`, and the reading of the GPU options a
user gives as sbatch lines (--gres=gpu:4, --gpus-per-node=4).

Each field says in its metadata what it becomes in the job script: an #SBATCH option (SbatchOf: its name, its
one-letter form, where its line goes, its value in the job), or where else the script uses it (SCRIPT_USE). One rule
writes the #SBATCH lines from it (slurm/sbatch_lines.py), and one refuses an --sbatch line that repeats one of them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from dptrain.option_fields import not_negative, positive, shown
from dptrain.errors import ConfigError


SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")  # sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
# The sbatch options that ask for GPUs, as the tutorials' job scripts write them (#SBATCH --gres=gpu:4), -> what their
# count is per: a node, the whole job (-G is --gpus), or a task. slurm.sbatch lines holding one make the job a GPU job.
GPU_SBATCH_OPTIONS = {"gres": "node", "gpus-per-node": "node", "gpus": "job", "G": "job", "gpus-per-task": "task"}
GPU_FORMS = "--gres=gpu:N, --gres=gpu:TYPE:N, --gpus-per-node=N, --gpus=N or --gpus-per-task=N"


@dataclass(frozen=True)
class SbatchGpus:
    """One sbatch option of slurm.sbatch that asks for GPUs: as written (--gres=gpu:a100:4), its count, what per."""

    written: str
    count: int
    per: Literal["node", "job", "task"]


def sbatch_gpus(lines: tuple[str, ...]) -> list[SbatchGpus]:
    """The GPU requests in slurm.sbatch's lines ('gres=gpu:4', '--gpus 8', '-G 8', 'gpus-per-task=1 --exclusive'),
    read as sbatch reads an #SBATCH line: options and their values; ConfigError in one sentence for one it cannot count."""
    found = []
    for line in lines:
        try:
            words = shlex.split(line)
        except ValueError:  # an unbalanced quote: sbatch would refuse the line; its GPU options are still counted
            words = line.split()
        if words and not words[0].startswith("-"):
            words[0] = "--" + words[0]  # written so in the script (render adds the --)
        at = 0
        while at < len(words):
            word, at = words[at], at + 1
            if word.startswith("--"):
                name, sep, value = word[2:].partition("=")
            elif word.startswith("-G"):  # -G 8, -G8
                name = "G"
                sep = value = word[2:].removeprefix("=")
            else:
                continue
            if name not in GPU_SBATCH_OPTIONS:
                continue
            if not sep and at < len(words):  # --gres gpu:4: the value is the next word
                value, at = words[at], at + 1
            written = f"-G {value}" if name == "G" else f"--{name}={value}"
            count = (_gres_gpus(value) if name == "gres" else _typed_counts(value)) if value else None
            if count is None:
                raise ConfigError(f"slurm.sbatch asks for GPUs as {shown(written)}, which dptrain cannot count; write it "
                                  f"as {GPU_FORMS}.")
            found.append(SbatchGpus(written, count, GPU_SBATCH_OPTIONS[name]))  # type: ignore[arg-type]
    return found


def _gres_gpus(value: str) -> int | None:
    """GPUs in a --gres request ('gpu:4', 'gpu:a100:2,nvme:1', 'gpu' for one; 'none'); None where a count is unreadable."""
    total = 0
    for item in value.split(","):
        name, *rest = item.removeprefix("gres/").split(":")
        if name != "gpu":
            continue
        if not rest or (len(rest) == 1 and not rest[0].isdigit()):  # gpu, gpu:a100: one GPU (of that type)
            total += 1
        elif rest[-1].isdigit() and len(rest) <= 2:
            total += int(rest[-1])
        else:
            return None
    return total


def _typed_counts(value: str) -> int | None:
    """The GPUs of --gpus, --gpus-per-node or --gpus-per-task ('4', 'a100:4', 'a100:2,v100:2'); None where unreadable."""
    counts = [item.split(":")[-1] for item in value.split(",")]
    if not all(c.isdigit() for c in counts) or any(len(item.split(":")) > 2 for item in value.split(",")):
        return None
    return sum(map(int, counts))


@dataclass(frozen=True)
class SbatchOf:
    """Field metadata (key SBATCH): the #SBATCH option a slurm.<field> becomes. value(slurm) is its value in the job
    (default: the field's own, written as given): None or False leaves the line out, True writes the option alone."""

    option: str
    """sbatch's name of it: --ntasks-per-node."""
    place: int
    """Where its line goes among the script's #SBATCH lines (the job's own lines, slurm/sbatch_lines.py's JOB_LINES,
    take their places among these)."""
    short: str | None = None
    """sbatch's one-letter form (-N), which an --sbatch line may use as well."""
    value: Callable[[SlurmConfig], object] | None = None

    def of(self, slurm: SlurmConfig, name: str) -> object:
        """Its value in the job of slurm, whose field `name` carries it."""
        return getattr(slurm, name) if self.value is None else self.value(slurm)


SBATCH = "sbatch"  # the metadata key of SbatchOf
SCRIPT_USE = "script_use"  # the metadata key of where the script uses a field no #SBATCH option carries


def sbatch_field(default: Any, option: str, place: int, short: str | None = None,
           value: Callable[[SlurmConfig], object] | None = None) -> Any:
    """A field that becomes an #SBATCH option (SbatchOf)."""
    return field(default=default, metadata={SBATCH: SbatchOf(option, place, short, value)})


def script_field(default: Any, where: str) -> Any:
    """A field that no #SBATCH option carries: where the script uses it instead."""
    return field(default=default, metadata={SCRIPT_USE: where})


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """The job `dptrain submit` writes and submits (sbatch's own option names, with _ for -)."""

    nodes: int = sbatch_field(1, "--nodes", 1, "-N")
    """Nodes of the job."""
    gpus_per_node: int = sbatch_field(0, "--gpus-per-node", 3, value=lambda s: None if s.sbatch_gpus_per_node()
                                      else s.gpus_per_node or None)  # an --sbatch line asking for GPUs is written instead
    """GPUs per node (0: a CPU job on gloo)."""
    cpus_per_node: int = sbatch_field(0, "--cpus-per-task", 4, "-c", value=lambda s: s.cpus_per_node // s.tasks_per_node
                                      if s.cpus_per_node else None)  # the node's cores, shared out among its tasks
    """CPU cores per node the job asks for (0: the partition's default); each rank gets its share as threads."""
    ranks_per_node: int | Literal["auto"] = sbatch_field("auto", "--ntasks-per-node", 2,
                                                         value=lambda s: s.tasks_per_node)  # agent mode: 1, the agent
    """Ranks (training processes) per node; auto: one per GPU, or one on a CPU job (it uses every core asked for)."""
    mode: Literal["per-rank", "agent"] = script_field("per-rank", "srun's tasks: one per rank, or one per node "
                                                      "running torch's elastic agent")
    """per-rank: one srun task per rank, placed by SLURM; agent: one srun task per node running torch's elastic
    agent, which starts that node's ranks (rendezvous on the first node; launch.max_restarts applies)."""
    time: str | None = sbatch_field(None, "--time", 5, "-t")
    """Time limit, as sbatch takes it (02:00:00, 1-12:00:00, ...; none: the partition's default)."""
    partition: str | None = sbatch_field(None, "--partition", 6, "-p")
    """Partition (none: the cluster's default)."""
    account: str | None = sbatch_field(None, "--account", 7, "-A")
    """Account charged for the job."""
    qos: str | None = sbatch_field(None, "--qos", 8, "-q")
    """Quality of service."""
    constraint: str | None = sbatch_field(None, "--constraint", 9, "-C")
    """Node features the job needs (sbatch --constraint)."""
    mem: str | None = sbatch_field(None, "--mem", 10)
    """Memory per node (sbatch --mem, e.g. 32G)."""
    exclusive: bool = sbatch_field(False, "--exclusive", 11)
    """Ask for whole nodes, shared with no other job."""
    signal_lead_s: int = sbatch_field(120, "--signal", 16, value=lambda s: f"USR1@{s.signal_lead_s}" if s.signal_lead_s
                                      else None)  # the snapshot signal
    """Seconds before the time limit at which SLURM sends SIGUSR1: the ranks write a snapshot at their next step
    boundary and stop (0: no signal; the job then loses the steps since its last periodic snapshot)."""
    requeue: bool = sbatch_field(False, "--requeue", 17)
    """After that signal's snapshot, rank 0 requeues the job (scontrol requeue); the rerun resumes from the snapshot.
    Also lets SLURM requeue the job after a preemption or a node failure."""
    master_addr: str | None = script_field(None, "export MASTER_ADDR: the address the ranks reach the first node by")
    """Address the ranks reach the first node by (none: its NodeAddr from scontrol; set it to use another network,
    e.g. the name of its InfiniBand interface)."""
    setup: tuple[str, ...] = script_field((), "shell lines run before srun")
    """Shell lines run before training, e.g. ["module load pytorch", "source ~/venv/bin/activate"]."""
    sbatch: tuple[str, ...] = script_field((), "extra #SBATCH lines, written as given, one option each")
    """Extra #SBATCH lines, e.g. ["--mail-type=END", "--reservation=course"]."""
    python: str | None = script_field(None, "the interpreter srun runs dptrain with")
    """The Python that runs dptrain in the job (none: the one running `dptrain submit`; with setup lines that
    activate an environment, or in a container, python: the first on the PATH there)."""
    container_image: str | None = script_field(None, "srun's tasks start in this image: srun --container-image "
                                               "(pyxis), or apptainer exec")
    """Run the ranks inside this container image (none: on the nodes as they are), started by
    slurm.container_engine: a registry image (pyxis: nvcr.io#nvidia/pytorch:25.01-py3; apptainer:
    docker://nvcr.io/nvidia/pytorch:25.01-py3) or an image file (pyxis: a .sqsh squashfs; apptainer: a .sif), which
    must exist. The folder dptrain submit runs in and the run folder are mounted at their own paths, and the ranks
    start in that folder; the image's python (see slurm.python) runs dptrain and needs torch."""
    container_env_file: str | None = script_field(None, "srun's tasks start in the container this file describes: "
                                                  "srun --environment")
    """Run the ranks in the container that this environment definition file describes instead (srun
    --environment=FILE, the pyxis/enroot Container Engine of clusters such as CSCS's): a .toml file, which must
    exist, or the name of one in ~/.edf. The file names the image, its mounts (which must hold the folder dptrain
    submit runs in and the run folder) and its workdir; give it or slurm.container_image, not both."""
    container_engine: Literal["pyxis", "apptainer"] = script_field("pyxis", "what starts container_image: pyxis "
                                                                   "(srun's options) or apptainer (apptainer exec)")
    """What starts slurm.container_image: pyxis (srun --container-image, with enroot) or apptainer (apptainer exec
    under srun, with --nv on a GPU job)."""

    def __post_init__(self) -> None:
        positive(self.nodes, "slurm.nodes")
        not_negative(self.gpus_per_node, "slurm.gpus_per_node")
        not_negative(self.cpus_per_node, "slurm.cpus_per_node")
        not_negative(self.signal_lead_s, "slurm.signal_lead_s")
        if self.ranks_per_node != "auto":
            positive(self.ranks_per_node, "slurm.ranks_per_node")
        gpus = self.gpus_here  # the sbatch lines' GPU requests, checked here: one sentence before anything is written
        if self.gpus_per_node and gpus != self.gpus_per_node:
            written = self.sbatch_gpus_per_node()[0]  # type: ignore[index]  # gpus differs: a line asks for them
            raise ConfigError(f"slurm.gpus_per_node = {self.gpus_per_node} but slurm.sbatch's {written} asks for "
                              f"{gpus} per node; ask for the GPUs once, as --gpus-per-node N or as an --sbatch line.")
        ranks = self.ranks_here
        if self.cpus_per_node and ranks > self.cpus_per_node:
            raise ConfigError(f"slurm.ranks_per_node = {ranks} is more than slurm.cpus_per_node = {self.cpus_per_node}; "
                              f"give every rank a core at least.")
        if self.master_addr is not None and any(c.isspace() or not c.isprintable() for c in self.master_addr):
            raise ConfigError(f"slurm.master_addr = {shown(self.master_addr)} holds a space or control character; give "
                              f"one host name or address.")
        if self.time is not None and not SLURM_TIME.fullmatch(self.time):
            raise ConfigError(f"slurm.time = {self.time!r} is not a time sbatch reads; write it as HH:MM:SS or D-HH:MM:SS.")
        if self.requeue and not self.signal_lead_s:
            raise ConfigError("slurm.requeue needs slurm.signal_lead_s above 0: the signal is what makes the ranks write "
                              "the snapshot the rerun resumes from.")
        for name, lines in {"setup": self.setup, "sbatch": self.sbatch, "python": (self.python or "",)}.items():
            if any(not c.isprintable() and c != "\t" for line in lines for c in line):
                raise ConfigError(f"slurm.{name} holds a line break or another control character; give printable text, "
                                  f"one line per list item.")
        self._check_container()

    def _check_container(self) -> None:
        """The container options, as far as they can be checked alone and without the files (slurm.containers checks
        the rest where the job is written: a rank reads this config too, where the files may not be)."""
        for name in ("container_image", "container_env_file"):
            value = getattr(self, name)
            if value is not None and (not value or any(c.isspace() or not c.isprintable() for c in value)):
                raise ConfigError(f"slurm.{name} = {shown(value)} is empty or holds a space or control character, "
                                  f"which the srun line cannot carry; give an image name or a path without spaces.")
        if self.container_image and self.container_env_file:
            raise ConfigError("slurm.container_image and slurm.container_env_file are two ways to give the container "
                              "(the environment file names its own image); keep one of them.")
        if self.container_env_file and self.container_engine != "pyxis":
            raise ConfigError(f"slurm.container_env_file is read by srun --environment (pyxis), not by "
                              f"{self.container_engine}; give the image as slurm.container_image instead, or drop "
                              f"slurm.container_engine.")

    @property
    def container(self) -> str | None:
        """What runs the ranks: pyxis (an image), edf (an environment file), apptainer; None: no container."""
        if self.container_env_file:
            return "edf"
        return self.container_engine if self.container_image else None

    @property
    def tasks_per_node(self) -> int:
        """srun's tasks on each node: one per rank, or one (the elastic agent) in agent mode."""
        return self.ranks_here if self.mode == "per-rank" else 1

    @property
    def ranks_here(self) -> int:
        """ranks_per_node resolved."""
        if self.ranks_per_node != "auto":
            return int(self.ranks_per_node)
        return self.gpus_here or 1

    @property
    def gpus_here(self) -> int:
        """GPUs per node: as an sbatch line asks for them (gres=gpu:4, ...), else gpus_per_node (the two agree)."""
        asked = self.sbatch_gpus_per_node()
        return asked[1] if asked else self.gpus_per_node

    def sbatch_gpus_per_node(self) -> tuple[str, int] | None:
        """(the first slurm.sbatch option asking for GPUs, as written; the GPUs per node they all ask for), None where
        none does. ConfigError in one sentence where they disagree, or a count cannot be made per node."""
        per_node: tuple[str, int] | None = None
        for asked in sbatch_gpus(self.sbatch):
            if asked.per == "node":
                count = asked.count
            elif asked.per == "job":  # sbatch may place them unevenly; dptrain starts the same ranks on every node
                if asked.count % self.nodes:
                    raise ConfigError(f"slurm.sbatch's {asked.written} asks for {asked.count} GPUs over "
                                      f"{self.nodes} nodes, which do not share them evenly; ask for a multiple of "
                                      f"{self.nodes}, or per node (--gpus-per-node N).")
                count = asked.count // self.nodes
            elif self.mode == "agent":  # one task per node: the agent, which starts that node's ranks
                count = asked.count
            elif self.ranks_per_node == "auto":  # auto is one rank per GPU: a circle, unless the ranks are given
                raise ConfigError(f"slurm.sbatch's {asked.written} gives each rank its GPUs, and the ranks per node "
                                  f"are auto (one per GPU); give --ranks-per-node N too, or ask per node "
                                  f"(--gpus-per-node N).")
            else:
                count = asked.count * int(self.ranks_per_node)
            if per_node is not None and count != per_node[1]:
                raise ConfigError(f"slurm.sbatch asks for {per_node[1]} GPUs per node ({per_node[0]}) and for {count} "
                                  f"({asked.written}); keep one of these lines.")
            per_node = per_node or (asked.written, count)
        return per_node
