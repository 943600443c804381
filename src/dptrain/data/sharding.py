"""Which samples each rank takes: pure functions of (n, seed, epoch, batch, rank, world_size).

The rule that makes every world size train the same model: each epoch has one permutation of
the split, made from (seed, epoch) alone; global batch k is permutation[k*B : (k+1)*B] whatever
the world size; rank r takes the r-th contiguous share of it. The last batch may be partial: it is
shared out unevenly (shares differ by at most one sample, some may be empty), never dropped and
never padded with duplicates.
"""

from __future__ import annotations

import torch


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's sample order, on the CPU so that it is identical on every device type."""
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def num_batches(n: int, global_batch: int) -> int:
    return -(-n // global_batch)


def global_batch_bounds(n: int, global_batch: int, k: int) -> tuple[int, int]:
    """[start, stop) of global batch k in the epoch's permutation."""
    assert 0 <= k < num_batches(n, global_batch), (k, n, global_batch)
    start = k * global_batch
    return start, min(start + global_batch, n)


def rank_share(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's share of `count` items; shares differ by at most one, earlier ranks larger."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def rank_batch_positions(n: int, global_batch: int, k: int, rank: int | None, world_size: int) -> tuple[int, int, int]:
    """(start, stop, global_count): rank's slice of global batch k, as positions in the permutation.

    rank None is a rank that takes no data (a dedicated parameter server): an empty slice.
    """
    g_start, g_stop = global_batch_bounds(n, global_batch, k)
    if rank is None:
        return g_start, g_start, g_stop - g_start
    r_start, r_stop = rank_share(g_stop - g_start, rank, world_size)
    return g_start + r_start, g_start + r_stop, g_stop - g_start
