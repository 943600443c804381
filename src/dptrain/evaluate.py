"""Evaluation on the test split, sharded over the ranks with exact counts; `dptrain eval` of a snapshot.

Each rank runs its share of every test batch (no gradients, no gradient sync); the sums of loss,
correct and samples are reduced once at the end, so every test sample counts exactly once.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dptrain.data.loader import Loader
from dptrain.metrics import finite_or_none

log = logging.getLogger("dptrain")


def evaluate(
    module: nn.Module,
    loader: Loader,
    autocast: Callable[[], contextlib.AbstractContextManager],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    predictions: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Loss and accuracy over the whole split; with `predictions`, appends (index, label, predicted) rows of this rank."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples (this rank)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        # Every rank runs every batch, empty shares included: a sharded model (fsdp) gathers its
        # parameters inside forward, which needs all ranks.
        for batch in loader.epoch_batches(0):
            with autocast():
                logits = module(batch.images)
            predicted = logits.argmax(1)
            loss = F.cross_entropy(logits.float(), batch.labels, reduction="sum")
            sums += torch.stack([loss.double(), (predicted == batch.labels).sum().double(),
                                 loss.new_tensor(len(batch.labels), dtype=torch.float64)])
            if predictions is not None:
                predictions.append(torch.stack([batch.indices, batch.labels, predicted], 1).cpu())
    all_reduce(sums)
    elapsed = time.perf_counter() - start
    module.train(was_training)
    loss, correct, count = sums.tolist()
    return {"eval_loss": finite_or_none(loss / count), "eval_acc": correct / count, "eval_count": int(count), "eval_time_s": elapsed}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def find_snapshot(path: Path) -> Path:
    """A snapshot folder as given, or the newest valid one of a run directory."""
    from dptrain import checkpoint
    from dptrain.checkpoint import SnapshotError

    if (path / checkpoint.MANIFEST).is_file():
        return path
    found = checkpoint.find_latest(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if found is None:
        raise SnapshotError(f"{path} is neither a snapshot nor a run directory with a valid snapshot; "
                            f"give a folder that dptrain checkpoint list shows as ok.")
    return found


PREDICTIONS_HEADER = ("index", "label", "predicted")


def write_predictions(rows: torch.Tensor, path: Path) -> None:
    """index,label,predicted per test sample, in the split's order; written whole, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PREDICTIONS_HEADER)
        writer.writerows(rows.tolist())
    tmp.replace(path)


def run_eval_worker(cfg_tree: dict[str, Any], snapshot: str, predictions_path: str | None) -> dict[str, Any]:
    """Entry point of every rank of `dptrain eval`: load the snapshot's weights into a plain model, evaluate."""
    from torch.distributed.checkpoint import load as dcp_load

    from dptrain import checkpoint
    from dptrain import config as config_mod
    from dptrain.data import build_loaders
    from dptrain.launch.env import DistEnv
    from dptrain.launch.worker import join_world, setup_logging
    from dptrain.metrics import metric_line
    from dptrain.models import build_model
    from dptrain.runtime import Phase, destroy_process_group

    cfg = config_mod.from_dict(cfg_tree)
    env = DistEnv.from_environ()
    phase = Phase(env.global_rank)
    setup_logging(None, env)
    try:
        device, _ = join_world(cfg, env, phase)
        with phase("loading the test split"):
            info, _, loader = build_loaders(
                cfg.data, device=device, global_batch=cfg.train.global_batch_size, eval_batch=cfg.train.eval_batch_size,
                rank=env.global_rank, world_size=env.world_size, seed=cfg.train.seed, channels_last=cfg.train.channels_last,
            )
        with phase(f"loading the weights of {snapshot}"):
            manifest = checkpoint.verify(Path(snapshot))
            if manifest["model"] != cfg.model.name:
                raise checkpoint.SnapshotError(f"snapshot {snapshot} holds model {manifest['model']}, not {cfg.model.name}.")
            model = build_model(cfg.model, info.image_shape, info.num_classes).to(device)
            if cfg.train.channels_last and device.type == "cuda":
                model = model.to(memory_format=torch.channels_last)
            state = {"model": model.state_dict()}
            dcp_load(state, checkpoint_id=snapshot)  # only the model's entries; fsdp shards come back whole
            model.load_state_dict(state["model"])
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.bf16)  # noqa: E731
        rows: list[torch.Tensor] | None = [] if predictions_path else None
        with phase("evaluation"):
            result = evaluate(model, loader, autocast, _all_reduce, rows)
        if rows is not None:
            with phase("gathering predictions"):
                mine = torch.cat(rows) if rows else torch.empty(0, 3, dtype=torch.long)
                everyone: list[Any] = [None] * env.world_size
                dist.all_gather_object(everyone, mine)
                if env.is_main:
                    table = torch.cat(everyone)
                    write_predictions(table[table[:, 0].argsort()], Path(predictions_path))
        if env.is_main:
            record = {"event": "eval", "snapshot": snapshot, "step": manifest["step"], "world_size": env.world_size, **result}
            log.info(metric_line(record))
            if predictions_path:
                log.info("predictions for %d test samples written to %s", result["eval_count"], predictions_path)
        return result
    except Exception as exc:
        log.error("%s", exc)
        raise
    finally:
        destroy_process_group()


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor
