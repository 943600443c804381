"""Writers for the real dataset file formats (IDX, CIFAR-10 python batches), used by the data tests.

They are written from the format specifications, independently of dptrain's readers.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np

IDX_IMAGES_MAGIC = 0x00000803
IDX_LABELS_MAGIC = 0x00000801
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: big-endian magic 0x0000080<ndim>, one big-endian int32 per dim, data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x00000800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> Path:
    data = idx_bytes(array)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def make_idx_arrays(n_train: int, n_test: int, seed: int = 0, size: int = 28, num_classes: int = 10):
    """(train_images, train_labels, test_images, test_labels) as uint8 numpy arrays."""
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, size, size), dtype=np.uint8),
        rng.integers(0, num_classes, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, size, size), dtype=np.uint8),
        rng.integers(0, num_classes, n_test, dtype=np.uint8),
    )


def write_idx_dataset(folder: Path, n_train: int = 60, n_test: int = 20, *, gz: bool = False, seed: int = 0, size: int = 28):
    """The four IDX files of MNIST/FashionMNIST in folder (names with .gz when gz); returns the arrays."""
    arrays = make_idx_arrays(n_train, n_test, seed, size)
    for stem, array in zip(IDX_STEMS, arrays):
        write_idx(folder / (f"{stem}.gz" if gz else stem), array, gz=gz)
    return arrays


def cifar_batch_bytes(images: np.ndarray, labels, *, protocol: int = 4, extra: dict | None = None) -> bytes:
    """A CIFAR-10 python batch: images N x 3 x 32 x 32 -> row of 1024 R, 1024 G, 1024 B bytes."""
    data = np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), 3 * 32 * 32)
    batch = {b"batch_label": b"testing batch", b"labels": [int(x) for x in labels], b"data": data,
             b"filenames": [f"img_{i}.png".encode() for i in range(len(images))]}
    batch.update(extra or {})
    return pickle.dumps(batch, protocol=protocol)


def write_cifar_batch(path: Path, images: np.ndarray, labels, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cifar_batch_bytes(images, labels, **kw))
    return path


def make_cifar_arrays(n_per_batch: int, n_test: int, seed: int = 0):
    """([(images, labels)] * 5 training batches, (images, labels) test batch)."""
    rng = np.random.default_rng(seed)

    def one(n):
        return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n).tolist()

    return [one(n_per_batch) for _ in range(5)], one(n_test)


def write_cifar_dataset(folder: Path, n_per_batch: int = 10, n_test: int = 12, seed: int = 0):
    """data_batch_1..5 and test_batch in folder (the cifar-10-batches-py folder itself)."""
    train, test = make_cifar_arrays(n_per_batch, n_test, seed)
    for i, (images, labels) in enumerate(train, 1):
        write_cifar_batch(folder / f"data_batch_{i}", images, labels)
    write_cifar_batch(folder / "test_batch", *test)
    return train, test


def write_cifar_archive(archive: Path, n_per_batch: int = 10, n_test: int = 12, seed: int = 0):
    """cifar-10-python.tar.gz holding cifar-10-batches-py/, as the official archive does."""
    train, test = make_cifar_arrays(n_per_batch, n_test, seed)
    members = [(f"data_batch_{i}", cifar_batch_bytes(*train[i - 1])) for i in range(1, 6)]
    members.append(("test_batch", cifar_batch_bytes(*test)))
    members.append(("batches.meta", pickle.dumps({b"label_names": [b"c%d" % i for i in range(10)]}, protocol=4)))
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(CIFAR_DIR)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        for name, payload in members:
            info = tarfile.TarInfo(f"{CIFAR_DIR}/{name}")
            info.size, info.mode = len(payload), 0o644
            tar.addfile(info, io.BytesIO(payload))
    return train, test


class Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]  # the pure-Python pickler, to change opcodes
    """Writes what Python 2 wrote for the official CIFAR files: str/bytes as BINSTRING, numpy.core names."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    def save_str(self, obj: str) -> None:
        data = obj.encode("latin-1")
        n = len(data)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + data)

    def save_global(self, obj, name=None) -> None:  # noqa: ANN001 - pickle's signature
        module = {"numpy._core.multiarray": "numpy.core.multiarray"}.get(obj.__module__, obj.__module__)
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)

    dispatch[bytes] = save_bytes
    dispatch[str] = save_str
    dispatch[type] = save_global


def py2_cifar_batch_bytes(images: np.ndarray, labels) -> bytes:
    data = np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), 3 * 32 * 32)
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump({b"batch_label": b"training batch 1 of 5", b"labels": list(labels), b"data": data})
    return buf.getvalue()
