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


class Dropout(nn.Dropout):
    """nn.Dropout whose mask, on the CPU, is cut from random bytes instead of drawn by bernoulli_.

    bernoulli_ draws one double per element. Here one int64 draw gives 8 bytes (4 elements for 16-bit levels),
    and an element is dropped when its byte is below p * 256: exactly p where p * 256 is an integer (the
    tutorials' 0.25 and 0.5), else p rounded to 1/65536 with 16-bit levels. The tutorials' CNN's two masks
    (64 images, one thread): 0.44 ms instead of bernoulli_'s 2.16 (`python perf/micro.py`, dropout).
    Another random stream than nn.Dropout's, just as seeded per rank. On other devices, in place, or in
    eval mode it is nn.Dropout.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.device.type != "cpu" or self.inplace or not 0 < self.p < 1:
            return super().forward(x)
        return x * keep_mask(x, self.p)


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """1 / (1 - p) where an element is kept, 0 where it is dropped, in x's shape, dtype and layout."""
    if (p * 256).is_integer():
        dtype, below = torch.uint8, round(p * 256)  # keep where byte >= p * 256
    else:
        dtype, below = torch.int16, round(p * 65536) - 32768  # int16 spans [-32768, 32767]
    count = x.numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.empty(-(-count // 8), dtype=torch.int64).random_(-2**63, None)  # every one of the 64 bits random
    keep = bits.view(dtype)[:x.numel()].ge(below)  # compared as integers: exact in any dtype of x
    mask = torch.empty_like(x)  # dense, in x's layout, so that the product keeps it (channels_last stays so)
    mask.as_strided((x.numel(),), (1,)).copy_(keep)  # every element is drawn alike: any order in memory serves
    return mask.mul_(1 / (1 - p))


def _onednn_linear_op():  # noqa: ANN202 - an OpOverloadPacket, or None
    """torch.ops.mkldnn._linear_pointwise (oneDNN's inner product, the op inductor emits for CPU linears), or None
    where this build of torch has none."""
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = _onednn_linear_op()


class Linear(nn.Linear):
    """nn.Linear (the same parameters and function) whose float32 products on the CPU go through oneDNN, not MKL.

    PyTorch computes a float32 linear layer on the CPU with MKL's sgemm, which takes its AVX2 path on AMD CPUs;
    oneDNN's inner product uses AVX-512 there. On an Intel Xeon, where MKL takes AVX-512 too, the gain is small:
    the tutorials' fc1 (9216 -> 128, 64 images, one thread) forward and backward took 3.72 ms instead of 4.25
    (`python perf/micro.py`, linear; run it on an AMD machine to see that gap). The sums are
    ordered differently, so results may differ from nn.Linear's in their last bits. Elsewhere (other devices and
    dtypes, autocast, torch.compile, inputs of other than 2 dimensions, empty batches, a torch without the op) it
    is nn.Linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An empty batch (a parameter server's serving rank) or a wrong width: nn.Linear, which takes the one
        # and words the other clearly, where oneDNN fails to build its primitive.
        if (ONEDNN_LINEAR is None or x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32
                or x.shape[0] == 0 or x.shape[1] != self.in_features
                or self.weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
                or torch.compiler.is_compiling()):
            return super().forward(x)
        return _OneDnnLinear.apply(x, self.weight, self.bias)


class _OneDnnLinear(torch.autograd.Function):
    """x @ weight.T + bias and its gradients, each product one call of oneDNN's inner product (which takes its
    operands as they lie in memory, transposed views included)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        return ONEDNN_LINEAR(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205 - autograd's signature
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = ONEDNN_LINEAR(grad, weight.t(), None, "none", [], "")  # grad @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = ONEDNN_LINEAR(grad.t(), x.t(), None, "none", [], "")  # grad.T @ x
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias
