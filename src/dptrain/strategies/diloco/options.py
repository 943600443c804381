"""diloco's torch-free half: [strategy.diloco] and its spec."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.errors import ConfigError
from dptrain.option_fields import not_negative, positive
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic


@dataclass(frozen=True, kw_only=True)
class DiLoCoOptions:
    """[strategy.diloco]: the inner steps between two outer steps, and the outer optimizer (DiLoCo, Douillard et al.
    2023: its defaults are the paper's)."""

    period: int = 32
    """Inner steps between two outer steps (H): each rank runs the configured optimizer (optim.*) on its own share
    of every global batch for H steps, then the ranks average their pseudo-gradients (the global model less their
    own) and take one outer step on the global model, from which every rank goes on."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate (SGD on the averaged pseudo-gradient)."""
    outer_momentum: float = 0.9
    """The outer optimizer's momentum (0: plain SGD; with period 1 and outer_lr 1, the same model as ddp)."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer step, as the paper's; applies where outer_momentum is above 0."""
    overlap_steps: int = 0
    """Inner steps the outer exchange runs behind (streaming): the pseudo-gradient's all-reduce starts after a period's
    last inner step and is waited for this many inner steps later, when the outer step moves the global model and
    each rank goes on from it plus what it learnt meanwhile; 0: each rank waits for it at once (the paper's DiLoCo).
    Fewer than period."""

    def __post_init__(self) -> None:
        positive(self.period, "strategy.diloco.period")
        positive(self.outer_lr, "strategy.diloco.outer_lr")
        not_negative(self.outer_momentum, "strategy.diloco.outer_momentum")
        not_negative(self.overlap_steps, "strategy.diloco.overlap_steps")
        if self.overlap_steps >= self.period:
            raise ConfigError(f"strategy.diloco.overlap_steps = {self.overlap_steps} must be less than "
                              f"strategy.diloco.period = {self.period} (a period's outer step comes before the next "
                              f"one's exchange); lower it or raise the period.")


SPEC = StrategySpec(name="diloco", about="DiLoCo: inner steps alone, an outer Nesterov step on the averaged "
                                         "pseudo-gradient every few steps, not exact",
                    table="diloco", options=DiLoCoOptions, traffic=Traffic(exchanges=(
                        Exchange("all_reduce", "parameters", "after", "one", every="period",  # the pseudo-gradient
                                 behind="overlap_steps"),
                        Exchange("all_reduce", "buffers", "after", "one", every="period", behind="overlap_steps")),
                        param_copies=2))
