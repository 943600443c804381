"""The tutorials' Lightning script, as their users write it (`sbatch run-gpu8-dist.sh mnist_lightning_ddp.py --gpus=4
--nodes=2 --epochs=100`): a LightningModule, a plain DataLoader (Lightning adds the DistributedSampler), a Trainer
given --gpus devices a node and --nodes nodes with strategy "ddp", and the model saved at the end by rank 0. Under
torchrun Lightning reads torchrun's variables (its TorchElasticEnvironment, which it prefers to SLURM's), so the same
script runs under `dptrain submit -- tutorial_lightning.py ...` (one torchrun per node) and `dptrain train -- ...`.
On a machine without GPUs --gpus counts CPU processes a node. It trains on random MNIST-shaped tensors (no download)
and writes where each rank ran (ranks.json beside the model).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            loss = self.trainer.callback_metrics["train_loss"].item()
            print(f"Epoch {self.current_epoch + 1:02d} | loss {loss:.4f} | world {self.trainer.world_size}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--model_dir", default="saved_models")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
    model = Classifier(lr=0.1)
    trainer = L.Trainer(accelerator="auto", devices=args.gpus, num_nodes=args.nodes, strategy="ddp",
                        max_epochs=args.epochs, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    where = [None] * trainer.world_size
    torch.distributed.all_gather_object(where, {"rank": trainer.global_rank, "host": socket.gethostname(),
                                                "node": int(os.environ.get("SLURM_NODEID", "-1"))})
    if trainer.is_global_zero:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.net.state_dict(), os.path.join(args.model_dir, "model.pt"))
        with open(os.path.join(args.model_dir, "ranks.json"), "w") as f:
            json.dump(where, f)
    torch.distributed.destroy_process_group()
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
