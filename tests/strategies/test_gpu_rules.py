"""What decides the strategies' GPU paths, on the CPU: the worker count auto gives single and dp, the DDP timers read
on each device, the autocast dtype of nn.DataParallel's replica threads, the backend that puts PowerSGD's buckets in
order, and the refusal of send/recv on gloo with CUDA tensors. What only a GPU shows is in perf/gpu_check.py."""

from __future__ import annotations

import inspect
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain import config
from dptrain.config import LaunchConfig, StrategyConfig
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.prestart import local_workers, workers_for
from dptrain.strategies.registry import STRATEGIES, build_strategy, check_world
from dptrain.strategies import comm_hooks
from dptrain.strategies.comm_hooks import CommCounter, InOrder
from dptrain.strategies.ddp.strategy import comm_timing_from
from dptrain.strategies.dp.strategy import AutocastDataParallel, in_callers_autocast


# Finding 2: `nproc_per_node = auto` on a machine with 2+ GPUs started one worker per GPU, which single and dp refuse.

@pytest.mark.parametrize("name", ["single", "dp"])
def test_auto_starts_one_worker_for_the_strategies_that_drive_every_gpu_from_one_process(name):
    assert STRATEGIES[name].one_process
    assert workers_for("auto", 8, STRATEGIES[name].one_process) == 1
    check_world(config.load(None, [("strategy.name", name)]), workers_for("auto", 8, True), 1000, on_cpu=False)


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name not in ("single", "dp")])
def test_auto_starts_one_worker_per_gpu_for_the_others_and_one_on_the_cpu(name):
    assert not STRATEGIES[name].one_process
    assert workers_for("auto", 4, STRATEGIES[name].one_process) == 4
    assert workers_for("auto", 0, STRATEGIES[name].one_process) == 1
    assert workers_for(3, 8, STRATEGIES[name].one_process) == 3


def test_local_workers_asks_the_strategy(monkeypatch):
    """local_workers reads the machine's GPU count and the strategy's rule (here 4 pretend GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    launch = LaunchConfig()
    assert local_workers(launch, StrategyConfig(name="dp")) == 1
    assert local_workers(launch, StrategyConfig(name="single")) == 1
    assert local_workers(launch, StrategyConfig(name="ddp")) == 4
    assert local_workers(launch) == 4  # no strategy named: one that runs a process a GPU
    assert local_workers(LaunchConfig(nproc_per_node=2), StrategyConfig(name="dp")) == 2  # a number as given


# Finding 3: on CUDA the host stamps of DDP's events say when the work was queued, not when it ran.

# A sampled step as DDP's logging data gives it (ns): the host stamps span 40 us (the nccl calls returning at once), the
# CUDA events 3 ms of communication, 2 ms of it under backward's compute.
TIMERS = {"backward_comm_time_start": 1_000_000, "backward_compute_time_end": 1_030_000,
          "backward_comm_time_end": 1_040_000, "backward_comm_time": 3_000_000,
          "backward_compute_comm_overlap_time": 2_000_000}


def test_on_cuda_the_timing_is_ddps_cuda_event_durations():
    timing = comm_timing_from(TIMERS, "cuda")
    assert timing is not None
    assert (timing.total_ms, timing.exposed_ms) == (3.0, 1.0)


def test_on_the_cpu_the_timing_is_the_host_stamps():
    timing = comm_timing_from(TIMERS, "cpu")
    assert timing is not None
    assert (timing.total_ms, timing.exposed_ms) == pytest.approx((0.04, 0.01))


def test_no_timing_before_ddps_first_sampled_step():
    assert comm_timing_from({}, "cuda") is None
    assert comm_timing_from({}, "cpu") is None
    # No overlap measured (the one bucket started after the compute's end: DDP leaves 0): all of it exposed.
    timing = comm_timing_from({"backward_comm_time": 5_000_000, "backward_compute_comm_overlap_time": 0}, "cuda")
    assert timing is not None and timing.exposed_ms == timing.total_ms == 5.0


def test_the_ddp_strategy_reads_the_fields_of_its_device():
    """Through DDP.comm_timing, as the loop calls it, with a stand-in for the wrapped model on a pretend CUDA device."""

    class WrappedOnCuda:
        def _get_ddp_logging_data(self) -> dict:
            return dict(TIMERS)

    for name in ("ddp", "zero1"):
        strategy = build_strategy(StrategyConfig(name=name), DistEnv(0, 0, 2, 2, "127.0.0.1", 0, "torchrun"),
                                  torch.device("cuda", 0))
        strategy.ddp = WrappedOnCuda()  # type: ignore[assignment] - only the logging data is read
        timing = strategy.comm_timing()
        assert timing is not None and (timing.total_ms, timing.exposed_ms) == (3.0, 1.0), name


# Finding 4: nn.DataParallel under train.bf16 ran its replicas in float16.

def torch_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply on the CPU, as it treats autocast: each replica on a thread of its own, which re-enters
    autocast with the caller's on/off only (a thread's dtype is the device's default)."""
    enabled = torch.is_autocast_enabled("cpu")
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        with torch.autocast("cpu", enabled=enabled):
            results[i] = modules[i](*inputs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(modules))]


class RecordsAutocastDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_autocast_dtype("cpu"))
        return x


# The CPU's default autocast dtype is bfloat16, CUDA's float16: on the CPU the caller's float16 plays the part of
# train.bf16's bfloat16, a dtype that is not the thread's default.
CALLERS, THREAD_DEFAULT = torch.float16, torch.get_autocast_dtype("cpu")


