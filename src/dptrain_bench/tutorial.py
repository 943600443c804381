"""The `tutorial` engine: the tutorials' plain loop (DataLoader + DistributedSampler + DDP or FSDP2), as a baseline.

Started by the sweep under torchrun, one process per worker:
    $ python -m torch.distributed.run --standalone --nproc-per-node 2 -m dptrain_bench.tutorial RUN_DIR
It trains what RUN_DIR/config.toml says (the same model, data, global batch, optimizer and epochs as the dptrain
points) and writes metrics.jsonl events and env.json of the shape dptrain writes (engines.py), so that collect reads
both alike. Per-sample normalisation, a Python DataLoader and no channels_last: what the tutorials do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dptrain_bench import engines
from dptrain.config import RunConfig

ENGINE = "tutorial"
STRATEGIES = ("ddp", "fsdp")


def check(cfg: RunConfig) -> None:
    """One sentence when the plain loop cannot run this config the way dptrain would."""
    engines.check_plain(cfg, ENGINE, STRATEGIES)


def main(run_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from dptrain.data.catalog import load
    from dptrain.data.spec import Normalise
    from dptrain.models import build_model

    cfg = engines.run_config(run_dir)
    device = engines.pick_device(cfg)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    spec, train, test = load(cfg.data)
    loader = engines.train_loader(Normalized(train, spec.mean, spec.std), cfg, rank, world)
    test_batches = engines.eval_batches(test.images, test.labels, cfg.train.eval_batch_size, rank, world)
    normalize = Normalise(spec.mean, spec.std, device)  # evaluation only: training normalises per sample
    model = wrap(build_model(cfg.model, spec.shape, spec.num_classes).to(device), cfg.strategy.name, device)
    optimizer = engines.make_optimizer(cfg, model.parameters())
    run_files = engines.RunFiles(run_dir, rank, ENGINE)
    run_files.run_start(cfg, world, device, len(loader))
    run_files.env(device, world)
    engines.train_epochs(cfg, model, training_step(model, optimizer), loader, test_batches, normalize, device, world,
                         run_files)
    engines.leave_world()


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


def training_step(model: Any, optimizer: Any) -> engines.TrainingStep:
    """The plain loop's step: the mean loss's backward (DDP's all-reduce, or FSDP's reduce-scatter), the update."""
    import torch.nn.functional as F

    def step(x: Any, y: Any) -> tuple[Any, Any]:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        return loss, logits

    return step


if __name__ == "__main__":
    main(Path(sys.argv[1]))
