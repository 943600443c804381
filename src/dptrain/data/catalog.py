"""The catalog: dataset names -> where their files may lie, how to read them, what they look like."""

from __future__ import annotations

import tarfile
from pathlib import Path

import torch

from dptrain.config import DataConfig
from dptrain.config.choices import DATASETS as DATASET_SPECS, SYNTHETIC
from dptrain.data import download
from dptrain.data.formats import read_cifar_batch, read_idx
from dptrain.data.spec import DatasetSpec, Split
from dptrain.data.synthetic import synthetic_dataset
from dptrain.errors import DataError
from dptrain.imports import import_object


# ---------------------------------------------------------------- IDX datasets (MNIST, FashionMNIST)

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_file(folder: Path, stem: str) -> Path:
    """The raw file if present, else its .gz (torchvision keeps both; Debian ships .gz only)."""
    raw = folder / stem
    return raw if raw.exists() else folder / f"{stem}.gz"


def _read_idx_split(folder: Path, prefix: str) -> Split:
    images_path, labels_path = idx_file(folder, f"{prefix}-images-idx3-ubyte"), idx_file(folder, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels; they do not belong together.")
    return Split(images.unsqueeze(1), labels.long())


def _read_idx_dataset(folder: Path) -> tuple[Split, Split]:
    return _read_idx_split(folder, "train"), _read_idx_split(folder, "t10k")


# ---------------------------------------------------------------- CIFAR-10

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_ARCHIVE = ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a")


def _read_cifar_dataset(folder: Path) -> tuple[Split, Split]:
    parts = [read_cifar_batch(folder / name) for name in CIFAR_TRAIN]
    train = Split(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return train, Split(*read_cifar_batch(folder / "test_batch"))


MNIST = DatasetSpec(
    name="mnist", shape=(1, 28, 28), num_classes=10, mean=(0.1307,), std=(0.3081,),
    train_size=60000,
    subdirs=("MNIST/raw", "mnist"), system_dirs=("/usr/share/datasets/mnist",),
    required=IDX_FILES,
    downloads=(
        ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
        ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
        ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
    ),
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    howto="use --data.download true, or copy the four IDX files there",
    read=_read_idx_dataset,
)
FASHION_MNIST = DatasetSpec(
    name="fashion-mnist", shape=(1, 28, 28), num_classes=10, mean=(0.2860,), std=(0.3530,),
    train_size=60000,
    subdirs=("FashionMNIST/raw", "fashion-mnist"), system_dirs=("/usr/share/datasets/fashion-mnist",),
    required=IDX_FILES,
    downloads=(
        ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
        ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
        ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
    ),
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    howto="on Debian/Ubuntu run `apt-get install dataset-fashion-mnist`, or use --data.download true",
    read=_read_idx_dataset,
)
CIFAR10 = DatasetSpec(
    name="cifar10", shape=(3, 32, 32), num_classes=10,
    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
    train_size=50000,
    subdirs=(CIFAR_DIR,), system_dirs=(),
    required=(*CIFAR_TRAIN, "test_batch"),
    downloads=(CIFAR_ARCHIVE,),
    mirrors=("https://www.cs.toronto.edu/~kriz/",),
    howto="use --data.download true, or unpack cifar-10-python.tar.gz there",
    read=_read_cifar_dataset,
)

# Keyed and ordered by config's list of the built-in datasets (config.choices.DATASETS, the one list of them), each
# entry naming one of the specs above: this module is importing itself there, from sys.modules, its specs defined.
DATASETS: dict[str, DatasetSpec] = {name: import_object(where, "data.name") for name, where in DATASET_SPECS.items()}


def _has_files(folder: Path, required: tuple[str, ...]) -> bool:
    return all((folder / f).exists() or (folder / f"{f}.gz").exists() for f in required)


def candidate_dirs(spec: DatasetSpec, root: Path) -> list[Path]:
    """Every folder searched, in order: torchvision layouts under root, root itself, system folders."""
    return [root / sub for sub in spec.subdirs] + [root] + [Path(d) for d in spec.system_dirs]


def locate(spec: DatasetSpec, root: Path) -> Path:
    """The first folder holding every file of the dataset, or one sentence naming where we looked."""
    searched = candidate_dirs(spec, root)
    for folder in searched:
        if _has_files(folder, spec.required):
            return folder
    raise DataError(
        f"dataset {spec.name} not found in {', '.join(map(str, searched))}; {spec.howto}."
    )


def fetch(spec: DatasetSpec, root: Path, mirror: str | None) -> Path:
    """Download into root (first mirror: --data.mirror) and unpack archives; safe to call from many processes."""
    mirrors = ([mirror] if mirror else []) + list(spec.mirrors)
    paths = download.fetch(root, list(spec.downloads), mirrors)
    with download.file_lock(root / ".download.lock"):
        for path in paths:
            if path.name.endswith(".tar.gz") and not _has_files(root / spec.subdirs[0], spec.required):
                _extract(path, root)
    return locate(spec, root)


def _extract(archive: Path, root: Path) -> None:
    """Unpack inside root only: no absolute paths, no '..', no links out of it."""
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(root, filter="data")
            else:  # Python 3.10 before 3.10.12 has no extraction filters: check the members ourselves
                for member in tar.getmembers():
                    target = (root / member.name).resolve()
                    if not (member.isfile() or member.isdir()) or not target.is_relative_to(root.resolve()):
                        raise tarfile.TarError(f"member {member.name} would land outside {root}")
                tar.extractall(root)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(f"{archive} cannot be unpacked ({exc}); delete it and download it again.") from None


def load(cfg: DataConfig) -> tuple[DatasetSpec, Split, Split]:
    """(spec, train, test) for a built-in or synthetic dataset, read and checked against its spec."""
    if cfg.name == SYNTHETIC:
        return synthetic_dataset(cfg)
    spec = DATASETS[cfg.name]
    root = Path(cfg.root)
    try:
        folder = locate(spec, root)
    except DataError:
        if not cfg.download:
            raise
        folder = fetch(spec, root, cfg.mirror)
    assert spec.read is not None, spec.name
    train, test = spec.read(folder)
    for split, name in ((train, "training"), (test, "test")):
        _check_split(spec, split, name, folder)
    return spec, train, test


def _check_split(spec: DatasetSpec, split: Split, name: str, folder: Path) -> None:
    if tuple(split.images.shape[1:]) != spec.shape:
        raise DataError(
            f"the {name} images in {folder} have shape {tuple(split.images.shape[1:])} but {spec.name} has {spec.shape}; "
            "the folder holds another dataset."
        )
    if len(split) and (int(split.labels.min()) < 0 or int(split.labels.max()) >= spec.num_classes):
        raise DataError(
            f"the {name} labels in {folder} range over {int(split.labels.min())}..{int(split.labels.max())} "
            f"but {spec.name} has classes 0..{spec.num_classes - 1}; the files are corrupt."
        )
