"""zero1's torch-free half: its spec (it reads ddp's table, [strategy.ddp])."""

from __future__ import annotations

from dptrain.strategies.ddp.options import BUFFERS_EACH_FORWARD, GRADIENTS_IN_BUCKETS
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic

SPEC = StrategySpec(name="zero1", about="ZeRO-1: DDP with the optimizer state sharded over the ranks", table="ddp",
                    traffic=Traffic(exchanges=(GRADIENTS_IN_BUCKETS, BUFFERS_EACH_FORWARD,
                                               Exchange("all_gather", "parameters", "after", "one")),  # each rank's updated partition, to all
                                    sharded=("optim",)))
