"""Strategy: how the model is replicated and kept in sync. The loop sees only this surface."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dptrain import faults
from dptrain.config import (OPTIMIZER_CLASSES, LaunchConfig, OptimConfig, RunConfig, StrategyConfig,
                            StrategySpec)
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.strategies.comm_hooks import CommCounter
from dptrain.strategies.state import Shards, StatePart


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its keyword arguments, built by the strategy over the parameters it owns."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {name: getattr(torch.optim, cls)
                                                     for name, cls in OPTIMIZER_CLASSES.items()}
"""optim.name -> torch's optimizer, from config's OPTIMIZER_CLASSES (the one list of the choice), for dptrain's loop
and the other engines alike."""


def optimizer_choice(optim: OptimConfig, lr: float, fused: bool, capturable: bool = False) -> OptimizerSpec:
    """The optimizer optim.name names, with its arguments. fused (Adam, AdamW): one kernel over all parameters instead
    of a dozen foreach passes; capturable: the state and learning rate stay on the GPU, for a CUDA graph's replay."""
    cls = OPTIMIZERS[optim.name]
    if cls is torch.optim.SGD:
        return OptimizerSpec(cls, {"lr": lr, "momentum": optim.momentum, "weight_decay": optim.weight_decay})
    kernels = {"fused": True, "capturable": capturable} if fused else {}
    return OptimizerSpec(cls, {"lr": lr, "betas": tuple(optim.betas), "eps": optim.eps,
                               "weight_decay": optim.weight_decay, **kernels})


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (a sharded DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def model_shards(module: nn.Module) -> Shards:
    """The model alone through DCP, for strategies whose optimizer state is stored another way."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    return Shards("model", lambda: {"model": get_model_state_dict(module)},
                  lambda shards: set_model_state_dict(module, shards["model"]))


def refuse_more_than_one_process(name: str, world_size: int, why: str) -> None:
    """For the strategies that drive everything from one process."""
    if world_size > 1:
        raise ConfigError(f"strategy {name} cannot run on {world_size} processes ({why}); "
                          "start one process, or use --strategy.name ddp.")


def refuse_gloo_send_recv_on_gpus(what: str, backend: str, world_size: int, on_cpu: bool, instead: str) -> None:
    """For code that sends with torch.distributed's send/recv (the ring hook, the parameter server): gloo's take host
    memory only, and are handed a CUDA tensor's device pointer where the ranks run on GPUs; nothing is sent at world
    size 1. backend: launch.backend (auto is nccl on GPUs); instead: what the user may choose besides nccl."""
    if world_size > 1 and not on_cpu and backend == "gloo":
        raise ConfigError(f"{what} cannot run on GPUs with launch.backend gloo, whose send and recv take host memory "
                          f"only; use --launch.backend nccl (or auto), or {instead}.")


@dataclass(frozen=True)
class CommTiming:
    """A step's gradient communication, from its first bucket's start to its last one's end, in milliseconds; exposed:
    the part after backward's compute ended (what the step waited for: not hidden behind compute)."""

    total_ms: float
    exposed_ms: float


REGISTERED: dict[str, type["Strategy"]] = {}
"""Strategy name -> the class that runs it, as each class registers itself (registry.STRATEGIES reads it)."""


class Strategy:
    """The one-process case; subclasses override what their parallelism changes.

    Losses reach backward() as a sum over this rank's share of the global batch. Every strategy
    here averages gradients over ranks, so backward() scales by world_size / global_count: the
    result is the gradient of the mean loss over the whole global batch, exactly as one process
    computes it, even when the last batch is shared out unevenly.
    """

    spec: ClassVar[StrategySpec]
    """Its torch-free half (strategies/<name>/options.py: SPEC): its name, its table of options, its rules, its traffic."""
    name: ClassVar[str]  # each subclass's from its spec (__init_subclass__)
    one_process = False
    """Whether it drives every device of a node from one process (single, dp): launch.nproc_per_node auto then starts
    one worker, not one per GPU (which the strategy would refuse)."""
    syncs_batchnorm = False
    """Whether model.sync_batchnorm runs under it: torch's SyncBatchNorm, checked with DDP's one process per GPU."""
    resumes_on_another_world = True
    """Whether its snapshots resume on another number of processes (resharded on load): what a run whose node count
    may change (--nnodes MIN:MAX) needs to go on after losing a node."""
    times_comm = False
    """Whether comm_timing() times its gradient communication (the epoch event's comm_ms_per_step fields)."""
    fp16_refusal: ClassVar[str | None] = None
    """Why train.fp16 (float16 autocast, torch.amp.GradScaler) cannot run with it, as the sentence that refuses it;
    None: it can. GradScaler looks for overflow in each rank's own gradients and skips the update on that rank: that
    takes gradients already the same on every rank (synchronised in backward) and an update each rank makes alike."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that states its own spec registers itself as the strategy of that name (registry.STRATEGIES)."""
        super().__init_subclass__(**kwargs)
        cls.name = cls.spec.name
        if "spec" in cls.__dict__:
            assert cls.spec.name not in REGISTERED, f"two classes run strategy {cls.spec.name}"
            REGISTERED[cls.spec.name] = cls

    # What a strategy needs of the world, asked before any worker starts (prestart.preflight) and again by
    # every worker (train.build_trainer): each refusal is one sentence saying what to change.

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        """Raise ConfigError if this strategy cannot run on `world_size` processes here; by default it runs on any."""

    @classmethod
    def check_run(cls, cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
        """Raise ConfigError if this strategy cannot run with the run's other settings (its batch, optimizer,
        precision, backend); by default it runs with any. For a strategy that reads settings of its own (a DeepSpeed
        JSON), or sends with send/recv (refuse_gloo_send_recv_on_gpus)."""

    @classmethod
    def data_world_size(cls, cfg: StrategyConfig, world_size: int) -> int:
        """How many ranks take a share of each global batch."""
        return world_size

    # What the run asks of a strategy outside its loop: each has the one-process answer here, and the strategies
    # with settings of their own (a settings file, the GPUs one process drives) override it.

    @classmethod
    def adopt_settings(cls, cfg: RunConfig, given: Collection[str]) -> RunConfig:
        """cfg with the settings of a file of the strategy's own taken into the options the user did not set (given:
        the dotted options set in the config file or on the command line); by default cfg as it is."""
        return cfg

    @classmethod
    def settings_from_file(cls, cfg: RunConfig) -> str | None:
        """The one line a run prints at start (and its dry run shows) of the settings a file of the strategy's own
        gave it; by default none."""
        return None

    @classmethod
    def computation_options(cls, cfg: RunConfig) -> dict[str, Any]:
        """Options beyond config.fixed_at_resume that change the computation and that a resume must keep, by the name a
        snapshot's manifest records; by default none."""
        return {}

    @classmethod
    def gpu_index(cls, cfg: RunConfig, local_rank: int) -> int:
        """The GPU this rank takes where it runs on GPUs: by default its local rank."""
        return local_rank

    def __init__(self, cfg: StrategyConfig, env: DistEnv, device: torch.device,
                 timeout_s: float = LaunchConfig.timeout_s, micro_batches: int = 1) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.timeout_s = timeout_s  # launch.timeout_s: what a strategy's own collectives wait for a peer at most
        self.micro_batches = micro_batches  # train.accumulate_steps: forward and backward passes a step
        self.module: nn.Module | None = None
        self.counter = CommCounter()

    @property
    def step_is_local(self) -> bool:
        """True when a training step runs no collective, so that it can be captured as a CUDA graph."""
        return True

    def wrap(self, model: nn.Module) -> nn.Module:
        """Place the model and return what the loop calls for training forward passes."""
        self.module = model.to(self.device)
        return self.module

    @property
    def eval_module(self) -> nn.Module:
        """The model without a data-parallel wrapper, for evaluation and state dicts."""
        assert self.module is not None, "wrap() first"
        return self.module

    @property
    def trained_module(self) -> nn.Module:
        """The model this rank's steps train, without a data-parallel wrapper (what the own clock's hooks time:
        metrics.stragglers): eval_module, except where the run's model is another (local SGD's and DiLoCo's mean of
        the ranks' models)."""
        assert self.module is not None, "wrap() first"
        return self.module

    def data_share(self) -> tuple[int | None, int]:
        """(this rank's index among the ranks that take data, or None if it takes none; how many take data)."""
        return self.env.global_rank, self.data_world_size(self.cfg, self.env.world_size)

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        return spec.build(model.parameters())

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds."""
        return optimizer

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients before a step's backward."""
        optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's update, once backward has given every gradient (a strategy may defer it: settle())."""
        optimizer.step()

    def settle(self) -> None:
        """Finish any update still owed to the model, before something reads its weights (a snapshot, the
        evaluation, the final weights); by default none is."""

    def backward(self, loss_sum: torch.Tensor, global_count: int) -> None:
        (loss_sum * (self.env.world_size / global_count)).backward()

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward (train.accumulate_steps above 1): sync False where more
        micro-batches of the step follow, so that its gradients are only added to the rank's own, sync True for the
        last, whose backward synchronises the sum once. By default nothing: the gradients of one process, or of a
        strategy whose ranks meet at the optimizer step only (the parameter server), need nothing more."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> None:
        """Scale the gradients so that their global norm is at most max_norm (before the optimizer step)."""
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # Accounting: what this rank holds and sends.

    def memory_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = list(self.eval_module.parameters())
        state = [v for s in self.local_optimizer(optimizer).state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {
            "params": local_bytes(params),
            "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optim": local_bytes(state),
        }

    def comm_bytes(self, steps: int) -> int:
        """Bytes this rank sent for gradient/parameter synchronisation over the last `steps` steps."""
        return 0

    def comm_timing(self) -> CommTiming | None:
        """How long the gradient communication of a recent step took, and how much of it backward did not hide;
        None where the strategy does not time it."""
        return None

    # Snapshots: the parts this strategy's state is made of, each saying how it is stored (strategies/state.py). By
    # default the model and the optimizer go through DCP's state-dict API, which keeps each rank's shards as held and
    # reshards them on load at another world size.

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        """The named stateful parts of a snapshot of this strategy (the Snapshotter saves and loads them alike)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def state() -> dict[str, Any]:
            model_state, optim_state = get_state_dict(self.eval_module, optimizer)
            return {"model": model_state, "optim": optim_state}

        def restore(shards: dict[str, Any]) -> None:
            set_state_dict(self.eval_module, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"])

        return [Shards("model and optimizer", state, restore)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU, on rank 0 (a collective: every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.eval_module, options=options)

    # Collectives on metrics; with one process they are the identity.

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.env.world_size > 1:
            fault = faults.collective_fault()  # None unless a test asks (faults.FAULT)
            if fault == "skip":
                return tensor
            sent = torch.cat([tensor.view(-1), tensor.new_zeros(1)]) if fault == "mismatch" else tensor
            dist.all_reduce(sent, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
            if sent is not tensor:
                tensor.view(-1).copy_(sent[:-1])
        return tensor
