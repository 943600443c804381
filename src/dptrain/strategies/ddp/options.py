"""ddp's torch-free half: [strategy.ddp], the options ddp and zero1 read, and its spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dptrain.option_fields import REFUSED_ELSEWHERE, may_change_at_resume, positive
from dptrain.strategies.spec import Exchange, StrategySpec, Traffic

CommHook = Literal["allreduce", "fp16", "bf16", "powersgd", "ring"]
"""DDP's gradient communication: allreduce (DDP's own), and the hooks of strategies/ddp/comm_hooks.py."""


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


GRADIENTS_IN_BUCKETS = Exchange("all_reduce", "gradients", "backward", "buckets")
BUFFERS_EACH_FORWARD = Exchange("broadcast", "buffers", "forward", "one")  # DDP's broadcast_buffers

SPEC = StrategySpec(name="ddp", about="DistributedDataParallel: a full replica per rank, gradients all-reduced",
                    table="ddp", options=DDPOptions,
                    traffic=Traffic(exchanges=(GRADIENTS_IN_BUCKETS, BUFFERS_EACH_FORWARD)))
