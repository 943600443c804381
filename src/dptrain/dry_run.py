"""`dptrain train --dry-run`: every check a run makes before it trains, and what it would do; nothing is written.

The command line's own checks (config, world, data files, model import, output folder) have run
already; this adds what needs the data and the model: one forward pass on one real batch (on the
CPU, in this process: no workers, no process group) and the snapshot a resume would start from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dptrain import snapshots
from dptrain.config import RunConfig
from dptrain.data import DataInfo, build_loaders, describe
from dptrain.data.catalog import DATASETS, locate
from dptrain.data.sharding import num_batches
from dptrain.distributed.env import Nodes
from dptrain.distributed.world import pick_backend
from dptrain.errors import ConfigError, DataError, SnapshotError
from dptrain.models import build_model
from dptrain.prestart import batch_split
from dptrain.runtime import wants_cuda
from dptrain.schedule import peak_lr, warmup_warning
from dptrain.strategies.registry import STRATEGIES


def dry_run(cfg: RunConfig, world_size: int, launched_outside: bool, nodes: Nodes | None = None) -> str:
    """The checks that need data and model, then a summary of the run; raises ConfigError (or DataError,
    SnapshotError) with one sentence if the run would fail, but for the snapshot it would resume from: a resume it
    would refuse (another experiment's snapshot, none whole) is what the run would do, and the summary says so on its
    resume line. nodes: the run's nodes, for a run over several."""
    info = describe(cfg.data)
    strategy = STRATEGIES[cfg.strategy.name]
    data_world = strategy.data_world_size(cfg.strategy, world_size)
    steps_per_epoch = num_batches(info.train_size, cfg.train.global_batch_size)  # as the loaders count them
    total_steps = cfg.train.total_steps(steps_per_epoch)
    present = _data_present(cfg)
    model, batch_shape = _forward_one_batch(cfg, data_world, present)
    parameters = sum(p.numel() for p in model.parameters())
    try:
        resume = _resume_plan(cfg, total_steps)
    except (ConfigError, SnapshotError) as exc:  # what the run would do: stop there; the dry run says so, and ends well
        resume = f"refused, so the run would stop before its first step: {exc}"
    on_cuda = wants_cuda(cfg.launch.device)
    device = "cuda:<local rank>" if on_cuda else "cpu"
    if launched_outside:
        workers = "ranks of the launcher that started this process"
    elif nodes is not None and nodes.count > 1:  # this node starts its share only
        per_node = world_size // nodes.count
        this = f"this is node {nodes.rank}" if nodes.rank is not None else "numbered by the rendezvous"
        workers = (f"ranks, {per_node} local workers on each of {nodes.count} nodes ({this})"
                   + (f"; it goes on with {nodes.fewest * per_node} ranks on {nodes.fewest} nodes or more after "
                      f"losing nodes" if nodes.elastic else ""))
    else:
        workers = "local workers"
    lines = [
        "dry run: nothing was written; the run would do this:",
        f"  world      {world_size} {workers} on {device}, backend {pick_backend(cfg.launch.backend, torch.device(device.split(':')[0]))}, "
        f"strategy {cfg.strategy.name}" + (f" ({data_world} of them take data)" if data_world != world_size else ""),
        f"  data       {_data_line(cfg, info, present)}",
        f"  batches    {batch_split(cfg, world_size)}; {steps_per_epoch} steps per epoch, {total_steps} in all "
        f"({cfg.train.epochs} epochs"
        + (f", stopped at step {cfg.train.max_steps}" if cfg.train.max_steps is not None else "") + ")",
        f"  model      {cfg.model.name}: {parameters:,} parameters"
        + ("; BatchNorm as SyncBatchNorm (statistics over the global batch)" if cfg.model.sync_batchnorm else "")
        + f"; one batch {'x'.join(map(str, batch_shape))} ran forward on the CPU",
        f"  optimizer  {cfg.optim.name}, peak lr {peak_lr(cfg):g}, schedule {cfg.optim.schedule}"
        + (f", warm-up {cfg.optim.warmup_steps} steps" if cfg.optim.warmup_steps else "")
        + (" along DeepSpeed's log curve" if cfg.optim.warmup_steps and
           cfg.strategy.deepspeed.warmup_type == "log" else ""),
        *_strategy_file_lines(cfg),
        *_profile_lines(cfg, total_steps),
        f"  writes     {cfg.output.run_dir} (config.toml, env.json, metrics.jsonl, tb/, logs/, checkpoints/"
        + (", model.pt)" if cfg.output.weights == cfg.output.run_dir / "model.pt" else f"); the final weights to "
           f"{cfg.output.weights}") + ("; they replace the earlier final weights there" if cfg.output.weights.exists()
                                       else ""),
        f"  resume     {resume}",
    ]
    warning = warmup_warning(cfg, total_steps)
    if warning is not None:  # as the run logs it at start
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _strategy_file_lines(cfg: RunConfig) -> list[str]:
    """The settings a file of the strategy's own states (a ds_config.json), as the run prints them at start."""
    from dptrain.strategies.registry import STRATEGIES

    line = STRATEGIES[cfg.strategy.name].settings_from_file(cfg)
    return [] if line is None else [f"  ds_config  {line}"]


def _profile_lines(cfg: RunConfig, total_steps: int) -> list[str]:
    """train.profile's steps, where the run profiles some, and where the traces go."""
    steps = cfg.train.profiled_steps
    if steps is None:
        return []
    first, last = steps[0], min(steps[1], total_steps)
    if first > total_steps:
        return [f"  profile    none: train.profile {cfg.train.profile} starts after the run's last step "
                f"({total_steps})"]
    return [f"  profile    steps {first} to {last} with torch.profiler on every rank, the traces in "
            f"{cfg.output.folder.profile}"]


def _data_line(cfg: RunConfig, info: DataInfo, present: bool) -> str:
    """The dataset's sizes, or, where its files are yet to be downloaded (data.download on), that the run would
    download them first, from where, and into which folder (describe() knows only the training split's official
    size then)."""
    shape = "x".join(map(str, info.image_shape))
    if present:
        return f"{info.name}: {info.train_size} training and {info.test_size} test samples of shape {shape}"
    spec = DATASETS[cfg.data.name]
    mirror = cfg.data.mirror or spec.mirrors[0]
    files = len(spec.downloads)
    return (f"{info.name}: not found under {cfg.data.root}, so the run would first download it there ({files} "
            f"file{'s' if files > 1 else ''} from {mirror}): {info.train_size} training samples of shape {shape}, "
            f"and the test split")


def _forward_one_batch(cfg: RunConfig, data_world: int, present: bool) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The model, after one forward pass on rank 0's share of the first global batch (zeros if the data is yet to be
    downloaded: a dry run downloads nothing)."""
    rank_batch = cfg.train.global_batch_size // data_world // cfg.train.accumulate_steps  # one micro-batch
    info = describe(cfg.data)
    images = None
    if present:
        _, train, _ = build_loaders(cfg.data, device=torch.device("cpu"), global_batch=cfg.train.global_batch_size,
                                    eval_batch=1, rank=0, world_size=data_world, seed=cfg.train.seed,
                                    channels_last=cfg.train.channels_last)
        images = next(iter(train.epoch_batches(0))).images[:rank_batch]  # its first micro-batch, as a step runs it
    if images is None:
        images = torch.zeros(rank_batch, *info.image_shape)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, info.image_shape, info.num_classes)
    model.eval()
    try:
        with torch.no_grad():
            logits = model(images)
    except Exception as exc:  # a user's model: any error in its forward is the finding
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model {cfg.model.name} fails on one batch of shape {tuple(images.shape)} ({first}); "
                          f"fix the model or the data options.") from None
    if logits.dim() != 2 or logits.shape[0] != len(images):
        raise ConfigError(f"model {cfg.model.name} returns shape {tuple(logits.shape)} for a batch of {len(images)}; "
                          f"it must return one row of class scores per image.")
    if info.num_classes is not None and logits.shape[1] != info.num_classes:
        raise ConfigError(f"model {cfg.model.name} returns {logits.shape[1]} class scores but {info.name} has "
                          f"{info.num_classes} classes.")
    return model, tuple(images.shape)


def _data_present(cfg: RunConfig) -> bool:
    if cfg.data.name not in DATASETS:  # synthetic and a user's Dataset: nothing to download
        return True
    try:
        locate(DATASETS[cfg.data.name], Path(cfg.data.root))
        return True
    except DataError:
        return False  # describe() passed, so data.download is on: the workers would fetch it


def _resume_plan(cfg: RunConfig, total_steps: int) -> str:
    """Which snapshot the run would start from, checked as a resume checks it (read only)."""
    if cfg.train.resume == "never":
        return "never (a fresh start)"
    if cfg.train.resume == "auto":
        folder = cfg.output.folder.checkpoints
        path = snapshots.find_latest(folder) if folder.is_dir() else None  # SnapshotError if none can be used
        if path is None:
            return "nothing to resume from: a fresh start"
    else:
        path = Path(cfg.train.resume)
    manifest = snapshots.verify(path)
    snapshots.check_compatible(manifest, cfg, path, total_steps)
    return f"from {path} (step {manifest['step']}, written by {manifest['world_size']} ranks)"
