"""The checks every command makes before a worker starts (or a job is submitted): the configuration against the world,
the device and backend, the run folder, the snapshot a resume or eval would read, the data and the model.

Each raises one sentence (ConfigError, DataError, SnapshotError) and writes nothing; `dptrain train --dry-run`
(dry_run.py) adds what needs the data loaded and the model built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

from dptrain import snapshots, config as config_mod
from dptrain.config import LaunchConfig, OutputConfig, RunConfig, StrategyConfig, TrainConfig
from dptrain.data import describe
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError, UnsafeFileError
from dptrain.files import check_replaceable
from dptrain.imports import import_object
from dptrain.models import check_input
from dptrain.read_back import open_regular, special_kind
from dptrain.run_folder import RunFolder
from dptrain.runtime import wants_cuda
from dptrain.safe_load import check_private_file


log = logging.getLogger("dptrain")


def preflight(cfg: RunConfig, world_size: int, job_on_cuda: bool | None = None) -> None:
    """Every check that can fail before a worker starts: config vs world, device, run folder, dataset, model.
    job_on_cuda: whether a job submitted from here runs on GPUs (None: the run is here, on what this machine has)."""
    import torch

    from dptrain.strategies.registry import check_world  # imports torch.distributed: only once a run is wanted

    on_cuda = wants_cuda(cfg.launch.device) if job_on_cuda is None else job_on_cuda
    if job_on_cuda is None and cfg.launch.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("launch.device = cuda but CUDA is not available here; use --launch.device cpu or auto.")
    if job_on_cuda is None:
        check_backend(cfg.launch.backend, on_cuda)
    check_output_dir(cfg.output.run_dir)
    check_weights_file(cfg.output)
    check_trackers(cfg)
    check_resume_target(cfg)
    info = describe(cfg.data)
    check_world(cfg, world_size, info.train_size, on_cpu=not on_cuda, torch_version=str(torch.__version__))
    check_batch_fits(cfg, world_size, info.train_size)
    if config_mod.is_import_path(cfg.model.name):
        import_object(cfg.model.name, "model.name")
    else:
        check_input(cfg.model, info.image_shape)


def check_trackers(cfg: RunConfig) -> None:
    """Each tracker of output.trackers is installed here (rank 0 imports it as the run starts)."""
    import importlib.util

    for name in cfg.output.trackers:
        choice = config_mod.TRACKERS[name]
        missing = [module for module in choice.needs if importlib.util.find_spec(module) is None]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(f"output.trackers {name} needs {', '.join(missing)}, which {verb} not installed here; run "
                              f"{choice.install}, or leave {name} out of output.trackers.")


def check_batch_fits(cfg: RunConfig, world_size: int, train_size: int) -> None:
    """The global batch is the training split's size or less: a larger one took the whole split every step, while the
    schedule and a scaled rate (optim.scale_lr_with) took the batch as stated."""
    batch = cfg.train.global_batch_size
    if batch <= train_size:
        return
    per_rank = cfg.train.batch_size_per_rank
    if per_rank is None:
        raise ConfigError(f"train.global_batch_size {batch} is larger than the training split ({train_size} samples), "
                          f"so every step would take the whole split; choose {train_size} or less.")
    from dptrain.strategies.registry import data_world_size  # imports torch: only once a run is wanted

    takers, pieces = data_world_size(cfg.strategy, world_size), cfg.train.accumulate_steps
    raise ConfigError(f"train.batch_size_per_rank {per_rank} x {_ranks_and_pieces(takers, pieces)} is a global batch "
                      f"of {batch}, larger than the training split ({train_size} samples), so every step would take "
                      f"the whole split; choose a batch per rank of {max(1, train_size // (takers * pieces))} or less.")


def _ranks_and_pieces(takers: int, pieces: int) -> str:
    """'2 ranks', or '2 ranks x 4 micro-batches' where train.accumulate_steps is 4."""
    return f"{takers} ranks" + (f" x {pieces} micro-batches" if pieces > 1 else "")


def batch_split(cfg: RunConfig, world_size: int) -> str:
    """How a step's global batch is shared out, in words: 'global 128 = 64 per rank' and, where train.accumulate_steps
    splits each share, '= 4 micro-batches of 16' (the dry run's and `dptrain config`'s line)."""
    from dptrain.strategies.registry import data_world_size  # imports torch: only once a run is wanted

    batch, pieces = cfg.train.global_batch_size, cfg.train.accumulate_steps
    share = batch // data_world_size(cfg.strategy, world_size)
    split = f"global {batch} = {share} per rank"
    return split + (f" = {pieces} micro-batches of {share // pieces} (train.accumulate_steps)" if pieces > 1 else "")


def check_elastic(cfg: RunConfig, fewest_nodes: int, most_nodes: int, per_node: int) -> None:
    """What a run whose node count may change (--nnodes MIN:MAX) needs: restarts (a lost node fails the others'
    workers, which the agent then restarts with the nodes left), a global batch that stays the same (the same math at
    every world size), snapshots that reshard, and a valid split at every world size it may have."""
    import torch

    from dptrain.strategies.registry import STRATEGIES, check_world

    spelled = f"--nnodes {fewest_nodes}:{most_nodes}"
    if cfg.launch.max_restarts < 1:
        raise ConfigError(f"{spelled} goes on after losing a node by restarting the workers of the nodes left, from the "
                          f"last snapshot; give --launch.max_restarts {most_nodes - fewest_nodes} (one per node it may "
                          f"lose; more to restart after other failures too).")
    if cfg.train.batch_size_per_rank is not None:
        raise ConfigError(f"train.batch_size_per_rank would change the global batch (and so the math) each time a node "
                          f"leaves a {spelled} run; give train.global_batch_size instead.")
    if not STRATEGIES[cfg.strategy.name].resumes_on_another_world:
        elastic = [name for name, cls in STRATEGIES.items() if cls.resumes_on_another_world and not cls.one_process]
        raise ConfigError(f"strategy {cfg.strategy.name}'s snapshots resume on as many processes only, so a {spelled} "
                          f"run could not go on after losing a node; use {', '.join(elastic[:-1])} or {elastic[-1]}, "
                          f"or a fixed --nnodes.")
    info = describe(cfg.data)
    for nodes in range(fewest_nodes, most_nodes + 1):
        check_world(cfg, nodes * per_node, info.train_size, on_cpu=not wants_cuda(cfg.launch.device),
                    torch_version=str(torch.__version__))


def check_leave_slow_node(cfg: RunConfig, fewest_nodes: int | None, most_nodes: int | None) -> None:
    """launch.leave_slow_node needs a run that may go on with fewer nodes (--nnodes MIN:MAX with MIN below MAX, whose
    own checks are check_elastic's) and the own clock that names the straggler (launch.watch). None: no node range
    (a fixed --nnodes, one node, a launcher of the user's or a SLURM job)."""
    leave = cfg.launch.leave_slow_node
    if not leave:
        return
    if fewest_nodes is None or most_nodes is None or fewest_nodes >= most_nodes:
        spelled = "no --nnodes" if most_nodes is None else f"--nnodes {most_nodes}"
        raise ConfigError(f"launch.leave_slow_node = {leave} needs a run that may go on with fewer nodes, and this one "
                          f"has {spelled}; give --nnodes MIN:MAX with MIN below MAX (dptrain train on each node), or "
                          f"set launch.leave_slow_node 0.")
    if not cfg.launch.watch:
        raise ConfigError(f"launch.leave_slow_node = {leave} needs launch.watch true: the ranks' own clocks name the "
                          f"slow node; set launch.watch true, or launch.leave_slow_node 0.")


def refuse_leave_slow_node_for_a_script(cfg: RunConfig) -> None:
    """launch.leave_slow_node with a script of the user's (`dptrain train -- my_train.py`, or its job): the slow node is
    named by dptrain's own loop, which a script does not run."""
    if cfg.launch.leave_slow_node:
        raise ConfigError(f"launch.leave_slow_node = {cfg.launch.leave_slow_node} needs dptrain's own training loop, "
                          f"which names the slow node; a script of yours is not timed that way: drop it.")


def adopt_strategy_settings(cfg: RunConfig, given: set[str]) -> RunConfig:
    """cfg with the settings of a file of the strategy's own (Strategy.adopt_settings: DeepSpeed's ds_config.json, the
    tutorials' train_batch_size, Adam params, clipping, WarmupLR) taken into the options that neither the --config file
    nor the command line sets (given: their dotted names, config.read); cfg itself where the strategy has none."""
    from dptrain.strategies.registry import STRATEGIES  # imports torch: only once a run is wanted

    return STRATEGIES[cfg.strategy.name].adopt_settings(cfg, given)


def named_after_its_experiment(cfg: RunConfig, given: set[str]) -> RunConfig:
    """cfg with its run folder named after its experiment (config.experiment_name: runs/fashion-mnist_mnist-cnn_ddp),
    where neither output.name nor output.dir was given: the same command finds its folder again and resumes, and a
    new experiment (another dataset, model, strategy or option a resume must keep) starts afresh in a folder of its
    own, instead of being refused by the snapshot of the last one. A runs/run of an earlier dptrain (whose default
    name that was) holding the same experiment is kept: the same command goes on resuming there."""
    if {"output.name", "output.dir"} & given:
        return cfg
    name = config_mod.experiment_name(cfg)
    earlier = RunFolder(dataclasses.replace(cfg.output, name=OutputConfig().name).run_dir)
    if _holds_the_same_experiment(earlier, cfg):
        log.info("%s holds this experiment, written by an earlier dptrain: the run goes on there (it would be named "
                 "%s now)", earlier.root, name)
        name = OutputConfig().name
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=name))


