"""The hook probe: what each way of exchanging that does work of its own costs a rank's CPU besides its bytes, on the
run's model: the compressing comm hooks (fp16, bf16, PowerSGD) a step, beyond DDP's own all-reduce; local SGD's
averaging and DiLoCo's outer step each time they run. The scaling model adds it to the step (Workload.own_cpu_s); a
sweep with such a strategy or hook records it in BENCH/hooks.json, and `bench tune` in its folder.

    $ dptrain bench probe hooks --data.name fashion-mnist --model.name mnist-cnn --threads 1

`python -m dptrain_bench.hook_probe --json ...` is the probe's internal entry, which measure() runs in a fresh Python.

One process with a process group of one (gloo) and `threads` CPU threads (a rank's). A hook: DDP with it and DDP
with its own all-reduce train alike on one fixed batch of the rank's size, one step each in turns, STEPS steps each
after WARM_STEPS; the hook's cost is the difference of their fastest steps in the process's CPU time (every thread's:
the hook's own thread and gloo's count). local SGD and DiLoCo: their exchange itself, as on two ranks (the all-reduce
over the group of one), the fastest of CALLS calls in CPU time. CPU time, not wall time: another program on the
machine slows the probe's wall clock, not its CPU seconds. The fastest, not a mean or median: the same work is the
same CPU seconds, and what else happens to a step (a virtual machine's stolen time counted to the process, a cache
another program emptied) only adds to it; a median over 5 rounds of 6 steps read bf16's cost as 0.0 to 7.4 ms and
PowerSGD's as 6.4 to 17.1 ms from one probe to the next on this project's 2-core machine. A hook's cost here leaves
out what its bytes cost on the wire and in the kernel's TCP (the link and the model's CPU a byte, k, count those).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain import read_back
from dptrain.files import written_atomically
from dptrain.read_back import UnreadableFile

log = logging.getLogger(__name__)

HOOKS_FILE = "hooks.json"
HOOKS = ("fp16", "bf16", "powersgd")
"""The comm hooks measured: those that do work of their own (DDP's all-reduce is the baseline; the ring hook's work
is its bytes)."""
AVERAGING = ("local_sgd", "diloco")
"""The strategies whose exchange, every period steps, is measured."""
STEPS = 30  # timed steps of each side, one of each in turns
WARM_STEPS = 3  # PowerSGD compresses from its third step; DDP rebuilds its buckets after its first
CALLS = 25  # timed exchanges (local SGD, DiLoCo)


@dataclass(frozen=True)
class HookProbe:
    """What the probe measured, and on what: the model, its input, the batch a rank, its threads, PowerSGD's rank."""

    model: str
    image_shape: tuple[int, ...]
    num_classes: int
    batch: int
    threads: int
    powersgd_rank: int
    cpu_s: dict[str, float]
    """A hook's CPU seconds a step, an averaging strategy's a call (every period steps), by name."""

    def matches(self, other: "HookProbe") -> bool:
        """Whether the two measured the same thing (their numbers aside)."""
        return (self.model, self.image_shape, self.num_classes, self.batch, self.threads, self.powersgd_rank) == (
            other.model, other.image_shape, other.num_classes, other.batch, other.threads, other.powersgd_rank)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "image_shape": list(self.image_shape), "num_classes": self.num_classes,
                "batch": self.batch, "threads": self.threads, "powersgd_rank": self.powersgd_rank,
                "cpu_s": self.cpu_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HookProbe":
        shape = read_back.field(d, "image_shape", "the probe")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
            raise read_back.BadValue(f"image_shape = {read_back.shown(shape)}, not a list of 1 to 4 sizes")
        cpu = read_back.mapping(read_back.field(d, "cpu_s", "the probe"), "cpu_s")
        return cls(model=read_back.text(read_back.field(d, "model", "the probe"), "model", 200),
                   image_shape=tuple(read_back.integer(n, "image_shape", 1, 1 << 20) for n in shape),
                   num_classes=read_back.integer(read_back.field(d, "num_classes", "the probe"), "num_classes", 1, 1 << 20),
                   batch=read_back.integer(read_back.field(d, "batch", "the probe"), "batch", 1, 1 << 24),
                   threads=read_back.integer(read_back.field(d, "threads", "the probe"), "threads", 1, 1 << 12),
                   powersgd_rank=read_back.integer(read_back.field(d, "powersgd_rank", "the probe"), "powersgd_rank",
                                                   1, 1 << 16),
                   cpu_s={read_back.text(k, "cpu_s", 40): read_back.number(v, f"cpu_s.{k}", 0, 3600)
                          for k, v in cpu.items()})


def read_hooks(bench_dir: Path) -> HookProbe | None:
    """BENCH/hooks.json's probe; None where there is none, or it is not what this module writes (logged)."""
    try:
        return read_back.read_json(bench_dir / HOOKS_FILE, lambda d: HookProbe.from_dict(read_back.mapping(d, "the file")))
    except FileNotFoundError:
        return None
    except UnreadableFile as exc:
        log.warning(f"{exc.path} {exc.problem}; the model takes the hooks and averagings to cost no CPU of their own")
        return None


