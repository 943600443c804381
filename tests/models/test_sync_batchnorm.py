"""model.sync_batchnorm: every BatchNorm layer of the model becomes torch.nn.SyncBatchNorm, with the same parameters and
buffers under the same names; a model without BatchNorm is refused in one sentence. Its exactness (float64-equal to one
process with the same global batch) needs GPUs: perf/gpu_check.py checks it there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.config import ModelConfig, load as load_config
from dptrain.errors import ConfigError
from dptrain.models import build_model, check_input

CIFAR = (3, 32, 32)


def test_resnet18s_batchnorm_layers_all_become_syncbatchnorm_with_the_same_state():
    torch.manual_seed(0)
    plain = build_model(ModelConfig(name="resnet18"), CIFAR, 10)
    torch.manual_seed(0)
    synced = build_model(ModelConfig(name="resnet18", sync_batchnorm=True), CIFAR, 10)
    kinds = lambda model: [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]  # noqa: E731
    assert kinds(plain) == [nn.BatchNorm2d] * 20
    assert kinds(synced) == [nn.SyncBatchNorm] * 20
    # the same tensors under the same names: a snapshot of either loads into the other
    assert plain.state_dict().keys() == synced.state_dict().keys()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in synced.state_dict().items())
    # out of a process group (one process), SyncBatchNorm is BatchNorm: the same outputs
    images = torch.randn(4, *CIFAR)
    assert torch.equal(plain(images), synced(images))


def test_the_option_is_read_from_the_command_line():
    cfg = load_config(None, [("model.name", "resnet18"), ("model.sync_batchnorm", "true")])
    assert cfg.model.sync_batchnorm is True and load_config(None, []).model.sync_batchnorm is False


@pytest.mark.parametrize("name", ["mnist-cnn", "cifar-cnn"])
def test_a_model_without_batchnorm_is_refused_before_start_and_when_built(name):
    shape = (1, 28, 28) if name == "mnist-cnn" else CIFAR
    cfg = ModelConfig(name=name, sync_batchnorm=True)
    sentence = (f"model.sync_batchnorm is set but model {name} has no BatchNorm layer to synchronise; drop "
                f"--model.sync_batchnorm (it is for models such as resnet18).")
    with pytest.raises(ConfigError) as before_start:
        check_input(cfg, shape)  # prestart.preflight's check of a built-in model
    with pytest.raises(ConfigError) as built:
        build_model(cfg, shape, 10)  # the dry run's, a worker's, and a user's model's
    assert str(before_start.value) == str(built.value) == sentence
    check_input(ModelConfig(name="resnet18", sync_batchnorm=True), CIFAR)  # it has BatchNorm: no refusal


def test_torchs_syncbatchnorm_takes_no_cpu_tensors_in_a_process_group(tmp_path):
    """Why model.sync_batchnorm is refused on the CPU (tests/strategies/test_sync_batchnorm.py): torch 2.13 raises
    in training under a process group, even of one process. If this starts to pass, lift that refusal."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        layer = nn.SyncBatchNorm(3)
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            layer(torch.randn(4, 3, 2, 2))
    finally:
        dist.destroy_process_group()
