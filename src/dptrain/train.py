"""The training loop: build(cfg, env) -> Run; Run.fit() trains, evaluates and logs exact metrics.

    $ dptrain train --nproc-per-node 2                 # 2 local workers, DDP over gloo/nccl
    $ torchrun --nproc-per-node 4 -m dptrain train     # under an existing launcher
    $ srun dptrain train                               # one task per rank under SLURM
"""

from __future__ import annotations

import contextlib
import os
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dptrain import faults
from dptrain.config import RunConfig, check_world
from dptrain.data import DataInfo, build_loaders
from dptrain.data.loader import Batch, Loader
from dptrain.evaluate import evaluate, sync
from dptrain.launch.env import DistEnv
from dptrain.metrics import EventLog, ProgressBar, finite_or_none, peak_memory_mb
from dptrain.models import build_model
from dptrain.runtime import Phase
from dptrain.checkpoint import Snapshotter
from dptrain.step_graph import StepGraph
from dptrain.stopping import Stopped, StopRequest
from dptrain.strategies import Strategy, build_strategy
from dptrain.strategies.base import OptimizerSpec

log = logging.getLogger("dptrain")



def optimizer_spec(cfg: RunConfig, capturable: bool = False) -> OptimizerSpec:
    """The optimizer as a class and its arguments, so that a strategy can shard or relocate it.

    capturable: Adam's state and learning rate stay on the GPU, so that a CUDA graph can replay the step.
    """
    o = cfg.optim
    if o.name == "sgd":
        return OptimizerSpec(torch.optim.SGD, {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay})
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    # fused: one kernel over all parameters instead of a dozen foreach passes; on the CPU the step
    # takes 0.9 ms instead of 4.5 ms for the tutorials' CNN, on an H100 0.35 ms less per step.
    return OptimizerSpec(cls, {"lr": o.lr, "weight_decay": o.weight_decay, "fused": True, "capturable": capturable})


def build_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int):  # noqa: ANN201
    """Stepped once per optimizer step; total_steps is the run's, so cosine and one-cycle end at the end."""
    o = cfg.optim
    if o.schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    if o.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=o.lr, total_steps=total_steps)
    if o.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=o.step_epochs * steps_per_epoch, gamma=o.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


