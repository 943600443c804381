"""The training loop: build_trainer(cfg, env, device, events, phase) -> Trainer; Trainer.fit() trains, evaluates and
logs exact metrics.

    $ dptrain train --nproc-per-node 2                 # 2 local workers, DDP over gloo/nccl
    $ torchrun --nproc-per-node 4 -m dptrain train     # under an existing launcher
    $ srun dptrain train                               # one task per rank under SLURM
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dptrain import snapshots, faults
from dptrain.snapshots import Snapshotter
from dptrain.config import RunConfig
from dptrain.data import DataInfo, build_loaders
from dptrain.data.loader import Batch, Loader
from dptrain.distributed.env import DistEnv
from dptrain.distributed.failures import Phase, WorkerFailure
from dptrain.distributed.world import barrier
from dptrain.errors import OutputError
from dptrain.evaluate import evaluate, sync
from dptrain.events import EPOCH, EPOCH_EVENT, LOSS, LR, SIGNAL_EVENT, STEP, STEP_EVENT
from dptrain.files import written_atomically
from dptrain.metrics import EventLog, ProgressBar, UtilisationSampler
from dptrain.metrics.epoch_account import EpochAccount, RankMeasures, train_fields
from dptrain.metrics.link_probe import LinkProbe
from dptrain.metrics.profiler import StepProfiler
from dptrain.metrics.stragglers import SLOWER_PCT, OwnClock, publish_window, window_straggler
from dptrain.models import build_model, training_flops_per_sample
from dptrain.runtime import bf16_autocast
from dptrain.schedule import Schedule, build_scheduler, peak_lr
from dptrain.step_graph import StepGraph
from dptrain.stopping import FEWEST_NODES_VAR, NodeLeaves, SlowNode, StopRequest
from dptrain.strategies.registry import build_strategy, check_world
from dptrain.strategies.base import Strategy
from dptrain.strategies.base import OptimizerSpec, optimizer_choice
from dptrain.strategies.state import StatePart, WholeFile
from dptrain.train_state import TrainState

log = logging.getLogger("dptrain")


class Diverged(WorkerFailure):
    """The training loss became nan or inf. Every rank raises it at the same step (it is read from a loss summed
    over the ranks), so that none waits for another; a WorkerFailure, so that it is said as it is, exit code 1."""


def optimizer_spec(cfg: RunConfig, capturable: bool = False) -> OptimizerSpec:
    """The optimizer as a class and its arguments, so that a strategy can shard or relocate it.

    capturable: Adam's state and learning rate stay on the GPU, so that a CUDA graph can replay the step.
    """
    # fused: one kernel over all parameters instead of a dozen foreach passes. The tutorials' CNN's step on one CPU
    # thread: 0.81 ms instead of 2.38 (`python perf/micro.py`, adam); on a GPU, `python perf/gpu_profile.py`.
    return optimizer_choice(cfg.optim, peak_lr(cfg), fused=True, capturable=capturable)


class LossScaler:
    """train.fp16: torch.amp.GradScaler over the step. The loss is scaled before backward, the gradients unscaled before
    clipping and the update, and a step whose gradients overflowed is not applied (the scale halves, and grows again
    after 2,000 clean steps: torch's defaults); each such step is counted in the loop's TrainState (the epoch event's
    skipped_steps). Its state (scale, growth count) is a part of every snapshot, written by rank 0: the same on every
    rank, whose gradients are the same once synchronised (strategies that would differ refuse train.fp16)."""

    FILE = "loss_scaler.pt"

    def __init__(self, device: torch.device, state: TrainState, global_rank: int) -> None:
        self.scaler = torch.amp.GradScaler(device.type)
        self.state, self.global_rank = state, global_rank

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients back to their true size, before clipping reads their norm."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update, unless a gradient overflowed; then the scale's update. get_scale() waits for the device, as
        GradScaler.step's own look at the gradients already has."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:  # it shrinks only after an overflow, whose step it skipped
            self.state.epoch_skipped += 1

    def state_part(self) -> StatePart:
        return WholeFile("loss scaler", self.FILE, lambda: self.scaler.state_dict() if self.global_rank == 0 else None,
                         self.scaler.load_state_dict)


@dataclass(kw_only=True)
class TrainStep:
    """One optimizer step on a batch: forward, the loss summed over this rank's share, backward (the strategy syncs
    the gradients), clipping, the update, then the schedule's step. Eager, or where train.cuda_graph applies, a CUDA
    graph's replay of the eager step (graph). With micro_batches above 1 (train.accumulate_steps) the share goes
    through forward and backward in that many pieces, the gradients synchronised with the last only
    (Strategy.gradient_sync): the same sum as the whole share's, and the same step."""

    strategy: Strategy
    model: nn.Module
    """What the strategy's wrap() returned (maybe compiled): the training forward."""
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    autocast: Callable[[], contextlib.AbstractContextManager]
    grad_clip: float | None
    graph: StepGraph | None = None
    micro_batches: int = 1
    profiler: StepProfiler | None = None
    """train.profile's profiler, which every step passes through (it records the steps of its range)."""
    scaler: LossScaler | None = None
    """train.fp16's loss scaler; None: the loss as it is."""

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sum of this rank's losses, its correct predictions), on the device."""
        with self.profiler.step() if self.profiler is not None else contextlib.nullcontext():
            if self.graph is not None:
                out = self.graph(batch.images, batch.labels)
            else:
                out = self.eager(batch.images, batch.labels, batch.global_count)
            self.scheduler.step()
            if self.graph is not None:
                self.graph.after_schedule_step()
        return out

    def eager(self, images: torch.Tensor, labels: torch.Tensor, global_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.strategy.zero_grad(self.optimizer)
        if self.micro_batches == 1:
            loss_sum, correct = self.forward_backward(images, labels, global_count)
        else:
            # Every rank runs every piece, an empty one too (a short last batch): its collectives (FSDP's gathers, the
            # last piece's sync) are met by all.
            pieces = list(zip(images.tensor_split(self.micro_batches), labels.tensor_split(self.micro_batches)))
            loss_sum, correct = torch.zeros((), dtype=torch.float64, device=images.device), 0
            for index, (part, part_labels) in enumerate(pieces):
                with self.strategy.gradient_sync(index == len(pieces) - 1):
                    part_loss, part_correct = self.forward_backward(part, part_labels, global_count)
                loss_sum, correct = loss_sum + part_loss, correct + part_correct
        if self.scaler is not None and self.grad_clip is not None:
            self.scaler.unscale(self.optimizer)  # the norm of the true gradients
        if self.grad_clip is not None:
            self.strategy.clip_grad_norm(self.model, self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.strategy.optimizer_step(self.optimizer)
        return loss_sum, correct

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor,
                         global_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's (or micro-batch's) forward and backward, its gradients added to the parameters' (backward scales
        them to the global batch's mean); the sum of its losses and its correct predictions."""
        with self.autocast():
            logits = self.model(images)
        # The loss in at least float32 (bf16 logits are summed in float32), float64 stays float64 (the tests' exact mode).
        loss_sum = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction="sum")
        self.strategy.backward(loss_sum if self.scaler is None else self.scaler.scale(loss_sum), global_count)
        return loss_sum.detach(), (logits.argmax(1) == labels).sum()

    def graphed(self, batch_size: int) -> "TrainStep":
        """This step replayed as a CUDA graph, captured from its eager form (one device: the batch is global). Made
        after a resume: the graph records the addresses of the optimizer state it loaded."""
        eager = lambda images, labels: self.eager(images, labels, len(labels))  # noqa: E731
        return dataclasses.replace(self, graph=StepGraph(eager, self.optimizer, batch_size))


