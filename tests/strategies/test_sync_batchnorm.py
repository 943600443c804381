"""model.sync_batchnorm is refused in one sentence, before any worker starts, where torch's SyncBatchNorm cannot run:
one process (single, dp), a strategy other than DDP's (ddp, zero1), the CPU."""

from __future__ import annotations

import pytest

from dptrain.cli import main
from dptrain.config import load as load_config
from dptrain.errors import ConfigError
from dptrain.strategies.registry import check_world

ONE = "model.sync_batchnorm synchronises BatchNorm over processes, and strategy {} runs one; drop it, or use " \
      "--strategy.name ddp (one process per GPU)."
OTHER = "model.sync_batchnorm runs under DDP's strategies only (torch's SyncBatchNorm is made for DDP), not {}; " \
        "drop it, or use --strategy.name ddp."
CPU = ("model.sync_batchnorm needs GPUs (torch's SyncBatchNorm takes no CPU tensors in training); drop it on the CPU, "
       "or run on GPUs with --launch.device cuda.")
CASES = {  # strategy -> (world size, the sentence on GPUs)
    "single": (1, ONE.format("single")), "dp": (1, ONE.format("dp")), "fsdp": (2, OTHER.format("fsdp")),
    "ps": (2, OTHER.format("ps")), "ddp": (2, None), "zero1": (2, None),
}


def config(strategy: str):
    return load_config(None, [("model.name", "resnet18"), ("model.sync_batchnorm", "true"), ("strategy.name", strategy)])


@pytest.mark.parametrize("strategy", CASES)
def test_sync_batchnorm_runs_under_ddp_on_gpus_only(strategy):
    world, sentence = CASES[strategy]
    if sentence is None:
        check_world(config(strategy), world, 1000, on_cpu=False)  # ddp's one process per GPU: accepted
    else:
        with pytest.raises(ConfigError) as caught:
            check_world(config(strategy), world, 1000, on_cpu=False)
        assert str(caught.value) == sentence
    with pytest.raises(ConfigError) as on_cpu:
        check_world(config(strategy), world, 1000, on_cpu=True)
    assert str(on_cpu.value) == (sentence or CPU)


def test_dptrain_train_refuses_it_on_the_cpu_before_any_worker_starts(tmp_path, capsys):
    code = main(["train", "--data.name", "synthetic", "--data.synthetic_shape", "3,32,32", "--model.name", "resnet18",
                 "--model.sync_batchnorm", "true", "--nproc-per-node", "2", "--output.dir", str(tmp_path / "run")])
    assert (code, capsys.readouterr().err) == (2, f"dptrain: error: {CPU}\n")
    assert not (tmp_path / "run").exists()
