"""`dptrain report` and collect on inputs that `dptrain bench` never writes: garbage rows of results.csv, planted
events in a run's metrics.jsonl, an outsized job.toml, and error text that would be Markdown or HTML in report.md.

Every folder here is written by hand (no training), so each test takes about a second, most of it matplotlib.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from pathlib import Path

import pytest

from dptrain_bench.collect import RESULT_COLUMNS, collect, summarize
from dptrain.cli import main
from dptrain.errors import ConfigError

POINT = "dptrain-ddp-w{}-r1"


def result_row(workers: object, epoch_time_s: object = 2.0, **cells: object) -> dict[str, object]:
    row = dict.fromkeys(RESULT_COLUMNS, "")
    row.update(engine="dptrain", strategy="ddp", nodes=1, workers=workers, repeat=1, status="ok", global_batch_size=32,
               epochs_timed=1, epoch_time_s=epoch_time_s, images_per_s=100, eval_loss=0.5, eval_acc=0.9,
               peak_mem_mb=100, torch="2.5", host="node1", run_dir=f"runs/{POINT.format(workers)}")
    row.update(cells)
    return row


def write_results(bench: Path, rows: list[dict[str, object]], raw_lines: tuple[str, ...] = ()) -> None:
    bench.mkdir(exist_ok=True)
    with (bench / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        f.writelines(line + "\n" for line in raw_lines)


def report(bench: Path, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """(exit code, stderr, report.md or "") of `dptrain report BENCH`."""
    code = main(["report", str(bench)])
    text = (bench / "report.md").read_text() if (bench / "report.md").is_file() else ""
    return code, capsys.readouterr().err, text


def read_summary(bench: Path) -> list[dict[str, str]]:
    with (bench / "summary.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def table_cells(line: str) -> int:
    """The cells of a Markdown table row: its pipes less one, a pipe after a backslash being text."""
    return len(re.findall(r"(?<!\\)\|", line)) - 1


@pytest.mark.slow
def test_bad_rows_of_results_csv_are_left_out_and_named(tmp_path, capsys, caplog):
    bench = tmp_path / "bench"
    caplog.set_level(logging.WARNING, logger="dptrain")
    # lines 2..9: a good 1-worker row and a good 2-worker row, then one bad cell each, then a short row
    write_results(bench, [result_row(1, 2.0), result_row(2, 1.0), result_row(4, 0), result_row(8, -1.0),
                          result_row(16, "nan"), result_row(32, "inf"), result_row(64, "fast"), result_row("two", 1.0)],
                  raw_lines=("dptrain,ddp,1",))
    code, err, text = report(bench, capsys)
    assert code == 0, err
    [warning] = caplog.messages  # one line for them all
    assert "7 rows of" in warning and "(results.csv line 4: epoch_time_s is '0', not a number from 1e-06 to 1e+08; ...)" in warning
    left_out = text.split("## Left out of this report", 1)[1]
    # plain text as it is: only Markdown's markup gets a backslash (test_text_from_results_csv_cannot_change_report_md)
    for line, what in [(4, "epoch_time_s is '0'"), (5, "epoch_time_s is '-1.0'"),
                       (6, "epoch_time_s is 'nan'"), (7, "epoch_time_s is 'inf'"),
                       (8, "epoch_time_s is 'fast'"), (9, "workers is 'two'"), (10, f"it has 3 cells, and the header {len(RESULT_COLUMNS)}")]:
        assert f"- results.csv line {line}: {what}" in left_out
    # only the good rows reach the table and summary.csv, and no speedup comes from a time of zero or less
    assert [line.split(" | ")[2] for line in text.split("## Summary", 1)[1].splitlines()
            if line.startswith("| dptrain |")] == ["1", "2"]  # the summary's rows (the accuracy table has its own)
    summary = read_summary(bench)
    assert [(s["workers"], float(s["speedup"]), float(s["efficiency"])) for s in summary] == [("1", 1.0, 1.0),
                                                                                              ("2", 2.0, 1.0)]


def test_results_csv_with_every_row_bad_is_one_sentence(tmp_path, capsys):
    bench = tmp_path / "bench"
    write_results(bench, [result_row(1, 0)])
    code, err, _ = report(bench, capsys)
    assert code == 2
    error = err.splitlines()[-1]
    assert error.startswith(f"dptrain: error: {bench} has no finished run left to plot: 1 left out, the first as "
                            f"results.csv line 2: epoch_time_s is '0', not a number from 1e-06 to 1e+08; fix the file it names")


@pytest.mark.parametrize("content, says", [
    (b"", "has no column engine"),
    (b"a,b\n1,2\n", "has no column engine"),
    (b"engine,strategy,workers,status,epoch_time_s\n\xff\xfe,ddp,1,ok,1\n", "is not UTF-8 text"),
])
def test_a_file_that_is_no_results_csv_is_one_sentence(tmp_path, capsys, content, says):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "results.csv").write_bytes(content)
    code, err, _ = report(bench, capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"dptrain: error: {bench / 'results.csv'} {says}") and "delete it" in err


def test_summary_never_divides_by_a_time_of_zero_or_less():
    # rows as a caller might hand them over unchecked: the speedup skips the times it cannot divide by
    rows = [{"engine": "dptrain", "strategy": "ddp", "workers": w, "status": "ok", "epoch_time_s": t}
            for w, t in [(1, 0.0), (2, -1.0), (4, 2.0), (8, 1.0)]]
    speedups = {s["workers"]: s["speedup"] for s in summarize(rows)}
    assert speedups == {1: "", 2: "", 4: 1.0, 8: 2.0}


def write_run(bench: Path, events: list[object], workers: int = 1, tail: str = "") -> Path:
    """A finished point's folder under BENCH/runs holding these events (dicts as JSON, strings as they are)."""
    run_dir = bench / "runs" / POINT.format(workers)
    run_dir.mkdir(parents=True)
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines) + tail)
    return run_dir


