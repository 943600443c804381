"""dp's torch-free half: [strategy.dp] and its spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.errors import ConfigError
from dptrain.option_fields import MAY_CHANGE_AT_RESUME, REFUSED_ELSEWHERE
from dptrain.strategies.spec import StrategySpec

@dataclass(frozen=True, kw_only=True)
class DPOptions:
    """[strategy.dp]: the GPUs nn.DataParallel drives."""

    devices: tuple[int, ...] = field(default=(), metadata={**MAY_CHANGE_AT_RESUME, **REFUSED_ELSEWHERE})
    """GPU indices as torch numbers the visible ones (after CUDA_VISIBLE_DEVICES), e.g. 0,1; the first holds the model,
    the optimizer and the gathered outputs. Empty: every visible GPU. The sums are the same on any set."""

    def __post_init__(self) -> None:
        if any(index < 0 for index in self.devices):
            raise ConfigError(f"strategy.dp.devices = {list(self.devices)} holds a negative index; GPUs are numbered "
                              f"from 0, e.g. --strategy.dp.devices 0,1.")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"strategy.dp.devices = {list(self.devices)} names a GPU twice; name each once.")


SPEC = StrategySpec(name="dp", about="nn.DataParallel: one process drives every visible GPU", table="dp",
                    options=DPOptions,
                    compile_refusal="train.compile cannot compile through nn.DataParallel's per-step replication; use "
                                    "--strategy.name ddp (one process per GPU), or drop train.compile.")
