"""Lines people read: rank 0's `Epoch 01/05 | ...` line, each rank's own epoch line in its log, the GPU log's rows."""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch

from dptrain.run_folder import RunFolder

from dptrain.metrics import EpochLineSink, RankEpochSink, epoch_line, gpu_log, metric_line, rank_epoch_line, run_epochs
from dptrain.metrics.gpu_log import COLUMNS, GpuLog, GpuReading, reading_line
from dptrain.train_state import TrainState
from tests.conftest import read_events, run_cli

EPOCH = {"event": "epoch", "time": 1.0, "epoch": 1, "step": 469, "train_loss": 0.494249, "train_acc": 0.82473,
         "train_samples": 60000, "epoch_time_s": 31.27, "samples_per_s": 1918.6, "peak_mem_mb": 482.82, "lr": 0.001,
         "cpu_util_pct": [97.3, 95.1], "eval_loss": 0.321631, "eval_acc": 0.8775, "eval_count": 10000}
NOT_EVALUATED = {k: v for k, v in EPOCH.items() if not k.startswith("eval_")}


def test_the_epoch_line_pads_to_the_totals_width_and_reads_as_the_tutorials_line():
    assert epoch_line(EPOCH, 5) == "Epoch 1/5 | train loss 0.4942 | acc 82.5% | eval acc 87.8% | 31.3 s | 1,919 img/s"
    assert epoch_line({**EPOCH, "epoch": 3}, 10).startswith("Epoch 03/10 | ")
    assert epoch_line({**EPOCH, "epoch": 7}, 120).startswith("Epoch 007/120 | ")


def test_the_epoch_line_has_eval_acc_only_when_the_epoch_evaluated_and_thousands_separators():
    assert epoch_line(NOT_EVALUATED, 5) == "Epoch 1/5 | train loss 0.4942 | acc 82.5% | 31.3 s | 1,919 img/s"
    fast = {**NOT_EVALUATED, "samples_per_s": 1234567.4, "train_acc": 1.0}
    assert epoch_line(fast, 2).endswith("| acc 100.0% | 31.3 s | 1,234,567 img/s")
    assert "train loss nan" in epoch_line({**EPOCH, "train_loss": None}, 5)  # JSON's null for a non-finite loss


def test_the_total_is_the_epochs_the_run_reaches():
    assert run_epochs(5, 5 * 469, 469) == 5  # no train.max_steps
    assert run_epochs(5, 1000, 469) == 3  # max_steps ends it in epoch 3 (partial): not a promise of 5
    assert run_epochs(5, 938, 469) == 2  # at an epoch's end
    assert run_epochs(2, 10_000, 469) == 2  # max_steps beyond the epochs: train.epochs ends it