def _holds_the_same_experiment(folder: RunFolder, cfg: RunConfig) -> bool:
    """Whether folder's config.toml is that of a run with cfg's options a resume must keep (nothing where it is
    missing, unreadable, or of options this dptrain does not know)."""
    if not folder.config.exists():
        return False
    try:
        theirs = config_mod.load(folder.config)
    except (ConfigError, OSError):
        return False
    return config_mod.fixed_at_resume(theirs) == config_mod.fixed_at_resume(cfg)


def resolve_batch(cfg: RunConfig, world_size: int) -> RunConfig:
    """cfg with train.global_batch_size = train.batch_size_per_rank x the ranks that take data x train.accumulate_steps,
    where the tutorials' per-rank batch is given (and cfg as it is otherwise). ConfigError where a global batch given too disagrees."""
    per_rank = cfg.train.batch_size_per_rank
    if per_rank is None:
        return cfg
    from dptrain.strategies.registry import data_world_size  # imports torch: only once a run is wanted

    takers, pieces = data_world_size(cfg.strategy, world_size), cfg.train.accumulate_steps
    total = per_rank * takers * pieces
    given = cfg.train.global_batch_size
    if given != total and given != TrainConfig.global_batch_size:  # the default gives way; a value given does not
        raise ConfigError(f"train.batch_size_per_rank {per_rank} x {_ranks_and_pieces(takers, pieces)} is a global "
                          f"batch of {total}, but train.global_batch_size is {given}; give one of the two.")
    if DistEnv.from_environ().is_main:  # every rank resolves it; one line says it (srun gathers the ranks' stderr)
        log.info("global batch %d = train.batch_size_per_rank %d x %s", total, per_rank, _ranks_and_pieces(takers, pieces))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=total))


