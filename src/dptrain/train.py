"""The training loop: build_trainer(cfg, env, device, events, phase) -> Trainer; Trainer.fit() trains, evaluates and
logs exact metrics.

    $ dptrain train --nproc-per-node 2                 # 2 local workers, DDP over gloo/nccl
    $ torchrun --nproc-per-node 4 -m dptrain train     # under an existing launcher
    $ srun dptrain train                               # one task per rank under SLURM
"""

from __future__ import annotations

import contextlib
import math
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dptrain import checkpoint, faults
from dptrain.checkpoint import Snapshotter
from dptrain.config import RunConfig
from dptrain.data import DataInfo, build_loaders
from dptrain.data.loader import Batch, Loader
from dptrain.distributed.env import DistEnv
from dptrain.distributed.failures import Phase, WorkerFailure
from dptrain.distributed.world import barrier
from dptrain.errors import OutputError
from dptrain.evaluate import evaluate, sync
from dptrain.files import written_whole
from dptrain.metrics import EventLog, ProgressBar, UtilisationSampler, peak_memory_mb, per_rank
from dptrain.models import build_model, training_flops_per_sample
from dptrain.runtime import bf16_autocast
from dptrain.schedule import Schedule, build_scheduler, peak_lr
from dptrain.step_graph import StepGraph
from dptrain.stopping import StopRequest, Stopped
from dptrain.strategies import Strategy, build_strategy, check_world
from dptrain.strategies.base import OptimizerSpec, optimizer_choice
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