def test_a_replica_thread_gets_the_devices_default_dtype_without_the_wrapper():
    """The finding itself: torch's treatment of a replica's thread loses the caller's dtype."""
    assert CALLERS != THREAD_DEFAULT
    replica = RecordsAutocastDtype()
    with torch.autocast("cpu", dtype=CALLERS):
        torch_parallel_apply([replica], [(torch.ones(1),)])
    assert replica.seen == [THREAD_DEFAULT]


def test_each_replica_thread_runs_under_the_callers_autocast_dtype():
    replicas = [RecordsAutocastDtype(), RecordsAutocastDtype()]
    with torch.autocast("cpu", dtype=CALLERS):
        torch_parallel_apply(in_callers_autocast(replicas, "cpu"), [(torch.ones(1),), (torch.ones(1),)])
    assert [r.seen for r in replicas] == [[CALLERS], [CALLERS]]


def test_without_autocast_the_replicas_are_handed_over_as_they_are():
    replicas = [RecordsAutocastDtype()]
    assert in_callers_autocast(replicas, "cpu") == replicas


def test_the_dp_wrapper_hands_its_replicas_over_under_the_callers_autocast(monkeypatch):
    """AutocastDataParallel.parallel_apply, the one dp builds, with torch's replica threads as above."""
    data_parallel = sys.modules["torch.nn.parallel.data_parallel"]  # the module: the package's name is a function

    monkeypatch.setattr(data_parallel, "parallel_apply", torch_parallel_apply)
    wrapper = AutocastDataParallel(nn.Identity())  # on the CPU nn.DataParallel keeps the module and no devices
    wrapper.src_device_obj = torch.device("cpu")  # what it holds on a GPU machine, for the device type
    replicas = [RecordsAutocastDtype(), RecordsAutocastDtype()]
    with torch.autocast("cpu", dtype=CALLERS):
        wrapper.parallel_apply(replicas, [(torch.ones(1),), (torch.ones(1),)], None)
    assert [r.seen for r in replicas] == [[CALLERS], [CALLERS]]


# Finding 7: PowerSGD's buckets were put in order by the parameters' device, not by the backend.

class PretendDDP:
    """What comm_hooks.install reads of a DDP model: its module, its parameters, its process group, the hook
    registered."""

    def __init__(self, device: str) -> None:
        self.params = [nn.Parameter(torch.zeros(4, 4, device=device))]
        self.module = nn.Module()
        self.process_group = None
        self.hooks: list = []

    def parameters(self):
        return iter(self.params)

    def register_comm_hook(self, state, hook) -> None:
        self.hooks.append(hook)


@pytest.mark.parametrize("backend, in_order", [("gloo", True), ("nccl", False)])
def test_powersgd_puts_buckets_in_order_by_the_backend_whatever_the_device(monkeypatch, backend, in_order):
    """Parameters on a device other than the CPU (meta stands in for CUDA): on gloo the buckets still go in order."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    model = PretendDDP("meta")
    comm_hooks.install(model, "powersgd", 1, CommCounter())  # type: ignore[arg-type] - a stand-in
    (counted,) = model.hooks
    hook = inspect.getclosurevars(counted).nonlocals["hook"]  # what the counting wrapper hands each bucket to
    owner = getattr(hook, "__self__", None)
    assert isinstance(owner, InOrder) == in_order
    if owner is not None:
        owner.close()  # ends its thread


# Finding 8: the ring hook and the parameter server send CUDA tensors with gloo's send/recv, which take host memory.

RING_ON_GLOO = [("strategy.ddp.comm_hook", "ring"), ("launch.backend", "gloo")]


@pytest.mark.parametrize("overrides, refused", [
    ([("strategy.name", "ddp"), *RING_ON_GLOO], "strategy ddp with comm_hook ring"),
    ([("strategy.name", "zero1"), *RING_ON_GLOO], "strategy zero1 with comm_hook ring"),
    ([("strategy.name", "ps"), ("launch.backend", "gloo")], "strategy ps"),
])
def test_send_recv_on_gloo_with_cuda_tensors_is_refused(overrides, refused):
    cfg = config.load(None, overrides)
    with pytest.raises(ConfigError) as error:
        check_world(cfg, 2, 1000, on_cpu=False)
    instead = "--launch.device cpu" if refused == "strategy ps" else "another --strategy.ddp.comm_hook"
    assert str(error.value) == (f"{refused} cannot run on GPUs with launch.backend gloo, whose send and recv take host "
                                f"memory only; use --launch.backend nccl (or auto), or {instead}.")


@pytest.mark.parametrize("overrides", [
    [("strategy.name", "ddp"), ("strategy.ddp.comm_hook", "ring")],  # auto: nccl on GPUs
    [("strategy.name", "ddp"), ("strategy.ddp.comm_hook", "ring"), ("launch.backend", "nccl")],
    [("strategy.name", "ddp"), ("strategy.ddp.comm_hook", "powersgd"), ("launch.backend", "gloo")],  # a collective
    [("strategy.name", "ps")],
])
def test_send_recv_runs_on_nccl_and_gloos_collectives_on_gpus(overrides):
    check_world(config.load(None, overrides), 2, 1000, on_cpu=False)


@pytest.mark.parametrize("overrides", [[("strategy.name", "ddp"), *RING_ON_GLOO],
                                       [("strategy.name", "ps"), ("launch.backend", "gloo")]])
def test_send_recv_runs_on_gloo_with_cpu_tensors_or_at_world_size_1(overrides):
    cfg = config.load(None, overrides)
    check_world(cfg, 2, 1000, on_cpu=True)
    check_world(cfg, 1, 1000, on_cpu=False)  # nothing is sent
