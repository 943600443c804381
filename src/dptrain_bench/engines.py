"""What the other engines (tutorial, lightning, deepspeed) share: their checks, and the parts of a point that must be
alike for their rows to compare with dptrain's.

Each engine is a module run by the sweep under torchrun, one process per worker, as `python -m MODULE RUN_DIR`; it
trains what RUN_DIR/config.toml says and writes metrics.jsonl and env.json through RunFiles, in the shape dptrain
writes them, so that collect reads every engine alike. Shared here, so that the engines differ in the engine only:
the optimizer (make_optimizer), the normalisation (dptrain's own, data.spec.Normalise), the train loader (one DistributedSampler seeded by
train.seed), the epoch clock and its metrics (EpochMeter: between barriers, evaluation off the clock), and
evaluation (every test sample once).
Importing this module imports no torch: the sweep imports it to check a sweep before running anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from dptrain.config import RunConfig
from dptrain.errors import ConfigError
from dptrain.run_folder import RunFolder
from dptrain.files import write_atomically

if TYPE_CHECKING:
    from dptrain.data.spec import Normalise

# What the plain loops do not do; a sweep that asks for it is refused rather than compared unlike with like.
PLAIN = {"optim.schedule": "constant", "optim.warmup_steps": 0, "optim.scale_lr_with": "none", "train.max_steps": None,
         "train.bf16": False, "train.grad_clip": None, "data.augment": "none", "strategy.ddp.comm_hook": "allreduce"}


def require(engine: str, package: str) -> None:
    """One sentence when the engine's package is not installed (found without importing it: importing is seconds)."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        found = False
    if not found:
        raise ConfigError(f"--engines {engine} needs the {package} package, which is not installed here; "
                          f"pip install 'dptrain[{package}]', or drop {engine} from --engines.")


def check_plain(cfg: RunConfig, engine: str, strategies: Iterable[str]) -> None:
    """One sentence when the engine cannot run this strategy, or an option the plain loop does not have."""
    strategies = tuple(strategies)
    if cfg.strategy.name not in strategies:
        raise ConfigError(f"--engines {engine} runs strategies {', '.join(strategies)} only, not {cfg.strategy.name}; "
                          f"drop it from --strategies or run the {engine} engine in a sweep of its own.")
    for key, plain in PLAIN.items():
        value: Any = cfg
        for part in key.split("."):  # strategy.ddp.comm_hook: a strategy's option, in its table
            value = getattr(value, part)
        if value != plain:
            raise ConfigError(f"--engines {engine} runs the plain loop, which has no {key} = {value}; "
                              f"drop --{key} or the {engine} engine.")


def run_config(run_dir: Path) -> RunConfig:
    from dptrain import config as config_mod

    return config_mod.load(RunFolder(run_dir).config)


def pick_device(cfg: RunConfig) -> Any:
    """cuda:LOCAL_RANK (torchrun sets it) on a CUDA run, else the CPU."""
    import torch

    from dptrain.runtime import wants_cuda

    if not wants_cuda(cfg.launch.device):
        return torch.device("cpu")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    torch.cuda.set_device(device)
    return device


