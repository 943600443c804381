from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.config import ModelConfig
from dptrain.errors import ConfigError
from dptrain.models import build_model, check_input


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mnist_cnn_is_the_tutorials_cnn_layer_for_layer():
    model = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,), (10, 128), (10,)]
    assert count(model) == 1_199_882
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.25, 0.5]
    assert model(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


@pytest.mark.parametrize("name, shape", [("cifar-cnn", (3, 32, 32)), ("resnet18", (3, 32, 32)), ("resnet18", (1, 28, 28))])
def test_image_models_take_their_inputs_and_train(name, shape):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), shape, 10)
    x, y = torch.randn(4, *shape), torch.tensor([0, 1, 2, 3])
    out = model(x)
    assert out.shape == (4, 10)
    nn.functional.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet18_has_the_cifar_stem():
    model = build_model(ModelConfig(name="resnet18"), (3, 32, 32), 10)
    stem_conv = model.stem[0]
    assert stem_conv.kernel_size == (3, 3) and stem_conv.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert 11_000_000 < count(model) < 11_300_000  # the usual 11.17 M of CIFAR ResNet-18


def test_dropout_false_removes_every_dropout_layer():
    model = build_model(ModelConfig(name="cifar-cnn", dropout=False), (3, 32, 32), 10)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    model.train()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), model(x))  # deterministic in training mode


def test_models_refuse_images_they_cannot_take():
    with pytest.raises(ConfigError, match="model mnist-cnn takes 1x28x28 images but the dataset has 3x32x32; use --model.name cifar-cnn or resnet18"):
        check_input(ModelConfig(name="mnist-cnn"), (3, 32, 32))
    with pytest.raises(ConfigError, match="model cifar-cnn takes Cx32x32 images but the dataset has 1x28x28; use --model.name mnist-cnn"):
        check_input(ModelConfig(name="cifar-cnn"), (1, 28, 28))
    check_input(ModelConfig(name="resnet18"), (1, 28, 28))  # any size


def test_a_users_model_by_import_path():
    model = build_model(ModelConfig(name="tests.user_code:TinyNet"), (1, 28, 28), None)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError, match="module tests.user_code has no attribute Nope"):
        build_model(ModelConfig(name="tests.user_code:Nope"), (1, 28, 28), None)
    with pytest.raises(ConfigError, match="built a PatternDataset, not a torch.nn.Module|must be constructible"):
        build_model(ModelConfig(name="tests.user_code:PatternDataset"), (1, 28, 28), None)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_layout_keeping_flatten_changes_no_value_and_keeps_the_gradient_layout(memory_format):
    from dptrain.models.layers import flatten

    x = torch.randn(4, 8, 6, 6).contiguous(memory_format=memory_format).requires_grad_()
    ours = flatten(x)
    assert torch.equal(ours, torch.flatten(x, 1))
    weight = torch.randn(ours.shape[1])
    (ours * weight).sum().backward()
    assert x.grad.is_contiguous(memory_format=memory_format)  # no layout conversion waits in the layer before
    assert torch.equal(x.grad, weight.view(8, 6, 6).expand(4, 8, 6, 6))


def test_training_flops_per_sample_count_forward_and_backward_of_every_matmul_and_convolution():
    """The tutorials' CNN, by hand: conv1 1->32 (3x3, 26x26 out), conv2 32->64 (3x3, 24x24), fc1 9216->128, fc2
    128->10, 2 operations per multiply-add. Backward computes every weight gradient (as much as the forward) and the
    input gradient of every layer but conv1, whose input (the image) needs none."""
    import torch

    from dptrain.config import ModelConfig
    from dptrain.models import build_model, training_flops_per_sample

    conv1, conv2 = 2 * 32 * 26 * 26 * 1 * 9, 2 * 64 * 24 * 24 * 32 * 9
    fc1, fc2 = 2 * 9216 * 128, 2 * 128 * 10
    forward = conv1 + conv2 + fc1 + fc2
    model = build_model(ModelConfig(), (1, 28, 28), 10)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert training_flops_per_sample(model, (1, 28, 28)) == 3 * forward - conv1
    # the model, its gradients and the random stream are as they were
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training


