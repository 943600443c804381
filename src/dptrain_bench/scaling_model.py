"""The scaling model: a step's time, images/s, efficiency and memory per rank of a strategy on N nodes, from the
measured compute per sample, the strategy's communication and a link (measured in link.json, or a named one).
Pure functions, no torch; docs/scaling-model.md writes the formulas out.

    step_s     = compute_s + comm_cpu_s + own_cpu_s + exposed_s
    compute_s  = batch x compute_s_per_sample / (N x rank_share(R))    N = nodes x R ranks, batch the global one
    comm_cpu_s = bytes a rank sends x comm_cpu_s_per_byte / min(1, its cores)    CPU ranks across nodes; else 0
    own_cpu_s  = the exchange's own CPU (hook probe) / period / min(1, its cores)  CPU ranks, 2 or more; else 0
    exposed_s  = comm_s - overlap x (min(comm in forward, forward compute) + min(comm in backward, backward compute))
                 with strategy.ddp.update_in_next_forward (a CPU rank: of 2 cores or more), backward's may also
                 hide behind the next forward:
                 min(comm in backward, backward compute + forward compute - min(comm in forward, forward compute));
                 an exchange every H steps that runs behind T of them (DiLoCo's overlap_steps) also hides
                 min(its comm a step, T x compute_s / H) (a CPU rank: of 2 cores or more)
    comm_s     = sum over the step's collectives of calls x link.seconds(collective, N, bytes per call) / every

comm_cpu_s is the CPU a rank's cores give to moving its bytes between hosts (TCP in the kernel, the backend's
copies and sums), time its compute waits for; a rank of less than a core (more ranks than cores on a machine) waits
longer. It is fitted on the multi-node runs' own CPU time (calibrate, comm_cpu_per_byte).

The collectives of a step (collectives()) are each strategy's own Traffic (each strategy's options.py: its SPEC; dptrain.config.SPECS),
read here without a strategy's name: ddp and zero1 all-reduce the gradients in buckets during backward (fp16 and bf16
hooks halve the bytes, PowerSGD sends r (rows + cols) per matrix in two all-reduces and the vectors in a third), zero1
then all-gathers the parameters, DDP broadcasts the module's buffers each forward; fsdp all-gathers each unit's
parameters in forward (again in backward when it reshards) and reduce-scatters the gradients in backward; the
parameter server receives N-1 gradients and sends N-1 parameter copies over its one link. The link times each with
the ring formulas of dptrain_bench/link.py (ring_terms), a point-to-point send as alpha + bytes / B.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, replace
from typing import Iterable, Protocol

from dptrain_bench.link import collective_seconds
from dptrain.config import SPECS, Exchange, Traffic
from dptrain.strategies.ddp.options import CommHook
from dptrain.errors import ConfigError

MAX_NODES = 256
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
POWERSGD_MIN_COMPRESSION = 2  # PowerSGD compresses a matrix only where it sends at most half its elements
STRATEGIES = tuple(name for name, spec in SPECS.items() if spec.traffic is not None)
"""The strategies whose traffic their spec states: those the model has formulas for (a Plan checks SPECS itself)."""
HOOKS: tuple[str, ...] = typing.get_args(CommHook)
NEXT_FORWARD_CORES = 2
"""The fewest cores a CPU rank needs for a transfer left running behind its compute to hide anything (the update in
the next forward, DiLoCo's streamed exchange): the transfer (the bytes' trip through the kernel's TCP and gloo) takes
CPU, and on a rank's only core it takes it from the compute it was to hide behind. On the lab's one-core hosts the
next-forward update ran 953 to 1,470 images/s against plain ddp's 1,285 to 1,498 (docs/benchmark.md): never faster
beyond the spread of identical runs. DiLoCo's exchange behind 8 of its 32 steps did gain there (1.08x to 1.22x), but
hid 50-66% of the exchange where the overlap fitted on plain ddp said all of it (docs/scaling-model.md): the model
credits it nothing there, and `bench tune` gives it a trial of its own."""


class Timed(Protocol):
    """What a link offers the model: its alpha-beta parameters and a collective's time (Link, link.LinkFit)."""

    latency_s: float
    bandwidth_bps: float

    def seconds(self, collective: str, world: int, nbytes: float) -> float: ...


@dataclass(frozen=True)
class Link:
    """A named link: one message's latency (alpha, s) and the bandwidth of each host's link (B, bytes/s)."""

    name: str
    latency_s: float
    bandwidth_bps: float
    assumption: str

    def seconds(self, collective: str, world: int, nbytes: float) -> float:
        return collective_seconds(collective, world, nbytes, self.latency_s, self.bandwidth_bps)


# The assumptions behind the named links: the nominal rate (what gloo's TCP gets close to on large buffers), and a
# message's latency through the kernel's TCP stack, a switch and gloo (RDMA for 100gbit).
NAMED_LINKS = {
    "100mbit": Link("100mbit", 200e-6, 100e6 / 8, "100 Mbit/s Ethernet, TCP: 12.5 MB/s, 200 us a message"),
    "1gbit": Link("1gbit", 50e-6, 1e9 / 8, "1 Gbit/s Ethernet, TCP: 125 MB/s, 50 us a message"),
    "10gbit": Link("10gbit", 20e-6, 10e9 / 8, "10 Gbit/s Ethernet, TCP: 1.25 GB/s, 20 us a message"),
    "100gbit": Link("100gbit", 5e-6, 100e9 / 8, "100 Gbit/s InfiniBand or RoCE, RDMA: 12.5 GB/s, 5 us a message"),
}


def named_link(name: str) -> Link:
    """The named link; ConfigError in one sentence for another name."""
    try:
        return NAMED_LINKS[name.lower()]
    except KeyError:
        raise ConfigError(f"--link {name!r} is no link the model knows; give one of {', '.join(NAMED_LINKS)}, or "
                          f"leave it out to use the measured link.json.") from None


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one step of the run computes and sends, for any strategy."""

    param_bytes: float
    """The whole model's parameters in bytes: one gradient, one replica."""
    global_batch: int
    """Samples per step over all ranks, the same at every rank count (strong scaling, as `dptrain bench` runs)."""
    batch_per_rank: int | None = None
    """Set: every rank takes this many samples a step, the global batch growing with the ranks (weak scaling)."""
    compute_s_per_sample: float
    """One rank alone on a node: its seconds per sample (1 / images/s of a 1-worker run, which sends nothing)."""
    element_size: int = 4
    """Bytes of a parameter's element: fp16 and bf16 hooks send 2 bytes in its place."""
    optimizer_bytes: float | None = None
    """The optimizer state of the whole model in bytes (None: Adam's two moments, 2 x param_bytes)."""
    buffer_bytes: float = 0.0
    """Module buffers (BatchNorm's statistics) that DDP broadcasts from rank 0 at each forward."""
    matrices: tuple[tuple[int, int], ...] = ()
    """(rows, cols) of each weight matrix (a convolution's as out x in*kh*kw), for PowerSGD; the rest is vectors."""
    powersgd_bytes: float | None = None
    """PowerSGD's bytes all-reduced per step as a run measured them (comm_bytes_per_step x N / 2(N-1)), used where
    the matrix shapes are not given."""
    fsdp_units: int = 1
    """FSDP units (strategy.fsdp.wrap): one all-gather each per gather pass."""
    backward_share: float = 2 / 3
    """The share of a step's compute in backward (two products of three): what a gradient all-reduce can hide behind."""
    rank_share: dict[int, float] = field(default_factory=dict)
    """R ranks on one node -> each rank's rate over one rank's alone (peak.json: peak(R) / (R peak(1)))."""
    ranks_share_a_node: bool = True
    """Without a rank_share entry: True (CPU), R ranks split the node (1/R each); False (one GPU a rank), 1 each."""
    machine_cores: int | None = None
    """CPU cores of one machine (env.json's machine_cores), for nodes that share a machine (machine_share)."""
    threads_alone: int | None = None
    """CPU threads of the 1-worker run that gave compute_s_per_sample (env.json's cpu_threads_per_rank)."""
    cores_busy_alone: float | None = None
    """Cores the 1-worker run kept busy (its cpu_util_pct / 100): its CPU seconds per sample over its wall seconds."""
    comm_cpu_s_per_byte: float = 0.0
    """CPU seconds a CPU rank spends on each byte it sends to other nodes, beyond its compute (comm_cpu_per_byte)."""
    own_cpu_s: dict[str, float] = field(default_factory=dict)
    """The CPU seconds a way of exchanging costs a rank besides its bytes, each time it runs, by Plan.own_cpu_key: a
    compressing hook's a step, local SGD's averaging and DiLoCo's outer step every period steps (the hook probe,
    dptrain_bench/hook_probe.py: hooks.json). A name missing costs nothing."""

    def batch(self, world: int) -> int:
        """The global batch of a step on `world` ranks."""
        return self.global_batch if self.batch_per_rank is None else self.batch_per_rank * world

    def share(self, ranks_per_node: int) -> float:
        if ranks_per_node in self.rank_share:
            return self.rank_share[ranks_per_node]
        return 1.0 / ranks_per_node if self.ranks_share_a_node else 1.0

    def cores_of_rank(self, world: int, machines: int | None, threads_per_rank: int | None) -> float | None:
        """The cores a CPU rank of t threads computes on: min(t, C / k) among the k ranks of a machine of C cores
        where the machines are known, else t. None where t is not known, or on GPUs."""
        if not (self.ranks_share_a_node and threads_per_rank):
            return None
        if not (machines and self.machine_cores):
            return float(threads_per_rank)
        return min(threads_per_rank, self.machine_cores / math.ceil(world / machines))

    def machine_share(self, world: int, machines: int, threads_per_rank: int) -> float | None:
        """Where several nodes are one machine (the lab cluster: network namespaces of one kernel), each rank's rate
        over the 1-worker run's, counted in cores: its cores (cores_of_rank) over the 1-worker run's,
        min(threads_alone, C). None where a count is missing or on GPUs (one each)."""
        cores = self.cores_of_rank(world, machines, threads_per_rank)
        if cores is None or not (self.machine_cores and self.threads_alone and machines):
            return None
        return cores / min(self.threads_alone, self.machine_cores)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A strategy and its communication settings ([strategy] of the config)."""

    strategy: str = "ddp"
    comm_hook: str = "allreduce"
    powersgd_rank: int = 4
    bucket_bytes: float = DDP_BUCKET_BYTES
    reshard_after_forward: bool = True
    param_dtype_size: int | None = None
    """fsdp mixed precision: bytes of a gathered parameter element (None: the parameters' own)."""
    reduce_dtype_size: int | None = None
    """fsdp mixed precision: bytes of a reduce-scattered gradient element (None: the parameters' own)."""
    update_in_next_forward: bool = False
    """strategy.ddp.update_in_next_forward: backward's collectives may also hide behind the next step's forward."""
    period: int = 1
    """local_sgd's and diloco's period (strategy.<table>.period): an exchange that runs `every` period, once in that
    many steps."""
    overlap_steps: int = 0
    """diloco's overlap_steps: the steps an exchange that may run `behind` goes on behind (0: waited for at once)."""

    @property
    def own_cpu_key(self) -> str | None:
        """The name under which the hook probe (Workload.own_cpu_s) measures what this plan's way of exchanging costs
        the rank's CPU besides its bytes: a comm hook's (ddp, zero1), an averaging's (local_sgd, diloco); None: none
        (DDP's own all-reduce, whose CPU is the bytes' own, and the strategies without a way of their own)."""
        if self.traffic.bucketed:
            return None if self.comm_hook in ("allreduce", "ring") else self.comm_hook
        return self.strategy if any(e.every for e in self.traffic.exchanges) else None

    @property
    def traffic(self) -> Traffic:
        """The strategy's collectives and memory per step, as its spec states them."""
        traffic = SPECS[self.strategy].traffic
        assert traffic is not None, "checked in __post_init__"
        return traffic

    def dtype_size(self, option: str | None) -> int | None:
        """Bytes of an element in the dtype a mixed-precision option names (None: the parameters' own)."""
        return {"param_dtype": self.param_dtype_size, "reduce_dtype": self.reduce_dtype_size}[option] if option else None

    def __post_init__(self) -> None:
        if self.strategy not in SPECS or SPECS[self.strategy].traffic is None:
            raise ConfigError(f"the scaling model has no formulas for strategy {self.strategy!r}; it knows "
                              f"{', '.join(STRATEGIES)}.")
        if self.comm_hook not in HOOKS:
            raise ConfigError(f"the scaling model has no formulas for comm hook {self.comm_hook!r}; it knows "
                              f"{', '.join(HOOKS)}.")
        if self.period < 1:
            raise ConfigError(f"the scaling model takes a period of 1 step or more, not {self.period}.")
        if not 0 <= self.overlap_steps < self.period:
            raise ConfigError(f"the scaling model takes overlap steps from 0 to fewer than the period ({self.period}), "
                              f"not {self.overlap_steps}.")


@dataclass(frozen=True)
class Collective:
    """`calls` of one collective of `nbytes` each in a step, in `phase`: forward or backward (it may hide behind
    that compute), or after (the optimizer's, exposed whole)."""

    kind: str
    """all_reduce, reduce_scatter, all_gather, broadcast (link.ring_terms), or send (point to point)."""
    nbytes: float
    calls: int
    phase: str
    every: int = 1
    """It runs once in this many steps (local SGD's period): its time and bytes a step are 1/every of one run's."""
    behind: int = 0
    """The steps each run goes on behind before it is waited for (DiLoCo's overlap_steps): it may hide behind their
    compute."""

    def seconds(self, link: Timed, world: int) -> float:
        """Its time a step: a run's time over `every`."""
        if self.kind == "send":
            return self.calls * (link.latency_s + self.nbytes / link.bandwidth_bps) / self.every
        return self.calls * link.seconds(self.kind, world, self.nbytes) / self.every


def powersgd_elements(matrices: Iterable[tuple[int, int]], vector_elements: float, rank: int) -> float:
    """Elements PowerSGD all-reduces per step: r (rows + cols) per matrix where that is at most half the matrix
    (PowerSGD's own rule, as comm_hooks counts it), the whole matrix elsewhere, and the vectors as they are."""
    total = vector_elements
    for rows, cols in matrices:
        r = min(rows, cols, rank)
        compressed = (rows + cols) * r
        total += compressed if compressed * POWERSGD_MIN_COMPRESSION < rows * cols else rows * cols
    return total


def gradient_bytes_sent(plan: Plan, work: Workload) -> tuple[float, int]:
    """(bytes all-reduced per step for the gradients of ddp or zero1 after the hook's compression, all-reduces per
    bucket): fp16 and bf16 send 2-byte elements, PowerSGD its factors in two all-reduces and the vectors in one."""
    if plan.comm_hook in ("fp16", "bf16"):
        return work.param_bytes * 2 / work.element_size, 1
    if plan.comm_hook == "powersgd":
        if not work.matrices and work.powersgd_bytes is not None:
            return work.powersgd_bytes, 3
        if not work.matrices:
            raise ConfigError("the scaling model needs the model's matrix shapes (Workload.matrices) to count "
                              "PowerSGD's traffic; give them, or the bytes a run measured (powersgd_bytes).")
        matrix_elements = sum(rows * cols for rows, cols in work.matrices)
        vectors = max(work.param_bytes / work.element_size - matrix_elements, 0.0)
        return powersgd_elements(work.matrices, vectors, plan.powersgd_rank) * work.element_size, 3
    return work.param_bytes, 1


def _runs(exchange: Exchange, plan: Plan, work: Workload) -> bool:
    """Whether the exchange runs in this plan: its option true where it names one, a buffer broadcast only of buffers."""
    if exchange.when is not None and not getattr(plan, exchange.when):
        return False
    return exchange.carries != "buffers" or bool(work.buffer_bytes)


def _collective(exchange: Exchange, plan: Plan, work: Workload, world: int) -> Collective:
    """One exchange of a strategy's traffic as the calls and bytes it makes in this plan and workload."""
    every = int(getattr(plan, exchange.every)) if exchange.every is not None else 1
    behind = int(getattr(plan, exchange.behind)) if exchange.behind is not None else 0
    return replace(_one_run(exchange, plan, work, world), every=every, behind=behind)


def _one_run(exchange: Exchange, plan: Plan, work: Workload, world: int) -> Collective:
    """An exchange's calls and bytes each time it runs."""
    if exchange.calls == "buckets":  # the gradients after the hook's compression, in DDP's buckets
        sent, per_bucket = gradient_bytes_sent(plan, work)
        buckets = max(1, math.ceil(work.param_bytes / plan.bucket_bytes))
        return Collective(exchange.kind, sent / (buckets * per_bucket), buckets * per_bucket, exchange.phase)
    if exchange.carries == "buffers":
        nbytes = work.buffer_bytes
    elif exchange.dtype is not None:  # mixed precision: the elements, in that dtype (the parameters' own for auto)
        nbytes = work.param_bytes / work.element_size * (plan.dtype_size(exchange.dtype) or work.element_size)
    else:
        nbytes = work.param_bytes
    if exchange.calls == "units":
        units = max(1, work.fsdp_units)
        return Collective(exchange.kind, nbytes / units, units, exchange.phase)
    return Collective(exchange.kind, nbytes, world - 1 if exchange.calls == "peers" else 1, exchange.phase)


def collectives(plan: Plan, work: Workload, world: int) -> list[Collective]:
    """The collectives one step of `plan` runs between `world` ranks (none for one rank): its spec's traffic."""
    if world <= 1:
        return []
    return [_collective(e, plan, work, world) for e in plan.traffic.exchanges if _runs(e, plan, work)]


def bytes_sent_per_rank(plan: Plan, work: Workload, world: int) -> float:
    """What the busiest rank sends per step, as the strategies count it (comm_bytes_per_step of metrics.jsonl):
    (N-1)/N of each all-gather's and reduce-scatter's buffer, 2 (N-1)/N of each all-reduce's, a broadcast's buffer
    once (rank 0), and each point-to-point send it makes whole (the parameter server's N-1 copies of the parameters;
    a worker sends one gradient only); an exchange that runs once every H steps, 1/H of that."""
    sent_by_busiest = [e for e in plan.traffic.exchanges if e.sent_by_busiest and _runs(e, plan, work)]
    total = 0.0
    for c in (_collective(e, plan, work, world) for e in sent_by_busiest) if world > 1 else ():
        if c.kind in ("broadcast", "send"):
            total += c.calls * c.nbytes / c.every
        else:
            total += c.calls * c.nbytes * (world - 1) / world * (2 if c.kind == "all_reduce" else 1) / c.every
    return total


def params_held(plan: Plan, world: int) -> int:
    """Copies of the model's parameters a rank holds at most (Traffic.param_copies), one more while an exchange runs
    behind the steps (the copy of what it sent); one process holds one."""
    streamed = any(e.behind and getattr(plan, e.behind) for e in plan.traffic.exchanges)
    return plan.traffic.param_copies + int(streamed) if world > 1 else 1


def memory_per_rank(plan: Plan, work: Workload, world: int) -> float:
    """Bytes of parameters, gradients and optimizer state on the fullest rank (activations left out: they depend on
    the batch per rank and the model, not on the strategy): what the strategy's traffic shards, 1/N of it; the rest
    whole (the parameter server's server holds all of it); the parameters as often as the rank holds them
    (params_held)."""
    params = work.param_bytes * params_held(plan, world)
    grads = work.param_bytes
    optim = 2 * work.param_bytes if work.optimizer_bytes is None else work.optimizer_bytes
    if world <= 1:
        return params + grads + optim
    traffic = plan.traffic
    sharded = set(traffic.sharded)
    if traffic.gathers_params and not plan.reshard_after_forward:  # gathered from forward until backward: all held
        sharded.discard("params")
    parts = {"params": params, "grads": grads, "optim": optim}
    whole = sum(size for part, size in parts.items() if part not in sharded)
    shards = sum(size for part, size in parts.items() if part in sharded)
    gathered = params / max(1, work.fsdp_units) if traffic.gathers_params and "params" in sharded else 0.0
    return whole + shards / world + gathered  # one unit gathered at a time, where it reshards

@dataclass(frozen=True, kw_only=True)
class Prediction:
    nodes: int
    ranks_per_node: int
    compute_s: float
    comm_cpu_s: float
    """What the rank's compute waits while its cores move its bytes (comm_cpu_seconds)."""
    own_cpu_s: float = 0.0
    """What it waits while its cores do the exchange's own work: a hook's compression, an averaging (own_cpu_seconds)."""
    comm_s: float
    exposed_s: float
    step_s: float
    images_per_s: float
    efficiency: float
    """compute_s / step_s: the throughput over what the same ranks would get with communication free."""
    memory_bytes: float
    bytes_sent: float

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


def rank_share(work: Workload, nodes: int, ranks_per_node: int, machines: int | None = None,
               threads_per_rank: int | None = None) -> float:
    """Each rank's rate over the 1-worker run's: Workload.share, or Workload.machine_share where nodes share
    machines (see predict)."""
    shared = (work.machine_share(nodes * ranks_per_node, machines, threads_per_rank or 0)
              if machines is not None and machines < nodes else None)
    return work.share(ranks_per_node) if shared is None else shared


def compute_seconds(work: Workload, nodes: int, ranks_per_node: int, machines: int | None = None,
                    threads_per_rank: int | None = None) -> float:
    """A step's compute on nodes x ranks_per_node ranks: the global batch split over them, each at its share of the
    1-worker run's rate (rank_share)."""
    world = nodes * ranks_per_node
    return work.batch(world) * work.compute_s_per_sample / (world * rank_share(work, nodes, ranks_per_node, machines,
                                                                                threads_per_rank))


def rank_cores(work: Workload, nodes: int, ranks_per_node: int, machines: int | None = None,
               threads_per_rank: int | None = None) -> float:
    """The cores a CPU rank's work runs on, at most 1 (the 1-worker run's busy cores times rank_share): CPU seconds a
    step that are its own take that much longer on a rank of less than a core."""
    cores = (work.cores_busy_alone or 1.0) * rank_share(work, nodes, ranks_per_node, machines, threads_per_rank)
    return min(1.0, max(cores, 1e-9))


def own_cpu_seconds(plan: Plan, work: Workload, nodes: int, ranks_per_node: int, machines: int | None = None,
                    threads_per_rank: int | None = None) -> float:
    """The wall time a rank's compute loses to the exchange's own work a step (Workload.own_cpu_s: a hook's every
    step, an averaging's every period steps), on its cores (rank_cores); 0 on one rank (nothing is exchanged) and on
    GPUs (the probe measures CPU ranks)."""
    key = plan.own_cpu_key
    if key is None or nodes * ranks_per_node <= 1 or not work.ranks_share_a_node:
        return 0.0
    per_run = work.own_cpu_s.get(key, 0.0)
    return per_run / plan.period / rank_cores(work, nodes, ranks_per_node, machines, threads_per_rank)


def comm_cpu_seconds(plan: Plan, work: Workload, nodes: int, ranks_per_node: int, machines: int | None = None,
                     threads_per_rank: int | None = None) -> float:
    """The wall time a CPU rank's compute loses to moving its bytes between nodes: their CPU seconds
    (Workload.comm_cpu_s_per_byte) on one core, longer on a rank of less than a core (the 1-worker run's busy cores
    times rank_share). 0 on GPUs (the collectives run there), on one node, or where no multi-node run measured it."""
    if nodes <= 1 or not work.ranks_share_a_node or not work.comm_cpu_s_per_byte:
        return 0.0
    return (bytes_sent_per_rank(plan, work, nodes * ranks_per_node) * work.comm_cpu_s_per_byte
            / rank_cores(work, nodes, ranks_per_node, machines, threads_per_rank))


def predict(plan: Plan, work: Workload, link: Timed, nodes: int, ranks_per_node: int = 1, overlap: float = 0.0,
            local_link: Timed | None = None, machines: int | None = None,
            threads_per_rank: int | None = None) -> Prediction:
    """One step of `plan` on nodes x ranks_per_node ranks: over `link` between nodes, or `local_link` (default: the
    same) when all ranks share one node. overlap: the fraction of the communication in forward and backward that
    hides behind that phase's compute (0: none, 1: all it can). machines (fewer than nodes where nodes share a
    machine's cores, as the lab cluster's do) and threads_per_rank: the ranks' cores are then counted
    (Workload.machine_share); None: every node is a machine of its own."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"{nodes} nodes x {ranks_per_node} ranks: both must be 1 or more")
    world = nodes * ranks_per_node
    batch = work.batch(world)
    if batch < world:
        raise ValueError(f"{world} ranks share a global batch of {batch}: some would get no sample")
    over = link if nodes > 1 or local_link is None else local_link
    compute = compute_seconds(work, nodes, ranks_per_node, machines, threads_per_rank)
    comm_cpu = comm_cpu_seconds(plan, work, nodes, ranks_per_node, machines, threads_per_rank)
    own_cpu = own_cpu_seconds(plan, work, nodes, ranks_per_node, machines, threads_per_rank)
    phase_compute = {"forward": compute * (1 - work.backward_share), "backward": compute * work.backward_share}
    by_phase = {"forward": 0.0, "backward": 0.0, "after": 0.0}
    behind, behind_room = 0.0, 0.0  # the exchanges that run behind the next steps, and those steps' compute, a step
    for c in collectives(plan, work, world):
        by_phase[c.phase] += c.seconds(over, world)
        if c.behind:
            behind, behind_room = behind + c.seconds(over, world), max(behind_room, c.behind * compute / c.every)
    comm = sum(by_phase.values())
    hidden_in_forward = min(by_phase["forward"], phase_compute["forward"])
    # with the update in the next forward, backward's collectives go on behind the next forward's compute as well
    # (what of it the forward's own collectives leave)
    # not on a CPU rank of fewer than NEXT_FORWARD_CORES cores, where known: a transfer left running behind compute
    # takes the compute's core (the next forward's, or a streamed exchange's inner steps')
    cores = work.cores_of_rank(world, machines, threads_per_rank)
    one_core = cores is not None and cores < NEXT_FORWARD_CORES
    behind_backward = phase_compute["backward"] + (
        phase_compute["forward"] - hidden_in_forward if plan.update_in_next_forward and not one_core else 0.0)
    hidden = overlap * (hidden_in_forward + min(by_phase["backward"], behind_backward)
                       + (0.0 if one_core else min(behind, behind_room)))
    exposed = comm - hidden
    step = compute + comm_cpu + own_cpu + exposed
    return Prediction(nodes=nodes, ranks_per_node=ranks_per_node, compute_s=compute, comm_cpu_s=comm_cpu,
                      own_cpu_s=own_cpu, comm_s=comm, exposed_s=exposed,
                      step_s=step, images_per_s=batch / step, efficiency=compute / step,
                      memory_bytes=memory_per_rank(plan, work, world),
                      bytes_sent=bytes_sent_per_rank(plan, work, world))


def node_counts(max_nodes: int = MAX_NODES) -> list[int]:
    """1, 2, 4, ... up to max_nodes (and max_nodes itself)."""
    counts = [2**i for i in range(int(math.log2(max_nodes)) + 1)]
    return counts if counts[-1] == max_nodes else counts + [max_nodes]


def curve(plan: Plan, work: Workload, link: Timed, ranks_per_node: int = 1, overlap: float = 0.0,
          max_nodes: int = MAX_NODES, local_link: Timed | None = None) -> list[Prediction]:
    """Predictions at 1, 2, 4, ... max_nodes nodes of ranks_per_node ranks each, as far as the global batch gives
    every rank a sample (a fixed global batch of 128 ends at 128 ranks; weak scaling, batch_per_rank, goes on)."""
    return [predict(plan, work, link, n, ranks_per_node, overlap, local_link) for n in node_counts(max_nodes)
            if work.batch(n * ranks_per_node) >= n * ranks_per_node]


@dataclass(frozen=True)
class Measured:
    """A measured point: its nodes and ranks (workers), and the images/s it trained at; where known (env.json), the
    machines its nodes were (fewer on the lab cluster) and each rank's CPU threads; and the ranks' mean CPU use
    (metrics.jsonl's cpu_util_pct: percent of one core)."""

    nodes: int
    workers: int
    images_per_s: float
    machines: int | None = None
    threads_per_rank: int | None = None
    cpu_util_pct: float | None = None

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.workers // self.nodes)


def split_for_fit(points: list[Measured]) -> tuple[list[Measured], list[Measured]]:
    """(fit on, predict): the smaller half of the distinct (nodes, workers) shapes, at least one and never all when
    there are two or more, to fit on; the larger ones held out, to predict and compare."""
    shapes = sorted({(p.nodes, p.workers) for p in points})
    keep = set(shapes[:max(1, min(math.ceil(len(shapes) / 2), len(shapes) - 1))])
    return [p for p in points if (p.nodes, p.workers) in keep], [p for p in points if (p.nodes, p.workers) not in keep]


OVERLAP_GRID = tuple(i / 100 for i in range(101))


def predict_point(plan: Plan, work: Workload, link: Timed, point: Measured, overlap: float,
                  local_link: Timed | None = None) -> Prediction:
    """The prediction of a measured point's shape, on the machines it ran on."""
    return predict(plan, work, link, point.nodes, point.ranks_per_node, overlap, local_link, point.machines,
                   point.threads_per_rank)


def fit_overlap(plan: Plan, work: Workload, points: list[Measured], link: Timed,
                local_link: Timed | None = None) -> float | None:
    """The overlap (0..1, by hundredths) whose predictions of the points with two ranks or more are closest in
    squared relative error to their measured images/s; None when no such point is given."""
    multi = [p for p in points if p.workers > 1]
    if not multi:
        return None

    def cost(overlap: float) -> float:
        return sum((predict_point(plan, work, link, p, overlap, local_link).images_per_s - p.images_per_s) ** 2
                   / p.images_per_s**2 for p in multi)

    return min(OVERLAP_GRID, key=cost)


def comm_cpu_per_byte(plan: Plan, work: Workload, points: list[Measured]) -> float:
    """CPU seconds a rank spent per byte it sent, beyond its compute, in the multi-node CPU points that say their CPU
    use: a rank's CPU seconds a step (cpu_util_pct x its step) less its samples' compute at the 1-worker run's CPU
    per sample (compute_s_per_sample x cores_busy_alone) and the exchange's own work (Workload.own_cpu_s), over the
    bytes it sent (bytes_sent_per_rank); their mean, 0 or more. 0 without such a point, or without the 1-worker run's CPU use to subtract."""
    if not work.ranks_share_a_node or not work.cores_busy_alone:
        return 0.0
    per_byte = []
    for p in points:
        sent = bytes_sent_per_rank(plan, work, p.workers)
        if p.nodes > 1 and p.cpu_util_pct and sent > 0:
            batch = work.batch(p.workers)
            cpu_per_step = p.cpu_util_pct / 100 * batch / p.images_per_s
            compute_cpu = batch / p.workers * work.compute_s_per_sample * work.cores_busy_alone
            key = plan.own_cpu_key  # the exchange's own work (a hook's compression) is not the bytes'
            own_cpu = work.own_cpu_s.get(key, 0.0) / plan.period if key is not None else 0.0
            per_byte.append((cpu_per_step - compute_cpu - own_cpu) / sent)
    return max(0.0, sum(per_byte) / len(per_byte)) if per_byte else 0.0


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What the measured points gave the model, and its error on those it was not fitted on."""

    work: Workload
    overlap: float
    overlap_fitted: bool
    fitted_on: list[Measured]
    held_out: list[tuple[Measured, Prediction]]

    def errors(self) -> list[tuple[Measured, Prediction, float]]:
        """(point, prediction, (predicted - measured) / measured) of each held-out point."""
        return [(m, p, (p.images_per_s - m.images_per_s) / m.images_per_s) for m, p in self.held_out]


def calibrate(plan: Plan, work: Workload, points: list[Measured], link: Timed, local_link: Timed | None = None,
              default_overlap: float = 0.0, hold_out: bool = True) -> Calibration:
    """Fit on the smaller shapes (split_for_fit), predict the larger: the compute per sample (and the cores it kept
    busy) from the fit set's 1-worker points where there are any (else work's own, from peak.json), the CPU that
    moving a byte between nodes costs from its multi-node points (comm_cpu_per_byte), the overlap from its multi-rank
    points (else default_overlap). hold_out False: fit on every point, none held out (a fit that predicts another
    sweep, `report --fitted-on`: its largest shapes, often its only multi-node ones, are what it most needs)."""
    fit_on, held = split_for_fit(points) if hold_out else (list(points), [])
    single = [p for p in fit_on if p.workers == 1 and p.nodes == 1]
    if single:
        busy = [p.cpu_util_pct / 100 for p in single if p.cpu_util_pct]
        work = replace(work, compute_s_per_sample=len(single) / sum(p.images_per_s for p in single),  # mean per sample
                       threads_alone=single[0].threads_per_rank or work.threads_alone,
                       cores_busy_alone=sum(busy) / len(busy) if busy else work.cores_busy_alone)
    work = replace(work, comm_cpu_s_per_byte=comm_cpu_per_byte(plan, work, fit_on))
    overlap = fit_overlap(plan, work, fit_on, link, local_link)
    fitted = overlap is not None
    overlap = default_overlap if overlap is None else overlap
    return Calibration(work=work, overlap=overlap, overlap_fitted=fitted, fitted_on=fit_on,
                       held_out=predicted(plan, work, held, link, overlap, local_link))


def fit_basis(points: list[Measured]) -> str:
    """What a fit rests on, in words: how many points, their shapes, and what each kind of point gave the model."""
    shapes = [f"{n}x{w // n}" for n, w in sorted({(p.nodes, p.workers) for p in points})]
    single = sum(1 for p in points if p.workers == 1)
    several = [p for p in points if p.workers > 1]
    across = sum(1 for p in several if p.nodes > 1)
    with_cpu = sum(1 for p in several if p.nodes > 1 and p.cpu_util_pct)
    kinds = [f"{single} of one worker for the compute per sample" if single else "",
             f"{len(several)} of several ranks ({across} across nodes) for the overlap" if several else "",
             f"{with_cpu} across nodes with their CPU use for the CPU a byte" if with_cpu else ""]
    return (f"{len(points)} point{'s' if len(points) != 1 else ''}, shapes {' and '.join(shapes)} (nodes x ranks per "
            f"node): " + ", ".join(k for k in kinds if k))


def predicted(plan: Plan, work: Workload, points: list[Measured], link: Timed, overlap: float,
              local_link: Timed | None = None) -> list[tuple[Measured, Prediction]]:
    """(point, the model's prediction of it) for each point."""
    return [(m, predict_point(plan, work, link, m, overlap, local_link)) for m in points]
