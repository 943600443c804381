"""A user's own model and dataset, importable as tests.user_code:Name by the workers."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from dptrain import faults


class TinyNet(nn.Module):
    """A user model constructed with no arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FailsOnRank1(TinyNet):
    """Raises in the forward pass of the 3rd training step on global rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 3 and os.environ.get("RANK") == "1":
                raise RuntimeError("injected failure")
        return super().forward(x)


class SleepsInForward(TinyNet):
    """Sleeps in its forward where the test's fault says (faults.FAULT 'forward:RANK:CALL:SECONDS'): a rank stuck in
    its model's code while the others wait in the step's collective."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(faults.stall_seconds("forward"))
        return super().forward(x)


class PatternDataset(Dataset):
    """A map-style dataset built as dptrain builds users' datasets: Factory(root=..., train=...)."""

    def __init__(self, root: str, train: bool) -> None:
        gen = torch.Generator().manual_seed(0 if train else 1)
        n = 96 if train else 37
        self.labels = torch.randint(0, 10, (n,), generator=gen)
        self.images = torch.randn(n, 1, 28, 28, generator=gen) + self.labels.view(-1, 1, 1, 1).float() / 5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


class BlocksInData(PatternDataset):
    """Blocks in __getitem__ where the test's fault says (faults.FAULT 'data:RANK:CALL:SECONDS'): a rank stuck in its
    data loader while the others wait in the step's collective."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(faults.stall_seconds("data"))
        return self.images[i], int(self.labels[i])


class EvenMLP(nn.Module):
    """Eight equal 128x128 layers: ZeRO-1's whole-parameter partition splits it evenly over 2 or 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)[:, :128]
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)[:, :10]
