"""The `tutorial` engine: the tutorials' plain loop (DataLoader + DistributedSampler + DDP or FSDP2), as a baseline.

Started by the sweep under torchrun, one process per worker:
    $ python -m torch.distributed.run --standalone --nproc-per-node 2 -m dptrain.bench.tutorial RUN_DIR
It trains what RUN_DIR/config.toml says (the same model, data, global batch, optimizer and epochs as the dptrain
points) and writes metrics.jsonl events and env.json of the shape dptrain writes, so that collect reads both alike.
Per-sample normalisation, a Python DataLoader and no channels_last: what the tutorials do.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

from dptrain.config import ConfigError, RunConfig

STRATEGIES = ("ddp", "fsdp")
# What the plain loop does not do; a sweep that asks for it is refused rather than compared unlike with like.
PLAIN = {"optim.schedule": "constant", "optim.warmup_steps": 0, "optim.scale_lr_with": "none", "train.max_steps": None,
         "train.bf16": False, "train.grad_clip": None, "data.augment": "none", "strategy.comm_hook": "allreduce"}


def check(cfg: RunConfig) -> None:
    """One sentence when the plain loop cannot run this config the way dptrain would."""
    if cfg.strategy.name not in STRATEGIES:
        raise ConfigError(f"--engines tutorial runs strategies {', '.join(STRATEGIES)} only, not {cfg.strategy.name}; "
                          f"drop it from --strategies or run the tutorial engine in a sweep of its own.")
    for key, plain in PLAIN.items():
        section, option = key.split(".")
        value = getattr(getattr(cfg, section), option)
        if value != plain:
            raise ConfigError(f"--engines tutorial runs the plain loop, which has no {key} = {value}; "
                              f"drop --{key} or the tutorial engine.")


def main(run_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dptrain import config as config_mod
    from dptrain.data.catalog import load
    from dptrain.models import build_model
    from dptrain.runtime import wants_cuda

    cfg = config_mod.load(run_dir / "config.toml")
    on_cuda = wants_cuda(cfg.launch.device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if on_cuda else "cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    spec, train, test = load(cfg.data)
    train_set, test_set = Normalized(train, spec.mean, spec.std), Normalized(test, spec.mean, spec.std)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.train.seed)
    loader = DataLoader(train_set, batch_size=cfg.train.global_batch_size // world, sampler=sampler,
                        num_workers=cfg.data.num_workers)
    model = wrap(build_model(cfg.model, spec.shape, spec.num_classes).to(device), cfg.strategy.name, device)
    optimizer = make_optimizer(cfg, model.parameters())
    sink = Sink(run_dir, rank)
    sink.write({"event": "run_start", "world_size": world, "strategy": cfg.strategy.name, "model": cfg.model.name,
                "data": cfg.data.name, "global_batch_size": cfg.train.global_batch_size,
                "total_steps": len(loader) * cfg.train.epochs, "device": device.type, "engine": "tutorial"})
    sink.env(device.type, world, torch.__version__, torch.get_num_threads())
    step = 0
    for epoch in range(1, cfg.train.epochs + 1):
        sampler.set_epoch(epoch)
        record, step = train_epoch(model, loader, optimizer, device, world, step)
        record |= evaluate(model, test_set, cfg.train.eval_batch_size, device, rank, world)
        sink.write({"event": "epoch", "epoch": epoch, "step": step, **record})
    sink.write({"event": "run_end", "step": step})
    dist.barrier()  # no rank tears gloo down while another still talks to it (seen: SIGABRT at exit with fsdp)
    dist.destroy_process_group()


class Normalized:
    """Per-sample conversion and normalisation, as ToTensor + Normalize do in the tutorials."""

    def __init__(self, split: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        import torch

        self.split = split
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return (self.split.images[i].float() / 255 - self.mean) / self.std, int(self.split.labels[i])


def wrap(model: Any, strategy: str, device: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def make_optimizer(cfg: RunConfig, params: Any) -> Any:
    import torch

    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=o.lr, weight_decay=o.weight_decay)


def train_epoch(model: Any, loader: Any, optimizer: Any, device: Any, world: int, step: int) -> tuple[dict, int]:
    """One epoch of the plain loop, timed between barriers (all ranks done), with metrics reduced over every rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model.train()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples (on the CPU: .item() per step is a sync)
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    dist.all_reduce(totals)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else rss_mb
    per_rank = [None] * world
    dist.all_gather_object(per_rank, (round(100 * cpu_seconds / seconds, 1), round(rss_mb, 1), peak_mb))
    loss_sum, correct, samples = totals.tolist()
    return {"train_loss": loss_sum / samples, "train_acc": correct / samples, "train_samples": int(samples),
            "epoch_time_s": seconds, "samples_per_s": samples / seconds, "peak_mem_mb": max(p[2] for p in per_rank),
            "cpu_util_pct": [p[0] for p in per_rank], "rss_max_mb": [p[1] for p in per_rank]}, step


def evaluate(model: Any, test_set: Normalized, batch_size: int, device: Any, rank: int, world: int) -> dict:
    """The whole test split, strided over the ranks without padding, so every sample counts once."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Subset

    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    start = time.perf_counter()
    shard = Subset(test_set, range(rank, len(test_set), world))
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=batch_size):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            totals += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                    (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"eval_loss": loss_sum / count, "eval_acc": correct / count, "eval_count": int(count),
            "eval_time_s": time.perf_counter() - start}


class Sink:
    """metrics.jsonl and env.json, written by rank 0 only."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.main = run_dir, rank == 0

    def write(self, event: dict) -> None:
        if self.main:
            with (self.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"event": event.pop("event"), "time": round(time.time(), 3), **event}) + "\n")
            if event.get("epoch"):
                print(f"epoch {event['epoch']}: {event['epoch_time_s']:.3f} s, train_loss {event['train_loss']:.4f}, "
                      f"eval_acc {event['eval_acc']:.4f}", flush=True)

    def env(self, device: str, world: int, torch_version: str, threads: int) -> None:
        if self.main:
            record = {"engine": "tutorial", "python": platform.python_version(), "torch": torch_version,
                      "host": platform.node(), "world_size": world, "launched_by": "torchrun",
                      "device": device, "cpu_threads_per_rank": threads}
            (self.run_dir / "env.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
