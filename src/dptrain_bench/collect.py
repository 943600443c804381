"""Run folders -> BENCH/results.csv (one row per run) and BENCH/summary.csv (mean and std per point).

Everything comes from the runs' own files (metrics.jsonl, env.json, bench_error.txt, and a SLURM point's job.toml)
and the sweep's matmul probes (peak.json), so `dptrain report` can rebuild both CSVs from BENCH alone.
achieved_tflops is the model's operations per sample (model_flops_per_sample, from dptrain's epoch events) at the
run's images/s; fraction_of_peak divides it by what the probe of the same worker count got (peak_tflops).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
import statistics
from pathlib import Path
from typing import Any

from dptrain_bench.folder import ERROR_FILE, RUNS_DIR, BenchFolder
from dptrain_bench.peak import read_peaks
from dptrain_bench.sweep import default_warmup, read_warmup
from dptrain.config import read_toml
from dptrain.reporting.sweep_files import POINT_NAME
from dptrain.events import flat_numbers, in_range, range_words, read_run_events
from dptrain.errors import ConfigError
from dptrain import read_back
from dptrain.files import written_atomically
from dptrain.read_back import UnreadableFile
from dptrain.run_folder import RunFolder

log = logging.getLogger(__name__)

RESULT_COLUMNS = ("engine", "strategy", "nodes", "workers", "repeat", "status", "global_batch_size", "epochs_timed",
                  "epoch_time_s", "images_per_s", "achieved_tflops", "peak_tflops", "fraction_of_peak", "eval_loss",
                  "eval_acc", "peak_mem_mb", "rss_max_mb", "cpu_util_pct", "cpu_bound_images_per_s", "comm_ms", "comm_exposed_ms",
                  "comm_bytes_per_step", "torch", "host", "run_dir", "error")
MEASURES = ("epoch_time_s", "images_per_s", "achieved_tflops", "peak_tflops", "fraction_of_peak", "eval_loss", "eval_acc",
            "peak_mem_mb", "rss_max_mb", "cpu_util_pct", "cpu_bound_images_per_s", "comm_ms", "comm_exposed_ms",
            "comm_bytes_per_step")
KEY = ("engine", "strategy", "workers")
SUMMARY_COLUMNS = (*KEY, "runs", "failed", *(f"{m}_{s}" for m in MEASURES for s in ("mean", "std")),
                   "speedup", "efficiency", "baseline_workers")


SMALL_FILE_BYTES = 1 << 16  # env.json and bench_error.txt hold a few lines; a larger one is cut here, not read whole
NAME = re.compile(r"[a-z0-9_]+")  # an engine's or a strategy's name, as in a point's folder name (POINT_NAME)


_is_number, _shown = read_back.is_number, read_back.shown


def run_row(run_dir: Path, warmup: int | None) -> dict[str, Any] | None:
    """One results row for a point's folder; None for a folder that is not a point (or was never started)."""
    match = POINT_NAME.match(run_dir.name)
    if not match:
        return None
    row: dict[str, Any] = {"engine": match["engine"], "strategy": match["strategy"], "nodes": run_nodes(run_dir),
                           "workers": int(match["workers"]), "repeat": int(match["repeat"]),
                           "run_dir": f"{RUNS_DIR}/{run_dir.name}"}  # relative to the bench folder, which may move
    events, skipped = read_run_events(RunFolder(run_dir).metrics)
    if skipped:
        several = len(skipped) > 1
        lines = f"{len(skipped)} line{'s' if several else ''} skipped ({skipped[0]}{'; ...' if several else ''})"
        log.warning(f"{run_dir / 'metrics.jsonl'}: {lines}; the run's numbers leave {'them' if several else 'it'} out.")
        # not a results.csv column: the report lists it when it collects the runs itself (relative to report.md)
        row["skipped_events"] = f"{row['run_dir']}/metrics.jsonl: {lines}"
    env = _read_json(RunFolder(run_dir).env)
    row["torch"], row["host"] = (value if isinstance(value := env.get(key), str) else "" for key in ("torch", "host"))
    start = next((e for e in events if e.get("event") == "run_start"), {})
    row["global_batch_size"] = start.get("global_batch_size", "")
    error_file = run_dir / ERROR_FILE
    if error_file.is_file() or not any(e.get("event") == "run_end" for e in events):
        row["status"] = "failed" if error_file.is_file() else "unfinished"
        row["error"] = _read_head(error_file).strip() if error_file.is_file() else "no run_end event (interrupted?)"
        return row
    epochs = sorted((e for e in events if e.get("event") == "epoch"), key=lambda e: e["epoch"])
    skip = default_warmup(len(epochs)) if warmup is None else warmup
    timed = [e for e in epochs if e["epoch"] > skip]
    row["status"], row["epochs_timed"] = "ok", len(timed)
    if timed:
        seconds = sum(e["epoch_time_s"] for e in timed)
        row["epoch_time_s"] = seconds / len(timed)
        row["images_per_s"] = sum(e["train_samples"] for e in timed) / seconds
        flops = [v for e in epochs for v in flat_numbers(e.get("model_flops_per_sample"))]
        row["model_flops_per_sample"] = flops[0] if flops else ""  # not a column: collect fills in the other engines' from it
        cpu = [statistics.fmean(flat_numbers(e.get("cpu_util_pct"))) for e in timed if flat_numbers(e.get("cpu_util_pct"))]
        row["cpu_util_pct"] = statistics.fmean(cpu) if cpu else ""
        row["cpu_bound_images_per_s"] = cpu_bound(timed, cores_per_rank(env, row["workers"]))
        for column, key in (("comm_ms", "comm_ms_per_step"), ("comm_exposed_ms", "comm_exposed_ms_per_step")):
            ranks_mean = [statistics.fmean(flat_numbers(e.get(key))) for e in timed if flat_numbers(e.get(key))]  # ddp, zero1 only
            row[column] = statistics.fmean(ranks_mean) if ranks_mean else ""
        sent = [max(flat_numbers(e.get("comm_bytes_per_step"))) for e in timed if flat_numbers(e.get("comm_bytes_per_step"))]
        row["comm_bytes_per_step"] = statistics.fmean(sent) if sent else ""  # the busiest rank's (dptrain's runs)
    evaluated = [e for e in epochs if isinstance(e.get("eval_loss"), (int, float))]
    if evaluated:
        row["eval_loss"], row["eval_acc"] = evaluated[-1]["eval_loss"], evaluated[-1].get("eval_acc", "")
    peaks = [v for e in epochs for v in flat_numbers(e.get("peak_mem_mb"))]
    rss = [v for e in epochs for v in flat_numbers(e.get("rss_max_mb"))]
    row["peak_mem_mb"] = max(peaks) if peaks else ""
    row["rss_max_mb"] = max(rss) if rss else ""
    return row


