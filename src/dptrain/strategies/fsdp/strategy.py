"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

reshard_after_forward=true frees each unit's gathered parameters after its forward and gathers
them again for backward (FULL_SHARD, ZeRO-3); false keeps them until backward (SHARD_GRAD_OP,
ZeRO-2), trading memory for one all-gather less per step. The root's own parameters (all of them
under wrap whole) stay gathered from forward to backward either way, as torch's default for the root:
backward needs them first, so freeing them would only gather them again at once.
"""

from __future__ import annotations

import contextlib
import typing
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dptrain.config import StrategyConfig
from dptrain.errors import ConfigError
from dptrain.strategies import shared_memory
from dptrain.strategies.base import Strategy
from dptrain.strategies.fsdp.options import SPEC, FloatDtype

DTYPES = {name: None if name == "auto" else getattr(torch, name) for name in typing.get_args(FloatDtype)}
"""strategy.fsdp's dtype options -> torch's dtype of that name; None: the parameters' own dtype, no cast (FSDP's
default)."""


def blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The root's children that hold parameters, one level into plain containers (ResNet's stages)."""
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child) > 1:
            yield from (c for c in child.children() if any(True for _ in c.parameters()))
        elif any(True for _ in child.parameters()):
            yield child


def units(model: nn.Module, wrap: str, min_params: int) -> list[nn.Module]:
    """The modules sharded as units of their own before the root (strategy.fsdp.wrap): block, blocks(model); size,
    innermost first, every module whose parameters not in a unit already reach min_params; whole, none."""
    if wrap == "whole":
        return []
    if wrap == "block":
        return list(blocks(model))
    found: list[nn.Module] = []

    def left(module: nn.Module) -> int:  # the module's parameters outside the units found below it
        count = sum(p.numel() for p in module.parameters(recurse=False)) + sum(left(c) for c in module.children())
        if module is not model and count >= min_params:
            found.append(module)
            return 0
        return count

    left(model)
    return found


def channels_last_convolutions(model: nn.Module) -> list[nn.Conv2d]:
    """The 2-D convolutions whose weights are laid out channels_last (train.channels_last), told by the strides
    themselves: a weight of one input channel is contiguous in both layouts, but its strides differ."""
    def laid_out_channels_last(weight: torch.Tensor) -> bool:
        n, c, h, w = weight.shape
        return weight.stride() == (c * h * w, 1, w * c, c) != (c * h * w, h * w, w, 1)

    return [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.dim() == 4 and laid_out_channels_last(m.weight)]


