"""DeviceLoader, GlobalBatchSampler, DatasetLoader, build_loaders: every world size sees the same global batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from dptrain.config import DataConfig
from dptrain.data import build_loaders, describe
from dptrain.data.augment import PAD, draws
from dptrain.data.catalog import DATASETS, Split
from dptrain.data.loader import Batch, DatasetLoader, DeviceLoader, GlobalBatchSampler
from dptrain.data.sharding import epoch_permutation
from dptrain.data.synthetic import synthetic_dataset, synthetic_spec
from dptrain.errors import ConfigError, DataError

from ..user_code import PatternDataset
from .datafiles import write_idx_dataset

CPU = torch.device("cpu")
N, GB = 103, 12  # 103 = 8 * 12 + 7: the last global batch is partial
MNIST, CIFAR = DATASETS["mnist"], DATASETS["cifar10"]


def id_split(n: int = N, shape=(1, 28, 28), seed: int = 0) -> Split:
    """Random images; label i for sample i, so that each batch names its samples."""
    images = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8))
    return Split(images, torch.arange(n))


def device_loader(split, spec=MNIST, *, rank=0, world=1, gb=GB, seed=7, shuffle=True, **kw) -> DeviceLoader:
    return DeviceLoader(split, spec, CPU, global_batch=gb, rank=rank, world_size=world, seed=seed, shuffle=shuffle, **kw)


def normalised(images: torch.Tensor, spec) -> torch.Tensor:
    mean = torch.tensor(spec.mean, dtype=torch.float64).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float64).view(1, -1, 1, 1)
    return ((images.double() / 255.0 - mean) / std).float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # fp32, u = 2^-24: x * scale + shift rounds scale, the product, shift and the sum, and the reference
    # rounds once to float32: <= u (2 |x scale| + |shift| + 2 |out|) <= 14.5u ~ 8.6e-7 (CIFAR's worst channel).
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.allclose(a, b, rtol=0, atol=1e-6))


# ---------------------------------------------------------------- DeviceLoader


def test_device_loader_single_process_follows_the_epoch_permutation():
    split = id_split()
    loader = device_loader(split)
    batches = list(loader.epoch_batches(0))
    assert len(loader) == len(batches) == 9
    order = epoch_permutation(N, 7, 0)
    for k, batch in enumerate(batches):
        assert isinstance(batch, Batch)
        assert batch.labels.tolist() == order[k * GB : (k + 1) * GB].tolist()
        assert batch.global_count == len(batch.labels) == min(GB, N - k * GB)
    assert batches[-1].global_count == 7  # partial: not dropped, not padded


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 3])
def test_device_loader_world_size_invariance(world, epoch):
    split = id_split()
    reference = list(device_loader(split).epoch_batches(epoch))
    per_rank = [list(device_loader(split, rank=r, world=world).epoch_batches(epoch)) for r in range(world)]
    assert all(len(batches) == len(reference) == 9 for batches in per_rank)
    seen = []
    for k, ref in enumerate(reference):
        shares = [batches[k] for batches in per_rank]
        assert torch.equal(torch.cat([s.labels for s in shares]), ref.labels)
        assert close(torch.cat([s.images for s in shares]), ref.images)
        assert {s.global_count for s in shares} == {ref.global_count}
        assert ref.global_count == min(GB, N - k * GB)
        sizes = [len(s.labels) for s in shares]
        assert max(sizes) - min(sizes) <= 1
        seen.extend(torch.cat([s.labels for s in shares]).tolist())
    assert sorted(seen) == list(range(N))  # every sample exactly once in the epoch


def test_device_loader_images_match_their_labels():
    split = id_split()
    for batch in device_loader(split, rank=1, world=3).epoch_batches(1):
        assert close(batch.images, normalised(split.images[batch.labels], MNIST))


def test_device_loader_order_changes_with_epoch_and_seed_only():
    split = id_split()
    labels = lambda loader, e: torch.cat([b.labels for b in loader.epoch_batches(e)]).tolist()  # noqa: E731
    a, b = device_loader(split, seed=7), device_loader(split, seed=7)
    assert labels(a, 0) == labels(b, 0)
    assert labels(a, 0) != labels(a, 1)
    assert labels(a, 0) != labels(device_loader(split, seed=8), 0)
    assert labels(a, 2) == epoch_permutation(N, 7, 2).tolist()


@pytest.mark.parametrize("world", [1, 3])
def test_device_loader_resume_equals_tail_of_full_epoch(world):
    split = id_split()
    for rank in range(world):
        loader = device_loader(split, rank=rank, world=world)
        full = list(loader.epoch_batches(2))
        for k in range(len(full) + 1):
            tail = list(loader.epoch_batches(2, start_batch=k))
            assert len(tail) == len(full) - k
            for got, want in zip(tail, full[k:]):
                assert torch.equal(got.labels, want.labels) and torch.equal(got.images, want.images)
                assert got.global_count == want.global_count


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_device_loader_eval_covers_each_sample_once_in_order(world):
    split = id_split(n=50)
    per_rank = [list(device_loader(split, rank=r, world=world, gb=8 * world, shuffle=False).epoch_batches(0)) for r in range(world)]
    order = [lab for k in range(len(per_rank[0])) for r in range(world) for lab in per_rank[r][k].labels.tolist()]
    assert order == list(range(50))
    # and it ignores the epoch
    again = [b.labels.tolist() for b in device_loader(split, world=world, gb=8 * world, shuffle=False).epoch_batches(5)]
    assert again == [b.labels.tolist() for b in per_rank[0]]


def test_device_loader_empty_shares_keep_their_shape():
    # 97 = 8 * 12 + 1: in the last global batch, rank 0 gets one sample and ranks 1..3 none.
    split = id_split(n=97, shape=(3, 32, 32))
    lasts = [list(device_loader(split, CIFAR, rank=r, world=4).epoch_batches(0))[-1] for r in range(4)]
    assert [len(b.labels) for b in lasts] == [1, 0, 0, 0]
    for b in lasts[1:]:
        assert tuple(b.images.shape) == (0, 3, 32, 32) and b.images.dtype == torch.float32
        assert tuple(b.labels.shape) == (0,) and b.global_count == 1


def test_device_loader_more_ranks_than_samples():
    split = id_split(n=3)
    batches = [list(device_loader(split, rank=r, world=5, gb=5).epoch_batches(0)) for r in range(5)]
    assert [len(b) for b in batches] == [1] * 5
    assert [len(b[0].labels) for b in batches] == [1, 1, 1, 0, 0]
    assert sorted(sum((b[0].labels.tolist() for b in batches), [])) == [0, 1, 2]


@pytest.mark.parametrize("spec", [MNIST, CIFAR], ids=["mnist", "cifar10"])
def test_device_loader_normalisation(spec):
    split = id_split(n=40, shape=spec.shape, seed=3)
    split = Split(torch.cat([split.images, torch.zeros(1, *spec.shape, dtype=torch.uint8), torch.full((1, *spec.shape), 255, dtype=torch.uint8)]), torch.arange(42))
    for batch in device_loader(split, spec, gb=16, shuffle=False).epoch_batches(0):
        assert batch.images.dtype == torch.float32
        assert close(batch.images, normalised(split.images[batch.labels], spec))
    # per channel: pixel 0 maps to -mean/std and 255 to (1 - mean)/std
    last = list(device_loader(split, spec, gb=42, shuffle=False).epoch_batches(0))[0].images
    for c, (m, s) in enumerate(zip(spec.mean, spec.std)):
        # against the exact value: the same <= 14.5u ~ 8.6e-7 rounding as in close()
        assert abs(float(last[40, c, 0, 0]) - (-m / s)) < 1e-6
        assert abs(float(last[41, c, 0, 0]) - ((1 - m) / s)) < 1e-6


def test_device_loader_channels_last_same_values():
    split = id_split(n=20, shape=(3, 32, 32))
    plain = list(device_loader(split, CIFAR, gb=8).epoch_batches(0))
    nhwc = list(device_loader(split, CIFAR, gb=8, channels_last=True).epoch_batches(0))
    for a, b in zip(plain, nhwc):
        assert b.images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


# ---------------------------------------------------------------- GlobalBatchSampler and DatasetLoader


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_global_batch_sampler_matches_device_loader(world, shuffle):
    split = id_split()
    for rank in range(world):
        sampler = GlobalBatchSampler(N, global_batch=GB, rank=rank, world_size=world, seed=7, shuffle=shuffle)
        loader = device_loader(split, rank=rank, world=world, shuffle=shuffle)
        for epoch, start in ((0, 0), (4, 0), (4, 5)):
            sampler.set_epoch(epoch, start)
            want = list(loader.epoch_batches(epoch, start_batch=start))
            assert len(sampler) == len(want) == 9 - start
            assert list(sampler) == [b.labels.tolist() for b in want]
            assert list(sampler.global_counts()) == [b.global_count for b in want]


class UserDataset(Dataset):
    """A user's map-style dataset: (uint8 image tensor, int label)."""

    def __init__(self, split: Split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        return self.split.images[i], int(self.split.labels[i])


def dataset_loader(dataset, *, rank=0, world=1, gb=GB, seed=7, shuffle=True) -> DatasetLoader:
    return DatasetLoader(dataset, CPU, global_batch=gb, rank=rank, world_size=world, seed=seed, shuffle=shuffle, num_workers=0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("make", [UserDataset, lambda s: TensorDataset(s.images, s.labels)], ids=["user", "tensor-dataset"])
def test_dataset_loader_matches_device_loader(world, make):
    split = id_split()
    dataset = make(split)
    for rank in range(world):
        dl = dataset_loader(dataset, rank=rank, world=world)
        dev = device_loader(split, rank=rank, world=world)
        assert len(dl) == len(dev) == 9
        for epoch, start in ((0, 0), (1, 0), (1, 6)):
            got, want = list(dl.epoch_batches(epoch, start)), list(dev.epoch_batches(epoch, start))
            assert len(got) == len(want) == 9 - start
            for g, w in zip(got, want):
                assert g.labels.dtype == torch.int64 and torch.equal(g.labels, w.labels)
                assert g.global_count == w.global_count
                # a user's Dataset is not normalised by dptrain: the raw values, as float
                assert g.images.dtype == torch.float32 and torch.equal(g.images, split.images[w.labels].float())


def test_dataset_loader_empty_share_shape():
    split = id_split(n=97, shape=(3, 32, 32))
    lasts = [list(dataset_loader(UserDataset(split), rank=r, world=4).epoch_batches(0))[-1] for r in range(4)]
    assert [len(b.labels) for b in lasts] == [1, 0, 0, 0]
    for b in lasts[1:]:
        assert tuple(b.images.shape) == (0, 3, 32, 32) and tuple(b.labels.shape) == (0,)
        assert b.global_count == 1


# ---------------------------------------------------------------- build_loaders and describe


@pytest.mark.parametrize("world", [1, 2, 3])
def test_build_loaders_synthetic(world):
    cfg = DataConfig(name="synthetic", synthetic_train_size=70, synthetic_test_size=23, synthetic_shape=(3, 8, 8), synthetic_num_classes=4)
    _, train_split, test_split = synthetic_dataset(cfg)
    built = [
        build_loaders(cfg, device=CPU, global_batch=12, eval_batch=5, rank=r, world_size=world, seed=1, channels_last=False)
        for r in range(world)
    ]
    info = built[0][0]
    assert (info.name, info.image_shape, info.num_classes, info.train_size, info.test_size) == ("synthetic", (3, 8, 8), 4, 70, 23)
    assert all(len(train) == 6 for _, train, _ in built)  # ceil(70 / 12)
    # the test loader: eval_batch per rank, no shuffling, every test sample once over all ranks
    test_batches = [list(test.epoch_batches(0)) for _, _, test in built]
    assert all(len(tb) == -(-23 // (5 * world)) for tb in test_batches)
    images = torch.cat([test_batches[r][k].images for k in range(len(test_batches[0])) for r in range(world)])
    labels = torch.cat([test_batches[r][k].labels for k in range(len(test_batches[0])) for r in range(world)])
    assert torch.equal(labels, test_split.labels)
    assert close(images, normalised(test_split.images, synthetic_spec(cfg)))
    # the train loader: the same global batches as one process
    one = list(build_loaders(cfg, device=CPU, global_batch=12, eval_batch=5, rank=0, world_size=1, seed=1, channels_last=False)[1].epoch_batches(2))
    shares = [list(train.epoch_batches(2)) for _, train, _ in built]
    for k, ref in enumerate(one):
        assert close(torch.cat([rank_batches[k].images for rank_batches in shares]), ref.images)
        assert torch.equal(torch.cat([rank_batches[k].labels for rank_batches in shares]), ref.labels)
    assert sorted(torch.cat([b.labels for b in one]).tolist()) == sorted(train_split.labels.tolist())


def test_build_loaders_user_dataset():
    cfg = DataConfig(name="tests.user_code:PatternDataset")
    info, train, test = build_loaders(cfg, device=CPU, global_batch=16, eval_batch=10, rank=1, world_size=2, seed=0, channels_last=False)
    assert (info.image_shape, info.num_classes, info.train_size, info.test_size) == ((1, 28, 28), None, 96, 37)
    assert isinstance(train, DatasetLoader) and len(train) == 6 and len(test) == 2  # 37 / (10 * 2)
    # global eval batches of 20: [0, 20) and [20, 37); rank 1 takes samples 10..19, then 29..36
    expected = PatternDataset(root="", train=False).labels
    got = [b.labels for b in test.epoch_batches(0)]
    assert [len(b) for b in got] == [10, 8]
    assert torch.equal(got[0], expected[10:20]) and torch.equal(got[1], expected[29:37])


def test_describe_counts_idx_labels_without_reading_images(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 33, 14, gz=True)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(b"garbage")  # not read by describe
    info = describe(DataConfig(name="mnist", root=str(tmp_path)))
    assert (info.name, info.image_shape, info.num_classes, info.train_size, info.test_size) == ("mnist", (1, 28, 28), 10, 33, 14)


def test_describe_synthetic_and_missing(tmp_path):
    info = describe(DataConfig(name="synthetic", synthetic_train_size=11, synthetic_test_size=5, synthetic_shape=(2, 4, 6)))
    assert (info.image_shape, info.train_size, info.test_size) == ((2, 4, 6), 11, 5)
    with pytest.raises(DataError):
        describe(DataConfig(name="mnist", root=str(tmp_path)))
    info = describe(DataConfig(name="mnist", root=str(tmp_path), download=True))  # the workers will fetch it
    assert info.train_size == 60000


# ---------------------------------------------------------------- augmentation in the training loaders


def crop_flipped(images: torch.Tensor, ids: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """The reference, one sample at a time: pad with zeros (black), crop at the drawn offsets, flip if drawn."""
    dy, dx, flip = draws(ids, seed, epoch)
    out = []
    for image, y, x, f in zip(images, dy.tolist(), dx.tolist(), flip.tolist()):
        h, w = image.shape[-2:]
        crop = torch.nn.functional.pad(image, (PAD,) * 4)[:, PAD + y : PAD + y + h, PAD + x : PAD + x + w]
        out.append(crop.flip(-1) if f else crop)
    return torch.stack(out) if out else images[:0]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("spec", [MNIST, CIFAR], ids=["mnist", "cifar10"])
def test_augmented_batches_are_the_normalised_crops_of_their_samples(spec, channels_last):
    split = id_split(shape=spec.shape)
    for batch in device_loader(split, spec, rank=1, world=2, augment="crop-flip", channels_last=channels_last).epoch_batches(3):
        # padded before normalisation: the border is black (-mean/std), as torchvision's recipe has it
        assert close(batch.images, normalised(crop_flipped(split.images[batch.indices], batch.indices, 7, 3), spec))
        assert batch.images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert torch.equal(batch.labels, batch.indices)


@pytest.mark.parametrize("world", [2, 3])
def test_augmented_global_batches_are_the_same_at_every_world_size(world):
    split = id_split(shape=(3, 32, 32))
    reference = list(device_loader(split, CIFAR, augment="crop-flip", channels_last=True).epoch_batches(1))
    per_rank = [list(device_loader(split, CIFAR, rank=r, world=world, augment="crop-flip", channels_last=True).epoch_batches(1))
                for r in range(world)]
    for k, ref in enumerate(reference):
        shares = [batches[k] for batches in per_rank]
        assert torch.equal(torch.cat([s.images for s in shares]), ref.images)  # exactly: same ops per sample
        assert torch.equal(torch.cat([s.labels for s in shares]), ref.labels)


@pytest.mark.parametrize("world", [1, 3])
def test_augmented_resume_equals_the_uninterrupted_epoch(world):
    split = id_split()
    for rank in range(world):
        full = list(device_loader(split, rank=rank, world=world, augment="crop-flip").epoch_batches(2))
        for k in (1, 5, 8):
            resumed = device_loader(split, rank=rank, world=world, augment="crop-flip")  # a fresh process's loader
            tail = list(resumed.epoch_batches(2, start_batch=k))
            assert len(tail) == len(full) - k
            assert all(torch.equal(got.images, want.images) for got, want in zip(tail, full[k:]))


def test_a_sample_gets_other_crops_in_another_epoch_and_the_same_in_the_same():
    split = id_split(n=300)
    loader = device_loader(split, gb=300, augment="crop-flip")
    plain = device_loader(split, gb=300)

    def by_sample(ldr, epoch):
        batch = next(ldr.epoch_batches(epoch))
        return batch.images[torch.argsort(batch.indices)]

    e0, e1 = by_sample(loader, 0), by_sample(loader, 1)
    assert torch.equal(e0, by_sample(loader, 0))
    differs = (e0 != e1).flatten(1).any(dim=1)
    assert differs.float().mean() > 0.95  # the same crop and flip twice: 1 / 162
    assert (e0 != by_sample(plain, 0)).flatten(1).any(dim=1).float().mean() > 0.95


def test_augment_none_leaves_batches_untouched():
    split = id_split()
    default = list(device_loader(split, rank=1, world=2).epoch_batches(0))
    none = list(device_loader(split, rank=1, world=2, augment="none").epoch_batches(0))
    assert all(torch.equal(a.images, b.images) and torch.equal(a.indices, b.indices) for a, b in zip(default, none))
    for batch in none:
        assert close(batch.images, normalised(split.images[batch.indices], MNIST))


def test_augmented_empty_shares_keep_their_shape():
    split = id_split(n=97, shape=(3, 32, 32))
    lasts = [list(device_loader(split, CIFAR, rank=r, world=4, augment="crop-flip", channels_last=True).epoch_batches(0))[-1]
             for r in range(4)]
    assert [tuple(b.images.shape) for b in lasts] == [(1, 3, 32, 32)] + [(0, 3, 32, 32)] * 3


@pytest.mark.parametrize("world", [1, 2])
def test_dataset_loader_augments_a_users_images_as_they_come(world):
    split = id_split(shape=(3, 12, 10))
    for rank in range(world):
        dl = DatasetLoader(UserDataset(split), CPU, global_batch=GB, rank=rank, world_size=world, seed=7, shuffle=True,
                           num_workers=0, channels_last=True, augment="crop-flip")
        dev = device_loader(split, CIFAR, rank=rank, world=world, augment="crop-flip", channels_last=True)
        for got, want in zip(dl.epoch_batches(4, 2), dev.epoch_batches(4, 2)):
            assert torch.equal(got.indices, want.indices)
            # not normalised by dptrain: the raw crops, as float, padded with 0; the same draws as the DeviceLoader's
            assert got.images.dtype == torch.float32 and got.images.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(got.images, crop_flipped(split.images[got.indices], got.indices, 7, 4).float())
            assert close(want.images, normalised(crop_flipped(split.images[want.indices], want.indices, 7, 4), CIFAR))


def test_dataset_loader_refuses_to_augment_images_without_channels_at_the_start():
    flat = TensorDataset(torch.zeros(10, 28, 28), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"data.augment crop-flip needs images of shape \[C, H, W\].*\[28, 28\]"):
        DatasetLoader(flat, CPU, global_batch=4, rank=0, world_size=1, seed=0, shuffle=True, num_workers=0, augment="crop-flip")
    DatasetLoader(flat, CPU, global_batch=4, rank=0, world_size=1, seed=0, shuffle=True, num_workers=0)  # without: fine


def test_build_loaders_augments_the_train_loader_only():
    cfg = DataConfig(name="synthetic", synthetic_train_size=40, synthetic_test_size=20, synthetic_shape=(3, 8, 8), augment="crop-flip")
    plain_cfg = DataConfig(name="synthetic", synthetic_train_size=40, synthetic_test_size=20, synthetic_shape=(3, 8, 8))
    _, train_split, test_split = synthetic_dataset(cfg)
    _, train, test = build_loaders(cfg, device=CPU, global_batch=40, eval_batch=20, rank=0, world_size=1, seed=5, channels_last=False)
    _, plain_train, plain_test = build_loaders(plain_cfg, device=CPU, global_batch=40, eval_batch=20, rank=0, world_size=1, seed=5, channels_last=False)
    spec = synthetic_spec(cfg)
    batch = next(train.epoch_batches(1))
    assert close(batch.images, normalised(crop_flipped(train_split.images[batch.indices], batch.indices, 5, 1), spec))
    assert not torch.equal(batch.images, next(plain_train.epoch_batches(1)).images)
    for epoch in (0, 1):  # the test loader never augments
        got, want = next(test.epoch_batches(epoch)), next(plain_test.epoch_batches(epoch))
        assert torch.equal(got.images, want.images)
        assert close(got.images, normalised(test_split.images[got.indices], spec))
