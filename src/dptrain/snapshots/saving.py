"""Snapshotter: a run's named state parts written atomically (every rank's shards, then rank 0's manifest and rename),
in the background where asked, pruned to the newest verified ones, and loaded back; the one rule of when one is due."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dptrain import faults
from dptrain.config import RunConfig
from dptrain.data import input_record
from dptrain.distributed.failures import Phase
from dptrain.distributed.world import barrier
from dptrain.errors import ConfigError, SnapshotError, UnsafeFileError
from dptrain.files import fsync_dir, written_atomically
from dptrain.run_folder import RunFolder
from dptrain.safe_load import check_private, dcp_load, load_tensors, make_private
from dptrain.stopping import StopRequest, Stopped
from dptrain.strategies.state import StatePart
from dptrain.train_state import TrainState
from dptrain.snapshots.finding import entries, first_reason, not_a_snapshot_folder, rerun_ending, span
from dptrain.snapshots.layout import (EXTRA, LATEST, MANIFEST, PREFIX, check_compatible, check_optimizer_keys,
                                     computation_options, config_hash, dcp_record, optimizer_record, read_manifest,
                                     reading, recorded_hash, sha256_of, verify, written_elsewhere)

log = logging.getLogger("dptrain")

def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def _rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG this rank draws from, as tensors and plain values (loadable with weights_only=True)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
             "numpy_pos": int(pos), "numpy_gauss": (int(has_gauss), float(gauss)), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], *state["numpy_gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class Snapshotter:
    """Saves and restores a run's named stateful parts, and decides when a snapshot is due.

    The parts: the loop's TrainState, the scheduler, the strategy's state parts (Strategy.state_parts:
    each says how it is stored and which files it reads; all are saved and loaded alike), each rank's
    RNG streams and partial-epoch sums. The loop calls at_step_boundary() after every step (a snapshot when
    due, or a stop's) and save_if_due() after every epoch's evaluation; the rule of when lives in due() alone.

    With async_save the DCP shards are copied to CPU memory at the step (DCP's staging), then
    written in the background over a gloo group of their own, so that their collectives never
    interleave with the training's; rank 0 commits the snapshot (manifest, rename, latest) once
    every rank's shards are written, at a later step boundary or before the next snapshot. The
    cost: one more copy of the model and optimizer state in CPU memory while a write is under way.
    """

    def __init__(self, cfg: RunConfig, env: Any, device: torch.device, strategy: Any, optimizer: torch.optim.Optimizer,
                 scheduler: Any, total_steps: int, steps_per_epoch: int, own_parts: Sequence[StatePart] = ()) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.own_parts = list(own_parts)  # the run's own parts beside the strategy's (train.fp16's loss scaler)
        self.strategy, self.optimizer, self.scheduler = strategy, optimizer, scheduler
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.root = cfg.output.folder.checkpoints
        self.group = None  # the background writes' own gloo group, made by start() (a collective)
        self.pending: tuple[Any, Path, Path] | None = None  # (future, tmp folder, final folder)
        self.last_step: int | None = None
        # Rank 0: snapshot name -> None (whole) or what is wrong, as verify() found it. Verifying reads every byte,
        # and a snapshot does not change once written (one that does is found by the next resume's verify()):
        # each is read once per process, not at every pruning.
        self.damage: dict[str, str | None] = {}

    def start(self) -> None:
        """Once every rank is here (a collective with 2 ranks or more). Every rank must see the folder rank 0 makes
        for snapshots: checked now, not at the first snapshot, which would cost every step before it."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            probe = self.root / ".seen-by-every-rank"
            if self.env.is_main:
                probe.mkdir(parents=True, exist_ok=True)
            barrier()
            unshared = None
            try:
                check_one_folder(probe)
            except SnapshotError as exc:  # raised on every rank alike: they all meet at the barrier
                unshared = exc
            barrier()  # every rank has looked before rank 0 takes it away
            if self.env.is_main:
                shutil.rmtree(probe, ignore_errors=True)
            if unshared is not None:
                raise unshared
        if self.cfg.checkpoint.async_save:
            self.group = dist.new_group(backend="gloo")

    def due(self, state: TrainState, after_evaluation: bool) -> bool:
        """The one rule of when to save. An epoch's last step is saved after its evaluation, so that a resume
        neither repeats nor loses the epoch's event; the run's last step is saved by the end of fit()."""
        every_steps, every_epochs = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_epochs
        on_step = bool(every_steps) and state.step % every_steps == 0
        if not after_evaluation:
            return on_step and state.step < self.total_steps and not state.epoch_done(self.steps_per_epoch)
        on_epoch = bool(every_epochs) and (state.epoch + 1) % every_epochs == 0
        return state.epoch_done(self.steps_per_epoch) and (on_epoch or on_step)

    def at_step_boundary(self, state: TrainState, stop: StopRequest, phase: Phase, before_saving: Callable[[], None],
                         on_signal: Callable[[dict[str, Any]], None] = lambda record: None) -> None:
        """The snapshotter's turn after every step: a snapshot when due; then the stop signals exchanged, and once every
        rank has agreed on one, a verified snapshot of this step, then Stopped (or, for a rehearsal's drill, training
        goes on). before_saving(): the loop's check that the state is fit to keep (train.Trainer._check_loss: never a
        snapshot of a diverged state). on_signal(record): what each agreed signal did (signal_record), on every rank."""
        with phase(f"snapshot after step {state.step}"):
            if self.due(state, after_evaluation=False):
                before_saving()
            self.save_if_due(state)
        with phase(f"signal exchange after step {state.step}"):
            signal_name = stop.agreed()
        if signal_name:
            with phase(f"snapshot at step {state.step}"):
                before_saving()
                self.save(state, wait=True)
                written = time.time()
            with phase(f"signal receipts after step {state.step}"):
                received = stop.receipts()  # after the snapshot: a rank the signal reached a moment later counts
            drill = stop.drill()
            on_signal(signal_record(signal_name, state.step, received, written, drill))
            if not drill:
                raise Stopped.after_step(signal_name, state.step)

    def save_if_due(self, state: TrainState, after_evaluation: bool = False) -> None:
        """At a step boundary (or after an evaluation): save if due(), else commit a finished background write."""
        if self.due(state, after_evaluation):
            self.save(state)
        elif self.pending is not None and self.pending[0].done():  # no collective, no waiting
            self.wait()

    def save(self, state: TrainState, wait: bool = False) -> Path:
        """A snapshot of this step boundary (every rank calls this at the same step); with wait, also written atomically."""
        self.strategy.settle()  # never half an update (strategy.ddp.update_in_next_forward)
        final = self.root / f"{PREFIX}{state.step:08d}"
        # A run resumed from this step may stop at it again, and a resume is bit-identical: a verified snapshot of this
        # step is kept, a damaged one (left by an earlier run, skipped by its resume) is written again.
        if self.last_step != state.step and not self._verified_on_rank0(final):
            self.wait()
            self._write(state, final)
            self.last_step = state.step
        if wait and self.pending is not None:
            self.wait()
            # Every rank returns only once rank 0 has committed: a rank that then exits first (after a stop signal)
            # makes srun --kill-on-bad-exit, or the elastic agent, kill the others, rank 0 among them.
            barrier()
        return final

    def _write(self, state: TrainState, final: Path) -> None:
        tmp = final.parent / f".tmp-{final.name}"
        run_dir = self.cfg.output.run_dir
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while saving
            tmp.mkdir(parents=True)
        barrier()
        try:
            check_one_folder(tmp)  # else a rank that cannot see it fails at its first file, alone, with torch's words
        except SnapshotError:
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # Everything but the shards is written now, before the (maybe background) DCP write: once
        # DCP's coordinator has finished, every rank's files are therefore complete.
        rank_state = {"rng": _rng_state(self.device), "epoch_sums": state.epoch_sums.cpu() if state.epoch_sums is not None else None}
        _save_file(rank_state, tmp / f"rank{self.env.global_rank}.pt", run_dir)
        parts = self._parts()
        for part in parts:  # synchronous, before DCP's write: complete once DCP's is
            _writing(lambda: part.save(tmp, torch.save), tmp, run_dir)
        if self.env.is_main:
            _save_file({"loop": state.state_dict(), "scheduler": self.scheduler.state_dict()}, tmp / EXTRA, run_dir)
            manifest = {"world_size": self.env.world_size, "strategy": self.cfg.strategy.name, "model": self.cfg.model.name,
                        "config_hash": config_hash(self.cfg), "config": computation_options(self.cfg),
                        "schedule_steps": self.total_steps, "torch": torch.__version__, "dcp": dcp_record(),
                        "optimizer": optimizer_record(self.optimizer), "step": state.step,
                        "input": input_record(self.cfg.data),  # what `dptrain predict` feeds the model (None: a user's Dataset)
                        "parts": {part.name: {"storage": part.storage, "files": sorted(part.files(self.env.world_size))}
                                  for part in parts}}
            (tmp / ".manifest-head.json").write_text(json.dumps(manifest))
        shards = _shards_of(parts)
        if self.group is None:
            from torch.distributed.checkpoint import save as dcp_save

            _writing(lambda: dcp_save(shards, checkpoint_id=str(tmp)), tmp, run_dir)
            barrier()
            self._commit(tmp, final)
            barrier()
        else:
            from torch.distributed.checkpoint import async_save as dcp_async_save

            self.pending = (dcp_async_save(_frozen_copy(shards), checkpoint_id=str(tmp), process_group=self.group), tmp, final)

    def _parts(self) -> list[StatePart]:
        """Every state part a snapshot holds: the strategy's (Strategy.state_parts), then the run's own."""
        return [*self.strategy.state_parts(self.optimizer), *self.own_parts]

    def _damage(self, path: Path) -> str | None:
        """None if the snapshot `path` verifies, else what is wrong with it (rank 0; remembered, see self.damage)."""
        if path.name not in self.damage:
            try:
                verify(path)
                self.damage[path.name] = None
            except SnapshotError as exc:
                self.damage[path.name] = str(exc)
        return self.damage[path.name]

    def _verified_on_rank0(self, final: Path) -> bool:
        """Whether a verified snapshot `final` exists, as rank 0 sees it, on every rank (a collective with 2 ranks or more):
        the ranks write a snapshot together or not at all, and another node may not see rank 0's files yet."""
        whole = [self.env.is_main and final.is_dir() and self._damage(final) is None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(whole, src=0)
        return bool(whole[0])

    def wait(self) -> None:
        """Wait for a background write and commit it (before the next snapshot, at the end, on a stop)."""
        if self.pending is not None:
            future, tmp, final = self.pending
            self.pending = None
            _writing(future.result, tmp, self.cfg.output.run_dir)  # raises what the background write raised
            self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rank 0: manifest with every file's size and sha256, fsync, rename, then move `latest`."""
        if not self.env.is_main:
            return
        head = tmp / ".manifest-head.json"
        manifest = json.loads(head.read_text())
        head.unlink()
        manifest["files"] = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
                             for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        make_private(tmp)  # a umask of 002 would let the group plant files, and verify() would refuse the snapshot
        _fsync_tree(tmp)
        faults.crash_before_rename(final.name)
        refusal = not_a_snapshot_folder(final, self.cfg.output.elsewhere)
        if refusal is not None:  # planted while the run trained: the start found none (choose)
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(refusal)
        replaced = final.parent / f".replaced-{final.name}"
        if final.is_dir():  # damaged (save() keeps a verified one): moved aside in one rename, as os.replace needs it gone
            log.warning("writing %s again, in place of the damaged one (%s)", final.name, (self._damage(final) or "").rstrip("."))
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        shutil.rmtree(replaced, ignore_errors=True)
        self.damage[final.name] = None  # every file was just hashed: whole, without reading it again
        with written_atomically(final.parent / LATEST) as pointer:
            pointer.write_text(final.name + "\n")
        _prune(final.parent, self.cfg.checkpoint.keep_last, manifest["config_hash"], self._damage)
        log.info("snapshot %s written", final)

    def load(self, path: Path, state: TrainState) -> None:
        """Restore every part from snapshot `path`: weights, optimizer, scheduler, position, every rank's RNG."""
        manifest = verify(path)
        if path.parent == self.root:
            self.damage[path.name] = None  # verified just now
        check_compatible(manifest, self.cfg, path, self.total_steps)
        world = manifest["world_size"]
        parts = self._parts()
        if world != self.env.world_size and any(part.same_world_only for part in parts):
            raise ConfigError(f"snapshot {path} holds the state of strategy {self.cfg.strategy.name} partitioned over {world} "
                              f"processes, and it resumes on as many only, not on {self.env.world_size}; run on {world} "
                              f"processes, or use {self.cfg.output.elsewhere} to start afresh.")
        for part in list(parts):
            if part.without_it is not None and part.name not in manifest.get("parts", {}) and part.files(world):
                # written before dptrain kept the part: resumed without it, as such a run would have
                log.warning("snapshot %s was written before dptrain kept the %s state in snapshots: %s", path,
                            part.name, part.without_it)
                parts.remove(part)
        for why in filter(None, (part.resumes_on(world, self.env.world_size) for part in parts)):
            raise ConfigError(f"snapshot {path} {why}, or use {self.cfg.output.elsewhere} to start afresh.")
        for name in sorted(set().union(*(part.files(world) for part in parts)) - set(manifest["files"])):  # a manifest without "parts"
            raise SnapshotError(f"snapshot {path} has a manifest that does not list {name}, which a resume reads; it is damaged.")
        if (theirs := written_elsewhere(manifest)) is not None:
            log.info("snapshot %s was written by torch %s; loading it under torch %s", path, theirs, torch.__version__)
        shards = _shards_of(parts)
        with reading(manifest, path, f"DCP shards ({', '.join(sorted(shards))})"):
            # another torch's optimizer may have had fewer hyper-parameters (2.6's Adam: no decoupled_weight_decay):
            # those keep this torch's defaults (the losses after such a resume are checked by the tests), named in the log
            kept = dcp_load(shards, path, ".param_groups." if theirs is not None else None)
        if kept:
            log.warning("snapshot %s, written by torch %s, lacks %s; kept at torch %s's defaults", path, theirs,
                        ", ".join(kept), torch.__version__)
        for part in parts:
            with reading(manifest, path, f"{part.name} state ({part.storage})"):
                part.load(path, shards, load_tensors, world)
        check_optimizer_keys(manifest, path, self.optimizer)
        with reading(manifest, path, f"loop state and scheduler ({EXTRA})"):
            extra = load_tensors(path / EXTRA)
            self.scheduler.load_state_dict(extra["scheduler"])
            state.load_state_dict(extra["loop"])
        if world == self.env.world_size:
            with reading(manifest, path, f"RNG states (rank{self.env.global_rank}.pt)"):
                mine = load_tensors(path / f"rank{self.env.global_rank}.pt")
                state.epoch_sums = _on(mine["epoch_sums"], self.device)
                _set_rng_state(mine["rng"], self.device)
        else:
            # Another world size: DCP has resharded the weights and optimizer, and the loader's position is
            # global. The partial-epoch sums are reduced over ranks at the epoch's end, so rank 0 carries
            # them all; per-rank RNG streams have no counterpart, so each rank keeps its fresh seed.
            sums = [load_tensors(path / f"rank{r}.pt")["epoch_sums"] for r in range(world)]
            if sums[0] is not None:
                total = torch.stack(sums).sum(0)
                state.epoch_sums = (total if self.env.is_main else torch.zeros_like(total)).to(self.device)
            else:
                state.epoch_sums = None
            log.info("resharding snapshot %s from world size %d to %d", path, world, self.env.world_size)
        state.roll_over(self.steps_per_epoch)
        self.last_step = manifest["step"]
        log.info("resumed from %s at step %d (epoch %d, %d batches into it)", path, state.step, state.epoch + 1, state.batches_consumed)


def signal_record(signal_name: str, step: int, received: list[float | None], written: float, drill: bool) -> dict[str, Any]:
    """An agreed signal's fields (events.SIGNAL_EVENT): its name, the step whose snapshot it wrote, when each rank got
    it (None: never), when the snapshot was written (rank 0's clock, seconds since 1970), and whether it was a drill."""
    from dptrain.events import DRILL, RECEIVED_AT, SIGNAL, SNAPSHOT_AT, STEP

    return {STEP: step, SIGNAL: signal_name, RECEIVED_AT: received, SNAPSHOT_AT: written, DRILL: drill}


def _shards_of(parts: list[Any]) -> dict[str, Any]:
    """What DCP writes or loads in place: every part's shards, under the part's top-level keys."""
    return {key: value for part in parts for key, value in part.shards().items()}


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _save_file(obj: Any, path: Path, run_dir: Path) -> None:
    _writing(lambda: torch.save(obj, path), path.parent, run_dir)


def _writing(write: Any, tmp: Path, run_dir: Path) -> Any:
    """Run a write of a snapshot; a full disk or a refused write becomes one sentence and leaves no temporary folder."""
    try:
        return write()
    except BaseException as exc:  # OSError, or DCP's CheckpointException (a BaseException) wrapping one per rank
        reason = write_failure(exc)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        rerun = rerun_ending(RunFolder(run_dir).checkpoints, " to resume from the last snapshot.")
        raise SnapshotError(f"could not write a snapshot into {run_dir / 'checkpoints'} ({reason}); "
                            f"free space or fix permissions there, then run the same command{rerun}") from exc


def write_failure(exc: BaseException | None) -> str | None:
    """Why a write failed, when the cause is the disk or its permissions ('No space left on device'); else None.

    The OSError may be exc itself, its cause or context, or inside DCP's per-rank failures; torch.save on a
    full disk raises a RuntimeError of its own ('unexpected pos ...')."""
    for _ in range(10):
        if exc is None:
            return None
        if isinstance(exc, OSError):
            return exc.strerror or str(exc)
        if "unexpected pos" in str(exc) or "No space left" in str(exc):
            return "No space left on device"
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                found = write_failure(failure[0] if isinstance(failure, tuple) else failure)  # DCP: (exception, traceback)
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


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


def _prune(root: Path, keep_last: int, config_hash_: str, damage: Callable[[Path], str | None]) -> None:
    """Keep the keep_last newest snapshots of this run that verify (damage(path) is None), and delete this run's older ones.

    Only a verified snapshot counts: a damaged one that kept a place pruned a verified one, and a resume then had fewer
    to fall back on. Never deleted: the newest verified snapshot, a damaged one newer than it (the run may write that
    step again, and replaces it then), a snapshot of another configuration (its manifest says so), and a folder that
    is not ours alone (check_private: another user's, or one others may write to). A damaged one older than the
    newest whole one can never be resumed from: deleted, and named in one log line. Past the keep_last newest whole
    ones every snapshot of this run is deleted without being verified: verifying reads every byte.
    """
    verified_kept, damaged = 0, []
    for path in (p for p, refusal in entries(root) if refusal is None):  # a link or a file is never ours to delete
        try:
            check_private(path, "snapshot")
            theirs = recorded_hash(read_manifest(path))
        except UnsafeFileError:
            continue
        except (SnapshotError, OSError):
            theirs = None  # no readable manifest (and the folder is ours): damaged, not another configuration's
        if theirs is not None and theirs != config_hash_:
            continue
        if verified_kept < keep_last:
            reason = damage(path)
            if reason is None:
                verified_kept += 1
                continue
            if verified_kept == 0:
                continue
            damaged.append((path, reason))
        shutil.rmtree(path, ignore_errors=True)
    if damaged:
        log.warning("deleted %s, older than a verified one; %s", span(damaged), first_reason(damaged))


def check_one_folder(folder: Path) -> None:
    """Every rank sees the folder `folder` that rank 0 has just made, at the same path (a collective; nothing with one
    process): each rank writes its files of a snapshot into it, and a rank that cannot see it failed alone, at its
    first file, with torch's 'Parent directory ... does not exist', while the others waited for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (str(folder), folder.is_dir()))
    made = views[0][0]
    for rank, (where, seen) in enumerate(views):
        if where != made:
            raise SnapshotError(f"snapshots need one folder that every node shares, but rank {rank} writes into {where} "
                                f"and rank 0 into {made}; give every node the same --output.dir, on a file system that "
                                f"all of them mount.")
        if not seen:
            raise SnapshotError(f"snapshots need one folder that every node shares: rank {rank} does not see {made}, "
                                f"which rank 0 made; put --output.dir on a file system that every node mounts.")