def check_resume_target(cfg: RunConfig) -> None:
    """A snapshot named by train.resume verifies; `never` does not write over an earlier run's snapshots."""
    if cfg.train.resume not in ("auto", "never"):
        snapshots.verify(Path(cfg.train.resume))  # SnapshotError: one sentence naming what is wrong
        return
    folder = cfg.output.folder.checkpoints
    if cfg.train.resume == "never" and any(p.is_dir() for p in folder.glob(f"{snapshots.PREFIX}*")):
        raise ConfigError(f"{cfg.output.run_dir} holds snapshots of an earlier run and train.resume is never; "
                          f"choose {cfg.output.elsewhere}, or delete {folder} to start afresh there.")


def check_backend(backend: str, on_cuda: bool) -> None:
    """nccl runs on CUDA devices only, and only where torch was built with it."""
    import torch.distributed as dist

    if backend == "nccl" and not on_cuda:
        raise ConfigError("launch.backend = nccl needs CUDA devices, and this run would use the CPU; "
                          "use --launch.backend gloo or auto.")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError("launch.backend = nccl but this torch build has no nccl; use --launch.backend gloo or auto.")


def check_gpus_for_workers(backend: str, workers: int, gpus: int) -> None:
    """Where dptrain's agent starts `workers` workers on GPUs on this node, which shows `gpus`: nccl takes one GPU per
    worker. With fewer (CUDA_VISIBLE_DEVICES=0 and 2 workers), the workers would all take cuda:0 and stop, once
    started, at NCCL's duplicate-GPU error. gloo lets ranks share a GPU (backend: launch.backend; auto is nccl here)."""
    if workers <= gpus or backend == "gloo":
        return
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{gpus} GPU{'' if gpus == 1 else 's'}" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    raise ConfigError(f"{workers} workers on this node would share the {seen} it shows, and nccl needs a GPU of its own "
                      f"for each; start at most {gpus} (--nproc-per-node {gpus}), make more GPUs visible, or use "
                      f"--launch.backend gloo.")