@dataclass(kw_only=True)
class Trainer:
    """One rank's training: build_trainer() makes it whole, fit() runs it.

    fit() goes epoch by epoch from where `state` stands (a resume puts it mid-epoch): run_epoch() trains the epoch's
    remaining batches, each a step with its counting, logging, snapshot and stop check; then the epoch's metrics are
    reduced over the ranks exactly, the test split is evaluated when due, one epoch event is emitted and a snapshot
    taken when due. Each boundary runs inside `phase`, so that a failure names the rank and where it stood.
    """

    cfg: RunConfig
    env: DistEnv
    device: torch.device
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Schedule
    train_loader: Loader
    eval_loader: Loader
    info: DataInfo
    events: EventLog
    phase: Phase
    total_steps: int
    snapshots: Snapshotter
    state: TrainState = field(default_factory=TrainState)
    """Where the loop stands; the snapshots save and restore it."""
    stop: StopRequest | None = None
    """SIGTERM/SIGUSR1 seen by any rank: snapshot at the next step boundary, then raise Stopped."""
    step_graph: StepGraph | None = None
    """train.cuda_graph: replays the captured training step (None: every step runs eagerly)."""
    utilisation: UtilisationSampler | None = None
    """This rank's CPU, memory and GPU use, sampled on a thread while fit() runs (None: no utilisation fields)."""
    flops_per_sample: int | None = None
    """The model's floating-point operations per training sample, forward and backward (counted on rank 0 only)."""
    finite_through: int = 0
    """The last step up to which every training loss was checked finite (fit() starts it at the resumed step)."""

    def fit(self) -> dict:
        """Train until train.epochs or train.max_steps; returns the last epoch event."""
        state, epochs = self.state, self.cfg.train.epochs
        progress = ProgressBar(enabled=self.env.is_main, every_s=self.cfg.train.progress_every_s,
                               total_steps=self.total_steps, start_step=state.step)
        sampler = self.utilisation = UtilisationSampler(self.device)  # a daemon thread, closed below
        last: dict = {}
        if state.is_complete(self.total_steps):
            log.info("this run is already complete at step %d; raise train.epochs or train.max_steps to go on, "
                     "or use another --output.name to start afresh", state.step)
        completed = False
        self.finite_through = state.step
        try:
            for epoch in range(state.epoch, epochs):
                # A resumed epoch whose steps are all done may still owe its event (stopped before evaluation).
                if state.is_complete(self.total_steps):
                    break
                if not state.resumes_mid_epoch(epoch):
                    state.start_epoch(epoch, self.device)
                remaining = min(len(self.train_loader) - state.batches_consumed, self.total_steps - state.step)
                progress.start_epoch(epoch + 1, epochs, remaining)
                train = self.run_epoch(epoch, progress)
                evaluation = {}
                if self._evaluation_due(epoch):
                    with self.phase(f"evaluation after epoch {epoch + 1}"):
                        evaluation = evaluate(self.strategy.eval_module, self.eval_loader, self._autocast, self.strategy.all_reduce)
                last = self.events.emit("epoch", epoch=epoch + 1, step=state.step, **train, **evaluation)
                state.epoch_reported = True
                with self.phase(f"snapshot after epoch {epoch + 1}"):
                    self.snapshots.save_if_due(state, after_evaluation=True)
            progress.stop()
            with self.phase("saving the final weights"):
                self._save_weights(self.cfg.output.folder.model)
            with self.phase(f"snapshot at step {state.step}"):
                self.snapshots.save(state, wait=True)
            completed = True
        finally:
            progress.stop()
            sampler.close()  # joins the sampler thread, on failure too
            if self.stop is not None:
                self.stop.close(wait=completed)
        return last

    def _evaluation_due(self, epoch: int) -> bool:
        """train.eval_every_epochs; the run's last epoch (or the partial epoch a max_steps stop ends in) always."""
        every = self.cfg.train.eval_every_epochs
        last = epoch + 1 == self.cfg.train.epochs or self.state.step >= self.total_steps
        return last or bool(every and (epoch + 1) % every == 0)

    def _save_weights(self, path: Path) -> None:
        """The whole model on rank 0, whatever the sharding (every rank takes part in gathering it)."""
        state = self.strategy.full_state_dict()
        if self.env.is_main:
            try:
                with written_whole(path) as tmp:
                    torch.save(state, tmp)
            except Exception as exc:
                reason = checkpoint.write_failure(exc)
                if reason is None:
                    raise
                rerun = checkpoint.rerun_ending(self.snapshots.root, ": it resumes from the last snapshot.")
                raise OutputError(f"could not write the final weights to {path} ({reason}); free space or fix permissions "
                                  f"there, then run the same command{rerun}") from exc

    def run_epoch(self, epoch: int, progress: ProgressBar) -> dict:
        """Train the rest of this epoch: one screen, in order: train, count, log, snapshot if due, stop if asked; then
        the epoch's training metrics, reduced over the ranks. Public for profiling (perf/gpu_profile.py times it)."""
        self.model.train()
        state = self.state
        steps = 0  # in this process's part of the epoch
        sync(self.device)
        start = time.perf_counter() - state.epoch_elapsed  # a resumed epoch's clock goes on from the snapshot
        if self.utilisation is not None:
            self.utilisation.restart()
        for batch in self.train_loader.epoch_batches(epoch, state.batches_consumed):
            with self.phase(f"step {state.step + 1}"):
                loss_sum, correct = self._run_batch(batch)
            state.count_step(loss_sum, correct, len(batch.labels), batch.global_count)
            steps += 1
            state.epoch_elapsed = time.perf_counter() - start  # host clock, no sync: what a snapshot records
            step_loss = None
            if state.step % self.cfg.train.log_every == 0:  # a collective: a failure in it names the rank and the step
                with self.phase(f"loss reduction of step {state.step}"):
                    step_loss = self._log_step(epoch, loss_sum, batch.global_count)
            progress.advance(step_loss, state.step, batch.global_count)
            faults.signal_if_due(self.env.global_rank, state.step)
            with self.phase(f"snapshot after step {state.step}"):
                if self.snapshots.due(state, after_evaluation=False):  # never a snapshot of a diverged state
                    self._check_loss()
                self.snapshots.save_if_due(state)
            self._stop_if_asked()
            if state.step >= self.total_steps:
                break
        with self.phase(f"metrics reduction of epoch {epoch + 1}"):
            assert state.epoch_sums is not None
            totals = self.strategy.all_reduce(state.epoch_sums.clone())  # also waits for every rank: the time covers the slowest
            elapsed = state.epoch_elapsed = time.perf_counter() - start
            peak = self.strategy.all_reduce(torch.tensor([peak_memory_mb(self.device)], device=self.device), op="max")
            accounting = self._accounting(steps)
            utilisation = self._utilisation()
        loss, correct, count = totals.tolist()
        self._check_loss(loss)  # before the epoch's evaluation, snapshot and the final weights
        return {
            "train_loss": loss / count, "train_acc": correct / count, "train_samples": int(count),
            "epoch_time_s": elapsed, "samples_per_s": state.epoch_seen / elapsed,
            **self._efficiency(state.epoch_seen / elapsed),
            "peak_mem_mb": peak.item(), "lr": self._lr(), **accounting, **utilisation,
        }

    def _efficiency(self, samples_per_s: float) -> dict[str, float]:
        """model_flops_per_sample, and achieved_tflops: those operations at the epoch's rate, over every rank
        (the model's own arithmetic; a strategy's extra work, such as recomputation, is not counted)."""
        if self.flops_per_sample is None:
            return {}
        return {"model_flops_per_sample": self.flops_per_sample,
                "achieved_tflops": self.flops_per_sample * samples_per_s / 1e12}

    def _stop_if_asked(self) -> None:
        """Once every rank has agreed on a stop signal: a whole snapshot of this step, then Stopped."""
        with self.phase(f"signal exchange after step {self.state.step}"):
            signal_name = self.stop.agreed() if self.stop is not None else None
        if signal_name:
            with self.phase(f"snapshot at step {self.state.step}"):
                self._check_loss()
                self.snapshots.save(self.state, wait=True)
            raise Stopped.after_step(signal_name, self.state.step)

    def _accounting(self, steps: int) -> dict[str, list[int]]:
        """Per rank: bytes of parameters, gradients and optimizer state held, and bytes sent per step."""
        held = self.strategy.memory_bytes(self.optimizer)
        sent = self.strategy.comm_bytes(steps) // max(steps, 1)
        table = torch.zeros(self.env.world_size, 4, dtype=torch.float64, device=self.device)
        table[self.env.global_rank] = torch.tensor([held["params"], held["grads"], held["optim"], sent], dtype=torch.float64)
        columns = self.strategy.all_reduce(table).long().t().tolist()
        names = ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "comm_bytes_per_step")
        return {**dict(zip(names, columns)), **self._comm_timing()}

    def _comm_timing(self) -> dict[str, list[float]]:
        """Per rank, where the strategy times it (ddp, zero1: a sampled step of DDP's): milliseconds of gradient
        communication in a step, and of those, the ones backward did not hide (the step waited for them)."""
        if self.env.world_size == 1 or type(self.strategy).comm_timing is Strategy.comm_timing:
            return {}  # the same answer on every rank: they all run the same strategy
        timing = self.strategy.comm_timing()
        table = torch.zeros(self.env.world_size, 2, dtype=torch.float64, device=self.device)
        table[self.env.global_rank] = torch.tensor([-1.0, -1.0] if timing is None else [timing.total_ms, timing.exposed_ms],
                                                   dtype=torch.float64)
        total, exposed = self.strategy.all_reduce(table).t().tolist()
        if min(total) < 0:  # a rank without a sampled step yet (DDP samples its 10th step first)
            return {}
        return {"comm_ms_per_step": [round(v, 3) for v in total], "comm_exposed_ms_per_step": [round(v, 3) for v in exposed]}

    def _utilisation(self) -> dict[str, list[float]]:
        """Per rank: CPU use and resident memory over this epoch's training, and its GPU's use where NVML is there."""
        if self.utilisation is None:
            return {}
        return per_rank(self.utilisation.take(), self.env.world_size, self.env.global_rank, self.strategy.all_reduce,
                        self.device)

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
        # The loss in at least float32 (bf16 logits are summed in float32), float64 stays float64 (the tests' exact mode).
        loss_sum = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction="sum")
        self.strategy.backward(loss_sum, global_count)
        if self.cfg.train.grad_clip is not None:
            self.strategy.clip_grad_norm(self.model, self.cfg.train.grad_clip)
        self.optimizer.step()
        return loss_sum.detach(), (logits.argmax(1) == labels).sum()

    def _lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _log_step(self, epoch: int, loss_sum: torch.Tensor, global_count: int) -> float:
        """The global mean loss of this step: one all-reduce and one host sync, on log steps only.

        The epoch's loss sum rides along in the same all-reduce: a nan or inf loss at any step so far stops the run here.
        """
        assert self.state.epoch_sums is not None
        step_total, epoch_total = self.strategy.all_reduce(torch.stack([loss_sum.double(), self.state.epoch_sums[0]])).tolist()
        self._check_loss(epoch_total)
        loss = step_total / global_count
        self.events.emit("step", epoch=epoch + 1, step=self.state.step, loss=loss, lr=self._lr())
        return loss

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
        last = checkpoint.newest_whole(self.snapshots.root)
        raise Diverged(diverged_sentence(epoch_total, self.finite_through + 1, state.step, state.epoch + 1,
                                         last.name if last is not None else None))

    def _autocast(self) -> contextlib.AbstractContextManager:
        return bf16_autocast(self.device, self.cfg.train.bf16, cache=self.step_graph is None)



