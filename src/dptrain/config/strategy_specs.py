"""Each strategy's torch-free half: its name, the class that runs it, the table of its own options, the rules on them
that need no torch, and its collectives and memory per step as data. SPECS is the one registry of strategy names:
config (strategy.name's choices, the tables' rules), the strategies (STRATEGIES, built from it) and the measuring
lab's scaling model (the traffic) all read it.

It lives in config because config sits below the strategies in the import layers (pyproject.toml) and needs the
names and tables to check a configuration before torch is imported; strategies/<name>.py holds the torch half,
whose class says `spec = SPECS["<name>"]`. docs/extending.md says how to add one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from dptrain.config.fields import MAY_CHANGE_AT_RESUME, REFUSED_ELSEWHERE, may_change_at_resume, positive
from dptrain.errors import ConfigError


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


@dataclass(frozen=True)
class Traffic:
    """A strategy's collectives and memory per step, for the scaling model: what it sends, when, and what each rank
    holds only 1/N of. An empty traffic is one process's (single)."""

    exchanges: tuple[Exchange, ...] = ()
    sharded: tuple[Part, ...] = ()
    """What each rank holds 1/N of between steps (the rest it holds whole)."""
    gathers_params: bool = False
    """It gathers its sharded parameters to compute: one wrap unit at a time where it reshards them after forward,
    all of them from forward to the end of backward where it does not."""

    @property
    def bucketed(self) -> bool:
        """Whether its gradients travel in DDP's buckets, which strategy.ddp.bucket_mb and comm_hook shape."""
        return any(exchange.calls == "buckets" for exchange in self.exchanges)


# ---------------------------------------------------------------- the tables of the strategies' own options

CommHook = Literal["allreduce", "fp16", "bf16", "powersgd", "ring"]
"""DDP's gradient communication: allreduce (DDP's own), and the hooks of strategies.comm_hooks, each installed by its
_install_<name>."""
FloatDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""A floating dtype by torch's name (strategies.fsdp.DTYPES: torch.<name>), or auto: the parameters' own."""


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """[strategy.ddp]: how ddp and zero1 (DDP with a sharded optimizer) send their gradients."""

    comm_hook: CommHook = field(default="allreduce", metadata=REFUSED_ELSEWHERE)
    """Gradient communication: allreduce, fp16 or bf16 compression, powersgd, or ring (hand-written)."""
    shared_memory: bool = True
    """With comm_hook allreduce, on CPU ranks that all run on one host: sum the gradients through a buffer in /dev/shm
    instead of gloo's TCP loopback (the same sum; a tenth of the time for the tutorials' CNN). Where it cannot be set
    up, gloo's all-reduce, with one log line saying why. On several hosts with several ranks a host: within each host
    through it, then across hosts by one rank a host (less traffic on each host's link)."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation (higher: closer to exact, more traffic)."""
    bucket_mb: float | None = may_change_at_resume(None)
    """The most MiB of gradients DDP sends in one message; backward's later layers wait less with smaller buckets, a
    slow link more with many small ones. None: one bucket for the shared-memory sum on one host (it overlaps
    nothing), else DDP's own (25 MiB, its first 1 MiB). `dptrain bench tune` tries a few."""

    update_in_next_forward: bool = may_change_at_resume(False)
    """Leave each bucket's all-reduce (or fp16, bf16, PowerSGD hook) running when backward ends and apply each layer's
    update just before the next forward reaches it, the first layers' buckets over a second channel: the next
    forward's first layers then run while the last layers' gradients still travel. The same math and bytes; no
    snapshot holds half an update. ddp only, not with comm_hook ring, train.grad_clip or train.compile; off by default
    (measured in docs/benchmark.md)."""

    def __post_init__(self) -> None:
        positive(self.powersgd_rank, "strategy.ddp.powersgd_rank")
        if self.bucket_mb is not None:
            positive(self.bucket_mb, "strategy.ddp.bucket_mb")


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """[strategy.fsdp]: FSDP2's resharding and mixed precision."""

    reshard_after_forward: bool = True
    """true frees gathered parameters after forward (ZeRO-3 / FULL_SHARD), false keeps them (ZeRO-2)."""
    param_dtype: FloatDtype = "auto"
    """Mixed precision: dtype of the gathered parameters used in forward and backward (auto: the parameters' own)."""
    reduce_dtype: FloatDtype = "auto"
    """Mixed precision: dtype of the gradient reduce-scatter (auto: the parameters' own)."""
    wrap: Literal["block", "size", "whole"] = may_change_at_resume("block")
    """How the model is cut into units that gather and free their parameters together: block (each child of the root
    that holds parameters, a ResNet stage's blocks one by one), size (the innermost modules holding wrap_min_params
    parameters or more, as torch's size-based policy), whole (one unit: the fewest collectives, the least memory
    saved). The sums are the same: a snapshot resumes under another wrap."""
    wrap_min_params: int = may_change_at_resume(100_000)
    """With wrap size: the parameters a unit holds at least (those of its submodules not wrapped already)."""

    def __post_init__(self) -> None:
        positive(self.wrap_min_params, "strategy.fsdp.wrap_min_params")


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


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """[strategy.ps]: the parameter server's roles."""

    dedicated_server: bool = False
    """Rank 0 only serves (the data is split across ranks 1..N-1) instead of also training."""


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


# ---------------------------------------------------------------- the registry

@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """What config, the strategies and the measuring lab know of a strategy without torch."""

    name: str
    runs: str
    """The Strategy class that runs it, as `package.module:Class` (imported by dptrain.strategies only)."""
    table: str | None = None
    """The [strategy.<table>] of options it reads (a field of StrategyConfig), None: none; several strategies may
    share one (zero1 reads ddp's)."""
    compile_refusal: str | None = None
    """Why train.compile cannot run with it, as the sentence that refuses it (None: it can)."""
    traffic: Traffic | None = None
    """Its collectives and memory per step; None: the scaling model has no formulas for it (its engine's own)."""


_GRADIENTS_IN_BUCKETS = Exchange("all_reduce", "gradients", "backward", "buckets")
_BUFFERS_EACH_FORWARD = Exchange("broadcast", "buffers", "forward", "one")  # DDP's broadcast_buffers

# One line a strategy; the order is strategy.name's (--help lists its choices so).
SPECS: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec(name="ddp", runs="dptrain.strategies.ddp:DDP", table="ddp",
                 traffic=Traffic(exchanges=(_GRADIENTS_IN_BUCKETS, _BUFFERS_EACH_FORWARD))),
    StrategySpec(name="fsdp", runs="dptrain.strategies.fsdp:FSDP", table="fsdp", traffic=Traffic(
        exchanges=(Exchange("all_gather", "parameters", "forward", "units", dtype="param_dtype"),
                   Exchange("all_gather", "parameters", "backward", "units", dtype="param_dtype",
                            when="reshard_after_forward"),
                   Exchange("reduce_scatter", "gradients", "backward", "units", dtype="reduce_dtype")),
        sharded=("params", "grads", "optim"), gathers_params=True)),
    StrategySpec(name="zero1", runs="dptrain.strategies.zero:Zero1", table="ddp", traffic=Traffic(
        exchanges=(_GRADIENTS_IN_BUCKETS, _BUFFERS_EACH_FORWARD,
                   Exchange("all_gather", "parameters", "after", "one")),  # each rank's updated partition, to all
        sharded=("optim",))),
    StrategySpec(name="ps", runs="dptrain.strategies.parameter_server:ParameterServer", table="ps", traffic=Traffic(
        # over the server's link, one worker after the other: nothing hides it
        exchanges=(Exchange("send", "gradients", "after", "peers", sent_by_busiest=False),  # push: N-1 gradients in
                   Exchange("send", "parameters", "after", "peers")))),  # pull: N-1 parameter copies out
    StrategySpec(name="dp", runs="dptrain.strategies.dp:DataParallel", table="dp",
                 compile_refusal="train.compile cannot compile through nn.DataParallel's per-step replication; use "
                                 "--strategy.name ddp (one process per GPU), or drop train.compile."),
    StrategySpec(name="single", runs="dptrain.strategies.single:SingleDevice", traffic=Traffic()),
    StrategySpec(name="deepspeed", runs="dptrain.strategies.deepspeed:DeepSpeed", table="deepspeed"),
)}

