"""The reference point: the tutorials' loop (DataLoader + DistributedSampler + DDP), timed like dptrain.

Run under torchrun (which, like the tutorials, sets OMP_NUM_THREADS=1 per worker):
    torchrun --standalone --nproc-per-node 2 perf/plain_ddp.py --steps 300 --global-batch 128
Prints one JSON line with images/s over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dptrain.config import DataConfig
from dptrain.data.catalog import load


class TutorialCNN(torch.nn.Module):
    """The tutorials' CNN_MNIST as they write it (kept here, so that dptrain's changes never reach the baseline)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, 1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.dropout2 = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(9216, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))


class NormalizedImages(Dataset):
    """Per-sample conversion and normalisation, as ToTensor + Normalize do in the tutorials."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float) -> None:
        self.images, self.labels, self.mean, self.std = images, labels, mean, std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return (self.images[i].float() / 255 - self.mean) / self.std, int(self.labels[i])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--data", default="fashion-mnist")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    spec, train, _ = load(DataConfig(name=args.data))
    dataset = NormalizedImages(train.images, train.labels, spec.mean[0], spec.std[0])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler, num_workers=0)
    torch.manual_seed(0)
    model = DistributedDataParallel(TutorialCNN())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    dist.barrier()
    start, step, images = time.perf_counter(), 0, 0
    while step < args.steps:
        sampler.set_epoch(step)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step, images = step + 1, images + len(y) * world
            if step == args.steps:
                break
    dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"images_per_s": images / elapsed, "steps": step, "seconds": elapsed,
                          "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