def train_loader(dataset: Any, cfg: RunConfig, rank: int, world: int) -> Any:
    """This rank's share of every global batch: a DistributedSampler shuffled from train.seed (set_epoch each epoch)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.train.seed)
    return DataLoader(dataset, batch_size=cfg.train.global_batch_size // world, sampler=sampler,
                      num_workers=cfg.data.num_workers)


def make_optimizer(cfg: RunConfig, params: Any) -> Any:
    """dptrain's choice of optimizer (strategies.base.optimizer_choice), unfused: the plain loops step with torch's
    default kernels, as the tutorials they stand for do, so that the comparison measures the engine, not the kernel."""
    from dptrain.strategies.base import optimizer_choice

    return optimizer_choice(cfg.optim, cfg.optim.lr, fused=False).build(params)


class Totals:
    """Loss sum, correct and samples as float64 on the CPU, summed over every rank by reduce()."""

    def __init__(self) -> None:
        import torch

        self.sums = torch.zeros(3, dtype=torch.float64)

    def add(self, loss_sum: Any, logits: Any, labels: Any) -> None:
        import torch

        # .item() waits for the device: once per step, as the tutorials do (on the CPU it costs nothing)
        self.sums += torch.tensor([float(loss_sum), (logits.argmax(1) == labels).sum().item(), len(labels)],
                                  dtype=torch.float64)

    def reduce(self) -> tuple[float, float, float]:
        import torch.distributed as dist

        dist.all_reduce(self.sums)
        loss_sum, correct, count = self.sums.tolist()
        return loss_sum, correct, count


def leave_world() -> None:
    """End another engine's run: a barrier (no rank tears the group down while another still talks to it), then
    dptrain's own teardown, whose pause lets gloo's threads finish first: a group destroyed right after the last
    barrier aborted a rank at exit now and then ("terminate called without an active exception"; 3 runs in 10
    of the tutorial engine here, 0 in 20 with the pause)."""
    import torch.distributed as dist

    from dptrain.distributed.world import destroy_process_group

    dist.barrier()
    destroy_process_group()


class EpochMeter:
    """One epoch's clock and metrics: started and stopped between barriers (all ranks), so the time is the slowest
    rank's; what runs between stop() and the next start() (evaluation, the engine's epoch-end hooks) is off it."""

    def __init__(self, device: Any, world: int) -> None:
        self.device, self.world = device, world
        self.totals, self.running = Totals(), False
        self.start_s = self.cpu_start_s = self.seconds = self.cpu_seconds = 0.0

    def start(self) -> None:
        import torch.distributed as dist

        self.totals = Totals()
        dist.barrier()
        self.start_s, self.cpu_start_s, self.running = time.perf_counter(), time.process_time(), True

    def add(self, loss: Any, logits: Any, labels: Any) -> None:
        self.totals.add(loss.item() * len(labels), logits, labels)

    def stop(self) -> None:
        """Stop the clock; a second call (an engine with two places an epoch may end) does nothing."""
        import torch
        import torch.distributed as dist

        if not self.running:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        self.seconds, self.cpu_seconds = time.perf_counter() - self.start_s, time.process_time() - self.cpu_start_s
        self.running = False

    def record(self) -> dict:
        """The epoch's train metrics, reduced over every rank (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        loss_sum, correct, samples = self.totals.reduce()
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else rss_mb
        per_rank: list[Any] = [None] * self.world
        dist.all_gather_object(per_rank, (round(100 * self.cpu_seconds / self.seconds, 1), round(rss_mb, 1), peak_mb))
        return {"train_loss": loss_sum / samples, "train_acc": correct / samples, "train_samples": int(samples),
                "epoch_time_s": self.seconds, "samples_per_s": samples / self.seconds,
                "peak_mem_mb": max(p[2] for p in per_rank), "cpu_util_pct": [p[0] for p in per_rank],
                "rss_max_mb": [p[1] for p in per_rank]}


TrainingStep = Callable[[Any, Any], tuple[Any, Any]]
"""(images, labels) on the device -> (the batch's mean loss, its logits), the model trained once: an engine's step."""