def _tutorial_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tutorials' order: ReLU, then max-pool (dropout off)."""
    f = nn.functional
    x = f.max_pool2d(f.relu(model.conv2(f.relu(model.conv1(x)))), 2)
    return model.fc2(f.relu(model.fc1(torch.flatten(x, 1))))


@pytest.mark.parametrize("channels_last", [False, True])
def test_mnist_cnn_pooling_before_the_relu_computes_the_tutorials_function_and_gradients(channels_last):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10).double().eval()
    x = torch.randn(16, 1, 28, 28, dtype=torch.float64)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    ours, theirs = model(x), _tutorial_forward(model, x)
    assert torch.equal(ours, theirs)  # relu(max(a)) = max(relu(a)), element by element
    grads = [torch.autograd.grad(out.square().sum(), list(model.parameters())) for out in (model(x), _tutorial_forward(model, x))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # float64: only the summation order may differ


@pytest.mark.parametrize("p", [0.25, 0.5, 0.3])
def test_dropout_drops_p_of_the_elements_and_scales_the_rest(p):
    from dptrain.models.layers import Dropout

    torch.manual_seed(0)
    layer = Dropout(p)
    x = torch.ones(64, 64, 12, 12).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = layer(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    kept = out != 0
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    n = x.numel()  # 589,824 draws: the dropped fraction's standard deviation is sqrt(p (1 - p) / n) < 0.00066
    assert abs((~kept).sum().item() / n - p) < 5 * (p * (1 - p) / n) ** 0.5
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())  # the gradient passes through the same mask and scale
    in_memory = kept.permute(0, 2, 3, 1).reshape(8, -1).float().mean(1)  # eighths of the mask, in memory order
    assert (in_memory - (1 - p)).abs().max() < 5 * (p * (1 - p) / (n / 8)) ** 0.5  # no part of it is stuck
    layer.eval()
    assert layer(x) is x or torch.equal(layer(x), x)
    torch.manual_seed(1)
    first = layer.train()(x)
    torch.manual_seed(1)
    assert torch.equal(layer(x), first)  # seeded: the same mask again


@pytest.mark.parametrize("shape", [(64, 9216, 128), (3, 5, 1), (1, 512, 10)])
def test_linear_through_onednn_computes_nn_linear_and_its_gradients(shape):
    """layers.Linear's float32 path (oneDNN's inner product, operands passed transposed) against float64."""
    from dptrain.models.layers import Linear

    batch, n_in, n_out = shape
    torch.manual_seed(0)
    layer = Linear(n_in, n_out)
    x = torch.randn(batch, n_in, requires_grad=True)
    grad = torch.randn(batch, n_out)
    out = layer(x)
    got = (out, *torch.autograd.grad(out, (x, layer.weight, layer.bias), grad))
    exact = nn.Linear(n_in, n_out).double()
    exact.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    out64 = exact(x64)
    want = (out64, *torch.autograd.grad(out64, (x64, exact.weight, exact.bias), grad.double()))
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        # float32 sums of up to 9216 products, ordered as oneDNN's kernels choose: seen here at most 7e-7 of the
        # tensor's scale; the bound leaves room for other CPUs' kernels and grows with the length of the sums.
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 1e-5 * scale * max(1, n_in / 1000), name


def test_linear_takes_onednn_on_the_cpu_in_float32_and_nn_linear_elsewhere(monkeypatch):
    from dptrain.models import layers

    calls = []
    real = layers.ONEDNN_LINEAR
    assert real is not None  # this torch has the op: otherwise the fast path is never tested
    monkeypatch.setattr(layers, "ONEDNN_LINEAR", lambda *args: calls.append(1) or real(*args))
    layer = layers.Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert len(calls) == 3  # forward, input gradient, weight gradient
    calls.clear()
    layer.double()(torch.randn(2, 8, dtype=torch.float64))  # oneDNN has no float64: nn.Linear's exact products
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.float()(x).dtype == torch.bfloat16  # autocast decides the dtype, as for nn.Linear
    layer(torch.randn(2, 3, 8))  # more than 2 dimensions
    assert layer(torch.randn(0, 8)).shape == (0, 4)  # an empty batch (a serving rank's), where oneDNN fails
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # nn.Linear's words for a wrong width
        layer(torch.randn(2, 7))
    assert calls == []
    assert list(layer.state_dict()) == ["weight", "bias"] and isinstance(layer, nn.Linear)
