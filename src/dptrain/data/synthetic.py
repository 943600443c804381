"""A deterministic synthetic dataset of any size and shape, learnable (each class has a prototype image)."""

from __future__ import annotations

import torch

from dptrain.config import DataConfig
from dptrain.data.spec import DatasetSpec, Split

# Fixed seeds: the data must not change with train.seed, so runs with other seeds see the same images.
PROTOTYPE_SEED = 1_000
SPLIT_SEEDS = {"train": 1_001, "test": 1_002}
PATTERN_AMPLITUDE = 30.0  # grey levels
NOISE_STD = 60.0  # grey levels


def _make_split(prototypes: torch.Tensor, size: int, seed: int) -> Split:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(prototypes), (size,), generator=gen)
    noise = torch.randn((size, *prototypes.shape[1:]), generator=gen) * NOISE_STD
    images = (prototypes[labels] + noise).round().clamp(0, 255).to(torch.uint8)
    return Split(images, labels)


def synthetic_dataset(cfg: DataConfig) -> tuple[DatasetSpec, Split, Split]:
    shape = tuple(cfg.synthetic_shape)
    gen = torch.Generator().manual_seed(PROTOTYPE_SEED)
    # A shared background plus a faint class pattern, under strong noise: learnable, not trivially.
    background = torch.rand(shape, generator=gen) * 255
    patterns = (torch.rand((cfg.synthetic_num_classes, *shape), generator=gen) - 0.5) * 2 * PATTERN_AMPLITUDE
    prototypes = background + patterns
    train = _make_split(prototypes, cfg.synthetic_train_size, SPLIT_SEEDS["train"])
    test = _make_split(prototypes, cfg.synthetic_test_size, SPLIT_SEEDS["test"])
    return synthetic_spec(cfg), train, test


def synthetic_spec(cfg: DataConfig) -> DatasetSpec:
    channels = cfg.synthetic_shape[0]
    return DatasetSpec(
        name="synthetic", shape=tuple(cfg.synthetic_shape), num_classes=cfg.synthetic_num_classes,
        mean=(0.5,) * channels, std=(0.3,) * channels, train_size=cfg.synthetic_train_size,
    )