def record(bench_dir: Path, wanted: HookProbe) -> HookProbe:
    """BENCH/hooks.json holds a probe of what `wanted` describes (its cpu_s aside): measured now where it holds none,
    or one of another model, batch or threads; the probe."""
    found = read_hooks(bench_dir)
    if found is not None and found.matches(wanted):
        return found
    probe = measure(wanted)
    import torch  # the versions next to the numbers

    bench_dir.mkdir(parents=True, exist_ok=True)
    with written_atomically(bench_dir / HOOKS_FILE) as tmp:  # a link planted there is replaced, never written through
        tmp.write_text(json.dumps({**probe.to_dict(), "torch": torch.__version__, "host": platform.node()}, indent=2)
                       + "\n")
    return probe


def measure(wanted: HookProbe, timeout_s: float = 600.0) -> HookProbe:
    """The probe of `wanted`'s model, batch and threads, in a fresh Python (nothing this process ran reaches it)."""
    from dptrain_bench.peak import probe_in_fresh_python

    args = ["--model", wanted.model, "--image-shape", ",".join(map(str, wanted.image_shape)), "--num-classes",
            str(wanted.num_classes), "--batch", str(wanted.batch), "--threads", str(wanted.threads),
            "--powersgd-rank", str(wanted.powersgd_rank), "--json"]
    return HookProbe.from_dict(probe_in_fresh_python(__name__, args, "the hook probe", timeout_s))


def describe(probe: HookProbe) -> str:
    each = ", ".join(f"{name} {seconds * 1e3:.2f} ms {'a step' if name in HOOKS else 'an exchange'}"
                     for name, seconds in probe.cpu_s.items())
    return (f"{probe.model}, a batch of {probe.batch} a rank, {probe.threads} thread{'s' if probe.threads != 1 else ''}: "
            f"{each}")


# ---------------------------------------------------------------- the probe's own process (torch from here on)

def _probe(wanted: HookProbe) -> HookProbe:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(wanted.threads)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            cpu = {hook: _hook_cpu_s(wanted, hook) for hook in HOOKS}
            cpu |= {name: _averaging_cpu_s(wanted, name) for name in AVERAGING}
        finally:
            dist.destroy_process_group()
    return HookProbe(**{**wanted.__dict__, "cpu_s": cpu})


def _model(wanted: HookProbe) -> Any:
    import torch

    from dptrain.config import ModelConfig
    from dptrain.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name=wanted.model), wanted.image_shape, wanted.num_classes)


def _hook_cpu_s(wanted: HookProbe, hook: str) -> float:
    """The hook's CPU a step beyond DDP's own all-reduce: the difference of the two sides' fastest steps, in turns."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from dptrain.strategies import comm_hooks

    generator = torch.Generator().manual_seed(1)
    images = torch.randn(wanted.batch, *wanted.image_shape, generator=generator)
    labels = torch.randint(0, wanted.num_classes, (wanted.batch,), generator=generator)

    def trainer(name: str) -> Any:
        ddp = DistributedDataParallel(_model(wanted), gradient_as_bucket_view=True)
        comm_hooks.install(ddp, name, wanted.powersgd_rank, comm_hooks.CommCounter())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step() -> float:
            started = time.process_time()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(images), labels).backward()
            optimizer.step()
            return time.process_time() - started

        for _ in range(WARM_STEPS):
            step()
        return step

    plain, hooked = trainer("allreduce"), trainer(hook)
    pairs = [(plain(), hooked()) for _ in range(STEPS)]
    return max(0.0, min(h for _, h in pairs) - min(p for p, _ in pairs))


def _averaging_cpu_s(wanted: HookProbe, name: str) -> float:
    """The strategy's exchange as on two ranks (the sum over the group of one), CPU a call: the fastest of CALLS."""
    import torch

    from dptrain.config import StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.base import OptimizerSpec
    from dptrain.strategies.registry import build_strategy

    as_two = DistEnv(0, 0, 2, 2, "127.0.0.1", 0, "none")  # the world it averages over; the group holds this process
    strategy = build_strategy(StrategyConfig(name=name), as_two, torch.device("cpu"))
    model = strategy.wrap(_model(wanted))
    optimizer = strategy.build_optimizer(model, OptimizerSpec(torch.optim.SGD, {"lr": 1e-3}))
    for p in model.parameters():  # one step, so that the optimizer has its state
        p.grad = torch.zeros_like(p)
    optimizer.step()
    calls = []
    for _ in range(CALLS):
        started = time.process_time()
        strategy.exchange()  # type: ignore[attr-defined]  # local_sgd's and diloco's
        calls.append(time.process_time() - started)
    return min(calls)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The internal entry's options (the command takes the run's options instead: cli.cmd_probe_hooks)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-shape", required=True)
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dptrain_bench.hook_probe")
    add_options(parser)
    args = parser.parse_args(argv)
    wanted = HookProbe(model=args.model, image_shape=tuple(int(n) for n in args.image_shape.split(",")),
                       num_classes=args.num_classes, batch=args.batch, threads=args.threads,
                       powersgd_rank=args.powersgd_rank, cpu_s={})
    probe = _probe(wanted)
    print(json.dumps(probe.to_dict()) if args.json else describe(probe))
    return 0


def batch_per_rank(global_batch: int, ranks: int) -> int:
    """The samples a rank computes a step when `ranks` share the global batch (at least one)."""
    return max(1, math.ceil(global_batch / ranks))


if __name__ == "__main__":
    sys.exit(main())