def diverged_sentence(value: float, first_step: int, step: int, epoch: int, last_snapshot: str | None) -> str:
    """What a diverged run says: where the loss stopped being finite, what was kept, what to change."""
    where = f"at step {step}" if first_step >= step else f"between steps {first_step} and {step}"
    kept = (f"the last snapshot before it, {last_snapshot}, is kept" if last_snapshot is not None
            else "no snapshot was written before it")
    return (f"the training loss became {value} {where} (epoch {epoch}) and the run stopped; {kept}; lower --optim.lr "
            f"or set --train.grad_clip, and use another --output.name to start afresh.")


def build_trainer(cfg: RunConfig, env: DistEnv, device: torch.device, events: EventLog, phase: Phase) -> Trainer:
    """Everything the loop needs, in order: data, model, strategy, optimizer, schedule."""
    strategy = build_strategy(cfg.strategy, env, device, cfg.launch.timeout_s)
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
    snapshots = Snapshotter(cfg, env, device, strategy, optimizer, scheduler, total_steps, steps_per_epoch)
    trainer = Trainer(cfg=cfg, env=env, device=device, strategy=strategy, model=wrapped, optimizer=optimizer,
                      scheduler=scheduler, train_loader=train_loader, eval_loader=eval_loader, info=info, events=events,
                      phase=phase, total_steps=total_steps, snapshots=snapshots, flops_per_sample=flops)
    snapshots.start()  # before the resume: a folder one node does not see is named as such, not as a missing snapshot
    with phase("resume"):
        path = checkpoint.choose(cfg, env.is_main, env.world_size)
        if path is not None:
            snapshots.load(path, trainer.state)
    trainer.stop = StopRequest(env.world_size)
    if graphed:  # after the resume: the graph records the addresses of the optimizer state it loaded
        step = lambda images, labels: trainer._train_step(images, labels, len(labels))  # noqa: E731 - one device: the batch is global
        trainer.step_graph = StepGraph(step, optimizer, cfg.train.global_batch_size)
    return trainer


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
