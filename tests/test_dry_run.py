"""`dptrain train --dry-run`: it checks what a run would need, says what the run would do, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

from dptrain.cli import main

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


def test_a_multi_node_dry_run_says_what_this_node_starts(tmp_path, capsys, monkeypatch):
    # It said "4 local workers" for 2 nodes x 2 workers: this node starts 2 of them.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--nproc-per-node", "2"]) == 0
    assert ("world      4 ranks, 2 local workers on each of 2 nodes (this is node 1) on cpu, backend gloo, strategy ddp"
            in capsys.readouterr().out)


def test_a_dry_run_names_the_snapshot_it_would_resume_from(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.max_steps", "3", "--output.name", "r"]) == 0
    capsys.readouterr()
    before = tree(tmp_path)
    assert main(["train", "--dry-run", *SMALL, "--train.max_steps", "6", "--output.name", "r"]) == 0
    assert f"resume     from {Path('runs/r/checkpoints/step-00000003')} (step 3, written by 1 ranks)" in capsys.readouterr().out
    assert tree(tmp_path) == before
    assert main(["train", "--dry-run", *SMALL, "--optim.lr", "0.5", "--output.name", "r"]) == 2  # a resume would refuse
    assert "was written with optim.lr = 0.001 but this run has 0.5" in capsys.readouterr().err


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