StrategyName = Literal[tuple(SPECS)]  # type: ignore[valid-type]  # SPECS' names: the one list of them
"""The strategies' names, as strategy.name takes them."""


def readers_of(table: str) -> tuple[str, ...]:
    """The strategies that read [strategy.<table>]."""
    return tuple(name for name, spec in SPECS.items() if spec.table == table)


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    name: StrategyName = "ddp"
    """ddp, fsdp (FSDP2), zero1 (DDP + sharded optimizer state), ps (parameter server),
    dp (nn.DataParallel, one process), single (one process, one device), deepspeed (DeepSpeed's ZeRO engine;
    pip install 'dptrain[deepspeed]')."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    dp: DPOptions = field(default_factory=DPOptions)
    ps: PSOptions = field(default_factory=PSOptions)
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)

    @property
    def spec(self) -> StrategySpec:
        """The chosen strategy's spec."""
        return SPECS[self.name]

    def __post_init__(self) -> None:
        # A table's options belong to the strategies that read it; set for another strategy, those marked
        # REFUSED_ELSEWHERE are refused (the others are left unread, so that one config serves a sweep of strategies).
        for table, options in self.tables().items():
            readers = readers_of(table)
            if self.name in readers:
                continue
            for f in dataclasses.fields(options):  # type: ignore[arg-type]  # every table is a dataclass
                value = getattr(options, f.name)
                if f.metadata.get("refused_elsewhere") and value != f.default:
                    who = " and ".join(readers)
                    who = f"strategy {who}" if len(readers) == 1 else who
                    raise ConfigError(f"strategy.{table}.{f.name} {value} applies to {who} only, not {self.name}; "
                                      f"drop it or use --strategy.name {readers[0]}.")

    def tables(self) -> dict[str, object]:
        """Table name -> its options, for every strategy that has options of its own."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
