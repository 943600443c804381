"""local_sgd's torch-free half: [strategy.local_sgd] and its spec."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.option_fields import not_negative, positive
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic


@dataclass(frozen=True, kw_only=True)
class LocalSGDOptions:
    """[strategy.local_sgd]: how often the ranks average their models, and from which step."""

    period: int = 16
    """Steps between two averagings (H): each rank steps on its own share of every global batch, and every H steps
    the ranks average their parameters and BatchNorm statistics. 1 averages after every step (with SGD, the same
    model as ddp); larger sends H times fewer bytes and drifts further between averagings (not exact)."""
    post_local_steps: int = 0
    """Post-local SGD: the first steps run as exact DDP (every step's gradients all-reduced, torch's
    post_localSGD_hook), the averaging every period steps only after them; 0: local from the first step."""

    def __post_init__(self) -> None:
        positive(self.period, "strategy.local_sgd.period")
        not_negative(self.post_local_steps, "strategy.local_sgd.post_local_steps")


# One all-reduce of every parameter (and, where the model has them, of its BatchNorm statistics) after the step,
# once every `period` steps; the first post_local_steps steps' DDP all-reduce is left out: the model times the steps
# after them.
AVERAGED_EVERY_PERIOD = (Exchange("all_reduce", "parameters", "after", "one", every="period"),
                         Exchange("all_reduce", "buffers", "after", "one", every="period"))

SPEC = StrategySpec(name="local_sgd", about="local SGD: each rank steps alone, the models averaged every few steps, "
                                            "not exact",
                    table="local_sgd", options=LocalSGDOptions, traffic=Traffic(exchanges=AVERAGED_EVERY_PERIOD,
                                                                                    param_copies=2))
