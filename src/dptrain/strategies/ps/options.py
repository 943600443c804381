"""ps's torch-free half: [strategy.ps] and its spec."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.strategies.spec import Exchange, StrategySpec, Traffic

@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """[strategy.ps]: the parameter server's roles."""

    dedicated_server: bool = False
    """Rank 0 only serves (the data is split across ranks 1..N-1) instead of also training."""


SPEC = StrategySpec(name="ps", about="a parameter server on send/recv", table="ps", options=PSOptions, traffic=Traffic(
    # over the server's link, one worker after the other: nothing hides it
    exchanges=(Exchange("send", "gradients", "after", "peers", sent_by_busiest=False),  # push: N-1 gradients in
               Exchange("send", "parameters", "after", "peers"))))  # pull: N-1 parameter copies out