def train_epochs(cfg: RunConfig, model: Any, step: TrainingStep, loader: Any, test_batches: list[tuple[Any, Any]],
                 normalize: Normalise, device: Any, world: int, run_files: RunFiles,
                 prepare: Callable[[Any], Any] = lambda x: x) -> None:
    """The plain loop every peer engine runs (tutorial, deepspeed): each epoch's batches through the engine's step on
    the meter's clock, then the test split; an epoch event for each, and the run's end. prepare: what the engine does
    to a batch's images on the device before its step (a normalisation where the loader yields raw pixels)."""
    meter, done = EpochMeter(device, world), 0
    for epoch in range(1, cfg.train.epochs + 1):
        loader.sampler.set_epoch(epoch)
        model.train()
        meter.start()
        for x, y in loader:
            x, y = prepare(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)
            loss, logits = step(x, y)
            meter.add(loss, logits, y)
            done += 1
        meter.stop()
        record = meter.record() | evaluate_test_split(model, test_batches, normalize, device)
        run_files.write({"event": "epoch", "epoch": epoch, "step": done, **record})
    run_files.write({"event": "run_end", "step": done})


def eval_batches(images: Any, labels: Any, batch_size: int, rank: int, world: int) -> list[tuple[Any, Any]]:
    """This rank's batches of the test split (uint8, as the split), strided over the ranks without padding, so every
    sample counts once. Every rank gets as many batches (the last ones empty where its share ran out): a sharded model
    (fsdp, ZeRO-3) gathers its parameters in every forward, a collective that each rank must join."""
    shard_x, shard_y = images[rank::world], labels[rank::world]
    most = -(-len(labels) // world)
    return [(shard_x[i:i + batch_size], shard_y[i:i + batch_size]) for i in range(0, most, batch_size)]


def evaluate_test_split(model: Any, batches: list[tuple[Any, Any]], normalize: Normalise, device: Any) -> dict:
    """Eval loss and accuracy over the whole test split (batches from eval_batches), reduced over every rank."""
    import torch
    import torch.nn.functional as F

    model.eval()
    totals = Totals()
    start = time.perf_counter()
    with torch.no_grad():
        for x, y in batches:
            x, y = normalize(x.to(device)), y.to(device)
            logits = model(x)
            totals.add(F.cross_entropy(logits, y, reduction="sum").item(), logits, y)
    return eval_record(totals, time.perf_counter() - start)


def eval_record(totals: Totals, seconds: float) -> dict:
    loss_sum, correct, count = totals.reduce()
    return {"eval_loss": loss_sum / count, "eval_acc": correct / count, "eval_count": int(count),
            "eval_time_s": seconds}


class RunFiles:
    """metrics.jsonl and env.json, written by global rank 0 only."""

    def __init__(self, run_dir: Path, rank: int, engine: str) -> None:
        self.run_dir, self.main, self.engine = run_dir, rank == 0, engine

    def write(self, event: dict) -> None:
        if self.main:
            with RunFolder(self.run_dir).metrics.open("a") as f:
                f.write(json.dumps({"event": event.pop("event"), "time": round(time.time(), 3), **event}) + "\n")
            if event.get("epoch"):
                print(f"epoch {event['epoch']}: {event['epoch_time_s']:.3f} s, train_loss {event['train_loss']:.4f}, "
                      f"eval_acc {event['eval_acc']:.4f}", flush=True)

    def run_start(self, cfg: RunConfig, world: int, device: Any, steps_per_epoch: int, **extra: Any) -> None:
        self.write({"event": "run_start", "world_size": world, "strategy": cfg.strategy.name, "model": cfg.model.name,
                    "data": cfg.data.name, "global_batch_size": cfg.train.global_batch_size,
                    "total_steps": steps_per_epoch * cfg.train.epochs, "device": device.type, "engine": self.engine,
                    **extra})

    def env(self, device: Any, world: int, versions: dict[str, str] | None = None) -> None:
        """env.json: the engine, its package's version and torch's, the host, the ranks and threads."""
        import torch

        if self.main:
            record = {"engine": self.engine, **(versions or {}), "python": platform.python_version(),
                      "torch": torch.__version__, "host": platform.node(), "world_size": world,
                      "launched_by": "torchrun", "device": device.type, "cpu_threads_per_rank": torch.get_num_threads()}
            write_atomically(RunFolder(self.run_dir).env, json.dumps(record, indent=2) + "\n")
