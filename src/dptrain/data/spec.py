"""What a dataset is: its splits as tensors and its spec (shape, classes, statistics, files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class Normalise:
    """uint8-scale pixels -> (x/255 - mean) / std per channel, a whole batch at once on its device, computed as
    x * 1/(255 std) - mean/std: one fused multiply-add (addcmul) instead of three passes. The training loader,
    predict and the other engines of the benchmark all normalise through it, so they agree to the bit."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device | str) -> None:
        shape = (1, len(mean), 1, 1)
        std_t = torch.tensor(std, device=device).view(shape)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=device).view(shape) / std_t

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, pixels.float(), self.scale)


@dataclass(frozen=True)
class Split:
    """One split as uint8 images (N, C, H, W) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset looks like and, for file-backed ones, where its files lie and how to read them."""

    name: str
    shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_size: int
    """Samples in the official training split (tests write smaller files; readers count the real ones)."""
    subdirs: tuple[str, ...] = ()
    """Folders under data.root searched before data.root itself (torchvision's layouts)."""
    system_dirs: tuple[str, ...] = ()
    """Folders where system packages install the files."""
    required: tuple[str, ...] = ()
    """Files (IDX: without .gz) that a folder must hold to be this dataset."""
    downloads: tuple[tuple[str, str], ...] = ()
    """(filename, md5) on the mirrors."""
    mirrors: tuple[str, ...] = ()
    howto: str = ""
    read: Callable[[Path], tuple[Split, Split]] | None = None