def channels_last_inputs(conv: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the convolution's input in channels_last (a copy unless it is already), so that oneDNN runs
    its channels_last kernels though FSDP2 gathers the weight in NCHW. For the tutorials' CNN on one CPU thread a
    step's forward and backward take 48 ms instead of 67 in NCHW, the same as with channels_last weights. The same
    function: only the order of the sums inside the convolutions may differ."""
    if args and torch.is_tensor(args[0]) and args[0].dim() == 4:
        return (args[0].to(memory_format=torch.channels_last), *args[1:])
    return args


class SharedMemoryCollectives:
    """FSDP2's all-gather and reduce-scatter (set_custom_all_gather, set_custom_reduce_scatter) for CPU ranks all on
    one host, through the shared buffer and FIFO barriers of strategies.shared_memory instead of gloo's TCP loopback.

    On gloo, 2 ranks, the tutorials' CNN (1.2 M parameters): the whole model's all-gather took 3.6 ms, its
    reduce-scatter 7.1 ms (gloo reduce-scatters as an all-reduce of the whole tensor), and each small unit's 0.6 to
    1 ms; a step of block units runs 12 of them (`python perf/fsdp_profile.py`).

    The buffer is used as two halves in turn, a slot per rank in each. A piece of a collective writes this rank's slot,
    waits at one barrier, then reads the other ranks' slots. One barrier a piece is enough: a rank writes into a half
    again two pieces later, past the barrier of the piece between, which every rank reaches only after it has read
    this piece. Each element of a reduce-scatter is summed by the rank that keeps it, in rank order: the same sum on
    every rank, and with two ranks gloo's bits (a + b = b + a). The duck-typed interface of FSDP2's (private)
    _fsdp_api.AllGather and ReduceScatter: allocate() and a call; the call ends with the collective done (no Work).
    """

    def __init__(self, transport: shared_memory.SharedMemoryAllReduce) -> None:
        self.transport, self.rank, self.world = transport, transport.rank, transport.world
        slot_bytes = transport.buffer.numel() // (2 * self.world)
        self.slot_bytes = slot_bytes - slot_bytes % 8  # every slot starts at a whole float64 (its view needs it)
        assert self.slot_bytes >= self.world * 8, "FSDP._share_memory sizes the buffer for one element per rank at least"
        self.turn = 0  # which half the next piece uses

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The slots of the next piece's half, as flat tensors of dtype."""
        half = self.turn * self.world * self.slot_bytes
        self.turn ^= 1
        return [self.transport.buffer[half + r * self.slot_bytes:half + (r + 1) * self.slot_bytes].view(dtype)
                for r in range(self.world)]

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """output = the ranks' inputs one after the other (FSDP's input is already this rank's part of the output)."""
        n, out = input_tensor.numel(), output_tensor.view(-1).view(self.world, -1)
        per_piece = self.slot_bytes // input_tensor.element_size()
        for start in range(0, n, per_piece):
            end = min(n, start + per_piece)
            slots = self._slots(input_tensor.dtype)
            slots[self.rank][:end - start].copy_(input_tensor.view(-1)[start:end])
            self.transport.barrier()
            for r in range(self.world):
                if r != self.rank or out[r].data_ptr() != input_tensor.data_ptr():
                    out[r, start:end].copy_(slots[r][:end - start])

    def reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, average: bool) -> None:
        """output = this rank's part of the sum (or mean) over the ranks of their inputs."""
        parts, out = input_tensor.view(-1).view(self.world, -1), output_tensor.view(-1)
        n = out.numel()
        per_piece = self.slot_bytes // input_tensor.element_size() // self.world
        for start in range(0, n, per_piece):
            end = min(n, start + per_piece)
            length = end - start
            slots = [s[:self.world * length].view(self.world, length) for s in self._slots(input_tensor.dtype)]
            slots[self.rank].copy_(parts[:, start:end])
            self.transport.barrier()
            mine = [s[self.rank] for s in slots]
            if self.world == 2:
                torch.add(mine[0], mine[1], out=out[start:end])
            else:
                torch.sum(torch.stack(mine), dim=0, out=out[start:end])
        if average:
            out.div_(self.world)


class SharedMemoryAllGather:
    """FSDP2's all-gather hook over SharedMemoryCollectives."""

    def __init__(self, collectives: SharedMemoryCollectives) -> None:
        self.collectives = collectives
        self.allocate = collectives.allocate

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        self.collectives.all_gather(output_tensor, input_tensor)


class SharedMemoryReduceScatter:
    """FSDP2's reduce-scatter hook over SharedMemoryCollectives: sum or mean (what FSDP asks for in float32 and
    lower precisions, where it leaves the division to the collective); any other reduction goes to gloo."""

    def __init__(self, collectives: SharedMemoryCollectives) -> None:
        self.collectives = collectives
        self.allocate = collectives.allocate

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
            self.collectives.reduce_scatter(output_tensor, input_tensor, average=op == dist.ReduceOp.AVG)
        else:
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)


