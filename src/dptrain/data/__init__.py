"""Data: readers, catalog, sharded loaders. `build_loaders` is the one entry the training loop uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from dptrain.config import DataConfig, is_import_path
from dptrain.config.choices import SYNTHETIC
from dptrain.data.catalog import DATASETS, DatasetSpec, idx_file, load, locate
from dptrain.data.formats import read_idx
from dptrain.data.loader import DatasetLoader, DeviceLoader, Loader
from dptrain.data.synthetic import synthetic_spec
from dptrain.errors import ConfigError, DataError
from dptrain.imports import import_object


@dataclass(frozen=True)
class DataInfo:
    """What the model and the checks need to know about a dataset."""

    name: str
    image_shape: tuple[int, ...]
    num_classes: int | None
    """None for a user's Dataset: not known without reading every label."""
    train_size: int
    test_size: int


def build_user_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    factory = import_object(cfg.name, "data.name")
    try:
        train, test = factory(root=cfg.root, train=True), factory(root=cfg.root, train=False)
    except TypeError as exc:
        raise ConfigError(
            f"data.name {cfg.name} must accept root= and train= keyword arguments ({exc}); wrap it in a function that does."
        ) from None
    for ds, split in ((train, "train"), (test, "test")):
        if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            raise ConfigError(f"data.name {cfg.name} returned {type(ds).__name__} for the {split} split, which is not a map-style Dataset (__len__ and __getitem__).")
    return train, test


def _user_info(cfg: DataConfig, train: Dataset, test: Dataset) -> DataInfo:
    """Shape from the first item; classes unknown without reading every label."""
    return DataInfo(cfg.name, tuple(torch.as_tensor(train[0][0]).shape), None, len(train), len(test))  # type: ignore[arg-type]  # checked map-style


def build_loaders(
    cfg: DataConfig, *, device: torch.device, global_batch: int, eval_batch: int, rank: int | None, world_size: int,
    seed: int, channels_last: bool,
) -> tuple[DataInfo, Loader, Loader]:
    """(info, train loader, test loader); the test loader covers every test sample exactly once over the ranks.

    Only the train loader augments (cfg.augment); the test loader never does."""
    share = dict(device=device, rank=rank, world_size=world_size, seed=seed, channels_last=channels_last)
    info, train, test, spec = _read(cfg)
    if spec is None:
        return (info, DatasetLoader(train, global_batch=global_batch, shuffle=True, num_workers=cfg.num_workers, augment=cfg.augment, **share),
                _test_loader(cfg, test, None, eval_batch, share))
    return (info, DeviceLoader(train, spec, global_batch=global_batch, shuffle=True, augment=cfg.augment, **share),
            _test_loader(cfg, test, spec, eval_batch, share))


def build_test_loader(
    cfg: DataConfig, *, device: torch.device, eval_batch: int, rank: int, world_size: int, seed: int, channels_last: bool,
) -> tuple[DataInfo, Loader]:
    """(info, test loader) for evaluation: the training split is neither kept nor put on the device."""
    info, _, test, spec = _read(cfg)
    share = dict(device=device, rank=rank, world_size=world_size, seed=seed, channels_last=channels_last)
    return info, _test_loader(cfg, test, spec, eval_batch, share)


def _read(cfg: DataConfig) -> tuple[DataInfo, Any, Any, DatasetSpec | None]:
    """(info, train, test, spec): a user's Datasets (spec None) or a built-in dataset's splits as tensors."""
    if is_import_path(cfg.name):
        train_ds, test_ds = build_user_datasets(cfg)
        return _user_info(cfg, train_ds, test_ds), train_ds, test_ds, None
    spec, train, test = load(cfg)
    return DataInfo(spec.name, spec.shape, spec.num_classes, len(train), len(test)), train, test, spec


def _test_loader(cfg: DataConfig, test: Any, spec: DatasetSpec | None, eval_batch: int, share: dict[str, Any]) -> Loader:
    global_batch = eval_batch * share["world_size"]
    if spec is None:
        return DatasetLoader(test, global_batch=global_batch, shuffle=False, num_workers=cfg.num_workers, **share)
    return DeviceLoader(test, spec, global_batch=global_batch, shuffle=False, **share)


def describe(cfg: DataConfig) -> DataInfo:
    """Cheap facts for the checks made before workers start: no full read of a built-in dataset."""
    if is_import_path(cfg.name):
        return _user_info(cfg, *build_user_datasets(cfg))
    if cfg.name == SYNTHETIC:
        return DataInfo(SYNTHETIC, tuple(cfg.synthetic_shape), cfg.synthetic_num_classes, cfg.synthetic_train_size, cfg.synthetic_test_size)
    spec: DatasetSpec = DATASETS[cfg.name]
    try:
        folder = locate(spec, Path(cfg.root))
    except DataError:
        if cfg.download:  # the workers will fetch it; sizes are the official ones
            return DataInfo(spec.name, spec.shape, spec.num_classes, spec.train_size, 0)
        raise
    if "train-labels-idx1-ubyte" in spec.required:  # IDX: the label file is small, count it
        train_size = len(_labels(folder, "train"))
        test_size = len(_labels(folder, "t10k"))
        return DataInfo(spec.name, spec.shape, spec.num_classes, train_size, test_size)
    return DataInfo(spec.name, spec.shape, spec.num_classes, spec.train_size, 0)


def input_record(cfg: DataConfig) -> dict[str, Any] | None:
    """What the model takes, from the config alone (no data file is read): the image shape, the normalisation
    (mean and std per channel, on pixel values / 255), the number of classes and the dataset's name. A snapshot's
    manifest keeps it, so that `dptrain predict` prepares new inputs as the training data was. None for a user's
    Dataset: dptrain neither normalises its images nor knows their shape without reading them."""
    if is_import_path(cfg.name):
        return None
    spec = synthetic_spec(cfg) if cfg.name == SYNTHETIC else DATASETS[cfg.name]
    return {"shape": list(spec.shape), "mean": list(spec.mean), "std": list(spec.std), "num_classes": spec.num_classes,
            "dataset": spec.name}


def _labels(folder: Path, prefix: str) -> torch.Tensor:
    return read_idx(idx_file(folder, f"{prefix}-labels-idx1-ubyte"), 1)


__all__ = ["DataInfo", "DataError", "build_loaders", "build_test_loader", "describe", "input_record"]
