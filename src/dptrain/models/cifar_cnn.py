"""A small VGG-style CNN for 32x32 images: two conv-conv-pool stages, then two linear layers."""

from __future__ import annotations

import torch
from torch import nn

from dptrain.models.layers import Dropout, Flatten, Linear


def _stage(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), Dropout(0.25),
    )


class CifarCNN(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(_stage(in_channels, 32), _stage(32, 64))
        self.classifier = nn.Sequential(
            Flatten(), Linear(64 * 8 * 8, 512), nn.ReLU(inplace=True), Dropout(0.5), Linear(512, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