@dataclass(kw_only=True)
class Trainer:
    """One rank's training, built whole by build_trainer(), run by fit(). Its shape, each boundary in its own
    `phase`, so that a failure names the rank and where it stood:

        fit()          for each epoch from where `state` stands (TrainState answers where a resume puts it):
          run_epoch()    enter the epoch (afresh, or mid-way after a resume); for each remaining batch: the step
                         (TrainStep), counted in the EpochAccount, then the step's boundary (_after_step: its loss
                         logged when due, then the snapshotter's turn: a snapshot when due, or a stop's);
                         then the epoch's numbers reduced over the ranks (EpochAccount.reduce: exact, float64)
          _end_epoch()   the evaluation when due, the epoch event (events.EPOCH_EVENT), a snapshot when due
        then _finish(): the final weights and the final snapshot.
    """

    cfg: RunConfig
    env: DistEnv
    device: torch.device
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    train_loader: Loader
    eval_loader: Loader
    info: DataInfo
    events: EventLog
    phase: Phase
    total_steps: int
    step: TrainStep
    snapshots: Snapshotter
    state: TrainState
    """Where the loop stands; the snapshots save and restore it."""
    stop: StopRequest
    """SIGTERM/SIGUSR1 seen by any rank: a snapshot at the next step boundary, then Stopped."""
    flops_per_sample: int | None = None
    """The model's floating-point operations per training sample, forward and backward (counted on rank 0 only)."""
    on_step: Callable[[TrainState], None] | None = None
    """Called on this rank after each step's boundary (logged, snapshot taken if due, stop checked), with the state:
    a profiler's hook (perf/gpu_profile.py steps torch.profiler with it). It runs outside any phase."""
    utilisation: UtilisationSampler | None = None
    """This rank's CPU, memory and GPU use, sampled on a thread while fit() runs (None: no utilisation fields)."""
    finite_through: int = 0
    """The last step up to which every training loss was checked finite (fit() starts it at the resumed step)."""
    hosts: list[str] | None = None
    """Every rank's host, by global rank (the worker sets it once the ranks have said where they run): a straggler's
    host in the epoch event."""
    slow_node: SlowNode | None = None
    """launch.leave_slow_node's count of the epochs that named a rank of the same node (None: no node leaves)."""
    link_probe: LinkProbe | None = None
    """Each node's link measured at every epoch's end, with launch.watch in a run of 3 nodes or more (None: not)."""
    straggler_rank: int | None = None
    """The rank the last epoch named its straggler (None: none)."""
    own_clock: OwnClock | None = None
    """The epoch's own clock while it runs (launch.watch), whose windows the log steps compare (metrics.stragglers)."""

    def fit(self) -> dict:
        """Train until train.epochs or train.max_steps; returns the last epoch event."""
        state, last, completed = self.state, {}, False
        progress = ProgressBar(enabled=self.env.is_main, every_s=self.cfg.train.progress_every_s,
                               total_steps=self.total_steps, start_step=state.step)
        sampler = self.utilisation = UtilisationSampler(self.device)  # a daemon thread, closed below
        self.finite_through = state.step
        if state.is_complete(self.total_steps):
            log.info("this run is already complete at step %d; raise train.epochs or train.max_steps to go on, "
                     "or use %s to start afresh", state.step, self.cfg.output.elsewhere)
        try:
            for epoch in range(state.epoch, self.cfg.train.epochs):
                if state.is_complete(self.total_steps):  # a resumed epoch with every step done may still owe its event
                    break
                last = self._end_epoch(epoch, self.run_epoch(epoch, progress))
                self._leave_if_slow(epoch)
            progress.stop()
            self._finish()
            completed = True
        finally:
            progress.stop()
            sampler.close()  # joins the sampler thread, on failure too
            self.stop.close(wait=completed)
        return last

    def run_epoch(self, epoch: int, progress: ProgressBar | None = None) -> dict:
        """Train the rest of this epoch, then return its training fields, reduced over the ranks. Public for
        profiling: perf/gpu_profile.py times it (with on_step for a per-step hook)."""
        state, progress = self.state, progress or ProgressBar(enabled=False)
        state.enter_epoch(epoch, self.device)
        progress.start_epoch(epoch + 1, self.cfg.train.epochs, state.steps_left_in_epoch(len(self.train_loader),
                                                                                         self.total_steps))
        account = self._start_account()
        # this rank's own time outside the collectives (metrics.stragglers): the epoch names a straggler from it
        own = OwnClock(self.strategy.trained_module, self.device, every=self.cfg.train.log_every) if self.cfg.launch.watch else None
        self.own_clock = own
        batches = self.train_loader.epoch_batches(epoch, state.batches_consumed)
        try:
            for batch in own.batches(batches) if own is not None else batches:
                with self.phase(f"step {state.step + 1}"), own.step() if own is not None else contextlib.nullcontext():
                    loss_sum, correct = self.step(batch)
                account.count(loss_sum, correct, len(batch.labels), batch.global_count)
                self._after_step(epoch, loss_sum, batch.global_count, progress)
                if state.step >= self.total_steps:
                    break
        finally:
            if own is not None:
                own.close()
            self.own_clock = None
        with self.phase(f"metrics reduction of epoch {epoch + 1}"):
            totals = account.reduce(state.epoch_sums, self.strategy.all_reduce, self.device,
                                    self._measured(account, own.totals() if own is not None else None),
                                    self.link_probe)
        self._check_loss(totals.loss_sum)  # before the epoch's evaluation, snapshot and the final weights
        if (slow := totals.straggler) is not None:  # every rank's log; the console once, from rank 0
            log.warning("%s", slow.sentence(epoch + 1), extra={"file_only": not self.env.is_main})
        self.straggler_rank = None if slow is None else slow.rank
        return train_fields(totals)

    def _after_step(self, epoch: int, loss_sum: torch.Tensor, global_count: int, progress: ProgressBar) -> None:
        """The step's boundary: its loss logged when due, progress, then the snapshotter's turn (a snapshot when due,
        or a stop's), then on_step."""
        state, step_loss = self.state, None
        if state.step % self.cfg.train.log_every == 0:  # a collective: a failure in it names the rank and the step
            with self.phase(f"loss reduction of step {state.step}"):
                step_loss = self._log_step(epoch, loss_sum, global_count)
        progress.advance(step_loss, state.step, global_count)
        faults.signal_if_due(self.env.global_rank, state.step)
        self.snapshots.at_step_boundary(state, self.stop, self.phase, before_saving=self._check_loss,
                                        on_signal=lambda record: self.events.emit(SIGNAL_EVENT.name, **record))
        if self.on_step is not None:
            self.on_step(state)

    def _end_epoch(self, epoch: int, train: dict[str, Any]) -> dict[str, Any]:
        """The epoch's evaluation when due, its event, and its snapshot when due; returns the event."""
        evaluation = {}
        if self._evaluation_due(epoch):
            with self.phase(f"evaluation after epoch {epoch + 1}"):
                self.strategy.settle()
                evaluation = evaluate(self.strategy.eval_module, self.eval_loader, self.step.autocast,
                                      self.strategy.all_reduce)
        event = self.events.emit(EPOCH_EVENT.name, **{EPOCH: epoch + 1, STEP: self.state.step}, **train, **evaluation)
        self.state.epoch_reported = True
        with self.phase(f"snapshot after epoch {epoch + 1}"):
            self.snapshots.save_if_due(self.state, after_evaluation=True)
        return event

    def _leave_if_slow(self, epoch: int) -> None:
        """launch.leave_slow_node: once one node's rank was the straggler that many epochs in a row, and epochs remain,
        a snapshot of this epoch's end, then NodeLeaves on every rank (the same decision on each: every rank reduced
        the same table)."""
        if self.slow_node is None or epoch + 1 >= self.cfg.train.epochs or self.state.is_complete(self.total_steps):
            return
        node = self.slow_node.after_epoch(self.straggler_rank)
        if node is None:
            return
        with self.phase(f"snapshot at step {self.state.step}"):
            self.snapshots.save(self.state, wait=True)
        epochs, per_node = self.slow_node.epochs, self.slow_node.ranks_per_node
        host = self.hosts[node * per_node] if self.hosts else "?"
        raise NodeLeaves(f"node {node} ({host}) leaves the run: one of its ranks was the slowest, more than "
                         f"{SLOWER_PCT:g}% above the others, {epochs} epoch{'s' * (epochs > 1)} in a row "
                         f"(launch.leave_slow_node {epochs}); the other nodes go on without it from the snapshot of "
                         f"step {self.state.step}.",
                         leaving=self.env.global_rank // per_node == node)

    def _finish(self) -> None:
        """The final weights, then the final snapshot, whole on disk before fit() returns."""
        with self.phase("saving the final weights"):
            self._save_weights(self.cfg.output.folder.model)
        with self.phase(f"snapshot at step {self.state.step}"):
            self.snapshots.save(self.state, wait=True)

    # ---- what the loop's steps above call ----------------------------------------------------------------------

    def _start_account(self) -> EpochAccount:
        """The epoch's account, its clock started once the device has finished earlier work; utilisation's window too."""
        self.step.model.train()
        sync(self.device)
        account = EpochAccount(self.state, self.env.world_size, self.env.global_rank, hosts=self.hosts)
        if self.utilisation is not None:
            self.utilisation.restart()
        return account

    def _measured(self, account: EpochAccount, own_time: tuple[float, float, float, int] | None = None) -> RankMeasures:
        """What this rank measured of the epoch besides its sums: memory held, bytes sent, communication times, its
        own time (OwnClock.totals), utilisation, the learning rate."""
        held = self.strategy.memory_bytes(self.optimizer)
        timing = self.strategy.comm_timing() if self.strategy.times_comm and self.env.world_size > 1 else None
        return RankMeasures(held_bytes=[held["params"], held["grads"], held["optim"]],
                            sent_bytes_per_step=self.strategy.comm_bytes(account.steps) // max(account.steps, 1),
                            lr=self._lr(), times_comm=self.strategy.times_comm,
                            comm_ms=None if timing is None else (timing.total_ms, timing.exposed_ms),
                            utilisation=None if self.utilisation is None else self.utilisation.take(),
                            flops_per_sample=self.flops_per_sample,
                            skipped_steps=None if self.step.scaler is None else self.state.epoch_skipped,
                            own_time=own_time)

    def _evaluation_due(self, epoch: int) -> bool:
        """train.eval_every_epochs; the run's last epoch (or the partial epoch a max_steps stop ends in) always."""
        every = self.cfg.train.eval_every_epochs
        last = epoch + 1 == self.cfg.train.epochs or self.state.step >= self.total_steps
        return last or bool(every and (epoch + 1) % every == 0)

    def _save_weights(self, path: Path) -> None:
        """The whole model on rank 0, whatever the sharding (every rank takes part in gathering it)."""
        self.strategy.settle()
        state = self.strategy.full_state_dict()
        if self.env.is_main:
            try:
                with written_atomically(path) as tmp:
                    torch.save(state, tmp)
            except Exception as exc:
                reason = snapshots.write_failure(exc)
                if reason is None:
                    raise
                rerun = snapshots.rerun_ending(self.snapshots.root, ": it resumes from the last snapshot.")
                raise OutputError(f"could not write the final weights to {path} ({reason}); free space or fix permissions "
                                  f"there, then run the same command{rerun}") from exc

    def _lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _log_step(self, epoch: int, loss_sum: torch.Tensor, global_count: int) -> float:
        """The global mean loss of this step: one all-reduce and one host sync, on log steps only.

        The epoch's loss sum rides along in the same all-reduce: a nan or inf loss at any step so far stops the run here.
        """
        assert self.state.epoch_sums is not None
        store = self._window_store()
        if store is not None:  # before the all-reduce: once it has returned on rank 0, every rank's window is there
            publish_window(store, self.env.global_rank, self.state.step, self.own_clock.window())
        step_total, epoch_total = self.strategy.all_reduce(torch.stack([loss_sum.double(), self.state.epoch_sums[0]])).tolist()
        self._check_loss(epoch_total)
        loss = step_total / global_count
        slow = None
        if store is not None and self.env.is_main:
            slow = window_straggler(store, self.env.world_size, self.state.step, self.hosts)
        self.events.emit(STEP_EVENT.name, **{EPOCH: epoch + 1, STEP: self.state.step, LOSS: loss, LR: self._lr()},
                         **(slow.fields() if slow is not None else {}))
        return loss

    def _window_store(self) -> Any:
        """The world's store where the log steps compare the ranks' windows of own time: with launch.watch, 2 ranks or
        more, inside an epoch; else None."""
        if self.own_clock is None or self.env.world_size < 2 or self.phase.world is None:
            return None
        return self.phase.world[0]

    def _check_loss(self, epoch_total: float | None = None) -> None:
        """Diverged, on every rank at the same step, if this epoch's loss summed over the ranks is nan or inf.

        epoch_total: that sum where the caller has just reduced it; else one all-reduce and host sync here (only before
        a snapshot: a diverged state is never saved). Earlier epochs were checked at their ends.
        """
        state = self.state
        if epoch_total is None:
            assert state.epoch_sums is not None
            epoch_total = self.strategy.all_reduce(state.epoch_sums[:1].clone()).item()
        if math.isfinite(epoch_total):
            self.finite_through = state.step
            return
        self.snapshots.wait()  # a background write of an earlier step holds a finite state: finish it
        barrier()  # every rank leaves only once rank 0 has committed it
        last = snapshots.newest_verified(self.snapshots.root)
        raise Diverged(diverged_sentence(epoch_total, self.finite_through + 1, state.step, state.epoch + 1,
                                         last.name if last is not None else None, self.cfg.output.elsewhere))


def diverged_sentence(value: float, first_step: int, step: int, epoch: int, last_snapshot: str | None,
                      elsewhere: str = snapshots.AFRESH) -> str:
    """What a diverged run says: where the loss stopped being finite, what was kept, what to change (elsewhere: the
    option that starts afresh, as the run was named: OutputConfig.elsewhere)."""
    where = f"at step {step}" if first_step >= step else f"between steps {first_step} and {step}"
    kept = (f"the last snapshot before it, {last_snapshot}, is kept" if last_snapshot is not None
            else "no snapshot was written before it")
    return (f"the training loss became {value} {where} (epoch {epoch}) and the run stopped; {kept}; lower --optim.lr "
            f"or set --train.grad_clip, and use {elsewhere} to start afresh.")


def build_trainer(cfg: RunConfig, env: DistEnv, device: torch.device, events: EventLog, phase: Phase) -> Trainer:
    """Everything the loop needs, in order: data, model, strategy, optimizer, schedule, snapshots, the resume, the
    step; the Trainer, whole."""
    strategy = build_strategy(cfg.strategy, env, device, cfg.launch.timeout_s, cfg.train.accumulate_steps)
    data_rank, data_world = strategy.data_share()
    with phase("data loading"):
        info, train_loader, eval_loader = build_loaders(
            cfg.data, device=device, global_batch=cfg.train.global_batch_size, eval_batch=cfg.train.eval_batch_size,
            rank=data_rank, world_size=data_world, seed=cfg.train.seed, channels_last=cfg.train.channels_last,
        )
        check_world(cfg, env.world_size, info.train_size, on_cpu=device.type == "cpu", torch_version=str(torch.__version__))
    with phase("model set-up"):
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        model = build_model(cfg.model, info.image_shape, info.num_classes)
        flops = training_flops_per_sample(model, info.image_shape) if env.is_main else None
        if cfg.train.channels_last:
            model = model.to(memory_format=torch.channels_last)
        wrapped = strategy.wrap(model)
        if cfg.train.compile:  # compiled on the first step; the eval module and the state dicts stay the eager ones
            wrapped = torch.compile(wrapped)
        graphed = use_step_graph(cfg, device, strategy)
        optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_spec(cfg, capturable=graphed))
        steps_per_epoch = len(train_loader)
        total_steps = cfg.train.total_steps(steps_per_epoch)
        scheduler = build_scheduler(cfg, optimizer, total_steps, steps_per_epoch)
    # Dropout and other randomness differ per rank, deterministically.
    torch.manual_seed(cfg.train.seed + 1 + env.global_rank)
    state = TrainState()
    scaler = LossScaler(device, state, env.global_rank) if cfg.train.fp16 else None
    snapshotter = Snapshotter(cfg, env, device, strategy, optimizer, scheduler, total_steps, steps_per_epoch,
                              own_parts=[] if scaler is None else [scaler.state_part()])
    snapshotter.start()  # before the resume: a folder one node does not see is named as such, not as a missing snapshot
    with phase("resume"):
        path = snapshots.choose(cfg, env.is_main, env.world_size)
        if path is not None:
            snapshotter.load(path, state)
    step = TrainStep(strategy=strategy, model=wrapped, optimizer=optimizer, scheduler=scheduler,
                     autocast=lambda: bf16_autocast(device, cfg.train.bf16 or cfg.train.fp16, cache=not graphed,
                                                    dtype=torch.float16 if cfg.train.fp16 else torch.bfloat16),
                     grad_clip=cfg.train.grad_clip, scaler=scaler,
                     micro_batches=cfg.train.accumulate_steps, profiler=step_profiler(cfg, env, device, state, total_steps))
    if graphed:  # after the resume: the graph records the addresses of the optimizer state it loaded
        step = step.graphed(cfg.train.global_batch_size)
    return Trainer(cfg=cfg, env=env, device=device, strategy=strategy, optimizer=optimizer, scheduler=scheduler,
                   train_loader=train_loader, eval_loader=eval_loader, info=info, events=events, phase=phase,
                   total_steps=total_steps, step=step, snapshots=snapshotter, state=state,
                   stop=StopRequest(env.world_size), flops_per_sample=flops, slow_node=slow_node(cfg, env),
                   link_probe=LinkProbe.for_run(env.global_rank, env.world_size, env.local_world_size,
                                                cfg.launch.timeout_s) if cfg.launch.watch else None)


def slow_node(cfg: RunConfig, env: DistEnv) -> SlowNode | None:
    """launch.leave_slow_node's SlowNode where dptrain's agent runs an elastic run (it says the fewest nodes: node 0,
    which hosts the rendezvous, never leaves); None elsewhere."""
    fewest = os.environ.get(FEWEST_NODES_VAR)
    if not cfg.launch.leave_slow_node or fewest is None or env.local_world_size < 1:
        return None
    return SlowNode(cfg.launch.leave_slow_node, env.local_world_size, env.world_size // env.local_world_size,
                    int(fewest))


def step_profiler(cfg: RunConfig, env: DistEnv, device: torch.device, state: TrainState,
                  total_steps: int) -> StepProfiler | None:
    """train.profile's profiler of this rank, from the step the run stands at; None without it."""
    steps = cfg.train.profiled_steps
    if steps is None:
        return None
    return StepProfiler(*steps, folder=cfg.output.folder.profile, rank=env.global_rank, device=device,
                        next_step=state.step + 1, total_steps=total_steps)


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
