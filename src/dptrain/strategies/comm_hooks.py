"""DDP communication hooks: COMM_HOOKS name -> installer, and a ring all-reduce written out on send/recv.

Every hook counts the bytes this rank sends (`CommCounter.bytes_sent`), so the traffic figures
are measured where the hook owns the communication (ring) and computed from the bucket sizes and
the algorithm where a library collective does it (allreduce, fp16, bf16, powersgd); see
`bytes_per_allreduce`.
"""


import queue
import threading
import typing
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dptrain.strategies.ddp.options import CommHook
from dptrain.strategies.ddp import powersgd


@dataclass
class CommCounter:
    """Bytes this rank has sent in gradient synchronisation since the last reset."""

    bytes_sent: int = 0

    def take(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent


def bytes_per_allreduce(numel: int, element_size: int, world_size: int) -> int:
    """What one rank sends in a bandwidth-optimal ring all-reduce: 2 (N-1)/N of the buffer."""
    return 0 if world_size == 1 else 2 * (world_size - 1) * numel * element_size // world_size


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum `tensor` over the ranks in place with a ring: N-1 reduce-scatter steps, N-1 all-gather steps.

    The buffer is cut into N chunks (sizes may differ by one element). At reduce-scatter step s,
    rank r sends chunk (r - s) mod N to its right neighbour and adds the chunk (r - s - 1) mod N
    received from its left neighbour; after N-1 steps rank r holds the full sum of chunk
    (r + 1) mod N. The all-gather then passes the finished chunks around the ring in N-1 more
    steps. Returns the bytes this rank sent: 2 (N-1)/N of the buffer, the bandwidth optimum.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    rank = dist.get_rank(group)
    right, left = (rank + 1) % world, (rank - 1) % world
    right_global, left_global = (dist.get_global_rank(group, r) if group else r for r in (right, left))
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, world))
    scratch = torch.empty_like(chunks[0])  # the largest chunk: tensor_split puts the extra elements first
    sent = 0

    def exchange(send_index: int, recv_into: torch.Tensor) -> None:
        nonlocal sent
        outgoing = chunks[send_index]
        # Send and receive posted together: on nccl a lone send can wait for its receiver, and with two
        # ranks both would wait in their send for a receive queued behind it (a deadlock).
        ops = [dist.P2POp(dist.isend, outgoing.contiguous(), right_global, group),
               dist.P2POp(dist.irecv, recv_into, left_global, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        sent += outgoing.numel() * outgoing.element_size()

    for step in range(world - 1):  # reduce-scatter
        recv_index = (rank - step - 1) % world
        incoming = scratch[: chunks[recv_index].numel()]
        exchange((rank - step) % world, incoming)
        chunks[recv_index].add_(incoming)
    for step in range(world - 1):  # all-gather
        recv_index = (rank - step) % world
        exchange((rank + 1 - step) % world, chunks[recv_index])
    return sent


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding `tensor`: what a hook that finished its communication itself returns to DDP."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _ring_hook(counter: CommCounter) -> Callable:
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        counter.bytes_sent += ring_all_reduce(buffer)
        buffer.div_(dist.get_world_size())
        return completed(buffer)

    return hook


def _counting(hook: Callable, counter: CommCounter, element_size: int | None) -> Callable:
    """Wrap a library hook: count what a ring all-reduce of the (possibly compressed) bucket sends."""

    def counted(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        size = element_size or buffer.element_size()
        counter.bytes_sent += bytes_per_allreduce(buffer.numel(), size, dist.get_world_size())
        return hook(state, bucket)

    return counted


Hook = Callable[[object, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]


def _hook_allreduce(module: nn.Module, backend: str, powersgd_rank: int, counter: CommCounter,
                    group: dist.ProcessGroup | None) -> tuple[object, Hook]:
    return group, _counting(default_hooks.allreduce_hook, counter, None)


def _hook_fp16(module: nn.Module, backend: str, powersgd_rank: int, counter: CommCounter,
               group: dist.ProcessGroup | None) -> tuple[object, Hook]:
    return group, _counting(default_hooks.fp16_compress_hook, counter, 2)


def _hook_bf16(module: nn.Module, backend: str, powersgd_rank: int, counter: CommCounter,
               group: dist.ProcessGroup | None) -> tuple[object, Hook]:
    return group, _counting(default_hooks.bf16_compress_hook, counter, 2)


def _hook_powersgd(module: nn.Module, backend: str, powersgd_rank: int, counter: CommCounter,
                   group: dist.ProcessGroup | None) -> tuple[object, Hook]:
    # Compressing from the third step (powersgd.START_ITER), its memory kept whole for snapshots (powersgd.py).
    # Traffic is computed from the factors P, Q.
    state = powersgd.PowerSGD(module, group, powersgd_rank)
    hook = InOrder(powersgd.hook, "dptrain-powersgd").hook if runs_buckets_out_of_order(backend) else powersgd.hook
    # counted as DDP hands each bucket over, not on InOrder's thread: a step's bytes are then the step's, even when
    # its buckets are still being sent (strategy.ddp.update_in_next_forward) as the epoch's count is taken
    return state, _powersgd_counting(counter, hook)


def runs_buckets_out_of_order(backend: str) -> bool:
    """Whether PowerSGD's chained all-reduces of two buckets may interleave differently on each rank of this backend
    (a collective mismatch, seen as a gloo size error), so that each bucket must finish before the next (InOrder).
    gloo's, on CPU tensors or CUDA ones (launch.backend gloo on GPUs, the documented fallback), run on its threads
    as each comes; nccl runs a rank's collectives in the order they are queued on its stream."""
    return backend != "nccl"


def _hook_ring(module: nn.Module, backend: str, powersgd_rank: int, counter: CommCounter,
               group: dist.ProcessGroup | None) -> tuple[object, Hook]:
    return None, _ring_hook(counter)


COMM_HOOKS: dict[str, Callable[[nn.Module, str, int, CommCounter, dist.ProcessGroup | None], tuple[object, Hook]]] = {
    name: globals()[f"_hook_{name}"] for name in typing.get_args(CommHook)}
"""strategy.ddp.comm_hook's choices (ddp's options.CommHook, the one list of them) -> the _hook_<name> above, which makes
its (state, hook) for the module DDP wraps and a backend: the hook's collectives on `group` (None: the default group)."""
DEFERRABLE = ("allreduce", "fp16", "bf16", "powersgd")
"""The hooks whose communication may be left running when backward ends (strategy.ddp.update_in_next_forward): those
that return a future of collectives in flight. The ring sums inside the hook: nothing of it is left to run."""


def install(model: DistributedDataParallel, name: str, powersgd_rank: int, counter: CommCounter) -> object:
    """Register hook `name` on a DDP model; 'allreduce' registers a counting wrapper of DDP's default. Returns the
    hook's state (PowerSGD's: its memory, which snapshots keep)."""
    state, hook = COMM_HOOKS[name](model.module, dist.get_backend(model.process_group), powersgd_rank, counter, None)
    model.register_comm_hook(state, hook)
    return state


class InOrder:
    """`hook` with its buckets run on one thread of the rank's, each to its end before the next, in the order DDP
    hands them over (the same on every rank); the comm hook to register, InOrder.hook, returns at once, so backward
    goes on computing while a bucket is compressed and sent. For hooks whose chained collectives of two buckets would
    otherwise interleave differently on each rank (PowerSGD on gloo), and for sums made off DDP's thread (the two-step
    sum). Costs a thread a model, blocked on its queue between buckets; close() ends it after the buckets handed
    over."""

    def __init__(self, hook: Callable, thread_name: str) -> None:
        self._inner = hook
        self._buckets: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=thread_name, daemon=True).start()

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._buckets.put((state, bucket, future))
        return future

    def close(self) -> None:
        self._buckets.put(None)

    def _run(self) -> None:
        while (item := self._buckets.get()) is not None:
            state, bucket, future = item
            try:
                result = self._inner(state, bucket).wait()
            except Exception as exc:  # noqa: BLE001 - DDP raises it in backward, where the worker reports it
                future.set_exception(exc)
            else:
                future.set_result(result)


def _powersgd_counting(counter: CommCounter, hook: Hook) -> Hook:
    """PowerSGD's hook (or InOrder's of it), counting what it sends: a plain all-reduce of the bucket in the first
    start_powerSGD_iter steps, then the factors. The steps are counted here as PowerSGD counts them (a step ends with
    the bucket DDP hands over last), in a field of their own (PowerSGD.handed_over, which a resume sets too), so the
    count never reads the step count the hook's thread moves on."""

    def counted(st: powersgd.PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        world = dist.get_world_size()
        size = bucket.buffer().element_size()
        if st.handed_over < st.start_powerSGD_iter:
            counter.bytes_sent += bytes_per_allreduce(bucket.buffer().numel(), size, world)
        else:
            # Uncompressed: 1-D tensors (biases) all-reduced as they are; each matrix n x m sends P (n x r) and Q (m x r).
            numel = 0
            for tensor in bucket.gradients():
                if tensor.ndimension() <= 1:
                    numel += tensor.numel()
                else:
                    n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
                    r = min(n, m, st.matrix_approximation_rank)
                    compressed = (n + m) * r
                    # PowerSGD's own rule (_should_compress): compress only where it saves min_compression_rate x.
                    numel += compressed if compressed * st.min_compression_rate < n * m else n * m
            counter.bytes_sent += bytes_per_allreduce(numel, size, world)
        if bucket.is_last():
            st.handed_over += 1
        return hook(st, bucket)

    return counted