def epoch(number: int, **fields: object) -> dict[str, object]:
    return {"event": "epoch", "epoch": number, "epoch_time_s": 1.0, "train_samples": 256, "eval_loss": 0.5,
            "eval_acc": 0.9, "peak_mem_mb": 100.0, "rss_max_mb": [100.0], "cpu_util_pct": [90.0]} | fields


def run_events(planted: object) -> list[object]:
    """run_start, epochs 1 and 2, the planted line as line 4, epoch 3, run_end."""
    return [{"event": "run_start", "global_batch_size": 32}, epoch(1), epoch(2), planted, epoch(3), {"event": "run_end"}]


PLANTED = {
    "missing key": {k: v for k, v in epoch(9).items() if k != "epoch_time_s"},
    "no epoch": {k: v for k, v in epoch(9).items() if k != "epoch"},
    "string for a number": epoch(9, epoch_time_s="fast"),
    "NaN time": '{"event": "epoch", "epoch": 9, "epoch_time_s": NaN, "train_samples": 256}',
    "zero time": epoch(9, epoch_time_s=0),
    "negative samples": epoch(9, train_samples=-256),
    "true for a number": epoch(9, train_samples=True),
    "NaN measure": '{"event": "epoch", "epoch": 9, "epoch_time_s": 1.0, "train_samples": 256, "eval_loss": NaN}',
    "string in a per-rank list": epoch(9, peak_mem_mb=[1.0, "x"]),
    "not an object": "[1, 2]",
    "not JSON, mid-file": '{"event": "epoch", "epo',
    "nested past the parser": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("planted", PLANTED.values(), ids=PLANTED.keys())
def test_a_planted_metrics_event_is_skipped_and_counted(tmp_path, caplog, planted):
    bench = tmp_path / "bench"
    run_dir = write_run(bench, run_events(planted))
    caplog.set_level(logging.WARNING, logger="dptrain")
    [row] = collect(bench)
    # the run is still reported, from its three good epochs (one warm-up: two timed), never from the planted one
    assert row["status"] == "ok" and row["epochs_timed"] == 2 and row["epoch_time_s"] == 1.0
    assert math.isfinite(row["images_per_s"]) and row["eval_loss"] == 0.5 and row["peak_mem_mb"] == 100.0
    assert row["skipped_events"].startswith(f"runs/{run_dir.name}/metrics.jsonl: 1 line skipped (line 4: ")
    [warning] = caplog.messages
    assert warning.startswith(f"{run_dir / 'metrics.jsonl'}: 1 line skipped (line 4: ")


def test_a_line_cut_short_at_the_end_is_skipped_without_a_word(tmp_path, caplog):
    bench = tmp_path / "bench"
    write_run(bench, run_events(epoch(9))[:-2], tail='{"event": "epoch", "ep')  # killed while writing epoch 3
    caplog.set_level(logging.WARNING, logger="dptrain")
    [row] = collect(bench)
    assert row["status"] == "unfinished" and "skipped_events" not in row and caplog.messages == []


@pytest.mark.slow
def test_report_rebuilt_from_the_runs_lists_the_skipped_lines(tmp_path, capsys, caplog):
    bench = tmp_path / "bench"
    caplog.set_level(logging.WARNING, logger="dptrain")
    write_run(bench, run_events(epoch(9, epoch_time_s="fast")), workers=1)
    write_run(bench, run_events(epoch(9)), workers=2)
    code, err, text = report(bench, capsys)
    assert code == 0, err
    assert ("- runs/dptrain-ddp-w1-r1/metrics.jsonl: 1 line skipped (line 4: epoch_time_s is 'fast', "
            "not a number from 1e-06 to 1e+08)") in text
    [warning] = caplog.messages
    assert warning.startswith(f"{bench / 'runs' / 'dptrain-ddp-w1-r1' / 'metrics.jsonl'}: 1 line skipped (line 4: ")


@pytest.mark.parametrize("job_toml, says", [
    ("[slurm]\nnodes = " + "[" * 10_000 + "]" * 10_000 + "\n", "nests brackets more than"),
    ("# padding\n" * 120_000 + "[slurm]\nnodes = 2\n", "is larger than 1 MiB"),
    ("[slurm]\nnodes = 'two'\n", "has slurm.nodes = 'two', not a positive integer"),
])
def test_an_unreadable_job_toml_counts_as_one_node_and_says_why(tmp_path, caplog, job_toml, says):
    bench = tmp_path / "bench"
    run_dir = write_run(bench, run_events(epoch(9)))
    (run_dir / "job.toml").write_text(job_toml)
    caplog.set_level(logging.WARNING, logger="dptrain")
    [row] = collect(bench)
    assert row["nodes"] == 1 and row["status"] == "ok"
    [warning] = caplog.messages
    assert warning.startswith(f"{run_dir.name} is counted as 1 node: {run_dir / 'job.toml'} {says}")


def test_a_job_toml_gives_the_nodes_of_a_slurm_point(tmp_path, caplog):
    bench = tmp_path / "bench"
    run_dir = write_run(bench, run_events(epoch(9)))
    (run_dir / "job.toml").write_text("[slurm]\nnodes = 2\n")
    caplog.set_level(logging.WARNING, logger="dptrain")
    [row] = collect(bench)
    assert row["nodes"] == 2 and caplog.messages == []


HOSTILE = ["# heading", "![x](http://remote/img.png)", "<script>alert(1)</script>", "a | b | c", "one\ntwo\r\n# three",
           "`code` **bold** [link](http://remote/) <img src=x onerror=alert(1)>", "line\u2028separator"]


@pytest.mark.slow
def test_text_from_results_csv_cannot_change_report_md(tmp_path, capsys):
    bench = tmp_path / "bench"
    failed = [result_row(4 * 2 ** i, "", status="failed", error=value) for i, value in enumerate(HOSTILE)]
    write_results(bench, [result_row(1, 2.0, host="<b>evil</b> | x"), result_row(2, 1.0, torch="2.5\n# torch"),
                          *failed])
    code, err, text = report(bench, capsys)
    assert code == 0, err
    assert "<script" not in text and "<img" not in text and "<b>" not in text  # no raw HTML
    assert "![x]" not in text and "](http" not in text  # no image and no link to a remote address
    headings = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert headings == ["# Scaling benchmark", "## Time per epoch", "## Speedup and parallel efficiency",
                        "## Validation loss and accuracy", "## Peak memory per worker",
                        "## Accuracy against bytes and time", "## Summary",
                        "## Runs that did not finish"]
    rows = text.split("## Runs that did not finish", 1)[1].strip().splitlines()
    assert len(rows) == 2 + len(HOSTILE) and all(table_cells(line) == 3 for line in rows)  # head, rule, one a run
    assert all(table_cells(line) == 13 for line in text.split("## Summary", 1)[1].splitlines() if line.startswith("| dptrain |"))
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "a \\| b \\| c" in text  # shown, as text
    # a # inside a line is no heading, and is left as it is
    assert "torch 2.5 # torch on node1" in text and "&lt;b&gt;evil&lt;/b&gt; \\| x" in text


def test_runs_that_timed_no_epoch_are_named_as_such(tmp_path, capsys):
    # A sweep whose runs ended within their warm-up epochs was reported as holding "no finished runs (no results.csv
    # ...)" beside the results.csv it holds.
    bench = tmp_path / "bench"
    write_results(bench, [result_row(1, epoch_time_s="", epochs_timed=0, images_per_s="")])
    code, err, text = report(bench, capsys)
    assert code == 2 and not text
    assert err.strip() == (f"dptrain: error: {bench} holds 1 run but no timed epoch to plot: the warm-up epochs "
                           f"(--warmup-epochs) are left out of the timing, and a run that ends within them "
                           f"(--train.max_steps, or as many --train.epochs) times none; run the sweep with more "
                           f"epochs than warm-up ones.")


def write_link(bench: Path, latency_s: float, bandwidth_bps: float, hosts: int = 2) -> None:
    """A link.json of one probe whose timings follow the ring formulas of that latency and bandwidth exactly."""
    from dptrain_bench.link import COLLECTIVES, LinkProbe, Timing, collective_seconds

    timings = [Timing(c, 2, s, collective_seconds(c, 2, s, latency_s, bandwidth_bps))
               for c in COLLECTIVES for s in (1 << 10, 1 << 16, 1 << 22)]
    probe = LinkProbe(backend="gloo", device="cpu", world=2, hosts=hosts, timings=timings)
    (bench / "link.json").write_text(json.dumps({"probes": [probe.to_dict()]}))


@pytest.mark.slow
def test_report_draws_the_scaling_model_and_states_its_error_on_held_out_points(tmp_path, capsys):
    from dptrain_bench.scaling_model import Link, Plan, Workload, predict
    from dptrain_bench.report import SCALING_PLOT, write_report

    # 1, 2 and 4 hosts of one rank each on a 1 Gbit/s link; the images/s of 1 and 2 hosts follow the model with an
    # overlap of 0.3, the 4-host point runs 10% slower than it predicts
    bench = tmp_path / "bench"
    link = Link("lab", 50e-6, 125e6, "")
    work = Workload(param_bytes=4e6, global_batch=128, compute_s_per_sample=1e-3)
    rates = {n: predict(Plan(strategy="ddp"), work, link, n, 1, 0.3).images_per_s for n in (1, 2, 4)}
    rates[4] *= 0.9
    write_results(bench, [result_row(n, 128 / rates[n], nodes=n, images_per_s=rates[n], global_batch_size=128)
                          for n in (1, 2, 4)])
    for n in (1, 2, 4):
        write_run(bench, [{"event": "run_start", "global_batch_size": 128},
                          epoch(1, mem_params_bytes=[4_000_000] * n, mem_optim_bytes=[8_000_000] * n,
                                comm_bytes_per_step=[0 if n == 1 else 8_000_000 * (n - 1) // n] * n),
                          {"event": "run_end"}], workers=n)
    write_link(bench, 50e-6, 125e6)
    text = write_report(bench, link="100mbit").read_text()
    assert (bench / SCALING_PLOT).stat().st_size > 10_000  # a drawn plot, not an empty canvas
    assert f"![Scaling model: measured and predicted]({SCALING_PLOT})" in text
    assert ("ddp: fitted on 2 points, shapes 1x1 and 2x1 (nodes x ranks per node): 1 of one worker for the compute "
            "per sample, 1 of several ranks (1 across nodes) for the overlap; compute 1 ms per sample from its 1-worker "
            "run; overlap 0.30 fitted.") in text.replace("\\", "")
    errors = text.split("## Model error on the points it was not fitted on", 1)[1].split("##", 1)[0]
    [held_out] = [line for line in errors.splitlines() if line.startswith("| ddp |")]
    assert held_out.startswith(f"| ddp | 4 | 4 | {rates[4]:.0f} | {rates[4] / 0.9:.0f} | +11.1% |")
    assert "Largest error: +11.1% (ddp at 4 workers on 4 nodes)." in errors
    predicted = text.split("## Predicted to 256 nodes", 1)[1]
    # a global batch of 128: the curves end at 128 nodes of one rank, and say why
    assert "| ddp | measured | 128 | 128 |" in predicted and "| ddp | 100mbit | 128 | 128 |" in predicted
    assert "| 256 |" not in predicted
    assert "Its curves end at 128 nodes: the global batch of 128 gives each of 128 ranks a sample" in text
    assert "100mbit (assumed): 100 Mbit/s Ethernet" in text


def write_lab_sweep(bench: Path, link, overlap: float, hosts: tuple[int, ...], slower: dict[int, float] | None = None,
                    comm_cpu_s_per_byte: float = 0.0):
    """A sweep of 1 rank on each of `hosts` hosts that are one 2-core machine (the lab cluster), a thread a rank: the
    runs' env.json say so, their images/s follow the model (times `slower` at a host count), link.json is `link`.
    With comm_cpu_s_per_byte, moving a byte between hosts costs a rank that much CPU, and results.csv has each
    point's CPU use (its compute's, a core's worth at 1 ms a sample, plus the bytes' over its step)."""
    from dptrain_bench.scaling_model import Plan, Workload, bytes_sent_per_rank, predict

    work = Workload(param_bytes=4e6, global_batch=128, compute_s_per_sample=1e-3, machine_cores=2, threads_alone=1,
                    cores_busy_alone=1.0, comm_cpu_s_per_byte=comm_cpu_s_per_byte)
    rates = {n: predict(Plan(strategy="ddp"), work, link, n, 1, overlap, machines=1, threads_per_rank=1).images_per_s
             * (slower or {}).get(n, 1.0) for n in hosts}
    cpu = {n: {"cpu_util_pct": 100 * (128 / n * 1e-3 + (n > 1) * bytes_sent_per_rank(Plan(), work, n)
                                      * comm_cpu_s_per_byte) * rates[n] / 128} if comm_cpu_s_per_byte else {}
           for n in hosts}
    write_results(bench, [result_row(n, 128 / rates[n], nodes=n, images_per_s=rates[n], global_batch_size=128, **cpu[n])
                          for n in hosts])
    for n in hosts:
        run_dir = write_run(bench, [{"event": "run_start", "global_batch_size": 128},
                                    epoch(1, mem_params_bytes=[4_000_000] * n, mem_optim_bytes=[8_000_000] * n,
                                          comm_bytes_per_step=[0 if n == 1 else 8_000_000 * (n - 1) // n] * n),
                                    {"event": "run_end"}], workers=n)
        (run_dir / "env.json").write_text(json.dumps({"hosts": n, "machines": 1, "machine_cores": 2,
                                                      "cpu_threads_per_rank": 1}))
    write_link(bench, link.latency_s, link.bandwidth_bps)
    return rates


def errors_of(text: str) -> list[str]:
    """The rows of report.md's error table."""
    errors = text.split("## Model error on the points it was not fitted on", 1)[1].split("##", 1)[0]
    return [line for line in errors.splitlines() if line.startswith("| ddp |")]


@pytest.mark.slow
def test_hosts_sharing_one_machine_are_predicted_with_its_cores_shared_and_a_fit_predicts_another_link(tmp_path):
    from dptrain_bench.scaling_model import Link
    from dptrain_bench.report import write_report

    # the 4-host point computes at half speed (4 ranks on 2 cores), which env.json's placement lets the model know
    lab = tmp_path / "1gbit"
    rates = write_lab_sweep(lab, Link("1gbit", 50e-6, 125e6, ""), 0.3, (1, 2, 4))
    [held_out] = errors_of(write_report(lab).read_text())
    assert held_out.startswith(f"| ddp | 4 | 4 | {rates[4]:.0f} | {rates[4]:.0f} | +0.0% |")
    for run_env in lab.glob("runs/*/env.json"):  # without it, 4 hosts would be 4 machines: half the compute time,
        run_env.unlink()  # the step (compute, then what communication it does not hide) a third shorter
    [blind] = errors_of(write_report(lab).read_text())
    assert float(blind.split("|")[-2].strip().rstrip("%")) > 30
    lab = tmp_path / "1gbit-again"
    write_lab_sweep(lab, Link("1gbit", 50e-6, 125e6, ""), 0.3, (1, 2, 4))
    # the same ranks on a 100 Mbit/s link, 10% slower at 2 hosts than the model says: every point held out
    slow = tmp_path / "100mbit"
    slow_rates = write_lab_sweep(slow, Link("100mbit", 200e-6, 12.5e6, ""), 0.3, (1, 2, 4), slower={2: 0.9})
    text = write_report(slow, fitted_on=lab).read_text()
    assert (f"ddp: fitted on none of these points, every one held out; compute 1 ms per sample from the fit on {lab}, "
            f"made on all its 3 points, shapes 1x1 and 2x1 and 4x1 (nodes x ranks per node): 1 of one worker for the "
            f"compute per sample, 2 of several ranks (2 across nodes) for the overlap; overlap 0.30 fitted."
            ) in text.replace("\\", "")
    rows = errors_of(text)
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2", "4"]
    assert rows[1].startswith(f"| ddp | 2 | 2 | {slow_rates[2]:.0f} | {slow_rates[2] / 0.9:.0f} | +11.1% |")
    assert rows[0].endswith("| +0.0% |") and rows[2].endswith("| +0.0% |")
    before = {f.name: f.stat().st_mtime_ns for f in slow.iterdir()}
    with pytest.raises(ConfigError, match=f"^--fitted-on {tmp_path / 'empty'} does not exist"):
        write_report(slow, fitted_on=tmp_path / "empty")
    assert {f.name: f.stat().st_mtime_ns for f in slow.iterdir()} == before  # refused before anything was written


@pytest.mark.slow
def test_the_cpu_that_moving_bytes_costs_is_fitted_on_the_runs_cpu_use_and_carried_to_another_link(tmp_path):
    from dptrain_bench.scaling_model import Link
    from dptrain_bench.report import write_report

    # 3 ns of a rank's CPU a byte sent: on 4 hosts of a 2-core machine, each rank with half a core, it costs twice the
    # wall time it does on 2; fitted on 1 and 2 hosts from results.csv's cpu_util_pct, the 4-host point is exact
    lab = tmp_path / "1gbit"
    rates = write_lab_sweep(lab, Link("1gbit", 50e-6, 125e6, ""), 0.3, (1, 2, 4), comm_cpu_s_per_byte=3e-9)
    text = write_report(lab).read_text()
    assert ("compute 1 ms per sample from its 1-worker run; moving a byte between nodes took 3 ns of a rank's CPU; "
            "overlap 0.30 fitted.") in text.replace("\\", "")
    [held_out] = errors_of(text)
    assert held_out.startswith(f"| ddp | 4 | 4 | {rates[4]:.0f} | {rates[4]:.0f} | +0.0% |")
    # the curves, a machine a node: on 2 nodes a rank sends the 4 MB gradient's 2(N-1)/N, 4 MB, at 3 ns a byte
    [two_nodes] = [row for row in text.splitlines() if row.startswith("| ddp | measured | 2 | 2 |")]
    assert two_nodes.split("|")[8].strip() == "12"
    # the same hosts at 100 Mbit/s, predicted from the 1 Gbit/s fit: its CPU a byte goes with it
    slow = tmp_path / "100mbit"
    slow_rates = write_lab_sweep(slow, Link("100mbit", 200e-6, 12.5e6, ""), 0.3, (1, 2, 4), comm_cpu_s_per_byte=3e-9)
    rows = errors_of(write_report(slow, fitted_on=lab).read_text())
    assert [row.split("|")[4].strip() for row in rows] == [f"{slow_rates[n]:.0f}" for n in (1, 2, 4)]
    assert all(row.endswith("| +0.0% |") for row in rows)


@pytest.mark.slow
def test_a_fit_from_another_sweep_rests_on_every_one_of_its_points(tmp_path):
    """A source sweep of 1 and 2 hosts (1 Gbit/s) predicts 3 hosts on another link: with the source's own split the
    fit would rest on its 1-host point alone (the overlap assumed 0, no CPU a byte) and predict the 3-host point 27.8%
    too fast; fitted on both points it carries the overlap and the CPU a byte from the 2-host point, and is exact."""
    from dptrain_bench.scaling_model import Link
    from dptrain_bench.report import write_report

    source = tmp_path / "1gbit"
    write_lab_sweep(source, Link("1gbit", 50e-6, 125e6, ""), 0.9, (1, 2), comm_cpu_s_per_byte=1e-8)
    target = tmp_path / "500mbit"
    rates = write_lab_sweep(target, Link("500mbit", 80e-6, 62.5e6, ""), 0.9, (1, 3), comm_cpu_s_per_byte=1e-8)
    text = write_report(target, fitted_on=source).read_text().replace("\\", "")
    assert (f"from the fit on {source}, made on all its 2 points, shapes 1x1 and 2x1 (nodes x ranks per node): 1 of "
            f"one worker for the compute per sample, 1 of several ranks (1 across nodes) for the overlap, 1 across "
            f"nodes with their CPU use for the CPU a byte; moving a byte between nodes took 10 ns of a rank's CPU; "
            f"overlap 0.90 fitted.") in text
    rows = errors_of(text)
    assert [row.split("|")[4].strip() for row in rows] == [f"{rates[n]:.0f}" for n in (1, 3)]
    assert all(abs(float(row.split("|")[-2].strip().rstrip("%"))) < 0.05 for row in rows), rows
    # the source's own report still holds its larger shape out, to judge the model on
    assert [row.split("|")[2].strip() for row in errors_of(write_report(source).read_text())] == ["2"]


@pytest.mark.slow
def test_report_without_link_json_or_with_an_unknown_link_name(tmp_path, capsys):
    from dptrain_bench.report import SCALING_PLOT, write_report

    bench = tmp_path / "bench"
    write_results(bench, [result_row(1, 2.0), result_row(2, 1.0)])
    text = write_report(bench).read_text()
    assert "Scaling model" not in text and not (bench / SCALING_PLOT).exists()
    write_link(bench, 50e-6, 125e6)  # a link, but no run folder to count the model's bytes in: said so
    text = write_report(bench).read_text()
    assert "no run holds its parameters' bytes" in text.replace("\\", "") and not (bench / SCALING_PLOT).exists()
    with pytest.raises(ConfigError, match="--link '10g' is no link the model knows"):
        write_report(bench, link="10g")


def test_the_models_plan_comes_from_the_sweeps_strategy_table():
    from dptrain_bench.report import _plan

    table = {"ddp": {"comm_hook": "bf16", "bucket_mb": 2, "powersgd_rank": 8, "update_in_next_forward": True},
             "fsdp": {"reshard_after_forward": False, "param_dtype": "bfloat16", "reduce_dtype": "auto"}}
    ddp, fsdp = _plan("ddp", table), _plan("fsdp", table)
    assert (ddp.comm_hook, ddp.bucket_bytes, ddp.powersgd_rank, ddp.update_in_next_forward) == ("bf16", 2 * 2**20, 8,
                                                                                              True)
    assert not _plan("zero1", table).update_in_next_forward  # ddp's option only
    assert (fsdp.comm_hook, fsdp.reshard_after_forward, fsdp.param_dtype_size, fsdp.reduce_dtype_size) == (
        "allreduce", False, 2, None)
    assert _plan("ddp", {}).bucket_bytes == 25 * 2**20  # unset: DDP's own buckets


@pytest.mark.slow
def test_fitted_on_reads_another_sweep_without_writing_in_it(tmp_path, capsys):
    """--fitted-on OTHER whose results.csv is gone: rebuilt from OTHER's runs to fit on, but never written there (it
    was written into the other sweep's folder)."""
    from dptrain_bench.scaling_model import Link

    bench, other = tmp_path / "bench", tmp_path / "other"
    write_lab_sweep(bench, Link("lab", 50e-6, 125e6, ""), 0.3, (1, 2))
    write_lab_sweep(other, Link("lab", 50e-6, 125e6, ""), 0.3, (1, 2))
    (other / "results.csv").unlink()
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    assert main(["report", str(bench), "--fitted-on", str(other)]) == 0, capsys.readouterr().err
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before
    assert "the fit on" in (bench / "report.md").read_text()


def test_the_cpu_bound_is_the_rate_had_each_step_taken_only_its_busiest_ranks_cpu_time():
    from dptrain_bench.collect import cores_per_rank, cpu_bound

    epochs = [{"epoch_time_s": 10.0, "train_samples": 1000, "cpu_util_pct": [80.0, 50.0]},
              {"epoch_time_s": 30.0, "train_samples": 3000, "cpu_util_pct": [40.0, 60.0]}]
    # the busiest rank's CPU: 8 s of the first epoch, 18 s of the second; 4000 images in 26 s
    assert cpu_bound(epochs, 1) == pytest.approx(4000 / 26)
    # ranks of 2 threads busy 80% of one core: 40% of their share; a rank busy beyond its threads counts as all busy
    assert cpu_bound(epochs, 2) == pytest.approx(4000 / (10 * 0.4 + 30 * 0.3))
    assert cpu_bound([{**epochs[0], "cpu_util_pct": [250.0]}], 2) == pytest.approx(100.0)
    assert cpu_bound([{**epochs[0], "cpu_util_pct": None}], 1) == ""  # no CPU use measured: no bound
    # the cores a rank could use: its threads, or its share of a machine that more ranks than cores share
    assert cores_per_rank({"cpu_threads_per_rank": 1, "machines": 1, "machine_cores": 2}, 4) == 0.5  # 4 lab hosts
    assert cores_per_rank({"cpu_threads_per_rank": 2, "machines": 2, "machine_cores": 8}, 4) == 2
    assert cores_per_rank({"cpu_threads_per_rank": "x", "machines": 1, "machine_cores": 4}, 2) == 1
    assert cores_per_rank({}, 4) is None and cpu_bound(epochs, None) == ""  # where the ranks ran is not known


@pytest.mark.parametrize("strategy, table, held", [("ddp", {}, 1), ("local_sgd", {}, 2),
                                                   ("diloco", {"diloco": {"period": 32}}, 2),
                                                   ("diloco", {"diloco": {"period": 32, "overlap_steps": 8}}, 3)])
def test_the_workloads_parameters_are_one_copy_of_the_model_whatever_the_strategy_holds(tmp_path, strategy, table,
                                                                                         held):
    """A run's mem_params_bytes counts every copy its rank holds (local SGD's and DiLoCo's run's model beside its own,
    a streamed DiLoCo's copy of what it sent); the model's exchanges carry one copy's bytes."""
    from dptrain_bench.report import _plan, _workload
    from dptrain_bench.scaling_model import memory_per_rank

    bench = tmp_path / "bench"
    write_run(bench, [{"event": "run_start", "global_batch_size": 128},
                      epoch(1, mem_params_bytes=[4_000_000 * held] * 2, mem_optim_bytes=[8_000_000] * 2),
                      {"event": "run_end"}], workers=2)
    row = {"strategy": strategy, "workers": 2, "run_dir": f"runs/{POINT.format(2)}"}
    work, _, _ = _workload(bench, [row], table)
    assert work is not None and work.param_bytes == 4_000_000
    assert memory_per_rank(_plan(strategy, table), work, 2) == 4_000_000 * held + 4_000_000 + 8_000_000


@pytest.mark.parametrize("diloco, kept", [({"period": 8, "overlap_steps": 2}, True),
                                           ({"period": 8, "overlap_steps": 8}, False),
                                           ({"overlap_steps": 40}, False),  # the default period, 32
                                           ({"overlap_steps": -1}, False)])
def test_a_sweep_json_whose_diloco_runs_behind_its_whole_period_leaves_the_plans_at_their_defaults(tmp_path, caplog,
                                                                                                  diloco, kept):
    """A planted sweep.json: the report's plans take its [strategy] only where DiLoCo's options could have run
    (overlap_steps from 0 to fewer than the period); else a log line says which, and nothing is refused."""
    from dptrain_bench.report import _plan, _sweep_strategy

    (tmp_path / "sweep.json").write_text(json.dumps({"config": {"strategy": {"diloco": diloco}}}))
    table = _sweep_strategy(tmp_path)
    plan = _plan("diloco", table)
    if kept:
        assert (plan.period, plan.overlap_steps) == (8, 2)
    else:
        assert (plan.period, plan.overlap_steps) == (32, 0)
        assert "config.strategy.diloco.overlap_steps" in caplog.text
