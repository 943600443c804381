"""`dptrain train --dry-run`: it checks what a run would need, says what the run would do, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dptrain.cli import main
from tests.conftest import read_events

SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "300", "--data.synthetic_test_size", "40",
         "--train.global_batch_size", "64"]


def tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_a_dry_run_reports_the_run_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    before = tree(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--nproc-per-node", "2", "--train.epochs", "3",
                 "--optim.warmup_steps", "4", "--output.name", "planned"]) == 0
    out = capsys.readouterr().out
    assert tree(tmp_path) == before  # no runs/, no logs, nothing touched
    assert "world      2 local workers on cpu, backend gloo, strategy ddp" in out
    assert "synthetic: 300 training and 40 test samples of shape 1x28x28" in out
    assert "global 64 = 32 per rank; 5 steps per epoch, 15 in all (3 epochs)" in out
    assert "one batch 32x1x28x28 ran forward on the CPU" in out
    assert "warm-up 4 steps" in out
    assert f"writes     {Path('runs') / 'planned'}" in out
    assert "nothing to resume from: a fresh start" in out
    assert "warning" not in out  # 4 warm-up steps of 15


def test_a_warmup_longer_than_the_run_is_one_warning_line(tmp_path, capsys, monkeypatch):
    # A dry run of 10 steps with a 1,000-step warm-up said nothing of it.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--train.epochs", "2", "--optim.warmup_steps", "1000"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert warnings == ["warning: optim.warmup_steps 1000 is longer than the run's 10 optimizer steps, so the learning "
                        "rate never reaches its peak 0.001 (the last step runs at 0.9% of it); lower "
                        "--optim.warmup_steps, or train for more steps."]


def test_a_multi_node_dry_run_says_what_this_node_starts(tmp_path, capsys, monkeypatch):
    # It said "4 local workers" for 2 nodes x 2 workers: this node starts 2 of them.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--nproc-per-node", "2"]) == 0
    assert ("world      4 ranks, 2 local workers on each of 2 nodes (this is node 1) on cpu, backend gloo, strategy ddp"
            in capsys.readouterr().out)


def test_a_multi_node_dry_run_without_a_node_rank_leaves_the_numbering_to_the_rendezvous(tmp_path, capsys, monkeypatch):
    # torchrun's multi-node line has no --node_rank: it was refused ("--node-rank is needed with --nnodes 2").
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                 "127.0.0.1:29400", "--nproc-per-node", "2"]) == 0
    assert ("world      4 ranks, 2 local workers on each of 2 nodes (numbered by the rendezvous) on cpu, backend gloo, "
            "strategy ddp" in capsys.readouterr().out)


@pytest.mark.slow
def test_a_dry_run_names_the_snapshot_it_would_resume_from(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.max_steps", "3", "--output.name", "r"]) == 0
    capsys.readouterr()
    before = tree(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--train.max_steps", "6", "--output.name", "r"]) == 0
    assert f"resume     from {Path('runs/r/checkpoints/step-00000003')} (step 3, written by 1 ranks)" in capsys.readouterr().out
    assert tree(tmp_path) == before
    # a resume the run would refuse is what the run would do: the dry run says so, and ends well
    assert main(["train", "--dry-run", *SMALL, "--optim.lr", "0.5", "--output.name", "r"]) == 0
    out = capsys.readouterr().out
    assert (f"  resume     refused, so the run would stop before its first step: snapshot "
            f"{Path('runs/r/checkpoints/step-00000003')} was written with optim.lr = 0.001 but this run has 0.5; use the "
            f"snapshot's setting, or another --output.name to start afresh.\n") in out
    assert tree(tmp_path) == before


def test_each_experiment_gets_its_own_default_run_folder_and_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    """After a small synthetic run in the one default folder (runs/run), the dry run of the tutorials' dataset was
    refused (`snapshot ... was written with data.name = 'synthetic' ...`)."""
    from tests.idx_files import write_idx_dataset

    monkeypatch.chdir(tmp_path)
    synthetic = ["train", *SMALL, "--train.epochs", "1", "--train.max_steps", "2"]
    assert main(synthetic) == 0
    [folder] = Path("runs").iterdir()
    assert folder.name.startswith("synthetic_mnist-cnn_ddp_")  # and 8 hex digits: SMALL's sizes are not the defaults
    capsys.readouterr()
    assert main([*synthetic[:-1], "3"]) == 0  # the same command, a step further: it resumes in its folder
    assert [p.name for p in Path("runs").iterdir()] == [folder.name]
    assert [e["step"] for e in read_events(folder, "run_start")] == [0, 2]
    write_idx_dataset(tmp_path / "Data" / "FashionMNIST" / "raw", 128, 32)
    capsys.readouterr()
    assert main(["train", "--dry-run", "--data.root", "./Data"]) == 0
    out = capsys.readouterr().out
    assert f"  writes     {Path('runs/fashion-mnist_mnist-cnn_ddp')} (config.toml" in out
    assert "  resume     nothing to resume from: a fresh start\n" in out


def test_a_run_folder_of_an_earlier_dptrain_goes_on_for_its_own_experiment_only(tmp_path, capsys, monkeypatch):
    """runs/run, the one default folder of earlier versions: the same command goes on resuming there; another
    experiment starts in a folder of its own."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.epochs", "1", "--train.max_steps", "2", "--output.name", "run"]) == 0
    capsys.readouterr()
    assert main(["train", "--dry-run", *SMALL, "--train.epochs", "1"]) == 0
    assert f"resume     from {Path('runs/run/checkpoints/step-00000002')} (step 2" in capsys.readouterr().out
    assert main(["train", "--dry-run", *SMALL, "--train.epochs", "1", "--optim.lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "writes     runs/synthetic_mnist-cnn_ddp_" in out and "nothing to resume from: a fresh start" in out


def test_a_model_that_fails_on_one_batch_is_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--dry-run", *SMALL, "--data.synthetic_shape", "3,8,8", "--model.name", "tests.user_code:TinyNet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("dptrain: error: model tests.user_code:TinyNet fails on one batch of shape (64, 3, 8, 8) (")
    assert err[0].endswith("); fix the model or the data options.")
    assert not (tmp_path / "runs").exists()
    assert os.listdir(tmp_path) == []


def test_a_dry_run_says_the_data_would_be_downloaded_where_its_files_are_not_there(tmp_path, capsys, monkeypatch):
    # It said "60000 training and 0 test samples", as if the test split were empty, and nothing of a download.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "--data.name", "mnist", "--data.download", "true", "--data.root",
                 str(tmp_path / "data"), "--data.mirror", "https://mirror.example/mnist/"]) == 0
    out = capsys.readouterr().out
    assert (f"  data       mnist: not found under {tmp_path / 'data'}, so the run would first download it there (4 files "
            f"from https://mirror.example/mnist/): 60000 training samples of shape 1x28x28, and the test split") in out
    assert "0 test samples" not in out
    assert not (tmp_path / "data").exists()  # a dry run downloads nothing


def test_a_dry_run_says_batchnorm_is_synchronised(tmp_path, monkeypatch):
    # The check before it (GPUs only) is the command line's; the dry run itself builds the converted model.
    from dptrain.config import load as load_config
    from dptrain.dry_run import dry_run

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [("data.name", "synthetic"), ("data.synthetic_shape", "3,32,32"),
                             ("data.synthetic_train_size", "64"), ("data.synthetic_test_size", "8"),
                             ("train.global_batch_size", "8"), ("model.name", "resnet18"),
                             ("model.sync_batchnorm", "true"), ("launch.device", "cuda")])
    out = dry_run(cfg, 2, launched_outside=False)
    assert "resnet18: 11,173,962 parameters; BatchNorm as SyncBatchNorm (statistics over the global batch); one batch " \
           "4x3x32x32 ran forward on the CPU" in out