def cores_per_rank(env: dict[str, Any], workers: int) -> float | None:
    """The cores a rank could use, from its env.json: its CPU threads, fewer where more ranks than cores share a
    machine (the lab cluster's hosts share one machine's); None where env.json does not say on how many machines of
    how many cores the ranks ran (the other engines write none)."""
    def number(key: str) -> float | None:
        value = env.get(key)
        return float(value) if _is_number(value) and value >= 1 else None

    threads, cores, machines = number("cpu_threads_per_rank") or 1.0, number("machine_cores"), number("machines")
    return min(threads, cores * machines / workers) if cores and machines else None


def cpu_bound(timed: list[dict[str, Any]], cores: float | None) -> float | str:
    """The images/s of the timed epochs had each step taken only its busiest rank's CPU time (cpu_util_pct over the
    cores it could use, a share of 1 at most): what hiding every wait for the link or for the other ranks would
    reach, where each rank's own CPU work (its compute, and the CPU that moving its bytes costs) stays. "" without
    CPU use or without the cores a rank could use."""
    if cores is None:
        return ""
    busy_seconds = 0.0
    for e in timed:
        busiest = max(flat_numbers(e.get("cpu_util_pct")), default=0.0)
        if busiest <= 0:
            return ""
        busy_seconds += e["epoch_time_s"] * min(1.0, busiest / 100 / cores)
    return sum(e["train_samples"] for e in timed) / busy_seconds if busy_seconds > 0 else ""


