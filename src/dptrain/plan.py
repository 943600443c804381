"""The one planning call between the command line and the ranks: plan() reads the configuration once (the --config
file and the --section.option overrides: what the user gave), takes in a strategy's own settings file and names the
run after its experiment, finds the world (this node's workers, the nodes of --nnodes, the launcher's, or a job's),
checks an elastic run's limits, resolves a per-rank batch into the global one, and makes every check a run makes
before a worker starts. `dptrain train`, `config`, `doctor` and `submit` each take their Plan from it.

    cli.py -> plan(config_path, overrides, nodes) -> Plan(cfg, world_size, ...) -> the ranks (launch/local.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dptrain import config as config_mod
from dptrain.config import RunConfig
from dptrain.distributed.env import Nodes
from dptrain.launch.local import world_size_here
from dptrain.launch.rendezvous import rendezvous_times
from dptrain.prestart import (adopt_strategy_settings, check_elastic, check_leave_slow_node, named_after_its_experiment,
                              preflight, preflight_job, refuse_leave_slow_node_for_a_script, resolve_batch)

JobShape = Callable[[RunConfig], tuple[RunConfig, int]]
"""A job's say in the plan (`dptrain submit`): the configuration with the job's options in it, and the job's world
size."""


@dataclass(frozen=True)
class Plan:
    """What a command runs: the configuration as the ranks take it, the world, who starts the ranks."""

    cfg: RunConfig
    """As the ranks run it: a per-rank batch resolved into train.global_batch_size at world_size."""
    given: RunConfig
    """As the user gave it (a per-rank batch kept one: a job's job.toml, which `sbatch --nodes=N` may resize)."""
    world_size: int
    launched_outside: bool = False
    """Whether a launcher outside dptrain (torchrun, srun) started this process."""
    nodes: Nodes | None = None


def plan(config_path: str | None, overrides: list[tuple[str, str]], nodes: Nodes | None = None, *,
         job: JobShape | None = None, trainer: bool = True, checked: bool = True) -> Plan:
    """The Plan of these arguments, after every check made before a worker starts (checked; the doctor makes its
    own). job: the world is that job's (`dptrain submit`), checked as a job's; trainer False: the ranks run a script
    of the user's, which reads its own options (no strategy file, batch or run checks)."""
    cfg, given_names = config_mod.read(config_path, overrides)
    if trainer:
        cfg = named_after_its_experiment(adopt_strategy_settings(cfg, given_names), given_names)
    launched_outside = False
    if job is not None:
        cfg, world_size = job(cfg)
    else:
        world_size, launched_outside = world_size_here(cfg, nodes)
        if nodes is not None and nodes.elastic:
            check_elastic(cfg, nodes.fewest, nodes.count, world_size // nodes.count)
            rendezvous_times(cfg.launch.timeout_s, nodes)  # DPTRAIN_RDZV_*, checked in a dry run too
    if not trainer:
        refuse_leave_slow_node_for_a_script(cfg)
        return Plan(cfg, cfg, world_size, launched_outside, nodes)
    elastic = nodes is not None and nodes.elastic and job is None
    check_leave_slow_node(cfg, nodes.fewest if elastic else None, nodes.count if nodes is not None else None)
    given, cfg = cfg, resolve_batch(cfg, world_size)
    if checked:
        (preflight_job if job is not None else preflight)(cfg, world_size)
    return Plan(cfg, given, world_size, launched_outside, nodes)
