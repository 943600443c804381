"""CUDA checks, run on a GPU machine with `pytest -m gpu` (CI has no GPU, so `pytest` deselects them)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import read_events, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # slow too: `-m "not slow"` replaces the default `-m "not gpu"`

# 2,000 synthetic samples in batches of 64: 31 full batches and a last one of 16 per epoch (run eagerly
# by a graphed run), 64 steps in two epochs; no dropout, so that a replayed graph and eager kernels
# draw no random numbers and must agree.
RUN = ["--data.name", "synthetic", "--data.synthetic_train_size", "2000", "--data.synthetic_test_size", "300",
       "--train.global_batch_size", "64", "--train.epochs", "2", "--train.log_every", "1", "--model.dropout", "false",
       "--train.deterministic", "true", "--strategy.name", "single"]


def weights(run_dir):
    return torch.load(run_dir / "model.pt")


def test_a_graphed_step_trains_as_the_eager_step(tmp_path):
    for name, extra in (("eager", []), ("graph", ["--train.cuda_graph", "true"])):
        result = run_cli(["train", *RUN, "--output.dir", str(tmp_path / name), "--optim.schedule", "cosine", *extra], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "training step captured after 3 eager steps" in (tmp_path / "graph" / "logs" / "rank0.log").read_text()
    eager, graph = (read_events(tmp_path / name, "step") for name in ("eager", "graph"))
    # Not bit-identical, and not a derived rounding bound: the replayed (capturable) Adam reads each step's
    # learning rate from a float32 GPU tensor, the eager one gets the schedule's Python float, so every update
    # differs by the float32 rounding of the lr (at most u/2 = 2^-25 ~ 3e-8 relative), which Adam can amplify for
    # weights whose gradient is near zero (see FP32_LOSS_BOUND in test_train_distributed.py). 1e-5 is an allowance
    # for that, not measured in this session (no GPU); a real error (a graph stuck at the first lr under the
    # cosine schedule, a replayed stale batch) moves the losses by far more.
    assert len(eager) == len(graph) == 64
    for a, b in zip(eager, graph):  # under a cosine schedule: a graph stuck at the first lr would drift away
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    we, wg = weights(tmp_path / "eager"), weights(tmp_path / "graph")
    for key in we:
        assert (we[key] - wg[key]).abs().max() <= 1e-5 * we[key].abs().max(), key


def test_a_graphed_run_resumes_bit_identical(tmp_path):
    graph = [*RUN, "--train.cuda_graph", "true", "--model.dropout", "true"]
    whole = run_cli(["train", *graph, "--output.dir", str(tmp_path / "whole")], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    part = tmp_path / "part"
    for steps in ("40", "64"):  # stops 8 steps into epoch 2, then resumes and captures again
        result = run_cli(["train", *graph, "--output.dir", str(part), "--train.max_steps", steps], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    ww, wp = weights(tmp_path / "whole"), weights(part)
    # Exact: deterministic kernels, the same capture on both sides, and a snapshot restores every state
    # (weights, Adam's moments and step, the dropout generator) bit for bit, so no rounding differs.
    assert all(torch.equal(ww[k], wp[k]) for k in ww)


def test_a_task_bound_to_one_gpu_uses_it_whatever_its_local_rank(tmp_path):
    """srun --gpus-per-task: each task sees one GPU, cuda:0, while SLURM_LOCALID counts up."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29000 + os.getpid() % 1000), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    result = run_cli(["train", *RUN, "--output.dir", str(tmp_path / "bound"), "--train.max_steps", "3"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_events(tmp_path / "bound", "run_start")[0]["device"] == "cuda:0"


def test_auto_workers_are_one_per_visible_gpu_and_one_for_single_and_dp():
    from dptrain.config import LaunchConfig, StrategyConfig
    from dptrain.prestart import local_workers

    assert local_workers(LaunchConfig(), StrategyConfig()) == torch.cuda.device_count()
    for name in ("single", "dp"):  # they drive every GPU from one process (and refuse more)
        assert local_workers(LaunchConfig(), StrategyConfig(name=name)) == 1
