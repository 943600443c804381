"""`dptrain bench sweep` and `dptrain report` end to end: real runs (gloo on CPU, tiny synthetic data), resumed and failed.

`dptrain bench sweep` runs in this process (its points are subprocesses of their own either way): a process of its own
would only add a start of Python and torch to each sweep.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import pytest

from dptrain_bench.collect import RESULT_COLUMNS, SUMMARY_COLUMNS
from dptrain_bench.peak import read_peaks
from dptrain_bench.report import PLOTS
from dptrain_bench.sweep import ERROR_FILE, LOG_FILE
from dptrain.cli import main
from dptrain.errors import ConfigError

pytestmark = pytest.mark.slow

TINY = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
        "--train.epochs", "2", "--train.global_batch_size", "32", "--train.progress_every_s", "0"]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run_bench(cwd: Path, *args: str) -> int:
    """`dptrain bench sweep ARGS` run in this process from the folder cwd; its exit code."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        return main(["bench", "sweep", *args])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, machine_probes: Path) -> tuple[Path, Path]:
    """(working folder, bench folder) of a 2-point sweep: workers 1,2 x ddp, one repeat. Its probes are the
    session's (machine_probes, taken with --probes-from): the same probes, made once, not twice (about 12 s); a sweep
    that probes for itself runs in the nightly tier (perf/speed.py's sweeps)."""
    cwd = tmp_path_factory.mktemp("bench")
    assert run_bench(cwd, "--workers", "1,2", "--strategies", "ddp", "--output.dir", "out", *TINY,
                     "--probes-from", str(machine_probes)) == 0
    return cwd, cwd / "out"


@pytest.mark.timeout(120)
def test_sweep_writes_one_row_per_run_and_a_summary(sweep):
    _, bench = sweep
    rows = read_rows(bench / "results.csv")
    assert tuple(rows[0]) == RESULT_COLUMNS
    peaks = read_peaks(bench)
    assert sorted(peaks) == [1, 2] and {(p.device, p.dtype) for p in peaks.values()} == {("cpu", "float32")}
    from dptrain_bench.link import read_link  # the link between the 2 workers' processes, for the scaling model

    link = read_link(bench)
    assert link is not None and list(link.probes) == [(1, 2)] and link.within_host is not None
    assert [(r["engine"], r["strategy"], r["workers"], r["status"]) for r in rows] == [
        ("dptrain", "ddp", "1", "ok"), ("dptrain", "ddp", "2", "ok")]
    for row in rows:
        assert row["nodes"] == "1" and row["global_batch_size"] == "32" and row["epochs_timed"] == "1"  # 1 warm-up epoch
        assert float(row["epoch_time_s"]) > 0 and float(row["images_per_s"]) > 0
        assert 0 <= float(row["eval_acc"]) <= 1 and float(row["eval_loss"]) > 0
        assert float(row["peak_mem_mb"]) > 0 and float(row["rss_max_mb"]) > 0 and float(row["cpu_util_pct"]) > 0
        # the probe of the row's worker count (peak.json), and the run's rate of the model's operations against it
        assert float(row["peak_tflops"]) == pytest.approx(peaks[int(row["workers"])].peak_tflops, rel=1e-5)  # %.6g
        assert float(row["fraction_of_peak"]) == pytest.approx(float(row["achieved_tflops"]) / float(row["peak_tflops"]),
                                                               rel=1e-4)
        assert row["torch"].startswith("2.") and row["host"] and row["run_dir"].startswith("runs/dptrain-ddp-w")
        run_dir = bench / row["run_dir"]
        assert (run_dir / LOG_FILE).read_text().startswith("$ ")  # the command, then its output
        assert len(list((run_dir / "checkpoints").glob("step-*"))) == 1  # epoch snapshots off; the run's end writes one
    summary = read_rows(bench / "summary.csv")
    assert tuple(summary[0]) == SUMMARY_COLUMNS
    assert [(s["workers"], s["runs"], s["failed"]) for s in summary] == [("1", "1", "0"), ("2", "1", "0")]
    assert float(summary[0]["speedup"]) == 1.0 and summary[0]["epoch_time_s_std"] == ""  # one repeat: no std