def run_nodes(run_dir: Path) -> int:
    """The nodes a point ran on: its SLURM job's (job.toml, the config the job trained from), else 1 (this machine).
    A job.toml that cannot be read is said in a warning and counts as 1 node, as a point without one does: the nodes
    column is a label of the run, and the run's own numbers still hold."""
    path = RunFolder(run_dir).job_config
    try:
        nodes = read_toml(path, str(path))["slurm"]["nodes"]
    except FileNotFoundError:
        return 1
    except ConfigError as exc:
        problem = str(exc).split("; ")[0]
    except (KeyError, TypeError):
        problem = f"{path} has no slurm.nodes"
    else:
        if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1:
            return nodes
        problem = f"{path} has slurm.nodes = {_shown(nodes)}, not a positive integer"
    log.warning(f"{run_dir.name} is counted as 1 node: {problem.rstrip('.')}.")
    return 1


def _read_head(path: Path) -> str:
    """The first SMALL_FILE_BYTES of a regular file as text ("" when it cannot be read)."""
    try:
        return read_back.read_head(path, SMALL_FILE_BYTES)
    except (FileNotFoundError, UnreadableFile):
        return ""


def _read_json(path: Path) -> dict:
    """A small JSON object file (env.json); {} where it is missing or not one."""
    try:
        return read_back.read_json_object(path, SMALL_FILE_BYTES)
    except (FileNotFoundError, UnreadableFile):
        return {}


def collect(bench_dir: Path) -> list[dict[str, Any]]:
    """Rows for every point folder under BENCH/runs, sorted by engine, strategy, workers, repeat."""
    warmup = read_warmup(bench_dir)
    runs = BenchFolder(bench_dir).runs
    rows = [row for d in sorted(runs.iterdir()) if d.is_dir() and (row := run_row(d, warmup))] if runs.is_dir() else []
    add_efficiency(rows, {w: p.peak_tflops for w, p in read_peaks(bench_dir).items()})
    return sorted(rows, key=lambda r: (r["engine"], r["strategy"], r["workers"], r["repeat"]))


def add_efficiency(rows: list[dict[str, Any]], peaks: dict[int, float]) -> None:
    """achieved_tflops, peak_tflops and fraction_of_peak of every finished row. The other engines log no operation
    count: every point of a sweep trains the same model on the same data (sweep.json), so theirs is dptrain's."""
    counts = [f for r in rows if (f := as_number(r.get("model_flops_per_sample")))]
    for row in rows:
        if row["status"] != "ok":
            continue
        top = peaks.get(int(row["workers"]))
        if top is not None:
            row["peak_tflops"] = top
        per_sample = as_number(row.get("model_flops_per_sample")) or (counts[0] if counts else None)
        rate = as_number(row.get("images_per_s"))
        if per_sample is None or rate is None:
            continue
        row["achieved_tflops"] = per_sample * rate / 1e12
        if top:
            row["fraction_of_peak"] = row["achieved_tflops"] / top


def as_number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def positive(value: Any) -> float | None:
    """The value as a number above zero, else None: a time or a rate that speedups may divide by."""
    number = as_number(value)
    return number if number is not None and number > 0 else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample standard deviation (empty with one run) per (engine, strategy, workers), and the speedup of
    the mean epoch time over the smallest worker count of the same engine and strategy."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["engine"], row["strategy"], int(row["workers"])), []).append(row)
    summary = []
    for key in sorted(groups):
        members = groups[key]
        ok = [r for r in members if r["status"] == "ok"]
        out: dict[str, Any] = dict(zip(KEY, key)) | {"runs": len(ok), "failed": len(members) - len(ok)}
        for measure in MEASURES:
            values = [v for r in ok if (v := as_number(r.get(measure))) is not None]
            out[f"{measure}_mean"] = statistics.fmean(values) if values else ""
            out[f"{measure}_std"] = statistics.stdev(values) if len(values) > 1 else ""
        summary.append(out)
    for row in summary:  # a speedup divides by both times: never from a time of zero or less
        line = [r for r in summary if (r["engine"], r["strategy"]) == (row["engine"], row["strategy"])
                and positive(r["epoch_time_s_mean"]) is not None]
        if not line or positive(row["epoch_time_s_mean"]) is None:
            row["speedup"] = row["efficiency"] = row["baseline_workers"] = ""
            continue
        base = min(line, key=lambda r: r["workers"])
        speedup = base["epoch_time_s_mean"] / row["epoch_time_s_mean"]
        row["speedup"], row["baseline_workers"] = speedup, base["workers"]
        row["efficiency"] = speedup * base["workers"] / row["workers"]
    return summary


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with written_atomically(path) as tmp, tmp.open("w", newline="") as f:  # never half a table, nor through a planted link
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c, "")) for c in columns})


