"""train.profile FIRST:LAST: torch.profiler over those steps on every rank, each rank's trace in the run's tb/profile/."""

from __future__ import annotations

import json

import pytest

from dptrain.cli import main
from dptrain.config import load as load_config
from dptrain.errors import ConfigError
from tests.conftest import plan_runs

# 2 ranks, 6 steps of the tutorials' CNN on synthetic data, steps 3 and 4 profiled
plan_runs({"profile/ddp": (["train", "--data.name", "synthetic", "--data.synthetic_train_size", "192",
                            "--data.synthetic_test_size", "20", "--train.global_batch_size", "32", "--train.epochs", "1",
                            "--train.profile", "3:4", "--checkpoint.every_epochs", "0"], (2,))})


def trace_events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_each_rank_writes_a_trace_of_the_profiled_steps_with_their_operators(planned_run):
    run_dir = planned_run("profile/ddp", 2)
    folder = run_dir / "tb" / "profile"
    traces = {rank: list(folder.glob(f"rank{rank}.*.pt.trace.json")) for rank in (0, 1)}
    assert all(len(found) == 1 for found in traces.values()), sorted(p.name for p in folder.iterdir())
    for rank, [trace] in traces.items():
        names = {event.get("name") for event in trace_events(trace)}
        assert {"ProfilerStep#3", "ProfilerStep#4"} <= names, rank  # the run's steps, as the step events count them
        assert not {"ProfilerStep#2", "ProfilerStep#5"} & names, rank  # and only those
        assert "aten::convolution" in names and "Optimizer.step#Adam.step" in names, rank
    assert "train.profile: steps 3 to 4 profiled on every rank" in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.parametrize("given", ["10", "5:3", "0:2", "a:b", "1:2:3"])
def test_a_profile_that_is_not_a_range_of_steps_is_one_sentence(given):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [("train.profile", given)])
    assert str(caught.value) == (f"train.profile = {given!r} is not a range of steps; give FIRST:LAST with 1 <= FIRST "
                                 f"<= LAST, such as 10:15 (the run's optimizer steps, counted from 1).")


def test_the_dry_run_says_which_steps_are_profiled(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--dry-run", "--data.name", "synthetic", "--data.synthetic_train_size", "256",
            "--train.global_batch_size", "64", "--train.epochs", "2", "--output.name", "p"]
    assert main([*argv, "--train.profile", "3:20"]) == 0
    assert "profile    steps 3 to 8 with torch.profiler on every rank, the traces in runs/p/tb/profile" in capsys.readouterr().out
    assert main([*argv, "--train.profile", "9:20"]) == 0
    assert "profile    none: train.profile 9:20 starts after the run's last step (8)" in capsys.readouterr().out
