"""`dptrain eval`: a snapshot's model on the test split, sharded over workers, every sample counted once."""

from __future__ import annotations

import csv

import pytest

from dptrain.cli import main
from tests.conftest import plan_runs, read_events, run_cli

pytestmark = pytest.mark.slow

# 53 test samples: not divisible by 2 or 3 workers, nor by the eval batch of 8 per worker.
TRAIN = ["--data.name", "synthetic", "--data.synthetic_train_size", "128",
         "--data.synthetic_test_size", "53", "--train.global_batch_size", "32", "--train.epochs", "1",
         "--train.eval_batch_size", "8", "--strategy.name", "fsdp"]


def metric_fields(stdout: str) -> dict[str, str]:
    line = next(line for line in stdout.splitlines() if "[METRIC]" in line and " snapshot=" in line)
    return dict(part.split("=", 1) for part in line.split("[METRIC]")[1].split())


# Trained on 2 ranks with the other modules' 2-rank runs, in one set of rank processes (planned_run).
plan_runs({"eval/trained": (["train", *TRAIN, "--launch.timeout_s", "60"], (2,))})


@pytest.fixture(scope="module")
def trained(planned_run):
    """A run folder trained with fsdp on 2 workers (its snapshot holds sharded weights)."""
    return planned_run("eval/trained", 2)


@pytest.mark.parametrize("workers", [1, pytest.param(3, marks=pytest.mark.nightly)])  # 3: an uneven split, also
def test_eval_counts_every_test_sample_once_and_matches_training(tmp_path, capsys, trained, workers):
    predictions = tmp_path / "predictions.csv"
    args = ["eval", "--checkpoint", str(trained), "--nproc-per-node", str(workers), "--predictions", str(predictions)]
    if workers == 1:  # one worker runs in this process, no launch
        code = main(args)
        stdout, stderr = capsys.readouterr()
    else:  # through the elastic agent, in a process of its own (the agent takes over its process's signals)
        result = run_cli(args, tmp_path)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    assert code == 0, stderr[-3000:]
    fields = metric_fields(stdout)
    final = read_events(trained, "epoch")[-1]  # the training run's own evaluation of the same weights
    assert int(fields["eval_count"]) == 53 and int(fields["world_size"]) == workers
    # The line prints 6 significant digits (<= 5e-6 relative); the same weights' per-sample losses summed
    # in float32 per batch of 8 in another grouping: gamma_7 ~ 7u on each side, 14u ~ 8.3e-7 (u = 2^-24);
    # logits of another per-worker batch size (other kernel blocking): ~ a few u. Sum < 6e-6 <= 1e-5.
    assert float(fields["eval_loss"]) == pytest.approx(final["eval_loss"], rel=1e-5)
    assert round(float(fields["eval_acc"]) * 53) == round(final["eval_acc"] * 53)  # the line prints 6 digits
    with predictions.open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["index"]) for r in rows] == list(range(53))  # every sample once, in the split's order
    correct = sum(r["label"] == r["predicted"] for r in rows)
    # Both are (an integer count) / 53 in float64, so equal counts give equal values (to 1e-16); one more or one
    # less correct prediction differs by 1/53 ~ 0.019: 1e-9 only separates the two.
    assert correct / 53 == pytest.approx(final["eval_acc"], abs=1e-9)


def test_eval_of_a_path_without_snapshot_is_one_sentence(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: {tmp_path} is neither a snapshot nor a run folder "
                                               f"with a valid snapshot; give a folder that dptrain checkpoint list shows as ok.")


def test_predictions_never_replace_a_file_that_is_not_one(trained, tmp_path, capsys):
    config = trained / "config.toml"
    before = config.read_text()
    assert main(["eval", "--checkpoint", str(trained), "--predictions", str(config)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --predictions {config} exists and is not a predictions "
                                               f"file; choose another path.")
    assert config.read_text() == before
    assert main(["eval", "--checkpoint", str(trained), "--predictions", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --predictions {tmp_path} is a folder; give a file name, "
                                               f"for example {tmp_path / 'predictions.csv'}.")
