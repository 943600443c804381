"""The sharding rule: pure functions of (n, seed, epoch, batch, rank, world_size)."""

from __future__ import annotations

import pytest
import torch

from dptrain.data.sharding import epoch_permutation, global_batch_bounds, num_batches, rank_batch_positions, rank_share


@pytest.mark.parametrize("world", range(1, 10))
def test_rank_share_partitions_exactly(world):
    for count in range(0, 40):
        shares = [rank_share(count, r, world) for r in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == count
        for (_, stop), (start, _) in zip(shares, shares[1:]):
            assert stop == start  # contiguous, no gap, no overlap
        sizes = [stop - start for start, stop in shares]
        assert all(s >= 0 for s in sizes) and sum(sizes) == count
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # earlier ranks take the extra samples


def test_rank_share_fewer_items_than_ranks():
    assert [rank_share(3, r, 5) for r in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert [rank_share(0, r, 3) for r in range(3)] == [(0, 0)] * 3


def test_num_batches_and_bounds():
    assert num_batches(103, 12) == 9 and num_batches(96, 12) == 8 and num_batches(1, 12) == 1 and num_batches(0, 4) == 0
    assert global_batch_bounds(103, 12, 0) == (0, 12)
    assert global_batch_bounds(103, 12, 8) == (96, 103)  # last batch partial, not dropped, not padded
    with pytest.raises(AssertionError):
        global_batch_bounds(103, 12, 9)


def test_rank_batch_positions_tile_the_epoch():
    n, gb = 103, 12
    for world in (1, 2, 3, 4, 5, 13):
        covered = []
        for k in range(num_batches(n, gb)):
            counts = set()
            for r in range(world):
                start, stop, count = rank_batch_positions(n, gb, k, r, world)
                covered.extend(range(start, stop))
                counts.add(count)
            assert counts == {min(gb, n - k * gb)}
        assert covered == list(range(n))


def test_epoch_permutation_depends_only_on_seed_and_epoch():
    a = epoch_permutation(500, seed=3, epoch=2)
    torch.manual_seed(12345)  # the global RNG plays no part
    torch.rand(10)
    b = epoch_permutation(500, seed=3, epoch=2)
    assert torch.equal(a, b)
    assert sorted(a.tolist()) == list(range(500))
    assert a.device.type == "cpu"


def test_epoch_permutation_differs_across_epochs_and_seeds():
    perms = {(s, e): tuple(epoch_permutation(200, s, e).tolist()) for s in range(3) for e in range(4)}
    assert len(set(perms.values())) == len(perms)
    assert perms[(0, 0)] != tuple(range(200))


def test_epoch_permutation_without_shuffle_is_identity():
    assert epoch_permutation(37, seed=5, epoch=9, shuffle=False).tolist() == list(range(37))
