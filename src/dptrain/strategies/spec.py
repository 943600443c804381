"""What the configuration, the strategies and the measuring lab know of a strategy without torch: its spec (name, the
table of options it reads, its rules) and its traffic, its collectives and memory per step as data, which the lab's
scaling model times. Each strategy's options.py makes one StrategySpec (strategies/catalog.py gathers them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


# ---------------------------------------------------------------- what a step sends and holds, as data

Part = Literal["params", "grads", "optim"]


@dataclass(frozen=True)
class Exchange:
    """One collective a step runs, as the scaling model (dptrain_bench/scaling_model.py) times it."""

    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"]
    """A collective of link.ring_terms, or send (point to point: alpha + bytes / B)."""
    carries: Literal["gradients", "parameters", "buffers"]
    """Whose bytes: the gradients' or the parameters' (param_bytes), the module's buffers (buffer_bytes)."""
    phase: Literal["forward", "backward", "after"]
    """When: in forward or backward (it may hide behind that compute), or after (the optimizer's, exposed whole)."""
    calls: Literal["one", "buckets", "units", "peers"]
    """How the bytes are cut into calls: one call; DDP's gradient buckets (strategy.ddp.bucket_mb), after the comm
    hook's compression; one call per wrap unit (FSDP), each a unit's share; one call of all of them per other rank."""
    dtype: Literal["param_dtype", "reduce_dtype"] | None = None
    """Mixed precision: the option whose dtype its elements travel in (None: the bytes as they are)."""
    when: str | None = None
    """A true/false option of the strategy's table that must be true for it to run (None: always)."""
    sent_by_busiest: bool = True
    """Whether the busiest rank sends it (a parameter server receives the workers' gradients, and sends the copies)."""
    every: str | None = None
    """An integer option of the strategy's table: the steps from one run of it to the next (local SGD's and DiLoCo's
    period H: their exchange runs once every H steps, its time and bytes spread over them); None: every step."""
    behind: str | None = None
    """An integer option of the strategy's table: the steps each run of it may go on behind (DiLoCo's overlap_steps:
    its all-reduce is waited for that many steps after it starts), the rank keeping a copy of what it sent meanwhile;
    None: it is waited for at once."""


@dataclass(frozen=True)
class Traffic:
    """A strategy's collectives and memory per step, for the scaling model: what it sends, when, and what each rank
    holds only 1/N of. An empty traffic is one process's (single)."""

    exchanges: tuple[Exchange, ...] = ()
    sharded: tuple[Part, ...] = ()
    """What each rank holds 1/N of between steps (the rest it holds whole)."""
    param_copies: int = 1
    """Copies of the model's parameters each rank holds: 2 where it keeps the run's model beside its own (local SGD's
    and DiLoCo's consensus)."""
    gathers_params: bool = False
    """It gathers its sharded parameters to compute: one wrap unit at a time where it reshards them after forward,
    all of them from forward to the end of backward where it does not."""

    @property
    def bucketed(self) -> bool:
        """Whether its gradients travel in DDP's buckets, which strategy.ddp.bucket_mb and comm_hook shape."""
        return any(exchange.calls == "buckets" for exchange in self.exchanges)


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """What config, the strategies and the measuring lab know of a strategy without torch."""

    name: str
    """strategy.name's value; its folder under strategies/ is named so."""
    about: str
    """What it is, in a few words: strategy.name's help lists it."""
    table: str | None = None
    """The [strategy.<table>] of options it reads, None: none; several strategies may share one (zero1 reads ddp's)."""
    options: type | None = None
    """The frozen dataclass of its table, where the table is its own (None where it reads another's, or none)."""
    compile_refusal: str | None = None
    """Why train.compile cannot run with it, as the sentence that refuses it (None: it can)."""
    traffic: Traffic | None = None
    """Its collectives and memory per step; None: the scaling model has no formulas for it (its engine's own)."""
