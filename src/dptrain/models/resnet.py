"""ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool): any image size, BatchNorm throughout.

BatchNorm statistics are per rank, so unlike the BatchNorm-free models, ResNet-18 trained on N ranks
is not the same computation as on one rank with the same global batch, unless model.sync_batchnorm
turns its BatchNorm layers into SyncBatchNorm (statistics over the global batch; on GPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.models.layers import Linear


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        widths, layers, c_in = (64, 128, 256, 512), [], 64
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(c_in, width, stride), BasicBlock(width, width, 1)))
            c_in = width
        self.layers = nn.Sequential(*layers)
        self.fc = Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
