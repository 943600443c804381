"""The `deepspeed` engine: DeepSpeed's engine (deepspeed.initialize) on the same model, data, global batch, optimizer
and epochs.

Started by the sweep under torchrun, one process per worker, as the tutorial and lightning engines start, so that
every engine pays the same start-up (deepspeed.init_distributed reads torchrun's variables; DeepSpeed's own `deepspeed`
launcher would start the same processes through its runner, and needs pdsh or a hostfile beyond one machine):
    $ python -m torch.distributed.run --standalone --nproc-per-node 2 -m dptrain_bench.deepspeed_engine RUN_DIR
Strategies map onto ZeRO stages (STAGES): ddp -> stage 0 (replicated parameters, gradients all-reduced in buckets by
the engine: DeepSpeed's data parallelism), zero1 -> stage 1 (optimizer state sharded, as dptrain's zero1), fsdp ->
stage 3 (parameters, gradients and optimizer state sharded, as FSDP). On the CPU: DS_ACCELERATOR=cpu, set before
deepspeed is imported, and gloo; fp32 throughout. The optimizer is the same torch one as the other engines
(engines.make_optimizer), handed to deepspeed.initialize, which wraps it in its ZeRO optimizer.

What DeepSpeed does that dptrain does not, turned off: its step log (steps_per_print beyond any run), wall-clock
breakdown timers, fp16/bf16 and loss scaling; no checkpoint is saved. It gets the same tensors as dptrain (the uint8
split, normalised a batch at once on the device: data.spec.Normalise) through engines.py's loader (a DistributedSampler
seeded by train.seed, as in the tutorial engine), not deepspeed.initialize's training_data loader, whose sampler is
never given an epoch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from dptrain_bench import engines
from dptrain.config import RunConfig

ENGINE = "deepspeed"
PACKAGE = "deepspeed"
STAGES = {"ddp": 0, "zero1": 1, "fsdp": 3}  # sweep strategy -> ZeRO stage
STRATEGIES = tuple(STAGES)


def check(cfg: RunConfig) -> None:
    """One sentence when DeepSpeed is not installed, or cannot run this config the way dptrain would."""
    engines.require(ENGINE, PACKAGE)
    engines.check_plain(cfg, ENGINE, STRATEGIES)


def ds_config(cfg: RunConfig, world: int) -> dict:
    """DeepSpeed's config for a point: one micro-batch per step (no accumulation), the strategy's ZeRO stage."""
    return {"train_batch_size": cfg.train.global_batch_size,
            "train_micro_batch_size_per_gpu": cfg.train.global_batch_size // world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": STAGES[cfg.strategy.name]},
            "zero_allow_untested_optimizer": True,  # torch's SGD: ZeRO's list of tested optimizers has Adam(W) only
            "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "steps_per_print": 2**62, "wall_clock_breakdown": False}


def main(run_dir: Path) -> None:
    cfg = engines.run_config(run_dir)
    device = engines.pick_device(cfg)
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported: else it looks for CUDA
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from dptrain.data.catalog import load
    from dptrain.data.spec import Normalise
    from dptrain.models import build_model
    from dptrain.strategies.deepspeed.strategy import skip_shared_memory_op

    skip_shared_memory_op()  # its build costs a minute on a fresh CPU machine and no training step uses it
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    spec, train, test = load(cfg.data)
    loader = engines.train_loader(TensorDataset(train.images, train.labels), cfg, rank, world)
    test_batches = engines.eval_batches(test.images, test.labels, cfg.train.eval_batch_size, rank, world)
    normalize = Normalise(spec.mean, spec.std, device)
    model = build_model(cfg.model, spec.shape, spec.num_classes).to(device)
    engine, *_ = deepspeed.initialize(model=model, optimizer=engines.make_optimizer(cfg, model.parameters()),
                                      config=ds_config(cfg, world))
    run_files = engines.RunFiles(run_dir, rank, ENGINE)
    run_files.run_start(cfg, world, device, len(loader), zero_stage=STAGES[cfg.strategy.name])
    run_files.env(device, world, {"deepspeed": deepspeed.__version__})
    engines.train_epochs(cfg, engine, training_step(engine), loader, test_batches, normalize, device, world, run_files,
                         prepare=normalize)
    engines.leave_world()


def training_step(engine: Any) -> engines.TrainingStep:
    """DeepSpeed's step: engine.backward and engine.step (its all-reduce or ZeRO's reduce-scatter, the optimizer, and
    the gradients zeroed)."""
    import torch.nn.functional as F

    def step(x: Any, y: Any) -> tuple[Any, Any]:
        logits = engine(x)
        loss = F.cross_entropy(logits, y)
        engine.backward(loss)
        engine.step()
        return loss, logits

    return step


if __name__ == "__main__":
    main(Path(sys.argv[1]))
