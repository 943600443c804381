"""Layers shared by the built-in models."""

from __future__ import annotations

import torch
from torch import nn


class _FlattenKeepingGradLayout(torch.autograd.Function):
    """torch.flatten(x, 1), whose gradient comes back in x's memory format.

    torch.flatten's own backward hands a channels_last input an NCHW gradient; the max-pool before
    it then converts its whole input-sized gradient between layouts, which costs about 9% of a
    training step of the tutorials' CNN on the CPU. The values are the same either way.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - autograd's signature
        ctx.shape = x.shape
        channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        ctx.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        return torch.flatten(x, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.reshape(ctx.shape).contiguous(memory_format=ctx.memory_format)


def flatten(x: torch.Tensor) -> torch.Tensor:
    """torch.flatten(x, 1) with the gradient in x's layout (see _FlattenKeepingGradLayout)."""
    return _FlattenKeepingGradLayout.apply(x)


class Flatten(nn.Module):
    """nn.Flatten() with the gradient in the input's layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return flatten(x)