@dataclass
class Run:
    cfg: RunConfig
    env: DistEnv
    device: torch.device
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: Loader
    eval_loader: Loader
    info: DataInfo
    events: EventLog
    phase: Phase
    total_steps: int
    step: int = 0
    # Where the run stands, for snapshots: the epoch, batches of it done, this rank's partial sums.
    epoch: int = 0
    batches_consumed: int = 0
    epoch_sums: torch.Tensor | None = None
    epoch_elapsed: float = 0.0
    """Seconds of training in this epoch so far, before a resume too (the epoch's time covers all of it)."""
    epoch_seen: int = 0
    """Samples over all ranks trained in this epoch so far."""
    epoch_reported: bool = False
    """Whether this epoch's event (training metrics and evaluation) has been emitted."""
    last_snapshot_step: int | None = None
    snapshotter: Snapshotter | None = None
    stop: StopRequest | None = None
    """SIGTERM/SIGUSR1 seen by any rank: snapshot at the next step boundary, then raise Stopped."""
    step_graph: StepGraph | None = None
    """train.cuda_graph: replays the captured training step (None: every step runs eagerly)."""

    def fit(self) -> dict:
        """Train until train.epochs or train.max_steps; returns the last epoch event."""
        progress = ProgressBar(enabled=self.env.is_main)
        epochs = self.cfg.train.epochs
        last: dict = {}
        if self.step >= self.total_steps and (self.epoch_reported or self.epoch_sums is None):
            log.info("this run is already complete at step %d; raise train.epochs or train.max_steps to go on, "
                     "or use another --output.name to start afresh", self.step)
        completed = False
        try:
            for epoch in range(self.epoch, epochs):
                resumed = epoch == self.epoch and self.epoch_sums is not None
                # A resumed epoch whose steps are all done may still owe its event (stopped before evaluation).
                if self.step >= self.total_steps and (not resumed or self.epoch_reported):
                    break
                if not resumed:
                    self._start_epoch(epoch)
                remaining = min(len(self.train_loader) - self.batches_consumed, self.total_steps - self.step)
                progress.start_epoch(epoch + 1, epochs, remaining)
                train = self._run_epoch(epoch, progress)
                with self.phase(f"evaluation after epoch {epoch + 1}"):
                    evaluation = evaluate(self.strategy.eval_module, self.eval_loader, self._autocast, self.strategy.all_reduce)
                last = self.events.emit("epoch", epoch=epoch + 1, step=self.step, **train, **evaluation)
                self.epoch_reported = True
                if self.batches_consumed == len(self.train_loader) and self._snapshot_due_at_epoch_end(epoch):
                    self._snapshot()
            progress.stop()
            with self.phase("saving the final weights"):
                self._save_weights(self.cfg.output.run_dir / "model.pt")
            self._snapshot(wait=True)
            completed = True
        finally:
            progress.stop()
            if self.stop is not None:
                self.stop.close(wait=completed)
        return last

    def _snapshot_due_at_epoch_end(self, epoch: int) -> bool:
        """checkpoint.every_epochs, and checkpoint.every_steps landing on the epoch's last step: a snapshot
        at an epoch's end comes after its evaluation, so that a resume neither repeats nor loses the epoch's event."""
        every_epochs, every_steps = self.cfg.checkpoint.every_epochs, self.cfg.checkpoint.every_steps
        return bool(every_epochs and (epoch + 1) % every_epochs == 0) or bool(every_steps and self.step % every_steps == 0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.batches_consumed = epoch, 0
        self.epoch_sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.epoch_elapsed, self.epoch_seen, self.epoch_reported = 0.0, 0, False

    def _snapshot(self, wait: bool = False) -> None:
        """A snapshot at this step boundary; with wait, also the end of a background write."""
        assert self.snapshotter is not None
        with self.phase(f"snapshot at step {self.step}"):
            if self.last_snapshot_step != self.step:
                self.snapshotter.save(self)
                self.last_snapshot_step = self.step
            if wait:
                self.snapshotter.wait()

    def _save_weights(self, path: Path) -> None:
        """The whole model on rank 0, whatever the sharding (every rank takes part in gathering it)."""
        state = self.strategy.full_state_dict()
        if self.env.is_main:
            tmp = path.with_suffix(".pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)

    def _run_epoch(self, epoch: int, progress: ProgressBar) -> dict:
        self.model.train()
        assert self.epoch_sums is not None
        # Sums on the device (loss, correct, samples of this rank); read once at the epoch's end (a host sync).
        sums = self.epoch_sums
        steps = 0  # in this process's part of the epoch
        sync(self.device)
        start = time.perf_counter() - self.epoch_elapsed  # a resumed epoch's clock goes on from the snapshot
        for batch in self.train_loader.epoch_batches(epoch, self.batches_consumed):
            with self.phase(f"step {self.step + 1}"):
                loss_sum, correct = self._run_batch(batch)
            # In place, from device values and a Python int: a tensor made from len(labels) would be a
            # host-to-device copy, which waits for the GPU every step and costs ~30% of a step on an H100.
            sums[0] += loss_sum
            sums[1] += correct
            sums[2] += len(batch.labels)
            self.epoch_seen += batch.global_count
            self.step += 1
            steps += 1
            self.batches_consumed += 1
            self.epoch_elapsed = time.perf_counter() - start  # host clock, no sync: what a snapshot records
            step_loss = self._log_step(epoch, loss_sum, batch.global_count) if self.step % self.cfg.train.log_every == 0 else None
            progress.advance(step_loss)
            faults.signal_if_due(self.env.global_rank, self.step)
            every = self.cfg.checkpoint.every_steps
            end_of_epoch = self.batches_consumed == len(self.train_loader)  # snapshot after the evaluation instead
            if every and self.step % every == 0 and self.step < self.total_steps and not end_of_epoch:
                self._snapshot()
            elif self.snapshotter is not None and self.snapshotter.pending is not None:
                with self.phase(f"snapshot after step {self.step}"):
                    self.snapshotter.poll()
            with self.phase(f"signal exchange after step {self.step}"):
                signal_name = self.stop.agreed() if self.stop is not None else None
            if signal_name:
                self._snapshot(wait=True)
                raise Stopped.after_step(signal_name, self.step)
            if self.step >= self.total_steps:
                break
        with self.phase(f"metrics reduction of epoch {epoch + 1}"):
            totals = self.strategy.all_reduce(sums.clone())  # also waits for every rank: the time covers the slowest
            elapsed = self.epoch_elapsed = time.perf_counter() - start
            peak = self.strategy.all_reduce(torch.tensor([peak_memory_mb(self.device)], device=self.device), op="max")
            accounting = self._accounting(steps)
        loss, correct, count = totals.tolist()
        return {
            "train_loss": finite_or_none(loss / count), "train_acc": correct / count, "train_samples": int(count),
            "epoch_time_s": elapsed, "samples_per_s": self.epoch_seen / elapsed,
            "peak_mem_mb": peak.item(), "lr": self._lr(), **accounting,
        }

    def _accounting(self, steps: int) -> dict[str, list[int]]:
        """Per rank: bytes of parameters, gradients and optimizer state held, and bytes sent per step."""
        held = self.strategy.memory_bytes(self.optimizer)
        sent = self.strategy.comm_bytes(steps) // max(steps, 1)
        table = torch.zeros(self.env.world_size, 4, dtype=torch.float64, device=self.device)
        table[self.env.global_rank] = torch.tensor([held["params"], held["grads"], held["optim"], sent], dtype=torch.float64)
        columns = self.strategy.all_reduce(table).long().t().tolist()
        names = ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "comm_bytes_per_step")
        return dict(zip(names, columns))

    def _run_batch(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (sum of this rank's losses, its correct predictions), on the device."""
        if self.step_graph is not None:
            out = self.step_graph(batch.images, batch.labels)
        else:
            out = self._train_step(batch.images, batch.labels, batch.global_count)
        self.scheduler.step()
        if self.step_graph is not None:
            self.step_graph.after_schedule_step()
        return out

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor, global_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            logits = self.model(images)
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        self.strategy.backward(loss_sum, global_count)
        if self.cfg.train.grad_clip is not None:
            self.strategy.clip_grad_norm(self.model, self.cfg.train.grad_clip)
        self.optimizer.step()
        return loss_sum.detach(), (logits.argmax(1) == labels).sum()

    def _lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _log_step(self, epoch: int, loss_sum: torch.Tensor, global_count: int) -> float:
        """The global mean loss of this step: one all-reduce and one host sync, on log steps only."""
        total = self.strategy.all_reduce(loss_sum.double().reshape(1).clone())
        loss = total.item() / global_count
        self.events.emit("step", epoch=epoch + 1, step=self.step, loss=finite_or_none(loss), lr=self._lr())
        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        # A graph cannot keep autocast's cache of cast weights between replays.
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.bf16,
                              cache_enabled=self.step_graph is None)



def build(cfg: RunConfig, env: DistEnv, device: torch.device, events: EventLog, phase: Phase) -> Run:
    """Everything the loop needs, in order: data, model, strategy, optimizer, schedule."""
    strategy = build_strategy(cfg.strategy, env, device)
    data_rank, data_world = strategy.data_share()
    with phase("data loading"):
        info, train_loader, eval_loader = build_loaders(
            cfg.data, device=device, global_batch=cfg.train.global_batch_size, eval_batch=cfg.train.eval_batch_size,
            rank=data_rank, world_size=data_world, seed=cfg.train.seed, channels_last=cfg.train.channels_last,
        )
        check_world(cfg, env.world_size, info.train_size)
    with phase("model set-up"):
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        model = build_model(cfg.model, info.image_shape, info.num_classes)
        if cfg.train.channels_last:
            model = model.to(memory_format=torch.channels_last)
        wrapped = strategy.wrap(model)
        graphed = use_step_graph(cfg, device, strategy)
        optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_spec(cfg, capturable=graphed))
        steps_per_epoch = len(train_loader)
        total_steps = cfg.train.epochs * steps_per_epoch
        if cfg.train.max_steps is not None:
            total_steps = min(total_steps, cfg.train.max_steps)
        scheduler = build_scheduler(cfg, optimizer, total_steps, steps_per_epoch)
    # Dropout and other randomness differ per rank, deterministically.
    torch.manual_seed(cfg.train.seed + 1 + env.global_rank)
    run = Run(cfg, env, device, strategy, wrapped, optimizer, scheduler, train_loader, eval_loader, info, events, phase, total_steps)
    with phase("resume"):
        resume(run)
    run.snapshotter = Snapshotter(cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
    run.stop = StopRequest(env.world_size)
    if graphed:  # after the resume: the graph records the addresses of the optimizer state it loaded
        step = lambda images, labels: run._train_step(images, labels, len(labels))  # noqa: E731 - one device: the batch is global
        run.step_graph = StepGraph(step, optimizer, cfg.train.global_batch_size)
    return run


def use_step_graph(cfg: RunConfig, device: torch.device, strategy: Strategy) -> bool:
    """train.cuda_graph where it can apply; where it cannot, one warning line says why."""
    if not cfg.train.cuda_graph:
        return False
    if device.type != "cuda":
        log.warning("train.cuda_graph applies to CUDA devices; training eagerly on %s", device)
        return False
    if not strategy.step_is_local:
        log.warning("train.cuda_graph: strategy %s communicates inside the step at this world size; training eagerly",
                    strategy.name)
        return False
    return True


def resume(run: Run) -> None:
    """Continue from the snapshot train.resume names: auto (the newest valid one here), a folder, or never."""
    from dptrain import checkpoint

    choice = run.cfg.train.resume
    if choice == "never":
        return
    if choice == "auto":
        # Rank 0 chooses for everyone: on a shared file system other ranks may not see the newest files yet.
        found = [checkpoint.find_latest(run.cfg.output.run_dir / "checkpoints") if run.env.is_main else None]
        if run.env.world_size > 1:
            torch.distributed.broadcast_object_list(found, src=0)
        path = found[0]
        if path is None:
            return
    else:
        path = Path(choice)
    checkpoint.load(run, path)
