"""Multi-process runs of the real CLI (elastic agent, gloo on CPU), each under a hard timeout."""

from __future__ import annotations

import json
import os

import pytest

from dptrain import config
from tests.conftest import read_events
from tests.idx_files import write_idx_dataset

pytestmark = pytest.mark.slow

SYNTHETIC = ["--data.name", "synthetic", "--data.synthetic_train_size", "1000", "--data.synthetic_test_size", "101"]


def step_losses(run_dir) -> list[float]:
    return [e["loss"] for e in read_events(run_dir, "step")]


def test_world_sizes_1_2_4_follow_the_same_loss_curve(cli, tmp_path):
    """Same global batch and seed, no dropout, fp32: every step's global loss agrees to 1e-5 relative."""
    curves = {}
    for world in (1, 2, 4):
        run_dir = tmp_path / f"w{world}"
        result = cli("train", "--nproc-per-node", str(world), *SYNTHETIC, "--model.dropout", "false",
                     "--train.max_steps", "30", "--train.global_batch_size", "32", "--train.log_every", "1",
                     "--output.dir", str(run_dir), timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[world] = step_losses(run_dir)
        assert len(curves[world]) == 30
    assert curves[1][-1] < curves[1][0]  # it trains
    for world in (2, 4):
        for step, (ref, got) in enumerate(zip(curves[1], curves[world]), start=1):
            assert abs(got - ref) <= 1e-5 * abs(ref), f"world {world}, step {step}: {got} vs {ref}"


def test_eval_counts_every_test_sample_once_with_an_uneven_split(cli, tmp_path):
    """101 test samples on 3 ranks, 100 training samples in global batches of 12 (last one: 4 over 3 ranks)."""
    run_dir = tmp_path / "w3"
    result = cli("train", "--nproc-per-node", "3", "--data.name", "synthetic", "--data.synthetic_train_size", "100",
                 "--data.synthetic_test_size", "101", "--train.global_batch_size", "12", "--train.eval_batch_size", "10",
                 "--train.epochs", "2", "--output.dir", str(run_dir), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = read_events(run_dir, "epoch")
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert all(e["eval_count"] == 101 for e in epochs)
    assert all(e["train_samples"] == 100 for e in epochs)
    assert all(e["step"] == 9 * e["epoch"] for e in epochs)  # ceil(100 / 12) = 9 steps per epoch, none dropped


def test_two_workers_train_on_real_format_files_end_to_end(cli, tmp_path):
    write_idx_dataset(tmp_path / "data" / "FashionMNIST" / "raw", train_size=400, test_size=103)
    run_dir = tmp_path / "runs" / "e2e"
    result = cli("train", "--nproc-per-node", "2", "--data.root", str(tmp_path / "data"), "--train.epochs", "2",
                 "--train.global_batch_size", "32", "--train.log_every", "5", "--output.name", "e2e", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = read_events(run_dir, "epoch")
    assert len(epochs) == 2
    for e in epochs:
        assert e["eval_count"] == 103 and e["train_samples"] == 400
        assert 0 <= e["train_acc"] <= 1 and e["samples_per_s"] > 0 and e["peak_mem_mb"] > 0
    assert epochs[1]["eval_acc"] > 0.5  # the bands are easy to learn: it really trained
    start = read_events(run_dir, "run_start")[0]
    assert start["world_size"] == 2 and start["data"] == "fashion-mnist"
    metric_lines = [line for line in result.stdout.splitlines() if "[METRIC]" in line]
    assert len(metric_lines) == 2 and "eval_count=103" in metric_lines[0] and "epoch=1" in metric_lines[0]
    saved = config.load(run_dir / "config.toml")
    assert saved.launch.nproc_per_node == 2 and saved.data.root == str(tmp_path / "data")
    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2
    assert env["cpu_threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)  # the cores split between the ranks
    assert (run_dir / "logs" / "rank0.log").exists() and (run_dir / "logs" / "rank1.log").exists()


def test_a_users_dataset_and_model_train_through_the_sampler_path(cli, tmp_path):
    run_dir = tmp_path / "user"
    result = cli("train", "--nproc-per-node", "2", "--data.name", "tests.user_code:PatternDataset",
                 "--model.name", "tests.user_code:TinyNet", "--train.global_batch_size", "10",
                 "--output.dir", str(run_dir), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = read_events(run_dir, "epoch")
    assert [e["eval_count"] for e in epochs] == [37, 37] and [e["train_samples"] for e in epochs] == [96, 96]


def test_a_failing_rank_is_named_with_its_phase(cli, tmp_path):
    result = cli("train", "--nproc-per-node", "2", *SYNTHETIC, "--model.name", "tests.user_code:FailsOnRank1",
                 "--launch.timeout_s", "20", "--output.dir", str(tmp_path / "fail"), timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "dptrain: error: rank 1 failed during step 3: injected failure"


@pytest.mark.parametrize("present", [0, 1])
def test_a_rank_that_never_joins_fails_the_run_within_the_timeout_naming_it(cli, tmp_path, present):
    """One rank of a 2-rank world under torchrun-style variables; the other never starts."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = {"RANK": str(present), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    result = cli("train", *SYNTHETIC, "--launch.timeout_s", "5", "--output.dir", str(tmp_path / "alone"), env=world, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    if present == 0:
        assert last == ("dptrain: error: rank 0 failed during rendezvous: rank 1 of 2 never joined within 5 s; "
                        "check that every rank was started with the same MASTER_ADDR:MASTER_PORT")
    else:
        assert last.startswith(f"dptrain: error: rank 1 failed during rendezvous: could not reach the store of rank 0 "
                               f"at 127.0.0.1:{port} within 5 s: rank 0 is missing or unreachable")
    assert elapsed < 60  # bounded by launch.timeout_s, not torch's 30-minute default


def test_a_rank_that_dies_unseen_by_any_agent_is_named_by_the_survivor(tmp_path):
    """Two ranks started apart, as on two nodes; rank 1 is SIGKILLed after step 3 and no agent notices."""
    import socket
    import time

    from dptrain.faults import SIGNAL_AT
    from tests.conftest import start_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["train", *SYNTHETIC, "--launch.timeout_s", "10", "--output.dir", str(tmp_path / "run"), "--train.epochs", "1"]
    ranks = []
    start = time.monotonic()
    for rank in (0, 1):
        world = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), SIGNAL_AT: "1:3:SIGKILL:self"}
        ranks.append(start_cli(args, tmp_path, world))
    try:
        _, err0 = ranks[0].communicate(timeout=120)
        ranks[1].communicate(timeout=30)
    finally:
        for proc in ranks:
            proc.kill()
    elapsed = time.monotonic() - start
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 1
    last = err0.strip().splitlines()[-1]
    assert last.startswith("dptrain: error: rank 0 failed during ")
    assert ": rank 1 did not answer (dead or stuck): " in last
    assert elapsed < 60  # found within launch.timeout_s (10 s) plus the 5-second roll call, not torch's 30 minutes