def _cell(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


# The columns without which results.csv is no sweep's; the others, missing from an older file, read as empty.
NEEDED_COLUMNS = ("engine", "strategy", "workers", "status", "epoch_time_s")
STATUSES = ("ok", "failed", "unfinished")


def row_problem(row: dict[str | None, Any], width: int) -> str | None:
    """Why a row of results.csv cannot be reported, or None. Only what the report reads is checked: the point's
    name, its status, and for a finished run its counts and measures (each empty, or a finite number that a time, a
    rate, a memory, a loss or an accuracy can be)."""
    if None in row:  # DictReader files the cells past the header's under None, and fills a short row with None
        return f"it has {width + len(row[None])} cells, and the header {width}"
    if any(value is None for value in row.values()):
        return f"it has {sum(value is not None for value in row.values())} cells, and the header {width}"
    for column in ("engine", "strategy"):
        if not NAME.fullmatch(row[column]):
            return f"{column} is {_shown(row[column])}, not a name of lowercase letters, digits and _"
    if not _integer(row["workers"], minimum=1):
        return f"workers is {_shown(row['workers'])}, not a positive integer"
    if row["status"] not in STATUSES:
        return f"status is {_shown(row['status'])}, not one of {', '.join(STATUSES)}"
    if row["status"] != "ok":  # a run that did not finish is listed with its error; its numbers are not read
        return None
    if not _integer(row.get("epochs_timed", "0"), minimum=0):
        return f"epochs_timed is {_shown(row['epochs_timed'])}, not an integer"
    if row.get("global_batch_size", "") != "" and not _integer(row["global_batch_size"], minimum=1):
        return f"global_batch_size is {_shown(row['global_batch_size'])}, not a positive integer"
    for measure in MEASURES:
        value = row.get(measure, "")
        if value != "" and not in_range(measure, as_number(value)):
            return f"{measure} is {_shown(value)}, {range_words(measure)}"
    return None


def _integer(text: str, minimum: int) -> bool:
    text = text.strip()  # ASCII digits only: no sign, point or exponent, and no "²", which isdigit() also takes
    return text.isascii() and text.isdigit() and int(text) >= minimum


def read_results(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a results.csv, and where and why the others were left out ("results.csv line 4: ...").

    A row that does not hold what `dptrain bench` writes (a cell too many or too few, a word where a number goes, a
    time of zero or less, nan or inf) is left out and named, and the report goes on with the other rows: one bad row
    is no reason to lose the report of the whole sweep, and report.md says what it left out. A file that is no
    results.csv at all (no header, a column missing, not UTF-8 text) is refused in one sentence."""
    where = path.name
    rows, left_out = [], []
    text = read_back.read_text(path, read_back.TABLE_BYTES, advice="delete it, and `dptrain report` writes it again "
                               "from the runs")
    try:
        with io.StringIO(text, newline="") as f:  # newline="": line breaks inside quoted cells kept, as csv wants
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in NEEDED_COLUMNS if c not in header]
            if missing:
                raise ConfigError(f"{path} has no column {missing[0]} (its first line is not the header `dptrain "
                                  f"bench` writes); delete it, and `dptrain report` writes it again from the runs.")
            for row in reader:
                problem = row_problem(row, len(header))
                if problem:
                    # a row is named by the line it starts on: its last line, less the line breaks inside its cells
                    cells = [v for v in row.values() if isinstance(v, str)] + (row.get(None) or [])
                    start = reader.line_num - sum(cell.count("\n") for cell in cells)
                    left_out.append(f"{where} line {start}: {problem}")
                else:
                    rows.append({c: "" for c in RESULT_COLUMNS} | row | {"workers": int(row["workers"])})
    except csv.Error as exc:  # a cell over the csv module's 128 KiB, say
        raise ConfigError(f"{path} line {reader.line_num} cannot be read as CSV ({exc}); delete the file, and "
                          f"`dptrain report` writes it again from the runs.") from None
    return rows, left_out


def write_results(bench_dir: Path, rows: list[dict[str, Any]] | None = None
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Collect the runs (unless given their rows) into results.csv and summary.csv; (rows, summary)."""
    rows = collect(bench_dir) if rows is None else rows
    summary = summarize(rows)
    folder = BenchFolder(bench_dir)
    write_csv(folder.results, RESULT_COLUMNS, rows)
    write_csv(folder.summary, SUMMARY_COLUMNS, summary)
    return rows, summary
