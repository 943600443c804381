"""The tutorials' DDP script, as their users write it and run it under torchrun: torchrun's variables (LOCAL_RANK,
and RANK and WORLD_SIZE through init_process_group), a DistributedSampler, DDP (gloo on CPUs, nccl on a GPU each),
their flags (--epochs, --batch_size, --model_dir), rank 0's epoch lines, and rank 0 saving the model at the end. It
trains a small classifier on random MNIST-shaped tensors (no download). tests/slurm/test_slurm_jobs.py submits it
with `dptrain submit -- tutorial_ddp.py ...`; it also writes where each rank ran (ranks.json beside the model).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--model_dir", default="saved_models")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).to(device),
                                    device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"Epoch {epoch:02d}/{args.epochs:02d} | loss {loss.item():.4f} | world {world}", flush=True)
    where: list[object] = [None] * world
    dist.all_gather_object(where, {"rank": rank, "host": socket.gethostname(),
                                   "node": int(os.environ.get("SLURM_NODEID", "-1"))})
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
        with open(os.path.join(args.model_dir, "ranks.json"), "w") as f:
            json.dump(where, f)
    dist.destroy_process_group()
    leave()


def leave() -> None:
    """Exit at once, output flushed. This is the test's own addition, not the tutorials': with torch 2.13 on gloo, a
    rank of this script sometimes aborts in the interpreter's teardown after its work is done ("terminate called
    without an active exception", SIGABRT), under plain torchrun too (1 run in 15 here, with or without
    destroy_process_group), which would fail the launch that the tests are about."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
