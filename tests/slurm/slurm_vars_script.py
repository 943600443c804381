"""A training script of the kind that takes its rank from SLURM's own variables (issue 42's seed 004: the tutorials'
`srun python train.py` habit), not torchrun's: it joins the world at MASTER_ADDR:MASTER_PORT with SLURM_PROCID and
SLURM_NTASKS, all-reduces its rank + 1, and writes what it saw into the folder given, one file per rank."""

import json
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank}/{world}", flush=True)
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": total.item(), "RANK": os.environ.get("RANK"),
               "WORLD_SIZE": os.environ.get("WORLD_SIZE"), "node": int(os.environ["SLURM_NODEID"])}, f)
dist.destroy_process_group()
