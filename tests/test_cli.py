"""Bad input through the CLI: one sentence on stderr, a non-zero exit, nothing already written lost."""

from __future__ import annotations

import pytest

from dptrain.cli import main, split_overrides
from dptrain.config import ConfigError
from tests.idx_files import idx_bytes, write_idx_dataset


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_split_overrides_accepts_both_spellings():
    assert split_overrides(["--optim.lr", "3e-4", "--train.bf16=true"]) == [("optim.lr", "3e-4"), ("train.bf16", "true")]
    with pytest.raises(ConfigError, match="needs a value"):
        split_overrides(["--optim.lr"])
    with pytest.raises(ConfigError, match="unexpected argument 'fast'"):
        split_overrides(["fast"])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optim.lrr", "1"], "unknown option optim.lrr; valid options in [optim] are"),
        (["--data.name", "synthetic", "--nproc-per-node", "3"], "train.global_batch_size 128 is not divisible by the world size 3"),
        (["--data.name", "synthetic", "--data.synthetic_train_size", "3", "--nproc-per-node", "4", "--train.global_batch_size", "4"],
         "world size 4 is larger than the training split (3 samples)"),
        (["--data.name", "synthetic", "--data.synthetic_shape", "3,32,32"], "model mnist-cnn takes 1x28x28 images but the dataset has 3x32x32; use --model.name cifar-cnn or resnet18"),
        (["--data.name", "synthetic", "--strategy.name", "single", "--nproc-per-node", "2"], "strategy single cannot run on 2 processes (it runs one process); start one process, or use --strategy.name ddp."),
        (["--data.name", "mnist", "--data.root", "nowhere"], "dataset mnist not found in nowhere/MNIST/raw, nowhere/mnist, nowhere"),
        (["--data.name", "synthetic", "--model.name", "no_such_pkg.models:Net"], "cannot import module no_such_pkg.models"),
    ],
)
def test_bad_input_is_one_sentence_before_any_worker_starts(capsys, tmp_path, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, "train", *argv)
    assert code == 2
    assert err.startswith("dptrain: error: ") and fragment in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_corrupt_dataset_names_the_file_and_keeps_earlier_results(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "data" / "MNIST" / "raw"
    write_idx_dataset(raw, train_size=50, test_size=20, gz=False)
    whole = (raw / "train-images-idx3-ubyte").read_bytes()
    (raw / "train-images-idx3-ubyte").write_bytes(whole[: len(whole) // 2])  # truncated mid-data
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"event": "epoch", "epoch": 1}\n')
    code, err = run_main(capsys, "train", "--data.name", "mnist", "--train.global_batch_size", "10")
    assert code == 1
    assert "rank 0 failed during data loading" in err and "train-images-idx3-ubyte is truncated" in err
    assert len(err.splitlines()) == 1
    assert (run_dir / "metrics.jsonl").read_text().startswith('{"event": "epoch", "epoch": 1}\n')


def test_one_process_run_in_this_process(capsys, tmp_path, monkeypatch):
    """world size 1 runs without the agent; exact counts even with a test split smaller than a batch."""
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "data"
    write_idx_dataset(raw, train_size=64, test_size=7)
    (raw / "extra.bin").write_bytes(idx_bytes(__import__("numpy").zeros(3, dtype="uint8")))  # ignored
    code = main(["train", "--data.name", "mnist", "--data.root", str(raw), "--strategy.name", "single",
                 "--train.global_batch_size", "16", "--train.epochs", "1"])
    assert code == 0
    text = (tmp_path / "runs" / "run" / "metrics.jsonl").read_text()
    assert '"eval_count": 7' in text and '"train_samples": 64' in text


def test_eval_refuses_to_write_predictions_over_another_file(tmp_path, capsys):
    from dptrain import checkpoint

    run_dir = tmp_path / "run"
    snapshot = run_dir / "checkpoints" / "step-00000001"
    snapshot.mkdir(parents=True)
    (run_dir / "config.toml").write_text('[data]\nname = "synthetic"\n')
    precious = run_dir / "config.toml"
    (snapshot / checkpoint.MANIFEST).write_text('{"world_size": 1, "strategy": "single", "model": "mnist-cnn", '
                                                 '"config_hash": "x", "step": 1, "files": {}}')
    assert main(["eval", "--checkpoint", str(run_dir), "--predictions", str(precious)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --predictions {precious} exists and is not a predictions "
                                               f"file; choose another path.")
    assert precious.read_text() == '[data]\nname = "synthetic"\n'


@pytest.mark.parametrize(("version", "on_cpu", "refused"), [("2.6.0+cu124", True, True), ("2.6.0", False, False),
                                                            ("2.7.0", True, False), ("2.13.0+cpu", True, False)])
def test_fsdp_on_the_cpu_is_refused_where_torch_cannot_run_it(version, on_cpu, refused):
    from dptrain import config
    from dptrain.cli import check_strategy_runs_here

    cfg = config.load(None, [("strategy.name", "fsdp")])
    if not refused:
        check_strategy_runs_here(cfg, on_cpu, version)
        return
    with pytest.raises(ConfigError) as error:
        check_strategy_runs_here(cfg, on_cpu, version)
    assert str(error.value) == (f"strategy fsdp on the CPU needs torch 2.7 or newer, and this is torch {version}; "
                                f"use --strategy.name ddp or zero1, or upgrade torch.")
