"""GPU requests as the tutorials' job scripts write them (#SBATCH --gres=gpu:4, --gpus=8, --gpus-per-task=1) in
slurm.sbatch: read into the GPUs per node, so that the job is a GPU job; a contradiction is one sentence."""

from __future__ import annotations

import pytest

from dptrain.config import SlurmConfig, sbatch_gpus
from dptrain.errors import ConfigError
from dptrain.slurm import partition as slurm_partition


@pytest.mark.parametrize("lines, per_node", [
    (("gres=gpu:4",), 4),
    (("--gres=gpu:a100:4",), 4),
    (("--gres gpu:a100:2,nvme:1",), 2),   # the value as the next word; other resources are not GPUs
    (("gres=gpu",), 1),                   # no count: one, as sbatch reads it
    (("gpus-per-node=a100:2,v100:2",), 4),
    (("gpus=4",), 4),
    (("-G 4",), 4),                       # --gpus' short form
    (("mail-type=END", "gres=gpu:4 --exclusive"), 4),
    (("mail-type=END",), 0),              # no GPU line: a CPU job, as before
])
def test_gpu_lines_give_the_gpus_per_node_and_the_ranks_follow(lines, per_node):
    job = SlurmConfig(sbatch=lines)
    assert job.gpus_here == per_node
    assert job.ranks_here == (per_node or 1)  # auto: one rank per GPU


@pytest.mark.parametrize("options, per_node", [
    (dict(nodes=2, sbatch=("gpus=8",)), 4),                                  # a total over the job's nodes
    (dict(ranks_per_node=4, sbatch=("gpus-per-task=1",)), 4),                # per task: times the ranks per node
    (dict(mode="agent", ranks_per_node=4, sbatch=("gpus-per-task=4",)), 4),  # agent mode: one task per node
    (dict(gpus_per_node=4, sbatch=("gres=gpu:4",)), 4),                      # the same count twice agrees
])
def test_totals_and_per_task_counts_become_per_node(options, per_node):
    assert SlurmConfig(**options).gpus_here == per_node


@pytest.mark.parametrize("options, sentence", [
    (dict(gpus_per_node=2, sbatch=("gres=gpu:4",)),
     "slurm.gpus_per_node = 2 but slurm.sbatch's --gres=gpu:4 asks for 4 per node; ask for the GPUs once, as "
     "--gpus-per-node N or as an --sbatch line."),
    (dict(sbatch=("gres=gpu:4", "gpus-per-node=2")),
     "slurm.sbatch asks for 4 GPUs per node (--gres=gpu:4) and for 2 (--gpus-per-node=2); keep one of these lines."),
    (dict(nodes=3, sbatch=("gpus=8",)),
     "slurm.sbatch's --gpus=8 asks for 8 GPUs over 3 nodes, which do not share them evenly; ask for a multiple of 3, "
     "or per node (--gpus-per-node N)."),
    (dict(sbatch=("gpus-per-task=1",)),
     "slurm.sbatch's --gpus-per-task=1 gives each rank its GPUs, and the ranks per node are auto (one per GPU); give "
     "--ranks-per-node N too, or ask per node (--gpus-per-node N)."),
    (dict(sbatch=("gres=gpu:a100:two",)),
     "slurm.sbatch asks for GPUs as '--gres=gpu:a100:two', which dptrain cannot count; write it as --gres=gpu:N, "
     "--gres=gpu:TYPE:N, --gpus-per-node=N, --gpus=N or --gpus-per-task=N."),
    (dict(sbatch=("gpus=",)), "slurm.sbatch asks for GPUs as '--gpus=', which dptrain cannot count"),
])
def test_contradictions_and_unreadable_counts_are_one_sentence(options, sentence):
    with pytest.raises(ConfigError) as caught:
        SlurmConfig(**options)
    message = str(caught.value)
    assert sentence in message and "\n" not in message


def test_each_gpu_option_is_read_as_written_and_others_are_left_alone():
    found = sbatch_gpus(("--gres=gpu:2 --mail-type=END", "-G8", "reservation=gpu:4"))
    assert [(g.written, g.count, g.per) for g in found] == [("--gres=gpu:2", 2, "node"), ("-G 8", 8, "job")]


def test_the_job_asks_for_its_gpus_once_through_the_users_line():
    # Both --gres=gpu:4 and --gpus-per-node=4 in one script: sbatch would see the GPUs asked for twice.
    job = SlurmConfig(gpus_per_node=4, sbatch=("gres=gpu:4",))
    assert slurm_partition.per_node_request(job) == (4, 4)
    assert slurm_partition.per_node_request(SlurmConfig(nodes=2, sbatch=("gpus=8",))) == (4, 4)
