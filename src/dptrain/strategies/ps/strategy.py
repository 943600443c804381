"""A parameter server written out on point-to-point send/recv, as the tutorials draw it.

Schedule of one step, N ranks, rank 0 the server:
  1. every rank runs forward and backward on its share of the global batch (no gradient hooks);
     with dedicated_server the server's share is empty, so its gradient is zero;
  2. push: each worker w = 1..N-1 sends its flat gradient to rank 0;
  3. rank 0 receives them in rank order, adds them to its own and divides by N: the mean over
     ranks, exactly what DDP's all-reduce computes;
  4. rank 0 steps the optimizer; only rank 0 ever holds optimizer state;
  5. pull: rank 0 sends the new flat parameters to every worker, which copies them in.
Traffic is counted as sent: each worker sends its gradients, rank 0 sends the parameters N-1 times.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dptrain.config import RunConfig, StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies.base import OptimizerSpec, Strategy, model_shards, refuse_gloo_send_recv_on_gpus
from dptrain.strategies.state import WHOLE_OPTIMIZER, StatePart, WholeFile
from dptrain.strategies.ps.options import SPEC

SERVER = 0


class ServerOptimizer(torch.optim.Optimizer):
    """What the loop steps on every rank: push gradients, rank 0 updates, pull parameters.

    It holds the real optimizer on every rank so that schedulers see the same param_groups, but
    only rank 0 ever steps it, so only rank 0 allocates its state.
    """

    def __init__(self, params: list[nn.Parameter], inner: torch.optim.Optimizer, strategy: "ParameterServer") -> None:
        self.params, self.inner, self.strategy = params, inner, strategy
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.state = inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        assert closure is None, "closures are not supported"
        world, rank = self.strategy.env.world_size, self.strategy.env.global_rank
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        flat = torch.empty_like(grads)
        if rank == SERVER:
            incoming = torch.empty_like(grads)
            for worker in range(1, world):  # push, received in rank order: a deterministic sum
                dist.recv(incoming, worker)
                grads += incoming
            grads /= world
            self._unflatten(grads, into_grads=True)
            if self.strategy.clip_norm is not None:  # on the mean gradient, as one process clips
                nn.utils.clip_grad_norm_(self.params, self.strategy.clip_norm)
            self.inner.step()
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            requests = [dist.isend(flat, worker) for worker in range(1, world)]  # pull
            for request in requests:
                request.wait()
            self.strategy.counter.bytes_sent += (world - 1) * flat.numel() * flat.element_size()
        else:
            dist.send(grads, SERVER)
            self.strategy.counter.bytes_sent += grads.numel() * grads.element_size()
            dist.recv(flat, SERVER)
            self._unflatten(flat, into_grads=False)

    def _unflatten(self, flat: torch.Tensor, into_grads: bool) -> None:
        """Copy `flat` (every tensor in logical, NCHW order, as reshape(-1) gave it) into the gradients or parameters.

        A gradient is rebuilt in its parameter's memory layout: the fused Adam and SGD kernels walk a
        gradient's memory as if laid out like its parameter, so an NCHW gradient of a channels_last
        weight would update each element with another element's gradient. (copy_ into the parameter
        goes by logical index, whatever the layouts.)
        """
        offset = 0
        for p in self.params:
            chunk = flat[offset : offset + p.numel()].view(p.shape)
            if into_grads:
                p.grad = torch.empty_like(p).copy_(chunk)  # empty_like keeps p's strides (channels_last included)
            else:
                p.copy_(chunk)
            offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class ParameterServer(Strategy):
    spec = SPEC
    fp16_refusal = ("train.fp16's torch.amp.GradScaler looks for overflow in each rank's own gradients, which strategy "
                    "ps sums only inside its step, so ranks could disagree on skipping it; use strategy ddp or zero1.")
    step_is_local = False  # collectives inside the step
    clip_norm: float | None = None
    """train.grad_clip, applied by the server to the mean gradient: a worker holds only its partial one."""

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        if cfg.ps.dedicated_server and world_size < 2:
            raise ConfigError("strategy ps with dedicated_server needs at least 2 processes (a server and a worker); "
                              "start more workers.")

    @classmethod
    def check_run(cls, cfg: RunConfig, world_size: int, on_cpu: bool) -> None:
        refuse_gloo_send_recv_on_gpus(f"strategy {cls.name}", cfg.launch.backend, world_size, on_cpu,
                                      "--launch.device cpu")

    @classmethod
    def data_world_size(cls, cfg: StrategyConfig, world_size: int) -> int:
        return world_size - 1 if cfg.ps.dedicated_server else world_size

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> None:
        self.clip_norm = max_norm

    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = model.to(self.device)
        if self.env.world_size > 1:  # every rank starts from the server's weights
            for tensor in self.module.state_dict().values():
                dist.broadcast(tensor, SERVER)
        return self.module

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return ServerOptimizer(params, spec.build(params), self)

    def data_share(self) -> tuple[int | None, int]:
        if not self.cfg.ps.dedicated_server:
            return super().data_share()
        rank = self.env.global_rank  # the workers 1..N-1 take the data as ranks 0..N-2
        return (None if rank == SERVER else rank - 1), self.data_world_size(self.cfg, self.env.world_size)

    def comm_bytes(self, steps: int) -> int:
        return self.counter.take()

    def state_parts(self, optimizer: torch.optim.Optimizer) -> list[StatePart]:
        """The model in DCP; the optimizer state, which only the server holds, as one file written by it."""

        def on_server() -> dict[str, Any] | None:
            return optimizer.state_dict() if self.env.global_rank == SERVER else None

        def restore(state: dict[str, Any]) -> None:
            if self.env.global_rank == SERVER:  # workers never step, so they stay without state
                optimizer.load_state_dict(state)

        return [model_shards(self.eval_module), WholeFile("optimizer", WHOLE_OPTIMIZER, on_server, restore)]
