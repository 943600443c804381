"""Loaders that yield this rank's share of each global batch (see sharding.py for the rule).

DeviceLoader keeps a whole split on the device as uint8 and normalises batch-wise there: no worker
processes, no per-sample Python, no host-to-device copy per step. DatasetLoader serves a user's
map-style torch Dataset through a DataLoader and GlobalBatchSampler, with the same sample order.
Both report the global batch size of every batch, which the loss needs for an exact mean.
Training loaders may augment (augment.py): each sample's crop and flip depend on (seed, epoch, sample
index) only, so the global batches stay the same whatever the world size and after a resume.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dptrain.data.augment import AUGMENTS, Augment, crop_flip
from dptrain.data.sharding import epoch_permutation, num_batches, rank_batch_positions
from dptrain.data.spec import DatasetSpec, Normalise, Split
from dptrain.errors import ConfigError


@dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    global_count: int
    """Samples in this global batch over all ranks (the loss is a mean over these)."""
    indices: torch.Tensor
    """Each sample's index in its split (for predictions written in the split's order)."""


class Loader(Protocol):
    def __len__(self) -> int: ...
    def epoch_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]: ...


class DeviceLoader:
    """A split on the device; `epoch_batches(e)` yields this rank's share of each global batch of epoch e."""

    def __init__(
        self,
        split: Split,
        spec: DatasetSpec,
        device: torch.device,
        *,
        global_batch: int,
        rank: int | None,
        world_size: int,
        seed: int,
        shuffle: bool,
        channels_last: bool = False,
        augment: Augment = "none",
    ) -> None:
        assert augment in AUGMENTS, augment
        self.images = split.images.to(device)  # uint8: a quarter of the float32 footprint
        self.labels = split.labels.to(device)
        self.normalise = Normalise(spec.mean, spec.std, device)
        self.device = device
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.seed, self.shuffle, self.augment = seed, shuffle, augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self) -> int:
        return num_batches(len(self.labels), self.global_batch)

    def _pixels(self, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        """The batch's uint8 images, augmented if asked. Augmenting before normalisation pads with pixel 0,
        black, as torchvision's RandomCrop(padding=4) before Normalize does (after it, 0 would be the mean
        colour), and the crop's gather then moves uint8, a quarter of float32's bytes, straight from the split."""
        if self.augment == "none":
            return self.images[idx]
        return crop_flip(self.images, idx, idx, seed=self.seed, epoch=epoch, memory_format=self.memory_format)

    def epoch_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        n = len(self.labels)
        order = epoch_permutation(n, self.seed, epoch, self.shuffle).to(self.device)
        for k in range(start_batch, len(self)):
            start, stop, global_count = rank_batch_positions(n, self.global_batch, k, self.rank, self.world_size)
            idx = order[start:stop]
            images = self.normalise(self._pixels(idx, epoch))
            yield Batch(images.contiguous(memory_format=self.memory_format), self.labels[idx], global_count, idx)


class GlobalBatchSampler(Sampler[list[int]]):
    """A distributed batch sampler with the global-batch rule; unlike DistributedSampler it never pads."""

    def __init__(self, n: int, *, global_batch: int, rank: int | None, world_size: int, seed: int, shuffle: bool) -> None:
        self.n, self.global_batch, self.rank, self.world_size = n, global_batch, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return num_batches(self.n, self.global_batch) - self.start_batch

    def global_counts(self) -> Iterator[int]:
        for k in range(self.start_batch, num_batches(self.n, self.global_batch)):
            yield rank_batch_positions(self.n, self.global_batch, k, self.rank, self.world_size)[2]

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_permutation(self.n, self.seed, self.epoch, self.shuffle)
        for k in range(self.start_batch, num_batches(self.n, self.global_batch)):
            start, stop, _ = rank_batch_positions(self.n, self.global_batch, k, self.rank, self.world_size)
            yield order[start:stop].tolist()


def _collate(image_shape: tuple[int, ...], items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (image, label) pairs; an empty share (last batch, more ranks than samples) keeps its shape."""
    if not items:
        return torch.empty(0, *image_shape), torch.empty(0, dtype=torch.long)
    images, labels = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in images]), torch.as_tensor(labels, dtype=torch.long)


def indices_on(indices: list[int], device: torch.device) -> torch.Tensor:
    """A batch's sample indices as a long tensor on device, with no wait for the device: made in host memory, pinned
    for a GPU, then copied asynchronously. (torch.tensor(indices, device=cuda) copies from pageable memory, which makes
    the host wait for the GPU's queue to drain: every step.)"""
    host = torch.tensor(indices, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class DatasetLoader:
    """A user's map-style Dataset through a DataLoader, sharded like DeviceLoader."""

    def __init__(
        self,
        dataset: Dataset,
        device: torch.device,
        *,
        global_batch: int,
        rank: int | None,
        world_size: int,
        seed: int,
        shuffle: bool,
        num_workers: int,
        channels_last: bool = False,
        augment: Augment = "none",
    ) -> None:
        assert augment in AUGMENTS, augment
        image_shape = tuple(torch.as_tensor(dataset[0][0]).shape)
        if augment != "none" and len(image_shape) != 3:
            raise ConfigError(f"data.augment {augment} needs images of shape [C, H, W], but this Dataset's first image "
                              f"has shape {list(image_shape)}; give each image a channel dimension, or set data.augment none.")
        self.sampler = GlobalBatchSampler(
            len(dataset), global_batch=global_batch, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle  # type: ignore[arg-type]  # map-style datasets have __len__
        )
        self.loader = DataLoader(
            dataset, batch_sampler=self.sampler, num_workers=num_workers,
            collate_fn=functools.partial(_collate, image_shape),
            pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
        )
        self.device, self.augment = device, augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self) -> int:
        return num_batches(self.sampler.n, self.sampler.global_batch)

    def epoch_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch, start_batch)
        # The sampler is deterministic: iterating it again beside the DataLoader gives the same indices.
        for (images, labels), indices, count in zip(self.loader, iter(self.sampler), self.sampler.global_counts()):
            ids = indices_on(indices, self.device)
            images = images.to(self.device, non_blocking=True)
            if self.augment != "none":  # on the images as the Dataset gives them (dptrain does not normalise them)
                rows = torch.arange(len(ids), device=self.device)
                images = crop_flip(images, rows, ids, seed=self.sampler.seed, epoch=epoch, memory_format=self.memory_format)
            images = images.float()
            if images.dim() == 4:
                images = images.contiguous(memory_format=self.memory_format)
            yield Batch(images, labels.to(self.device, non_blocking=True), count, ids)
