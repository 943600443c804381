"""MODELS: name -> builder, from config.choices.MODELS (the one list of the built-in models, each naming its class and
the images it takes); `build_model` also takes a user's `package.module:ClassName`."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dptrain.config import ModelConfig, is_import_path
from dptrain.config.choices import MODELS as MODEL_CHOICES, ModelChoice
from dptrain.errors import ConfigError
from dptrain.imports import import_object

Builder = Callable[[tuple[int, ...], int | None], nn.Module]
"""Builds a model for (image shape C x H x W, number of classes or None when unknown)."""


def _builder(choice: ModelChoice) -> Builder:
    """Its class, built for the number of classes (10 when unknown) and, where it takes any, the images' channels."""
    cls = import_object(choice.builds, "model.name")

    def build(shape: tuple[int, ...], classes: int | None) -> nn.Module:
        channels = {} if choice.channels is not None else {"in_channels": shape[0]}
        return cls(num_classes=classes or 10, **channels)

    return build


MODELS: dict[str, Builder] = {name: _builder(choice) for name, choice in MODEL_CHOICES.items()}

# What each built-in model takes: (channels, (height, width)); None: any.
INPUTS: dict[str, tuple[int | None, tuple[int, int] | None]] = {
    name: (choice.channels, choice.size) for name, choice in MODEL_CHOICES.items()}
SUGGESTION = {(1, 28, 28): "mnist-cnn", (3, 32, 32): "cifar-cnn or resnet18"}


def check_input(cfg: ModelConfig, image_shape: tuple[int, ...]) -> None:
    """Refuse a built-in model that cannot take this dataset's images, before any worker starts."""
    channels, size = INPUTS[cfg.name]
    shape = tuple(image_shape)
    if (channels is not None and shape[0] != channels) or (size is not None and shape[1:] != size):
        want = "x".join(map(str, (channels or "C", *(size or ("H", "W")))))
        raise ConfigError(
            f"model {cfg.name} takes {want} images but the dataset has {'x'.join(map(str, shape))}; "
            f"use --model.name {SUGGESTION.get(shape, 'resnet18')}."
        )
    if cfg.sync_batchnorm:
        with torch.device("meta"):  # shapes only: nothing is initialised or allocated
            model = MODELS[cfg.name](shape, None)
        if not has_batchnorm(model):
            raise ConfigError(_no_batchnorm(cfg.name))


def build_model(cfg: ModelConfig, image_shape: tuple[int, ...], num_classes: int | None) -> nn.Module:
    if is_import_path(cfg.name):
        cls = import_object(cfg.name, "model.name")
        try:
            model = cls()
        except TypeError as exc:
            raise ConfigError(f"model.name {cfg.name} must be constructible with no arguments ({exc}); give its arguments defaults.") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name {cfg.name} built a {type(model).__name__}, not a torch.nn.Module.")
    else:
        check_input(cfg, image_shape)
        model = MODELS[cfg.name](image_shape, num_classes)
    if not cfg.dropout:
        _remove_dropout(model)
    if cfg.sync_batchnorm:
        model = sync_batchnorm(model, cfg.name)
    return model


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


def sync_batchnorm(model: nn.Module, name: str) -> nn.Module:
    """model with every BatchNorm layer as torch.nn.SyncBatchNorm (the same parameters and buffers, under the same
    names: snapshots of either load into the other); ConfigError where it has none, since the option would change
    nothing the user asked it to."""
    if not has_batchnorm(model):
        raise ConfigError(_no_batchnorm(name))
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _no_batchnorm(name: str) -> str:
    return (f"model.sync_batchnorm is set but model {name} has no BatchNorm layer to synchronise; drop "
            f"--model.sync_batchnorm (it is for models such as resnet18).")


def _remove_dropout(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.modules.dropout._DropoutNd):
            setattr(module, name, nn.Identity())
        else:
            _remove_dropout(child)


def training_flops_per_sample(model: nn.Module, image_shape: tuple[int, ...]) -> int:
    """Floating-point operations of one training step per sample: the forward pass and the backward pass (weight
    gradients, and input gradients of every layer but the first), as torch.utils.flop_counter counts them
    (matrix products and convolutions, 2 per multiply-add; elementwise work is not counted).

    Counted on a copy on the meta device (shapes only, nothing computed), in eval mode (batch norm then accepts the
    two samples), with the global random state left as it was: the run's model, gradients and random streams are
    untouched.
    """
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    probe = copy.deepcopy(model).to("meta").eval()  # shapes are all the count needs: nothing is computed
    samples = 2
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        probe(torch.zeros(samples, *image_shape, device="meta")).float().sum().backward()
    return counter.get_total_flops() // samples
