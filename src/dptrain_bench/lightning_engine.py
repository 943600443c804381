"""The `lightning` engine: Lightning's Trainer on the same model, data, global batch, optimizer and epochs.

Started by the sweep under torchrun, one process per worker, as Lightning's users start multi-node jobs (Lightning
reads torchrun's variables: TorchElasticEnvironment), and as the tutorial and deepspeed engines start, so that every
engine pays the same start-up; Lightning's own launcher would re-run the script in subprocesses of its own instead:
    $ python -m torch.distributed.run --standalone --nproc-per-node 2 -m dptrain_bench.lightning_engine RUN_DIR
Strategies: ddp -> Lightning's "ddp" (DistributedDataParallel); fsdp -> ModelParallelStrategy, whose configure_model
shards the model with FSDP2's fully_shard, as dptrain's and the tutorial's fsdp do (Lightning's "fsdp", FSDP1,
refuses the CPU).

What Lightning does that dptrain does not, turned off so that the comparison is fair: Trainer(barebones=True) (no
checkpointing, no logger, no progress bar, no model summary, no sanity validation before training, no logging every
log_every_n_steps), and use_distributed_sampler=False: the loaders are engines.py's, the train one a DistributedSampler
seeded by train.seed, given the tutorial engine's epochs, so Lightning sees the tutorial's batches; the eval one every
test sample once (Lightning's own sampler would pad the split with repeated samples). Lightning gets the same tensors
as dptrain: the uint8 split in a TensorDataset, each batch normalised on the device in on_after_batch_transfer
(data.spec.Normalise). The epoch clock (engines.EpochMeter) runs from on_train_epoch_start to the start of validation; the
eval loss and accuracy come from Lightning's validation loop.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptrain_bench import engines
from dptrain.config import RunConfig

if TYPE_CHECKING:
    from dptrain.data.spec import Normalise

ENGINE = "lightning"
PACKAGE = "lightning"
STRATEGIES = ("ddp", "fsdp")


def check(cfg: RunConfig) -> None:
    """One sentence when Lightning is not installed, or cannot run this config the way dptrain would."""
    engines.require(ENGINE, PACKAGE)
    engines.check_plain(cfg, ENGINE, STRATEGIES)


def main(run_dir: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from torch.utils.data import DataLoader, TensorDataset

    from dptrain.data.catalog import load
    from dptrain.data.spec import Normalise
    from dptrain.models import build_model

    cfg = engines.run_config(run_dir)
    device = engines.pick_device(cfg)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # torchrun's; Lightning reads the same
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(cfg.train.seed)
    spec, train, test = load(cfg.data)
    loader = engines.train_loader(TensorDataset(train.images, train.labels), cfg, rank, world)
    test_batches = engines.eval_batches(test.images, test.labels, cfg.train.eval_batch_size, rank, world)
    run_files = engines.RunFiles(run_dir, rank, ENGINE)
    module = classifier(build_model(cfg.model, spec.shape, spec.num_classes), cfg, device, world,
                        Normalise(spec.mean, spec.std, device), run_files)
    trainer = L.Trainer(accelerator="cuda" if device.type == "cuda" else "cpu", devices=local_world,
                        num_nodes=world // local_world, strategy=strategy(cfg.strategy.name, world),
                        max_epochs=cfg.train.epochs, precision="32-true", barebones=True,
                        use_distributed_sampler=False,
                        plugins=[TorchElasticEnvironment()])  # torchrun's ranks, even inside a SLURM allocation
    run_files.run_start(cfg, world, device, len(loader))
    run_files.env(device, world, {"lightning": L.__version__})
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=DataLoader(test_batches, batch_size=None))
    run_files.write({"event": "run_end", "step": trainer.global_step})
    engines.leave_world()


def strategy(name: str, world: int) -> Any:
    """ddp: Lightning's "ddp". fsdp: ModelParallelStrategy, whose configure_model shards the model with FSDP2's
    fully_shard as dptrain's and the tutorial's fsdp do (Lightning's "fsdp", FSDP1, refuses the CPU)."""
    if name == "ddp":
        return "ddp"
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def classifier(net: Any, cfg: RunConfig, device: Any, world: int, normalize: Normalise, run_files: engines.RunFiles) -> Any:
    """The LightningModule around net: automatic optimisation, and the epoch's clock and metrics in its hooks.
    (A class made here: the sweep imports this module to check a sweep, and must not import Lightning to do so.)"""
    import lightning as L
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.meter, self.evaluated = engines.EpochMeter(device, world), engines.Totals()
            self.train_record: dict = {}
            self.eval_record: dict = {}
            self.eval_start_s = 0.0

        def forward(self, x: Any) -> Any:
            return self.net(x)

        def configure_model(self) -> None:
            """fsdp: shard the model (Lightning calls this hook under every strategy, on the model on its device)."""
            from torch.distributed.fsdp import fully_shard

            if cfg.strategy.name == "fsdp":
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self) -> Any:
            return engines.make_optimizer(cfg, self.parameters())  # after wrapping: fsdp's are the sharded ones

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            x, y = batch  # on the device, train and validation batches alike
            return normalize(x), y

        def on_train_epoch_start(self) -> None:
            # Lightning gave the sampler epoch 0, 1, ...; the other engines' 1, 2, ...: the same batches as theirs
            self.trainer.train_dataloader.sampler.set_epoch(self.current_epoch + 1)
            self.eval_record = {}
            self.meter.start()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            self.meter.add(loss, logits, y)
            return loss

        def end_training(self) -> None:
            """Stop the clock once per epoch: at the start of validation, or at the epoch's end without one."""
            if self.meter.running:
                self.meter.stop()
                self.train_record = self.meter.record()

        def on_validation_start(self) -> None:
            self.end_training()
            self.evaluated, self.eval_start_s = engines.Totals(), time.perf_counter()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            self.evaluated.add(F.cross_entropy(logits, y, reduction="sum").item(), logits, y)

        def on_validation_epoch_end(self) -> None:
            self.eval_record = engines.eval_record(self.evaluated, time.perf_counter() - self.eval_start_s)

        def on_train_epoch_end(self) -> None:
            self.end_training()
            run_files.write({"event": "epoch", "epoch": self.current_epoch + 1, "step": self.global_step,
                        **self.train_record, **self.eval_record})

    return Classifier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
