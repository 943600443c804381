"""Run directories -> BENCH/results.csv (one row per run) and BENCH/summary.csv (mean and std per point).

Everything comes from the runs' own files (metrics.jsonl, env.json, bench_error.txt, and a SLURM point's job.toml)
and the sweep's matmul probes (peak.json), so `dptrain report` can rebuild both CSVs from BENCH alone.
achieved_tflops is the model's operations per sample (model_flops_per_sample, from dptrain's epoch events) at the
run's images/s; fraction_of_peak divides it by what the probe of the same worker count got (peak_tflops).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import tomllib
from pathlib import Path
from typing import Any

from dptrain.bench.peak import read_peaks
from dptrain.bench.sweep import ERROR_FILE, POINT_NAME, default_warmup, read_events, read_warmup
from dptrain.launch.slurm import CONFIG_NAME

RESULT_COLUMNS = ("engine", "strategy", "nodes", "workers", "repeat", "status", "global_batch_size", "epochs_timed",
                  "epoch_time_s", "images_per_s", "achieved_tflops", "peak_tflops", "fraction_of_peak", "eval_loss",
                  "eval_acc", "peak_mem_mb", "rss_max_mb", "cpu_util_pct", "torch", "host", "run_dir", "error")
MEASURES = ("epoch_time_s", "images_per_s", "achieved_tflops", "peak_tflops", "fraction_of_peak", "eval_loss", "eval_acc",
            "peak_mem_mb", "rss_max_mb", "cpu_util_pct")
KEY = ("engine", "strategy", "workers")
SUMMARY_COLUMNS = (*KEY, "runs", "failed", *(f"{m}_{s}" for m in MEASURES for s in ("mean", "std")),
                   "speedup", "efficiency", "baseline_workers")


def _flat(values: Any) -> list[float]:
    """A per-rank list, or one number, as floats (None and missing left out)."""
    items = values if isinstance(values, list) else [values]
    return [float(v) for v in items if isinstance(v, (int, float))]


def run_row(run_dir: Path, warmup: int | None) -> dict[str, Any] | None:
    """One results row for a point's folder; None for a folder that is not a point (or was never started)."""
    match = POINT_NAME.match(run_dir.name)
    if not match:
        return None
    row: dict[str, Any] = {"engine": match["engine"], "strategy": match["strategy"], "nodes": run_nodes(run_dir),
                           "workers": int(match["workers"]), "repeat": int(match["repeat"]),
                           "run_dir": f"runs/{run_dir.name}"}  # relative to the bench folder, which may move
    events = read_events(run_dir)
    env = _read_json(run_dir / "env.json")
    row["torch"], row["host"] = env.get("torch", ""), env.get("host", "")
    start = next((e for e in events if e.get("event") == "run_start"), {})
    row["global_batch_size"] = start.get("global_batch_size", "")
    error_file = run_dir / ERROR_FILE
    if error_file.is_file() or not any(e.get("event") == "run_end" for e in events):
        row["status"] = "failed" if error_file.is_file() else "unfinished"
        row["error"] = error_file.read_text().strip() if error_file.is_file() else "no run_end event (interrupted?)"
        return row
    epochs = sorted((e for e in events if e.get("event") == "epoch"), key=lambda e: e["epoch"])
    skip = default_warmup(len(epochs)) if warmup is None else warmup
    timed = [e for e in epochs if e["epoch"] > skip]
    row["status"], row["epochs_timed"] = "ok", len(timed)
    if timed:
        seconds = sum(e["epoch_time_s"] for e in timed)
        row["epoch_time_s"] = seconds / len(timed)
        row["images_per_s"] = sum(e["train_samples"] for e in timed) / seconds
        flops = [v for e in epochs for v in _flat(e.get("model_flops_per_sample"))]
        row["model_flops_per_sample"] = flops[0] if flops else ""  # not a column: collect fills in the peers' from it
        cpu = [statistics.fmean(_flat(e.get("cpu_util_pct"))) for e in timed if _flat(e.get("cpu_util_pct"))]
        row["cpu_util_pct"] = statistics.fmean(cpu) if cpu else ""
    evaluated = [e for e in epochs if isinstance(e.get("eval_loss"), (int, float))]
    if evaluated:
        row["eval_loss"], row["eval_acc"] = evaluated[-1]["eval_loss"], evaluated[-1].get("eval_acc", "")
    peaks = [v for e in epochs for v in _flat(e.get("peak_mem_mb"))]
    rss = [v for e in epochs for v in _flat(e.get("rss_max_mb"))]
    row["peak_mem_mb"] = max(peaks) if peaks else ""
    row["rss_max_mb"] = max(rss) if rss else ""
    return row


def run_nodes(run_dir: Path) -> int:
    """The nodes a point ran on: its SLURM job's (job.toml, the config the job trained from), else 1 (this machine)."""
    try:
        return int(tomllib.loads((run_dir / CONFIG_NAME).read_text())["slurm"]["nodes"])
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError):
        return 1


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def collect(bench_dir: Path) -> list[dict[str, Any]]:
    """Rows for every point folder under BENCH/runs, sorted by engine, strategy, workers, repeat."""
    warmup = read_warmup(bench_dir)
    runs = bench_dir / "runs"
    rows = [row for d in sorted(runs.iterdir()) if d.is_dir() and (row := run_row(d, warmup))] if runs.is_dir() else []
    add_efficiency(rows, {w: p.peak_tflops for w, p in read_peaks(bench_dir).items()})
    return sorted(rows, key=lambda r: (r["engine"], r["strategy"], r["workers"], r["repeat"]))


def add_efficiency(rows: list[dict[str, Any]], peaks: dict[int, float]) -> None:
    """achieved_tflops, peak_tflops and fraction_of_peak of every finished row. The peer engines log no operation
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
    for row in summary:
        line = [r for r in summary if (r["engine"], r["strategy"]) == (row["engine"], row["strategy"])
                and as_number(r["epoch_time_s_mean"]) is not None]
        if not line or as_number(row["epoch_time_s_mean"]) is None:
            row["speedup"] = row["efficiency"] = row["baseline_workers"] = ""
            continue
        base = min(line, key=lambda r: r["workers"])
        speedup = base["epoch_time_s_mean"] / row["epoch_time_s_mean"]
        row["speedup"], row["baseline_workers"] = speedup, base["workers"]
        row["efficiency"] = speedup * base["workers"] / row["workers"]
    return summary


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c, "")) for c in columns})


def _cell(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["workers"] = int(row["workers"])
    return rows


def write_results(bench_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Collect the runs into results.csv and summary.csv; (rows, summary)."""
    rows = collect(bench_dir)
    summary = summarize(rows)
    write_csv(bench_dir / "results.csv", RESULT_COLUMNS, rows)
    write_csv(bench_dir / "summary.csv", SUMMARY_COLUMNS, summary)
    return rows, summary
