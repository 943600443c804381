"""Snapshots through torch.distributed.checkpoint, written atomically, found and verified on resume.

A snapshot is a folder checkpoints/step-00000120/ holding the DCP shards of the model and the
optimizer (or, for zero1 and ps, whose optimizers DCP cannot see into, the whole optimizer state
in optimizer.pt, written by rank 0), one rank<R>.pt per rank (its RNG states and its partial-epoch metric sums), extra.pt
(scheduler and loop position) and manifest.json (world size, strategy, model, config hash, torch
version, every file with its size and sha256). It is written under .tmp-step-..., flushed, then
renamed, and only then does checkpoints/latest (a one-line file, replaced atomically) point at it:
a crash at any moment leaves the previous snapshot whole and found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dptrain import config as config_mod
from dptrain import faults, runtime
from dptrain.config import ConfigError, RunConfig

log = logging.getLogger("dptrain")

PREFIX = "step-"
LATEST = "latest"
MANIFEST = "manifest.json"
WHOLE_OPTIMIZER = "optimizer.pt"  # for strategies whose optimizer DCP cannot shard (zero1, ps)
# Options that may change between a snapshot and its resume: how long to run, where data and logs
# live, how often to save, how evaluation is batched, which device. Every other option changes the
# computation, so a resume refuses it. The world size may change too: the shards are resharded on
# load (see load()).
RESUMABLE_CHANGES = {("train", "epochs"), ("train", "max_steps"), ("train", "resume"), ("train", "log_every"),
                     ("train", "deterministic"), ("train", "cuda_graph"), ("train", "eval_batch_size"),
                     ("data", "root"), ("data", "download"), ("data", "mirror"), ("data", "num_workers"),
                     ("launch", "timeout_s"), ("launch", "nproc_per_node"), ("launch", "max_restarts"), ("launch", "device"),
                     ("output", "name"), ("output", "dir")}
# Schedules whose shape depends on the run's length: a resume must keep the length they were planned for.
LENGTH_BOUND_SCHEDULES = ("cosine", "onecycle")


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message names it and what is wrong."""


def computation_options(cfg: RunConfig) -> dict[str, Any]:
    """Every option that changes the computation, as dotted names: what a resume must keep."""
    tree = config_mod.to_dict(cfg)
    options = {f"{s}.{k}": v for s, opts in tree.items() if s != "checkpoint"
               for k, v in opts.items() if (s, k) not in RESUMABLE_CHANGES}
    return json.loads(json.dumps(options, default=str))  # as the manifest holds them: tuples become lists


