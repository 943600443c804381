"""The check that a partition can hold a job, made before it is submitted: SLURM queues a job that asks for more
nodes, or more CPUs or GPUs per node, than its partition has, and it then waits for ever (reason PartitionConfig,
PartitionNodeLimit). sinfo says what the partition's nodes have; where it is missing, fails or is slow, sbatch decides.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from dptrain.config import SlurmConfig
from dptrain.errors import ConfigError
from dptrain.slurm.job import counted

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
    """(CPUs, GPUs) that one node of the job must have, as the script asks for them."""
    tasks = s.tasks_per_node
    return tasks * (s.cpus_per_node // tasks if s.cpus_per_node else 1), s.gpus_here


def check_nodes_fit(s: SlurmConfig) -> None:
    """ConfigError in one sentence where the job asks for more nodes, or more CPUs or GPUs per node, than the
    partition has. Where sinfo is missing, fails, is slow or names no node, nothing is checked and sbatch decides."""
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