def test_the_epoch_line_sink_writes_one_line_per_epoch_event_and_leaves_the_metric_line_alone(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    before = metric_line(EPOCH)
    sink = EpochLineSink(5)
    for event in ({"event": "step", "step": 3, "loss": 0.5}, EPOCH, {"event": "run_end", "step": 469}):
        sink.write(event)
    assert [r.getMessage() for r in caplog.records] == [epoch_line(EPOCH, 5)]
    assert metric_line(EPOCH) == before


def test_a_ranks_own_line_reads_its_sums_and_goes_to_its_log_file_only(caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    state = TrainState()
    state.start_epoch(1, torch.device("cpu"))
    for _ in range(3):  # three steps of 16 of this rank's samples in global batches of 32
        state.count_step(torch.tensor(8.0, dtype=torch.float64), torch.tensor(12), 16, 32)
    state.epoch_elapsed = 2.25
    RankEpochSink(1, lambda: state, torch.device("cpu")).write({**EPOCH, "epoch": 2})
    [record] = caplog.records
    assert record.file_only  # rank 0's console shows the Epoch line instead
    assert re.fullmatch(r"rank 1 epoch 2: 3 steps, 48 samples in 2\.2 s, train loss 0\.5000, peak memory [\d,]+ MiB",
                        record.getMessage()), record.getMessage()
    assert (rank_epoch_line(3, 12, 469, 30016, 31.24, None, 1536.4)
            == "rank 3 epoch 12: 469 steps, 30,016 samples in 31.2 s, peak memory 1,536 MiB")


def test_with_rank_epoch_lines_every_ranks_own_line_reaches_its_console(caplog):
    """output.rank_epoch_lines: the tutorials print every rank's epoch line (seed 001); other ranks' went to their
    log files only. The record is marked for every rank's console, and the console's filter lets it through."""
    from dptrain.worker import on_console

    caplog.set_level(logging.INFO, logger="dptrain")
    state = TrainState()
    state.start_epoch(1, torch.device("cpu"))
    state.count_step(torch.tensor(8.0, dtype=torch.float64), torch.tensor(12), 16, 32)
    RankEpochSink(1, lambda: state, torch.device("cpu"), on_console=True).write({**EPOCH, "epoch": 2})
    RankEpochSink(1, lambda: state, torch.device("cpu")).write({**EPOCH, "epoch": 2})
    marked, plain = caplog.records
    assert marked.getMessage().startswith("rank 1 epoch 2: 1 steps, 16 samples")
    assert on_console(False, marked) and on_console(True, marked)  # rank 1's console, and rank 0's
    assert not on_console(False, plain) and not on_console(True, plain)  # by default its log file only
    info = logging.LogRecord("dptrain", logging.INFO, __file__, 1, "world size 2", None, None)
    warning = logging.LogRecord("dptrain", logging.WARNING, __file__, 1, "skipping", None, None)
    assert on_console(True, info) and not on_console(False, info) and on_console(False, warning)  # as before


@pytest.mark.nightly  # the default run keeps two workers' epoch lines and each rank's log
def test_every_ranks_epoch_line_reaches_the_runs_output_on_request(tmp_path):
    """Two local workers, as the job's output gets them: rank 1's lines on stdout beside rank 0's."""
    result = run_cli(["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64",
                      "--data.synthetic_test_size", "16", "--train.global_batch_size", "32", "--train.epochs", "2",
                      "--nproc-per-node", "2", "--output.rank_epoch_lines", "true"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        said = [line for line in result.stdout.splitlines() if f"INFO rank {rank} epoch " in line]
        assert [line.split(f"INFO rank {rank} ")[1].split(":")[0] for line in said] == ["epoch 1", "epoch 2"], result.stdout
        assert said[0].split(" ")[2] == f"rank{rank}"  # printed by that rank


def test_the_gpu_log_writes_a_header_and_a_row_per_sample_then_stops(tmp_path, caplog):
    readings = iter([GpuReading(97.0, 41.0, 12034.4, 312.6, 61.0), GpuReading(3.0, 0.0, 512.0)])
    clock = iter([1_800_000_000.0, 1_800_000_005.0])
    path = tmp_path / "logs" / "gpu_rank1.log"
    writer = GpuLog(path, lambda: next(readings), "dptrain GPU log: rank 1, cuda:1 (Fake GPU)", interval_s=3600,
                    clock=lambda: next(clock))
    writer.start()  # the header and a first row at once: a short run still has one
    assert writer.sample()
    writer.close()
    assert not writer._thread.is_alive() and writer.file is None
    lines = path.read_text().splitlines()
    assert lines[0] == "# dptrain GPU log: rank 1, cuda:1 (Fake GPU), NVML every 3600 s" and lines[1] == COLUMNS
    assert lines[3] == reading_line(1_800_000_000.0, GpuReading(97.0, 41.0, 12034.4, 312.6, 61.0))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +97 +41 +12,034 +313 +61", lines[3]), lines[3]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +3 +0 +512 +- +-", lines[4]), lines[4]  # no power, no temp
    assert len(lines) == 5
    # each value under its column's name
    assert [m.end() for m in re.finditer(r"\S+", lines[1])][-5:] == [m.end() for m in re.finditer(r"\S+", lines[3])][-5:]
    assert not caplog.records


def test_the_gpu_log_samples_on_its_thread_and_a_failing_sample_stops_it_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="dptrain")
    calls, third = [], threading.Event()

    def read() -> GpuReading:
        calls.append(1)
        if len(calls) >= 3:
            third.set()
            raise RuntimeError("NVML lost the device")
        return GpuReading(50.0, 10.0, 100.0)

    writer = GpuLog(tmp_path / "gpu_rank0.log", read, "t", interval_s=0.01).start()
    assert third.wait(5)
    writer._thread.join(5)
    assert not writer._thread.is_alive()  # it stopped by itself after the failure
    writer.close()
    rows = [line for line in (tmp_path / "gpu_rank0.log").read_text().splitlines() if not line.startswith("#")]
    assert len(rows) == 2 and len(calls) == 3
    assert [r.getMessage() for r in caplog.records] == [f"the GPU log {tmp_path / 'gpu_rank0.log'} stopped: NVML lost the device"]


def test_without_a_gpu_there_is_no_gpu_log_and_nothing_is_said(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with gpu_log(RunFolder(tmp_path), 0, torch.device("cpu")) as writer:
        assert writer is None
    with gpu_log(None, 0, torch.device("cuda", 0)) as writer:  # no run folder: nowhere to write
        assert writer is None
    assert not (tmp_path / "logs").exists() and not caplog.records


@pytest.mark.slow
def test_two_workers_print_epoch_lines_and_each_rank_logs_its_own(cli, tmp_path):
    result = cli("train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size",
                 "64", "--train.epochs", "2", "--train.global_batch_size", "32", "--nproc-per-node", "2",
                 "--output.dir", str(tmp_path / "X"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "X"
    epochs = read_events(run, "epoch")
    said = [line.split(" INFO ", 1)[1] for line in result.stdout.splitlines() if " INFO " in line]
    human = [line for line in said if line.startswith("Epoch ")]
    assert human == [epoch_line(e, 2) for e in epochs], said
    assert human[0].startswith("Epoch 1/2 | ") and human[1].startswith("Epoch 2/2 | ") and "eval acc" in human[1]
    assert [line for line in said if line.startswith("[METRIC]")] == [metric_line(e) for e in epochs]  # unchanged
    assert not any(line.startswith("rank ") for line in said)  # the ranks' own lines stay in their logs
    assert any(line.startswith("world size 2 (dptrain's elastic agent), device cpu") for line in said), said
    for rank in (0, 1):
        own = re.findall(rf"rank{rank} INFO (rank {rank} epoch (\d): 8 steps, 128 samples in [\d.]+ s, train loss [\d.]+, "
                         rf"peak memory [\d,]+ MiB)$", (run / "logs" / f"rank{rank}.log").read_text(), re.M)
        assert [epoch for _, epoch in own] == ["1", "2"], own  # 256 samples in 8 steps of 32: 16 of each rank's per step
    assert not list((run / "logs").glob("gpu_*"))  # no GPU here: no GPU log


def test_the_first_line_names_who_started_the_ranks(monkeypatch):
    """dptrain's agent gives its workers torchrun's variables: the label says the agent, not torchrun (and one
    process is one process, not 'none')."""
    from dptrain.distributed.ending import AGENT_PID
    from dptrain.distributed.env import DistEnv
    from dptrain.worker import started_by

    monkeypatch.delenv(AGENT_PID, raising=False)
    assert started_by(DistEnv.single()) == "one process"
    launched = DistEnv(0, 0, 2, 2, "127.0.0.1", 29500, "torchrun")
    assert started_by(launched) == "torchrun"
    assert started_by(DistEnv(0, 0, 2, 2, "node1", 29500, "slurm")) == "srun"
    monkeypatch.setenv(AGENT_PID, "123")
    assert started_by(launched) == "dptrain's elastic agent"