@pytest.mark.timeout(60)
def test_report_writes_pngs_and_markdown(sweep, monkeypatch, capsys):
    from dptrain.cli import main

    cwd, bench = sweep
    (bench / "results.csv").rename(bench / "kept.csv")  # report rebuilds it from the runs
    monkeypatch.chdir(cwd)
    assert main(["report", "out"]) == 0, capsys.readouterr().err
    assert read_rows(bench / "results.csv") == read_rows(bench / "kept.csv")
    text = (bench / "report.md").read_text()
    for name in PLOTS:
        data = (bench / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({name})" in text  # embedded by a relative path
    assert "| dptrain | ddp | 2 | 1 |" in text and "How to read them" in text and "Matmul peak (peak.json" in text


@pytest.mark.timeout(120)
def test_resumed_sweep_runs_only_the_missing_point(sweep, caplog):
    cwd, bench = sweep
    done, cut = bench / "runs" / "dptrain-ddp-w1-r1", bench / "runs" / "dptrain-ddp-w2-r1"
    kept = (done / LOG_FILE).stat().st_mtime_ns
    metrics = cut / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if '"run_end"' not in line))
    (cut / "stale").write_text("from the interrupted run")
    caplog.set_level(logging.INFO, logger="dptrain_bench")  # the sweep's lines: dptrain_bench.sweep's logger
    assert run_bench(cwd, "--workers", "1,2", "--strategies", "ddp", "--output.dir", "out", *TINY) == 0
    assert "1 done already, 1 to run" in caplog.text and "matmul peak" not in caplog.text  # probed once per sweep
    assert (done / LOG_FILE).stat().st_mtime_ns == kept
    assert '"run_end"' in metrics.read_text() and not (cut / "stale").exists()  # redone in a fresh folder
    assert [r["status"] for r in read_rows(bench / "results.csv")] == ["ok", "ok"]


@pytest.mark.timeout(60)
def test_failing_point_is_recorded_and_the_exit_code_says_so(tmp_path, capsys, machine_probes):
    # a training split of one sample for 2 workers is refused inside the run: a real failure of one point, in seconds
    assert run_bench(tmp_path, "--workers", "2", "--strategies", "ddp", "--output.dir", "out", *TINY,
                     "--data.synthetic_train_size", "1", "--probes-from", str(machine_probes)) == 1
    assert ("1 of the sweep's runs failed: dptrain-ddp-w2-r1: dptrain: error: world size 2 is larger than the training "
            "split") in capsys.readouterr().err
    [row] = read_rows(tmp_path / "out" / "results.csv")
    assert row["status"] == "failed" and row["error"].startswith("dptrain: error: world size 2 is larger")
    assert row["peak_tflops"] == row["fraction_of_peak"] == ""  # a failed run has no rate to divide
    assert (tmp_path / "out" / "runs" / "dptrain-ddp-w2-r1" / ERROR_FILE).is_file()


@pytest.mark.timeout(60)
def test_report_without_results_is_one_sentence(tmp_path, monkeypatch, capsys):
    from dptrain.cli import main

    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["report", "empty"]) == 2
    assert capsys.readouterr().err == ("dptrain: error: empty holds no finished runs (no results.csv, and no run under "
                                       "empty/runs ended); run `dptrain bench sweep --output.dir empty` first.\n")


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_results_csv_is_said_to_be_one_not_rebuilt_over(tmp_path, monkeypatch, capsys):
    # It was taken for a missing results.csv: "holds no finished runs (no results.csv ...)".
    from dptrain.cli import main

    (tmp_path / "sweep" / "runs").mkdir(parents=True)
    os.mkfifo(tmp_path / "sweep" / "results.csv")
    monkeypatch.chdir(tmp_path)
    assert main(["report", "sweep"]) == 2
    assert capsys.readouterr().err == ("dptrain: error: sweep/results.csv is a FIFO, not a regular file; delete it, and "
                                       "`dptrain report` writes it again from the runs.\n")
    assert (tmp_path / "sweep" / "results.csv").is_fifo()


