"""train.eval_every_epochs: which epochs are evaluated; the last one, and a max_steps stop, always are."""

from __future__ import annotations

import pytest

from dptrain.cli import main
from tests.conftest import read_events

SMALL = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "32",
         "--train.global_batch_size", "32", "--checkpoint.every_epochs", "0"]


@pytest.mark.parametrize(("every", "epochs", "max_steps", "evaluated"), [
    ("2", "5", None, [2, 4, 5]),
    ("0", "3", None, [3]),
    ("1", "2", None, [1, 2]),
    ("0", "3", "3", [2]),  # 2 steps per epoch: the run stops 1 step into epoch 2, which is evaluated
])
def test_evaluated_epochs(tmp_path, every, epochs, max_steps, evaluated):
    run_dir = tmp_path / "run"
    extra = ["--train.max_steps", max_steps] if max_steps else []
    assert main([*SMALL, "--train.eval_every_epochs", every, "--train.epochs", epochs, *extra, "--output.dir", str(run_dir)]) == 0
    events = read_events(run_dir, "epoch")
    assert [e["epoch"] for e in events if "eval_loss" in e] == evaluated
    assert all(e["eval_count"] == 32 for e in events if "eval_loss" in e)
    assert all("train_loss" in e for e in events)  # every epoch reports its training metrics
