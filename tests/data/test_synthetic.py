"""The synthetic dataset: deterministic, shaped by the config, test split independent of the train size."""

from __future__ import annotations

import pytest
import torch

from dptrain.config import DataConfig
from dptrain.data.catalog import load
from dptrain.data.synthetic import synthetic_dataset, synthetic_spec
from dptrain.errors import ConfigError


def cfg(**kw) -> DataConfig:
    base = dict(name="synthetic", synthetic_train_size=120, synthetic_test_size=40, synthetic_shape=(3, 8, 6), synthetic_num_classes=5)
    return DataConfig(**{**base, **kw})


def test_synthetic_is_deterministic_and_ignores_the_global_rng():
    spec_a, train_a, test_a = synthetic_dataset(cfg())
    torch.manual_seed(999)
    torch.rand(100)
    spec_b, train_b, test_b = synthetic_dataset(cfg())
    assert spec_a == spec_b
    for a, b in ((train_a, train_b), (test_a, test_b)):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_synthetic_sizes_shapes_and_classes_follow_the_config():
    spec, train, test = synthetic_dataset(cfg())
    assert (spec.name, spec.shape, spec.num_classes, spec.train_size) == ("synthetic", (3, 8, 6), 5, 120)
    assert len(spec.mean) == len(spec.std) == 3
    assert tuple(train.images.shape) == (120, 3, 8, 6) and tuple(test.images.shape) == (40, 3, 8, 6)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert len(train.labels) == 120 and len(test.labels) == 40
    assert int(train.labels.min()) >= 0 and int(train.labels.max()) < 5
    assert set(train.labels.tolist()) == set(range(5))  # 120 draws over 5 classes: every class present


def test_synthetic_spec_matches_dataset_spec():
    c = cfg(synthetic_shape=(2, 5, 5), synthetic_num_classes=3)
    assert synthetic_spec(c) == synthetic_dataset(c)[0]
    assert synthetic_spec(c).mean == (0.5, 0.5) and synthetic_spec(c).std == (0.3, 0.3)


def test_synthetic_test_split_unchanged_when_train_size_changes():
    _, train_small, test_small = synthetic_dataset(cfg(synthetic_train_size=50))
    _, train_big, test_big = synthetic_dataset(cfg(synthetic_train_size=300))
    assert torch.equal(test_small.images, test_big.images) and torch.equal(test_small.labels, test_big.labels)
    # and a larger training split extends the smaller one
    assert torch.equal(train_big.labels[:50], train_small.labels)


def test_synthetic_classes_are_learnable():
    # Each class is noise around its own prototype: the class means are far apart, same class near.
    _, train, test = synthetic_dataset(cfg(synthetic_train_size=500))
    means = torch.stack([train.images[train.labels == c].float().mean(0) for c in range(5)])
    dists = torch.cdist(test.images.float().flatten(1), means.flatten(1))
    accuracy = (dists.argmin(1) == test.labels).float().mean().item()
    assert accuracy > 0.9


def test_load_synthetic_equals_synthetic_dataset():
    c = cfg()
    spec, train, test = load(c)
    _, train2, test2 = synthetic_dataset(c)
    assert spec.name == "synthetic" and torch.equal(train.images, train2.images) and torch.equal(test.labels, test2.labels)


@pytest.mark.parametrize(
    "bad", [dict(synthetic_train_size=0), dict(synthetic_test_size=-1), dict(synthetic_shape=(1, 0, 4)), dict(synthetic_num_classes=1)]
)
def test_synthetic_config_rejects_impossible_sizes(bad):
    with pytest.raises(ConfigError):
        cfg(**bad)
