"""A diverged run (the training loss nan or inf) stops at once with one sentence and exit code 1, on every rank alike,
and keeps the last snapshot taken before it: no snapshot of the diverged state, no final weights."""

from __future__ import annotations

import re

import pytest

from dptrain import snapshots
from tests.conftest import read_events

RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
       "--train.global_batch_size", "64", "--optim.name", "sgd", "--launch.timeout_s", "60"]
SENTENCE = re.compile(r"dptrain: error: the training loss became (nan|inf) (at step (\d+)|between steps (\d+) and (\d+)) "
                      r"\(epoch (\d+)\) and the run stopped; (.*); lower --optim\.lr or set --train\.grad_clip, "
                      r"and use another --output\.dir to start afresh\.")
# The second epoch's divergence on 2 workers in the default run (the ranks agree to stop), on 1 in the nightly tier;
# the first step's on 1 worker in the default run, on 2 in the nightly tier.
WORKERS = [pytest.param(1, marks=pytest.mark.nightly), pytest.param(2, marks=[pytest.mark.slow, pytest.mark.timeout(240)])]


def diverged(result, run_dir) -> re.Match:
    """The one sentence of a diverged run, checked: exit code 1, nothing else on stderr, the run's files consistent."""
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and (match := SENTENCE.fullmatch(lines[0])), result.stderr
    assert "Traceback" not in result.stdout and "Logging error" not in result.stdout
    assert not (run_dir / "model.pt").exists()  # the final weights are never the diverged ones
    assert all(e["loss"] is not None for e in read_events(run_dir, "step"))  # no null loss logged as if all were well
    return match


def snapshot_steps(run_dir) -> list[int]:
    return sorted(int(p.name.removeprefix(snapshots.PREFIX)) for p in (run_dir / "checkpoints").glob(f"{snapshots.PREFIX}*"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.nightly)])  # 2: second epoch's, below
def test_a_diverged_run_stops_at_its_first_snapshot_after_the_nan_and_keeps_the_one_before(cli, tmp_path, workers):
    """lr 1e30: the first update throws the weights far out, the losses after it are not finite."""
    run_dir = tmp_path / "run"
    result = cli(*RUN, "--nproc-per-node", str(workers), "--optim.lr", "1e30", "--train.epochs", "2",
                 "--checkpoint.every_steps", "1", "--output.dir", str(run_dir))
    match = diverged(result, run_dir)
    assert match[3] is not None, "a snapshot every step: each step's loss is checked before its snapshot"
    step = int(match[3])
    kept = f"{snapshots.PREFIX}{step - 1:08d}"
    assert match[7] == f"the last snapshot before it, {kept}, is kept"
    assert snapshot_steps(run_dir) == list(range(1, step))  # none of the diverged step, none after it
    assert (run_dir / "checkpoints" / snapshots.LATEST).read_text().strip() == kept
    assert snapshots.verify(run_dir / "checkpoints" / kept)["step"] == step - 1  # whole


@pytest.mark.slow
def test_a_run_that_diverges_before_any_snapshot_says_so(cli, tmp_path):
    """The issue's command: sgd at lr 1e30, checked at the end of the epoch (no log step, no snapshot before it)."""
    run_dir = tmp_path / "run"
    result = cli(*RUN, "--optim.lr", "1e30", "--train.epochs", "2", "--output.dir", str(run_dir))
    match = diverged(result, run_dir)
    assert match[6] == "1" and match[7] == "no snapshot was written before it"
    assert match[4] == "1" and int(match[5]) == 256 // 64  # unchecked from step 1 to the epoch's end
    assert not (run_dir / "checkpoints").exists()
    assert read_events(run_dir, "epoch") == []


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
def test_a_run_that_diverges_in_its_second_epoch_keeps_the_first_epochs_snapshot(cli, tmp_path, workers):
    """A step schedule with gamma 1e30: epoch 1 trains at lr 0.01, epoch 2 at 1e28; seen at the log steps (every 2)."""
    run_dir = tmp_path / "run"
    result = cli(*RUN, "--nproc-per-node", str(workers), "--optim.lr", "0.01", "--optim.schedule", "step",
                 "--optim.gamma", "1e30", "--train.epochs", "3", "--train.log_every", "2", "--output.dir", str(run_dir))
    match = diverged(result, run_dir)
    steps_per_epoch = 256 // 64
    assert match[6] == "2"
    seen = int(match[3] or match[5])
    assert seen % 2 == 0 and steps_per_epoch < seen <= 2 * steps_per_epoch  # at a log step of epoch 2
    assert match[7] == f"the last snapshot before it, {snapshots.PREFIX}{steps_per_epoch:08d}, is kept"
    assert snapshot_steps(run_dir) == [steps_per_epoch]
    assert snapshots.verify(run_dir / "checkpoints" / f"{snapshots.PREFIX}{steps_per_epoch:08d}")
    [epoch] = read_events(run_dir, "epoch")  # epoch 1's event, finite; epoch 2 has none
    assert epoch["epoch"] == 1 and epoch["train_loss"] is not None
