"""Local workers of a training script of the user's own, started as torchrun starts them (`dptrain train
--nproc-per-node 2 -- my_train.py --epochs 5`), by dptrain's elastic agent (launch/local.py): a free port where the
run has one node (no MASTER_PORT to pick, no clash with another run on the machine), `dptrain train`'s node options
across several (--nnodes, --node-rank, --master-addr, or --rdzv-endpoint), restarts that say which rank failed and
why (--launch.max_restarts), the agent's log in the run folder (runs/<script's name>/logs/launcher.log), and each
rank's share of the cores as OMP_NUM_THREADS where it is not set (torchrun gives every rank one thread).

Each rank reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under torchrun; its output goes to the
console, as torchrun's does. Under a launcher already (torchrun, or srun with a task per rank), the script replaces
this process instead and reads that launcher's variables.
"""

from __future__ import annotations

import os
import sys

from dptrain.config import RunConfig
from dptrain.distributed.env import Nodes
from dptrain.launch.local import launch_local, world_size_here
from dptrain.launch.user_script_rank import WATCH_TIMEOUT
from dptrain.prestart import check_output_dir
from dptrain.runtime import available_cores
from dptrain.user_script import UserScript

EXAMPLE = "dptrain train --nproc-per-node 2 -- my_train.py --epochs 5"
# The sections of a run's options that still mean something for a script of the user's: where its run folder is
# (output: the agent's log goes there) and how its workers start (launch: nproc_per_node, timeout_s, max_restarts).
SCRIPT_SECTIONS = ("output", "launch")
THREADS_VAR = "OMP_NUM_THREADS"


def run_script(script: UserScript, cfg: RunConfig, nodes: Nodes | None, dry_run: bool) -> int:
    """Start this node's workers of script (or exec it under a launcher already); 0 once every rank has ended well.
    LaunchError naming the failed rank otherwise; with dry_run, say what would start and start nothing."""
    world_size, launched_outside = world_size_here(cfg, nodes)
    if not launched_outside:  # the agent's log goes there: a file in its place, or no right to write, said first
        check_output_dir(cfg.output.run_dir)
    python = script.python or sys.executable
    command = (python, "-u", *script.target, *script.args)
    log_file = cfg.output.folder.launcher_log
    if launched_outside:
        said = f"dptrain: {script.shown} runs as rank {os.environ.get('RANK', '?')} of the launcher that started dptrain"
        print(said, file=sys.stderr, flush=True)
        if dry_run:
            return 0
        os.execvp(python, command)
    per_node = world_size // (nodes.count if nodes else 1)
    threads = os.environ.get(THREADS_VAR) or str(max(1, available_cores() // per_node))
    where = "on a free port" if nodes is None else f"{nodes.count} nodes meeting at {nodes.endpoint}"
    print(f"dptrain: {'would start' if dry_run else 'starting'} {script.shown} on {per_node} local worker(s), world "
          f"size {world_size}, through dptrain's elastic agent ({where}), {THREADS_VAR}={threads} each; the agent's "
          f"log: {log_file}", file=sys.stderr, flush=True)
    if dry_run:
        return 0
    kept = os.environ.get(THREADS_VAR)
    os.environ[THREADS_VAR] = threads  # the workers inherit the agent's environment
    os.environ[WATCH_TIMEOUT] = str(cfg.launch.timeout_s)  # a collective overrunning it ends the run, named
    try:
        launch_local(python, command[1:], per_node, cfg.launch.timeout_s, cfg.launch.max_restarts, log_file, nodes,
                     on_cuda=False)  # a program of its own: nothing is forked from this process
    finally:
        os.environ.pop(WATCH_TIMEOUT, None)
        if kept is None:
            os.environ.pop(THREADS_VAR, None)
    return 0