def check_output_dir(run_dir: Path) -> None:
    """The run folder is a folder this user can write in, or can be made as one; nothing is created here."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"the run folder {run_dir} is a file; choose another --output.name or --output.dir.")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"the run folder {run_dir} cannot be made: {existing} is a file; "
                          f"choose another --output.name or --output.dir.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"the run folder {run_dir} cannot be written: {existing} is not writable for you; "
                          f"choose another --output.dir, or fix its permissions.")
    if existing == run_dir and _has_entries(run_dir) and not RunFolder(run_dir).holds_a_run():
        # `--output.dir /etc -- script.py` made /etc/logs/launcher.log; a run would have written config.toml there
        raise ConfigError(f"the run folder {run_dir} holds files but no run of dptrain's (none of config.toml, "
                          f"metrics.jsonl, logs/, checkpoints/, ...); choose a new or empty folder, or an earlier run's, "
                          f"with another --output.dir or --output.name.")
    # What a run of this folder writes into or appends to, checked now: found at the first snapshot, a read-only
    # checkpoints/ cost the steps before it, and 2 workers printed 15 lines of C++ frames around the sentence.
    for path, folder in RunFolder(run_dir).written_by_a_run():
        if not path.exists():
            continue
        if path.is_dir() != folder:
            raise ConfigError(f"{path} is a {'file' if folder else 'folder'} where the run keeps its "
                              f"{'folder' if folder else 'file'}; move it away, or choose another --output.dir.")
        kind = None if folder else special_kind(path.stat().st_mode)
        if kind is not None:  # metrics.jsonl, appended to: a FIFO there held the run at its open for ever
            raise ConfigError(f"{path} is {kind} where the run keeps its file; move it away, or choose another "
                              f"--output.dir.")
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise ConfigError(f"{path} is not writable for you, and the run writes there; fix its permissions, or "
                              f"choose another --output.dir.")


def _has_entries(folder: Path) -> bool:
    """Whether folder holds anything (a folder that cannot be listed is left to the writes that follow)."""
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is not None
    except OSError:
        return False


def check_weights_file(output: OutputConfig) -> None:
    """The final weights' file (output.weights_dir/weights_file) can be written at the run's end: none of the run
    folder's own files or folders (--model_filename config.toml replaced the run's configuration with the weights;
    checkpoints made the final snapshot fail), not a folder, no file of the user's but earlier final weights (as
    predict and export replace none), in a folder this user can write in or make (the run makes it). Found there, a
    bad path cost the whole run's training."""
    path = output.weights
    kept = RunFolder(output.run_dir).keeps(path)
    if kept is not None:
        own, what = kept
        if own.resolve() == path.resolve():
            raise ConfigError(f"output.weights_file {path.name} would put the final weights in place of {own}, the run's "
                              f"{what}; give another --output.weights_file, such as model.pt.")
        raise ConfigError(f"the final weights' file {path} lies in {own}, where the run keeps its {what}; give another "
                          f"--output.weights_dir.")
    if path.is_dir():
        raise ConfigError(f"the final weights' file {path} is a folder; give another --output.weights_file, or "
                          f"another --output.weights_dir.")
    if (path.exists() or path.is_symlink()) and not is_final_weights(path):
        raise ConfigError(f"the final weights' file {path} already exists and holds no weights that torch.save wrote, "
                          f"so the run would destroy it; give another --output.weights_file, or move that file away.")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"the folder of the final weights {path.parent} cannot be made: {existing} is a file; "
                          f"give another --output.weights_dir.")
    if not os.access(existing, os.W_OK | os.X_OK):  # the file is replaced atomically: its folder is what is written
        raise ConfigError(f"the final weights cannot be written to {path}: {existing} is not writable for you; give "
                          f"another --output.weights_dir, or fix its permissions.")


