"""deepspeed's torch-free half: [strategy.deepspeed] and its spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dptrain.errors import ConfigError
from dptrain.option_fields import MAY_CHANGE_AT_RESUME, REFUSED_ELSEWHERE
from dptrain.strategies.spec import StrategySpec

@dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """[strategy.deepspeed]: DeepSpeed's ZeRO stage and its own settings."""

    zero_stage: int = field(default=2, metadata=REFUSED_ELSEWHERE)
    """ZeRO stage, 1, 2 or 3; 1 shards the optimizer state over the ranks, 2 the gradients too, 3 the parameters too."""
    config: str | None = field(default=None, metadata={**MAY_CHANGE_AT_RESUME, **REFUSED_ELSEWHERE})
    """A DeepSpeed JSON file (ds_config.json) for the engine's own settings, such as ZeRO's buckets and communication
    (None: DeepSpeed's defaults). The batch, optimizer, schedule, clipping, precision and ZeRO stage stay dptrain's
    options: the file may repeat them, and a run that it contradicts is refused. A resume may name another file that
    says the same: what it says is part of the snapshot's configuration."""
    warmup_type: Literal["linear", "log"] = field(default="linear", metadata=REFUSED_ELSEWHERE)
    """The shape of the warm-up (optim.warmup_steps W): linear, s / W after s optimizer steps (dptrain's), or log,
    log(s + 1) / log(W) (DeepSpeed's WarmupLR default). A ds_config.json's WarmupLR sets it: log where the file names
    no warmup_type, as DeepSpeed reads it."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"strategy.deepspeed.zero_stage = {self.zero_stage} is not a ZeRO stage that strategy "
                              f"deepspeed runs; pick 1, 2 or 3.")


SPEC = StrategySpec(name="deepspeed", about="DeepSpeed's ZeRO engine; pip install 'dptrain[deepspeed]'",
                    table="deepspeed", options=DeepSpeedOptions)