def config_hash(cfg: RunConfig) -> str:
    """Hash of computation_options(cfg)."""
    return hashlib.sha256(json.dumps(computation_options(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """A rename is durable only once its directory is flushed."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class Snapshotter:
    """Writes a run's snapshots; with async_save the DCP shards are written in a background thread.

    Asynchronous: the state is copied to CPU memory at the step (DCP's staging), then written while
    training goes on, over a gloo group of its own so that its collectives never interleave with
    the training's. Only once every rank's shards are written does rank 0 commit the snapshot
    (manifest, rename, latest), at a later step boundary or before the next snapshot. The cost:
    one more copy of the model and optimizer state in CPU memory while a write is under way.
    """

    def __init__(self, keep_last: int, async_save: bool) -> None:
        self.keep_last = keep_last
        self.is_main = dist.get_rank() == 0
        self.group = dist.new_group(backend="gloo") if async_save else None  # a collective: every rank builds it
        self.pending: tuple[Any, Path, Path] | None = None  # (future, tmp folder, final folder)

    def save(self, run: Any) -> Path:
        """Snapshot `run` at this step boundary (every rank calls this at the same step); returns its folder."""
        self.wait()
        root = run.cfg.output.run_dir / "checkpoints"
        name = f"{PREFIX}{run.step:08d}"
        final, tmp = root / name, root / f".tmp-{name}"
        if final.is_dir():  # this step is already saved (a run resumed from it and stopped again)
            return final
        if run.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while saving
            tmp.mkdir(parents=True)
        runtime.barrier()
        # Everything but the shards is written now, before the (maybe background) DCP write: once
        # DCP's coordinator has finished, every rank's files are therefore complete.
        torch.save({"rng": _rng_state(run.device), "epoch_sums": run.epoch_sums.cpu()}, tmp / f"rank{run.env.global_rank}.pt")
        whole_optimizer = run.strategy.whole_optimizer_state(run.optimizer)
        if run.env.is_main:
            if whole_optimizer is not None:
                torch.save(whole_optimizer, tmp / WHOLE_OPTIMIZER)
            torch.save({"scheduler": run.scheduler.state_dict(), "step": run.step, "epoch": run.epoch,
                        "batches_consumed": run.batches_consumed, "epoch_reported": run.epoch_reported,
                        "epoch_elapsed": run.epoch_elapsed, "epoch_seen": run.epoch_seen}, tmp / "extra.pt")
            manifest = {"world_size": run.env.world_size, "strategy": run.cfg.strategy.name, "model": run.cfg.model.name,
                        "config_hash": config_hash(run.cfg), "config": computation_options(run.cfg),
                        "schedule_steps": run.total_steps, "torch": torch.__version__, "step": run.step}
            (tmp / ".manifest-head.json").write_text(json.dumps(manifest))
        state = run.strategy.snapshot_state(run.optimizer)
        if self.group is None:
            from torch.distributed.checkpoint import save as dcp_save

            dcp_save(state, checkpoint_id=str(tmp))
            runtime.barrier()
            self._commit(tmp, final)
            runtime.barrier()
        else:
            from torch.distributed.checkpoint import async_save as dcp_async_save

            self.pending = (dcp_async_save(_frozen_copy(state), checkpoint_id=str(tmp), process_group=self.group), tmp, final)
        return final

    def poll(self) -> None:
        """At a step boundary: commit a background write that has finished (no collective, no waiting)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for a background write and commit it (before the next snapshot, at the end, on a stop)."""
        if self.pending is not None:
            future, tmp, final = self.pending
            self.pending = None
            future.result()  # raises what the background write raised
            self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rank 0: manifest with every file's size and sha256, fsync, rename, then move `latest`."""
        if not self.is_main:
            return
        head = tmp / ".manifest-head.json"
        manifest = json.loads(head.read_text())
        head.unlink()
        manifest["files"] = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                             for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _fsync_tree(tmp)
        faults.crash_before_rename(final.name)
        os.replace(tmp, final)
        pointer = final.parent / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, final.parent / LATEST)
        _fsync_dir(final.parent)
        _prune(final.parent, self.keep_last)
        log.info("snapshot %s written", final)


def _frozen_copy(state: Any) -> Any:
    """The state with every CPU tensor copied, so that training cannot change it during a background write.

    DCP's staging copies device tensors to CPU memory, but torch 2.6 writes CPU tensors as they are:
    a snapshot of step 5 then held the weights of a later step (seen in the async-resume test).
    """
    if isinstance(state, dict):
        return {key: _frozen_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_frozen_copy(value) for value in state)
    if torch.is_tensor(state) and state.device.type == "cpu":
        return state.detach().clone()
    return state


def _prune(root: Path, keep_last: int) -> None:
    snapshots = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())
    for old in snapshots[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a whole snapshot; SnapshotError naming the first missing or damaged file."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotError(f"snapshot {path} has no {MANIFEST}: it is incomplete.")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        fields_present = all(key in manifest for key in ("world_size", "strategy", "model", "config_hash", "step"))
    except (json.JSONDecodeError, KeyError, TypeError):
        fields_present = False
    if not fields_present or not isinstance(files, dict):
        raise SnapshotError(f"snapshot {path} has a damaged {MANIFEST}.")
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise SnapshotError(f"snapshot {path} lacks {name}: it is incomplete.")
        if file.stat().st_size != meta["bytes"] or _sha256(file) != meta["sha256"]:
            raise SnapshotError(f"snapshot {path} has a damaged {name} (size or sha256 differs from the manifest).")
    return manifest


def list_snapshots(root: Path) -> list[tuple[Path, str]]:
    """Every snapshot folder under root, newest first, with 'ok' or what is wrong with it."""
    out = []
    for path in sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        try:
            manifest = verify(path)
            out.append((path, f"ok: step {manifest['step']}, world size {manifest['world_size']}, strategy {manifest['strategy']}"))
        except SnapshotError as exc:
            out.append((path, str(exc)))
    return out


def find_latest(root: Path) -> Path | None:
    """The newest snapshot that verifies; each skipped one is named in one log line."""
    for path, status in list_snapshots(root):
        if status.startswith("ok"):
            return path
        log.warning("skipping %s", status)
    return None


def check_compatible(manifest: dict[str, Any], cfg: RunConfig, path: Path, total_steps: int) -> None:
    """ConfigError naming the first option this run changed that a resume must keep."""
    how_to = "use the snapshot's setting, or another --output.name to start afresh"
    for key, ours in (("model", cfg.model.name), ("strategy", cfg.strategy.name)):
        if manifest[key] != ours:
            raise ConfigError(f"snapshot {path} was written with {key} {manifest[key]} but this run has {ours}; {how_to}.")
    if manifest["config_hash"] != config_hash(cfg):
        theirs, ours = manifest.get("config", {}), computation_options(cfg)
        changed = [name for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]
        if changed:
            name = changed[0]
            more = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
            raise ConfigError(f"snapshot {path} was written with {name} = {theirs.get(name)!r} but this run has "
                              f"{ours.get(name)!r}{more}; {how_to}.")
        raise ConfigError(f"snapshot {path} was written with another configuration (only run length, logging, paths and "
                          f"the device may change); {how_to}.")
    planned = manifest.get("schedule_steps", total_steps)
    if cfg.optim.schedule in LENGTH_BOUND_SCHEDULES and planned != total_steps:
        raise ConfigError(f"snapshot {path} follows a {cfg.optim.schedule} learning-rate schedule planned for {planned} steps, "
                          f"but this run would last {total_steps}; keep train.epochs and train.max_steps as they were, "
                          f"or use another --output.name to start afresh.")


def load(run: Any, path: Path) -> None:
    """Restore `run` from snapshot `path`: weights, optimizer, scheduler, position, every rank's RNG."""
    from torch.distributed.checkpoint import load as dcp_load

    manifest = verify(path)
    check_compatible(manifest, run.cfg, path, run.total_steps)
    state = run.strategy.snapshot_state(run.optimizer)
    dcp_load(state, checkpoint_id=str(path))
    run.strategy.restore_snapshot_state(run.optimizer, state)
    if not run.strategy.optimizer_in_dcp:
        run.strategy.restore_whole_optimizer_state(run.optimizer, torch.load(path / WHOLE_OPTIMIZER, weights_only=False))
    extra = torch.load(path / "extra.pt", weights_only=False)
    run.scheduler.load_state_dict(extra["scheduler"])
    run.step, run.epoch, run.batches_consumed = extra["step"], extra["epoch"], extra["batches_consumed"]
    run.epoch_reported, run.epoch_elapsed, run.epoch_seen = extra["epoch_reported"], extra["epoch_elapsed"], extra["epoch_seen"]
    if manifest["world_size"] == run.env.world_size:
        mine = torch.load(path / f"rank{run.env.global_rank}.pt", weights_only=False)
        run.epoch_sums = mine["epoch_sums"].to(run.device)
        _set_rng_state(mine["rng"], run.device)
    else:
        # Another world size: DCP has resharded the weights and optimizer, and the loader's position is
        # global. The partial-epoch sums are reduced over ranks at the epoch's end, so rank 0 carries
        # them all; per-rank RNG streams have no counterpart, so each rank keeps its fresh seed.
        others = [torch.load(path / f"rank{r}.pt", weights_only=False)["epoch_sums"] for r in range(manifest["world_size"])]
        run.epoch_sums = (torch.stack(others).sum(0) if run.env.is_main else torch.zeros_like(others[0])).to(run.device)
        log.info("resharding snapshot %s from world size %d to %d", path, manifest["world_size"], run.env.world_size)
    if run.batches_consumed >= len(run.train_loader) and run.epoch_reported:  # a finished epoch: go on with the next
        run.epoch, run.batches_consumed, run.epoch_sums = run.epoch + 1, 0, None
    log.info("resumed from %s at step %d (epoch %d, %d batches into it)", path, run.step, run.epoch + 1, run.batches_consumed)