class FSDP(Strategy):
    """Traffic computed per step: all-gather of the parameters in forward (and again in backward for the units under
    the root when resharding), reduce-scatter of the gradients, in their dtypes. Through gloo each is (N-1)/N of the
    bytes (a ring); through shared memory, what a rank writes there for the others: its shard of each all-gather and
    the whole of each reduce-scatter's input."""

    spec = SPEC
    step_is_local = False  # collectives inside the step
    fp16_refusal = ("train.fp16's torch.amp.GradScaler would look for overflow in each rank's shard of the gradients "
                    "alone, and skip the update on some ranks only; use strategy.fsdp.param_dtype bfloat16 or "
                    "--train.bf16 true, or strategy ddp.")
    shared_memory_collectives: SharedMemoryCollectives | None = None
    """The all-gathers and reduce-scatters through /dev/shm (CPU ranks all on one host), once wrapped; None: gloo's."""

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int, on_cpu: bool, torch_version: str) -> None:
        """FSDP2 runs on the CPU (gloo) from torch 2.7 on; 2.6 fails in the first step ('Stream' has no record_event)."""
        from torch.torch_version import TorchVersion

        if on_cpu and TorchVersion(torch_version) < (2, 7):
            raise ConfigError(f"strategy fsdp on the CPU needs torch 2.7 or newer, and this is torch {torch_version}; "
                              f"use --strategy.name ddp or zero1, or upgrade torch.")

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 shards contiguous parameters only: channels_last weights go back to NCHW. A convolution runs in
        # channels_last when its input or its weight is, so those convolutions get their inputs in channels_last
        # instead (see channels_last_inputs).
        kept_channels_last = channels_last_convolutions(model)
        model = model.to(self.device, memory_format=torch.contiguous_format)
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[self.cfg.fsdp.param_dtype], reduce_dtype=DTYPES[self.cfg.fsdp.reduce_dtype])
        inner = units(model, self.cfg.fsdp.wrap, self.cfg.fsdp.wrap_min_params)
        in_units = {p for unit in inner for p in unit.parameters()}
        self.numel_in_units = sum(p.numel() for p in in_units)
        for unit in inner:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.cfg.fsdp.reshard_after_forward, mp_policy=policy)
        # The root is never resharded after forward (torch's own default for it): backward starts with the root's
        # parameters, so resharding them would free them only to gather them again right away, which costs one
        # all-gather of them a step (under wrap whole, of the whole model: 2 instead of 1 a step) and saves no memory
        # (backward's peak holds them anyway). The sums are the same.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        for conv in kept_channels_last:
            conv.register_forward_pre_hook(channels_last_inputs)
        if self.uses_shared_memory():
            self._share_memory(model, inner)
        self.module = model
        return model

    def _share_memory(self, model: nn.Module, inner: list[nn.Module]) -> None:
        """Every unit's all-gathers and reduce-scatters through /dev/shm, where the buffer can be set up."""
        # Room for the whole model's reduce-scatter input from every rank, twice (SharedMemoryCollectives' halves),
        # with a row of padding per parameter and 8 elements for the slots' alignment; shared_memory caps the buffer
        # (32 MiB), and a larger unit goes through in pieces.
        world = self.env.world_size
        numel = sum(p.numel() for p in model.parameters()) + world * sum(1 for _ in model.parameters())
        dtypes = [d for d in (DTYPES[self.cfg.fsdp.param_dtype], DTYPES[self.cfg.fsdp.reduce_dtype]) if d is not None]
        element_size = max([d.itemsize for d in dtypes] + [p.element_size() for p in model.parameters()])
        transport = shared_memory.open_on_this_host(max_numel=-(-2 * world * numel // (world + 1)) + 8,
                                                    element_size=element_size, timeout_s=self.timeout_s)
        if transport is None:
            return
        collectives = self.shared_memory_collectives = SharedMemoryCollectives(transport)
        for unit in [*inner, model]:
            unit.set_custom_all_gather(SharedMemoryAllGather(collectives))
            unit.set_custom_reduce_scatter(SharedMemoryReduceScatter(collectives))

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """FSDP2's set_requires_gradient_sync on every unit: the micro-batches before a step's last keep their unsharded
        gradients and add to them, and the last one's backward reduce-scatters the sum, once. Each micro-batch still
        gathers the parameters it computes with (comm_bytes counts those)."""
        assert self.module is not None, "wrap() first"
        self.module.set_requires_gradient_sync(sync)  # type: ignore[operator]  # an FSDPModule's, since wrap()
        return contextlib.nullcontext()

    def uses_shared_memory(self) -> bool:
        """CPU ranks, all on this host: FSDP's collectives go through shared memory (a decision every rank makes alike).
        A buffer that cannot be set up leaves them on gloo."""
        return shared_memory.all_on_this_host(self.device, self.env)

    def comm_bytes(self, steps: int) -> int:
        world = self.env.world_size
        numel = sum(p.numel() for p in self.eval_module.parameters())  # DTensor numel: the full size
        # Gathered once a step: the root's own parameters, and every unit's unless resharded after forward (twice).
        gathered = numel + (self.numel_in_units if self.cfg.fsdp.reshard_after_forward else 0)
        own_size = next(self.eval_module.parameters()).element_size()
        param_size = getattr(DTYPES[self.cfg.fsdp.param_dtype], "itemsize", own_size)
        reduce_size = getattr(DTYPES[self.cfg.fsdp.reduce_dtype], "itemsize", own_size)
        # Every micro-batch (train.accumulate_steps) gathers the parameters again; the gradients are reduced once.
        gathered *= self.micro_batches
        if self.shared_memory_collectives is not None:
            per_step = gathered * param_size // world + numel * reduce_size
        else:
            per_step = (gathered * param_size + numel * reduce_size) * (world - 1) // world
        return steps * per_step