@pytest.mark.nightly  # the tutorial engine's point (6 s); the default run keeps its refusals and the sweep's rows
@pytest.mark.timeout(60)
def test_tutorial_engine_writes_the_same_event_shape(tmp_path, machine_probes):
    assert run_bench(tmp_path, "--workers", "2", "--strategies", "ddp", "--engines", "tutorial", "--output.dir", "out", *TINY,
                     "--probes-from", str(machine_probes)) == 0
    [row] = read_rows(tmp_path / "out" / "results.csv")
    assert (row["engine"], row["workers"], row["status"], row["global_batch_size"], row["epochs_timed"]) == (
        "tutorial", "2", "ok", "32", "1")
    assert float(row["epoch_time_s"]) > 0 and float(row["eval_loss"]) > 0 and float(row["peak_mem_mb"]) > 0
    events = [json.loads(line) for line in (tmp_path / "out" / "runs" / "tutorial-ddp-w2-r1" / "metrics.jsonl").open()]
    assert [e["event"] for e in events] == ["run_start", "epoch", "epoch", "run_end"]
    assert events[1]["train_samples"] == 256 and events[1]["eval_count"] == 64 and len(events[1]["cpu_util_pct"]) == 2


def test_a_sweep_goes_under_runs_by_default_not_into_the_source_folder_bench():
    from dptrain_bench.sweep import sweep_from_options

    sweep, _ = sweep_from_options(config_path=None, pairs=[("data.name", "synthetic")], workers="1", strategies="ddp",
                                  repeats=1, warmup_epochs=0, engines="dptrain", run_timeout_s=60)
    assert sweep.bench_dir == Path("runs") / "bench" / "synthetic"


def test_probes_from_an_earlier_sweep_are_copied_where_the_sweep_has_none_and_nothing_else(tmp_path, machine_probes):
    from dptrain_bench.link import LINK_FILE, read_link
    from dptrain_bench.peak import PEAK_FILE
    from dptrain_bench.sweep import adopt_probes

    fresh = tmp_path / "fresh"
    assert adopt_probes(machine_probes, fresh) == [PEAK_FILE, LINK_FILE]
    assert read_peaks(fresh) == read_peaks(machine_probes) and read_link(fresh).probes == read_link(machine_probes).probes
    own = tmp_path / "own"
    own.mkdir()
    (own / PEAK_FILE).write_text("the sweep's own, kept as it is")
    assert adopt_probes(machine_probes, own) == [LINK_FILE] and (own / PEAK_FILE).read_text().startswith("the sweep's")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / PEAK_FILE).write_text('{"probes": "not probes"}')  # not a sweep's: named, and nothing copied
    with pytest.raises(ConfigError, match=f"^--probes-from {planted}: peak.json is not what dptrain writes there "
                                          f"\\(probes is 'not probes', not an object of at most 1024 entries\\); give "
                                          f"the folder of an earlier sweep on this machine, or drop --probes-from"):
        adopt_probes(planted, tmp_path / "other")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"^--probes-from {empty} holds no peak.json or link.json a sweep wrote; "
                                          f"give the folder of an earlier sweep on this machine, or drop it"):
        adopt_probes(empty, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_probes_from_is_refused_by_tune_in_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for tune in (["tune"], ["--tune"]):  # the subcommand, and its spelling of before the subcommands
        assert main(["bench", *tune, "--probes-from", str(tmp_path), "--output.dir", "t"]) == 2
        err = capsys.readouterr().err
        assert ("--probes-from is an option of `dptrain bench sweep`, not of `dptrain bench tune`" in err
                and err.count("\n") == 1)
    assert not (tmp_path / "t").exists()
