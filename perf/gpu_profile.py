"""Where a training step's time goes on one GPU: dptrain's epoch against a bare eager loop.

Builds the run in this process exactly as a worker does (world size 1), then prints
  - dptrain's epoch time (whole epochs, after a warm-up epoch),
  - the bare loop's time per step on one fixed batch (model, loss, backward, Adam), with
    Adam's foreach and fused implementations,
  - a profile of 50 of dptrain's steps (through Trainer.on_step): launches per step and the top operators by host
    time.

    python perf/gpu_profile.py --data.root data [--train.cuda_graph true]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from dptrain import config as config_mod
from dptrain.distributed.env import DistEnv
from dptrain.distributed.failures import Phase
from dptrain.metrics import EventLog
from dptrain.train import build_trainer
from dptrain.worker import join_world

PROFILED_STEPS = 50


def bare_ms_per_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, fused: bool, steps: int = 300) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
    for i in range(steps + 30):
        if i == 30:
            torch.cuda.synchronize()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels, reduction="sum")
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    args = sys.argv[1:] + ["--strategy.name", "single", "--train.epochs", "4", "--train.resume", "never", "--output.dir", "/tmp/gpu-profile"]
    cfg = config_mod.load(None, [(key.removeprefix("--"), value) for key, value in zip(args[::2], args[1::2])])
    env = DistEnv.from_environ()
    phase = Phase(env.global_rank)
    device, _ = join_world(cfg, env, phase)
    trainer = build_trainer(cfg, env, device, EventLog([]), phase)
    for epoch in range(3):
        result = trainer.run_epoch(epoch)
        print(f"dptrain epoch {epoch + 1}: {result['epoch_time_s']:.3f} s, {result['samples_per_s']:.0f} images/s "
              f"({len(trainer.train_loader)} steps, {result['epoch_time_s'] / len(trainer.train_loader) * 1e3:.2f} ms/step)")

    batch = next(iter(trainer.train_loader.epoch_batches(0)))
    model = trainer.strategy.eval_module
    for fused in (False, True):
        ms = bare_ms_per_step(model, batch.images, batch.labels, fused)
        print(f"bare eager step ({'fused' if fused else 'foreach'} Adam): {ms:.2f} ms/step, epoch ~{ms * len(trainer.train_loader) / 1e3:.3f} s")

    from torch.profiler import ProfilerActivity, profile, schedule

    # The 4th epoch's steps 2 to 51 (step 1 warms the profiler up): the profiler moves on at each step's end through
    # the loop's on_step hook, and records nothing after them (the rest of the epoch runs unrecorded).
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)) as prof:
        trainer.on_step = lambda state: prof.step()
        trainer.run_epoch(3)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    copies = sum(e.count for e in events if e.key.startswith("cudaMemcpy"))
    syncs = sum(e.count for e in events if "Synchronize" in e.key)
    print(f"per step: {launches / PROFILED_STEPS:.1f} kernel launches, {copies / PROFILED_STEPS:.1f} memcpy calls, "
          f"{syncs / PROFILED_STEPS:.2f} synchronizations")
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
