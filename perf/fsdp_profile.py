"""Where an FSDP2 step of the tutorials' CNN goes on the CPU: dptrain's fsdp strategy against the tutorial's plain
FSDP2 loop (dptrain_bench/tutorial.py), both on 2 gloo ranks of one thread each, in one run, side by side:

    .venv/bin/python perf/fsdp_profile.py                  # 5 interleaved rounds of 20 steps per variant
    .venv/bin/python perf/fsdp_profile.py --variants tutorial,dptrain-nchw-gloo --profile   # and per step, the
                                        # collectives and the ops that took the most time (torch.profiler)

Each variant is one way of wrapping the model and stepping it, on the same random batch (64 images per rank):
- tutorial: fully_shard on the root only, Adam with torch's default (foreach) kernels, mean loss: tutorial.py's loop.
- dptrain: dptrain's strategies.fsdp.FSDP.wrap under its defaults, fused Adam and the summed loss scaled by
  Strategy.backward: train.TrainStep.eager.
- dptrain-<wrap>: the same under strategy.fsdp.wrap <wrap> (block, size, whole).
- dptrain-nchw: the same with train.channels_last false (NCHW weights and batches).
- dptrain-gloo: the same with FSDP2's own collectives on gloo instead of dptrain's through shared memory.
Options combine: dptrain-whole-gloo; dptrain-nchw-gloo is what dptrain's fsdp ran before it had either (block units,
whose root holds no parameters of the tutorials' CNN, so the root's resharding made no difference there).
Rank 0 prints per variant the median and the fastest round's milliseconds per step (the fastest is the least disturbed
on a machine shared with other work), each as a speed ratio to the first variant, and the CPU time of both ranks per
step (which the other work disturbs less than wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

BATCH_PER_RANK = 64
VARIANTS = ("tutorial", "dptrain-nchw-gloo", "dptrain", "dptrain-whole")


def build(variant: str, rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable, bool]:
    """The wrapped model, its optimizer, one training step (images, labels) -> None, and whether it takes NHWC
    batches (train.channels_last: dptrain's loader keeps them so)."""
    from torch.distributed.fsdp import fully_shard

    from dptrain.config import ModelConfig, OptimConfig, StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.models import build_model
    from dptrain.strategies.base import optimizer_choice
    from dptrain.strategies.fsdp.strategy import FSDP

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
    if variant == "tutorial":
        fully_shard(model)
        optimizer = optimizer_choice(OptimConfig(), 1e-3, fused=False).build(model.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        return model, optimizer, step, False
    options = variant.split("-")[1:]
    channels_last = "nchw" not in options  # train.channels_last's default: the weights and the batches in NHWC
    wrap = next((o for o in options if o in ("block", "size", "whole")), StrategyConfig().fsdp.wrap)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    base = StrategyConfig(name="fsdp")
    cfg = replace(base, fsdp=replace(base.fsdp, wrap=wrap))
    env = DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun")
    strategy = FSDP(cfg, env, torch.device("cpu"))
    if "gloo" in options:  # FSDP2's own collectives, as before the shared-memory ones
        strategy.uses_shared_memory = lambda: False  # type: ignore[method-assign]
    wrapped = strategy.wrap(model)
    optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_choice(OptimConfig(), 1e-3, fused=True))
    global_count = BATCH_PER_RANK * world

    def dptrain_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = wrapped(x)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        strategy.backward(loss_sum, global_count)
        optimizer.step()
        (logits.argmax(1) == y).sum()

    return wrapped, optimizer, dptrain_step, channels_last


def worker(rank: int, world: int, store_path: str, variants: list[str], rounds: int, steps: int, profile: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.manual_seed(rank)
    x, y = torch.randn(BATCH_PER_RANK, 1, 28, 28), torch.randint(0, 10, (BATCH_PER_RANK,))
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    steps_of = {v: build(v, rank, world)[2:] for v in variants}
    built = {v: (lambda f, nhwc: lambda x, y: f(x_nhwc if nhwc else x, y))(*steps_of[v]) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu_times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up: lazy init, allocator
        for _ in range(3):
            built[v](x, y)
    for r in range(rounds):  # interleaved, so that drift on a shared machine spreads over every variant
        for v in variants if r % 2 == 0 else reversed(variants):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                built[v](x, y)
            cpu = torch.tensor([time.process_time() - cpu_start])
            dist.barrier()
            times[v].append((time.perf_counter() - start) / steps * 1e3)
            dist.all_reduce(cpu)
            cpu_times[v].append(cpu.item() / steps * 1e3)
    if rank == 0:
        # The fastest round too: on a machine shared with other work it is the least disturbed one.
        base, base_min = statistics.median(times[variants[0]]), min(times[variants[0]])
        for v in variants:
            med, fastest = statistics.median(times[v]), min(times[v])
            print(f"{v:>16}: median {med:6.2f} ms/step ({base / med:.2f}x the {variants[0]}'s speed), "
                  f"fastest {fastest:6.2f} ({base_min / fastest:.2f}x); CPU of all ranks "
                  f"{statistics.median(cpu_times[v]):6.2f} ms/step", flush=True)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        for v in variants:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    built[v](x, y)
            if rank == 0:
                events = prof.key_averages()
                print(f"--- {v}: per step")
                for e in events:
                    if any(k in e.key for k in ("all_gather", "reduce_scatter", "all_reduce", "c10d::", "gloo:")):
                        print(f"  {e.key:60} {e.count / steps:6.1f} calls {e.cpu_time_total / steps / 1e3:7.2f} ms")
                print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args.variants.split(","), args.rounds, args.steps,
                               args.profile), nprocs=world)


if __name__ == "__main__":
    main()