def is_final_weights(path: Path) -> bool:
    """Whether path is a regular file (after links) that torch.save wrote: a zip archive with a data.pkl, as the
    final weights are (an earlier run's, which the same command replaces); read without unpickling anything."""
    try:
        with open_regular(path) as file, zipfile.ZipFile(file) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):  # NotRegularFile (a FIFO, a device) too
        return False


def preflight_job(cfg: RunConfig, world_size: int) -> None:
    """preflight for a job submitted from here: it runs on the GPUs it asks for, if any (--gpus-per-node, or an
    --sbatch line: gres=gpu:4, gpus=8, gpus-per-task=1)."""
    on_gpus = cfg.slurm.gpus_here > 0
    if cfg.launch.device == "cuda" and not on_gpus:
        raise ConfigError("launch.device = cuda but the job asks for no GPUs; add --gpus-per-node N (or --sbatch "
                          "gres=gpu:N), or use --launch.device auto.")
    preflight(cfg, world_size, job_on_cuda=on_gpus and cfg.launch.device != "cpu")


def snapshot_and_its_run(given: Path, overrides: list[tuple[str, str]], workers: int | None,
                          command: str) -> tuple[Path, RunConfig, dict[str, Any]]:
    """(the snapshot that --checkpoint names, given: a snapshot folder or a run folder; the run's configuration with
    the command's overrides and its number of workers, default 1; the snapshot's manifest), verified safe and whole
    before any worker starts."""
    snapshot = snapshots.find_snapshot(given)
    saved = RunFolder(snapshot.parent.parent).config
    if not saved.exists():  # a FIFO or a device there is not missing: check_private_file says what it is
        raise ConfigError(f"{saved} is missing: {command} rebuilds the model from the run's configuration; "
                          f"keep the snapshot inside its run folder (RUN/checkpoints/step-N).")
    try:  # it names the data and the model (even code to import): it is as much input from others as the snapshot
        check_private_file(saved, "the run's configuration")
    except UnsafeFileError as exc:
        raise ConfigError(str(exc)) from None
    # The run's folder is where the snapshot lies, whatever its config says (an older dptrain allowed names that are
    # refused now, such as "my run": eval and predict write nothing there, and must still read such a run).
    run_dir = snapshot.parent.parent
    cfg = config_mod.load(saved, [("output.name", "run"), ("output.dir", str(run_dir)), *overrides,
                                  ("launch.nproc_per_node", str(workers or 1)), ("launch.max_restarts", "0")])
    return snapshot, cfg, snapshots.verify(snapshot)


def check_predictions_path(path: Path) -> None:
    """Write over an earlier predictions file of eval only, never over another file (a run's config.toml, say)."""
    from dptrain.evaluate import PREDICTIONS_HEADER

    check_replaceable(path, "--predictions", lambda first: first == list(PREDICTIONS_HEADER), "a predictions file")


def local_workers(launch: LaunchConfig, strategy: StrategyConfig | None = None) -> int:
    """launch.nproc_per_node resolved for this machine (workers_for); strategy None: one that runs a process a GPU."""
    gpus = 0
    if wants_cuda(launch.device):
        import torch

        gpus = torch.cuda.device_count()
    one_process = False
    if strategy is not None:
        from dptrain.strategies.registry import STRATEGIES  # imports torch.distributed: only once a run is wanted

        one_process = STRATEGIES[strategy.name].one_process
    return workers_for(launch.nproc_per_node, gpus, one_process)


def workers_for(nproc_per_node: int | str, gpus: int, one_process: bool) -> int:
    """launch.nproc_per_node resolved: a number as given; auto: one per GPU the run uses (gpus: 0 on the CPU), one
    where it uses none (one worker uses every core: a second would only split them, and add its gradient traffic) or
    where the strategy drives every GPU from one process (single, dp: one process per GPU is what they refuse)."""
    if nproc_per_node != "auto":
        return int(nproc_per_node)
    if one_process:
        return 1
    return max(1, gpus)
