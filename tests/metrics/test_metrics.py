"""An epoch's account (its clock, its per-rank tables, its event's training fields), utilisation per rank, progress
lines in job logs, and [METRIC] lines that stay one line in a terminal."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from rich.console import Console

from dptrain import snapshots, config
from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.events import EPOCH_EVENT
from dptrain.metrics import MetricLineSink, ProgressBar, UtilisationSampler, metric_line, per_rank, progress_line
from dptrain.metrics.epoch_account import EpochAccount, EpochTotals, train_fields
from dptrain.metrics.utilisation import GPU_FIELDS
from dptrain.train_state import TrainState
from tests.conftest import read_events

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "100", "--data.synthetic_test_size", "30",
         "--strategy.name", "single", "--train.global_batch_size", "32", "--train.log_every", "1"]
PROGRESS = re.compile(r"progress: epoch (\d+)/(\d+) step (\d+)/(\d+) (\d+) images/s ETA (\d\d:\d\d:\d\d|unknown)$")


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(1000))


@pytest.mark.slow
def test_cpu_utilisation_and_resident_memory_are_measured_and_the_thread_stops():
    sampler = UtilisationSampler(torch.device("cpu"), interval_s=0.05)
    try:
        _busy(0.4)
        values = sampler.take()
        time.sleep(0.3)  # idle: the next window's CPU use is far lower
        idle = sampler.take()
    finally:
        sampler.close()
    assert not sampler._thread.is_alive()
    threads = psutil.Process().num_threads()
    # One busy Python thread: about 100% of one core, less when other processes share the cores; then idle.
    assert 0 < values["cpu_util_pct"] <= 100 * threads
    assert idle["cpu_util_pct"] < values["cpu_util_pct"]
    assert 100 < values["rss_max_mb"] < 100_000  # this process (torch loaded) holds some 300 MiB
    assert set(values) == {"cpu_util_pct", "rss_max_mb"}


@pytest.mark.skipif(nvml_works(), reason="this test is about machines without NVML; this one has it")
def test_without_nvml_a_gpu_rank_has_no_gpu_fields_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    sampler = UtilisationSampler(torch.device("cuda", 0), interval_s=0.05)  # NVML fails before CUDA is touched
    try:
        time.sleep(0.2)
        windows = [sampler.take(), sampler.take()]
    finally:
        sampler.close()
    assert all(not set(GPU_FIELDS) & set(w) and w["rss_max_mb"] > 0 for w in windows)
    lines = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("no GPU utilisation fields: NVML is not available here ("), lines


def test_per_rank_lists_hold_each_ranks_values_and_drop_a_field_some_rank_lacks():
    mine = {0: {"cpu_util_pct": 90.5, "rss_max_mb": 400.0, "gpu_util_mean_pct": 80.0},
            1: {"cpu_util_pct": 10.0, "rss_max_mb": 300.0}}
    tables: list[torch.Tensor] = []
    for rank in (0, 1):  # what each rank contributes; then the sum an all-reduce makes
        per_rank(mine[rank], 2, rank, lambda t: tables.append(t.clone()) or t, torch.device("cpu"))
    total = tables[0] + tables[1]
    assert per_rank(mine[0], 2, 0, lambda t: total, torch.device("cpu")) == {"cpu_util_pct": [90.5, 10.0],
                                                                              "rss_max_mb": [400.0, 300.0]}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_account_counts_each_step_into_the_state_and_a_resumed_epochs_clock_goes_on():
    state, clock = TrainState(), Clock(100.0)
    state.start_epoch(0, torch.device("cpu"))
    state.epoch_elapsed = 7.5  # the snapshot's time of an epoch resumed mid-way
    account = EpochAccount(state, world_size=2, global_rank=1, clock=clock)
    for loss, correct in ((6.0, 10), (4.5, 12)):
        clock.now += 2.0
        account.count(torch.tensor(loss, dtype=torch.float64), torch.tensor(correct), 16, 32)
    assert account.steps == 2 and state.step == 2 and state.epoch_seen == 64
    assert state.epoch_sums.tolist() == [10.5, 22.0, 32.0]
    assert state.epoch_elapsed == 11.5  # what a snapshot after step 2 records: 7.5 before the resume, 4 since
    clock.now += 0.25  # the sums' reduction, waiting for the slowest rank
    assert account.stop_clock() == 11.75 == state.epoch_elapsed


def test_each_ranks_own_row_summed_over_the_ranks_is_every_ranks_values_exactly():
    values = {0: [4799528, 0, 2**52 + 1, 3.0], 1: [4799528, 17, 1, 5.0], 2: [1, 2, 3, 4]}
    rows = [EpochAccount(TrainState(), 3, rank).own_row(values[rank], torch.device("cpu")) for rank in values]
    assert all(row.dtype == torch.float64 for row in rows)
    assert rows[1][0].tolist() == rows[1][2].tolist() == [0.0] * 4  # the other ranks' rows: zeros
    assert sum(rows).tolist() == [values[0], values[1], values[2]]  # float64 holds 2**52 + 1 exactly


TOTALS = EpochTotals(loss_sum=3.0, correct=75.0, samples=100.0, seen=100, elapsed_s=0.5, peak_mem_mb=512.0, lr=0.001,
                     footprint=[[10.0, 10.0], [20.0, 20.0], [30.0, 15.0], [400.0, 400.0]], utilisation={},
                     comm_timing=[[1.23456, 2.0], [0.5, 0.25]], flops_per_sample=2_000_000)


def test_the_epochs_training_fields_are_the_reduced_numbers_in_the_schemas_order():
    fields = train_fields(TOTALS)
    assert fields == {"train_loss": 0.03, "train_acc": 0.75, "train_samples": 100, "epoch_time_s": 0.5,
                      "samples_per_s": 200.0, "model_flops_per_sample": 2_000_000, "achieved_tflops": 4e-4,
                      "peak_mem_mb": 512.0, "lr": 0.001, "mem_params_bytes": [10, 10], "mem_grads_bytes": [20, 20],
                      "mem_optim_bytes": [30, 15], "comm_bytes_per_step": [400, 400],
                      "comm_ms_per_step": [1.235, 2.0], "comm_exposed_ms_per_step": [0.5, 0.25]}
    assert list(fields) == [f for f in EPOCH_EVENT.fields if f in fields]
    assert all(type(v) is int for v in fields["mem_optim_bytes"])  # byte counts, as the event has always had them


def test_without_a_flop_count_or_a_sampled_step_on_every_rank_those_fields_are_left_out():
    fields = train_fields(replace(TOTALS, flops_per_sample=None, comm_timing=[[-1.0, 2.0], [-1.0, 0.5]],
                                  utilisation={"cpu_util_pct": [97.5, 90.0]}))
    assert not {"model_flops_per_sample", "achieved_tflops", "comm_ms_per_step"} & set(fields)
    assert list(fields)[-1] == "cpu_util_pct" and fields["cpu_util_pct"] == [97.5, 90.0]
    assert "comm_ms_per_step" not in train_fields(replace(TOTALS, comm_timing=None))


@pytest.mark.slow
def test_an_epoch_event_carries_the_utilisation_lists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.max_steps", "6", "--output.name", "run"]) == 0
    run = tmp_path / "runs" / "run"
    epochs = read_events(run, "epoch")
    threads = psutil.Process().num_threads()
    for event in epochs:
        assert len(event["cpu_util_pct"]) == 1 and 0 < event["cpu_util_pct"][0] <= 100 * threads
        assert len(event["rss_max_mb"]) == 1 and event["rss_max_mb"][0] > 100
        assert not set(GPU_FIELDS) & set(event)
    metric_lines = [line for line in (run / "logs" / "rank0.log").read_text().splitlines() if "[METRIC]" in line]
    assert len(metric_lines) == 2 and all(re.search(r" cpu_util_pct=[\d.]+ rss_max_mb=[\d.]+ ", line) for line in metric_lines)


EPOCH = {"event": "epoch", "time": 1.0, "epoch": 1, "step": 469, "train_loss": 0.503974, "train_acc": 0.819283,
         "train_samples": 60000, "epoch_time_s": 51.4696, "samples_per_s": 1165.74, "peak_mem_mb": 482.82, "lr": 0.001,
         "mem_params_bytes": [4799528, 4799528], "comm_bytes_per_step": [4799528, 4799528],
         "cpu_util_pct": [97.3, 95.1], "rss_max_mb": [480.2, 470.9], "eval_loss": 0.321631, "eval_acc": 0.8805}


def test_the_metric_line_stays_one_line_in_a_narrow_terminal(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    console = Console(force_terminal=True, width=80, file=io.StringIO())
    MetricLineSink(console).write(EPOCH)
    out = console.file.getvalue()
    line = metric_line(EPOCH)
    assert len(line) > 3 * 80
    assert out == line + "\n"  # no newline inserted at 80 columns, no colour codes
    assert [(r.getMessage(), r.file_only) for r in caplog.records] == [(line, True)]  # the log files get it once too


def test_the_metric_line_goes_through_the_log_when_output_is_no_terminal(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    console = Console(force_terminal=False, width=80, file=io.StringIO())
    MetricLineSink(console).write(EPOCH)
    assert console.file.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [metric_line(EPOCH)]


def test_progress_lines_every_interval_with_rate_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    now = [0.0]
    bar = ProgressBar(True, every_s=30, total_steps=100, start_step=10, clock=lambda: now[0],
                      console=Console(force_terminal=False, file=io.StringIO()))
    bar.start_epoch(2, 3, 50)
    for step in range(11, 31):  # 20 steps of 128 images, 2 s each
        now[0] += 2.0
        bar.advance(None, step, 128)
    lines = [r.getMessage() for r in caplog.records]
    # at 30 s (step 25): 15 steps, 1920 images in 30 s; 75 steps left at 2 s each
    assert lines == [progress_line(2, 3, 25, 100, 64.0, 150.0)] == ["progress: epoch 2/3 step 25/100 64 images/s ETA 00:02:30"]
    assert not ProgressBar(True, every_s=0, console=Console(force_terminal=False, file=io.StringIO())).lines
    assert not ProgressBar(True, every_s=30, console=Console(force_terminal=True, file=io.StringIO())).lines


@pytest.mark.slow
def test_a_run_with_stdout_to_a_pipe_prints_progress_lines(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # rich would take stdout for a terminal
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "dptrain", "train", *SMALL, "--train.max_steps", "6",
                           "--train.progress_every_s", "0.001"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(" INFO ", 1)[1] for line in proc.stdout.splitlines() if " INFO progress: " in line]
    found = [PROGRESS.match(line) for line in lines]
    assert len(lines) == 6 and all(found), lines  # every step, as the interval is shorter than a step
    assert [(int(m[1]), int(m[3]), int(m[4])) for m in found] == [(1, 1, 6), (1, 2, 6), (1, 3, 6), (1, 4, 6), (2, 5, 6), (2, 6, 6)]
    assert all(int(m[5]) > 0 for m in found)


def test_progress_every_s_is_checked():
    with pytest.raises(ConfigError, match=r"train.progress_every_s = -1.0 must be 0 or more"):
        config.load(None, [("train.progress_every_s", "-1")])
    quiet = config.load(None, [("train.progress_every_s", "0")])
    assert quiet.train.progress_every_s == 0
    assert snapshots.config_hash(quiet) == snapshots.config_hash(config.RunConfig())  # a resume may change it
