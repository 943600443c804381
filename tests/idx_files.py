"""Write small datasets in the real IDX format (as MNIST/FashionMNIST ship) for tests."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_dataset(folder: Path, train_size: int, test_size: int, seed: int = 0, gz: bool = True) -> None:
    """Four IDX files with learnable images (brightness of a class-dependent band)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label : 2 * label + 4, :] += 150
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            data = idx_bytes(array)
            if gz:
                (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / stem).write_bytes(data)
