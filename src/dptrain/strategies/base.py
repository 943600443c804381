"""Strategy: how the model is replicated and kept in sync. The loop sees only this surface."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dptrain.config import ConfigError, LaunchConfig, RunConfig, StrategyConfig
from dptrain.dist.env import DistEnv
from dptrain.strategies.comm_hooks import CommCounter


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its keyword arguments, built by the strategy over the parameters it owns."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (a sharded DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def refuse_more_than_one_process(name: str, world_size: int, why: str) -> None:
    """For the strategies that drive everything from one process."""
    if world_size > 1:
        raise ConfigError(f"strategy {name} cannot run on {world_size} processes ({why}); "
                          "start one process, or use --strategy.name ddp.")


class Strategy:
    """The one-process case; subclasses override what their parallelism changes.

    Losses reach backward() as a sum over this rank's share of the global batch. Every strategy
    here averages gradients over ranks, so backward() scales by world_size / global_count: the
    result is the gradient of the mean loss over the whole global batch, exactly as one process
    computes it, even when the last batch is shared out unevenly.
    """

    name = "single"

    # What a strategy needs of the world, asked before any worker starts (prestart.preflight) and again by
    # every worker (train.build): each refusal is one sentence saying what to change.

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        """Raise ConfigError if this strategy cannot run on `world_size` processes here; by default it runs on any."""

    @classmethod
    def check_run(cls, cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
        """Raise ConfigError if this strategy cannot run with the run's other settings (its batch, optimizer,
        precision); by default it runs with any. For a strategy that reads settings of its own (a DeepSpeed JSON)."""

    @classmethod
    def data_world_size(cls, cfg: StrategyConfig, world_size: int) -> int:
        """How many ranks take a share of each global batch."""
        return world_size

    def __init__(self, cfg: StrategyConfig, env: DistEnv, device: torch.device,
                 timeout_s: float = LaunchConfig.timeout_s) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.timeout_s = timeout_s  # launch.timeout_s: what a strategy's own collectives wait for a peer at most
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

    def data_share(self) -> tuple[int | None, int]:
        """(this rank's index among the ranks that take data, or None if it takes none; how many take data)."""
        return self.env.global_rank, self.data_world_size(self.cfg, self.env.world_size)

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        return spec.build(model.parameters())

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds."""
        return optimizer

    def backward(self, loss_sum: torch.Tensor, global_count: int) -> None:
        (loss_sum * (self.env.world_size / global_count)).backward()

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

    # Snapshots. The model, and by default the optimizer, go through DCP's state-dict API, which
    # keeps each rank's shards as held and reshards them on load at another world size. Where DCP
    # cannot see into the optimizer (ZeroRedundancyOptimizer, the parameter server's), the strategy
    # sets optimizer_in_dcp = False and gives the whole optimizer state on rank 0 instead, written
    # as one file; that loads at any world size too.
    optimizer_in_dcp = True

    def snapshot_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What DCP writes (and loads in place): the model, and the optimizer if optimizer_in_dcp, as held here."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.optimizer_in_dcp:
            return {"model": get_model_state_dict(self.eval_module)}
        model_state, optim_state = get_state_dict(self.eval_module, optimizer)
        return {"model": model_state, "optim": optim_state}

    def restore_snapshot_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.optimizer_in_dcp:
            set_model_state_dict(self.eval_module, state["model"])
        else:
            set_state_dict(self.eval_module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def whole_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Where not optimizer_in_dcp: the optimizer's whole state on rank 0, None elsewhere (a collective)."""
        return None

    def restore_whole_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"strategy {self.name} keeps its optimizer state in DCP")

    # A strategy whose engine writes its own checkpoint (DeepSpeed) names a subfolder of the snapshot for it.
    # The Snapshotter calls save_own_state on every rank before DCP's write, and load_own_state after DCP's
    # load; verify() reads every file there as plain data, like the others, and requires own_files().
    # Such a snapshot resumes at the world size it was written at only.
    own_folder: str | None = None

    def save_own_state(self, snapshot: Path) -> None:
        """Write this strategy's own state into snapshot / own_folder (every rank; a collective)."""

    def load_own_state(self, snapshot: Path) -> None:
        """Load this strategy's own state from snapshot / own_folder, a verified snapshot (every rank)."""

    @classmethod
    def own_files(cls, manifest: dict[str, Any]) -> set[str]:
        """The files of own_folder that load_own_state reads, relative to the snapshot, for the snapshot of `manifest`."""
        return set()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU, on rank 0 (a collective: every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.eval_module, options=options)

    # Collectives on metrics; with one process they are the identity.

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.env.world_size > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor
