"""BENCH/results.csv -> four PNGs and BENCH/report.md that embeds them with the summary table.

    $ dptrain report runs/bench/fmnist
"""

from __future__ import annotations

import html
import logging
import math
import re
import unicodedata
from pathlib import Path
from typing import Any

from dptrain.bench.collect import (SUMMARY_COLUMNS, as_number, collect, positive, read_results, summarize, write_csv,
                                   write_results)
from dptrain.errors import ConfigError

log = logging.getLogger(__name__)

PLOTS = {
    "epoch_time.png": "Time per epoch",
    "speedup.png": "Speedup and parallel efficiency",
    "validation.png": "Validation loss and accuracy",
    "memory.png": "Peak memory per worker",
}

HOW_TO_READ = (
    "How to read them: each line is one engine and strategy; each point is the mean over its repeats, the bars one "
    "standard deviation (none with a single repeat). With perfect scaling the time per epoch halves each time the "
    "workers double, following the dashed line drawn from the line's smallest worker count, and the speedup equals "
    "the ratio of worker counts (efficiency 1.0); communication, synchronisation and, on the CPU, workers sharing "
    "memory bandwidth pull the points above the dashed line. The global batch is the same at every worker count, so "
    "each worker's share shrinks as workers are added and the optimizer sees the same batches: the validation loss "
    "and accuracy should stay flat, and a drift there means the runs are not equivalent. The peak memory is per "
    "worker (allocated CUDA memory on GPUs, resident memory of the process on the CPU): strategies that shard "
    "parameters, gradients and optimizer state (fsdp) should use less per worker as workers are added. TFLOPS is the "
    "model's own arithmetic at the run's images/s, over all workers; \"of peak\" divides it by what the same number of "
    "processes got together from square matmuls on the same device and dtype (peak.json). Near 100% the steps compute "
    "as fast as large matrix products do; far below, memory traffic, communication or overheads bound them. The probe "
    "and the runs take turns, so on a shared machine other work that slows one and not the other moves the fraction, "
    "past 100% when it slowed the probe."
)


def load_rows(bench_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """results.csv, or, when there is none, rebuilt from BENCH/runs (and written); and what was left out of it (rows
    of results.csv, lines of the runs' metrics.jsonl), where and why."""
    if not bench_dir.is_dir():
        raise ConfigError(f"{bench_dir} does not exist; give the --output.dir of a `dptrain bench` sweep.")
    results = bench_dir / "results.csv"
    if results.is_file():
        rows, left_out = read_results(results)
        if left_out:
            several = len(left_out) > 1  # report.md, when there is one to write, lists every one of them
            log.warning(f"report: {len(left_out)} row{'s' if several else ''} of {results} left out, not being what "
                        f"`dptrain bench` writes ({left_out[0]}{'; ...' if several else ''}).")
        return rows, left_out
    rows = collect(bench_dir)  # collect warns of the lines it skipped itself
    if rows:
        write_results(bench_dir, rows)
    return rows, [note for r in rows if (note := r.get("skipped_events"))]


def write_report(bench_dir: Path) -> Path:
    """The PNGs and report.md in bench_dir; the path of report.md."""
    rows, left_out = load_rows(bench_dir)
    summary = [s for s in summarize(rows) if positive(s["epoch_time_s_mean"]) is not None]
    if not summary and left_out:
        raise ConfigError(f"{bench_dir} has no finished run left to plot: {len(left_out)} left out, the first as "
                          f"{left_out[0]}; fix the file it names (a deleted results.csv is written again from the "
                          f"runs).")
    if not summary and rows:
        raise ConfigError(f"{bench_dir} holds {len(rows)} run{'s' if len(rows) > 1 else ''} but no timed epoch to plot: "
                          f"the warm-up epochs (--warmup-epochs) are left out of the timing, and a run that ends "
                          f"within them (--train.max_steps, or as many --train.epochs) times none; run the sweep with "
                          f"more epochs than warm-up ones.")
    if not summary:
        raise ConfigError(f"{bench_dir} holds no finished runs (no results.csv, and no run under {bench_dir / 'runs'} "
                          f"ended); run `dptrain bench --output.dir {bench_dir}` first.")
    write_csv(bench_dir / "summary.csv", SUMMARY_COLUMNS, summarize(rows))
    plot_all(summary, bench_dir)
    path = bench_dir / "report.md"
    path.write_text(markdown(rows, summary, left_out))
    return path


# The punctuation Markdown reads as markup (emphasis, code, links and images, headings, lists, tables, strikethrough);
# a backslash before it makes it plain text. <, > and & are left to html.escape.
MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|~])")


def md_text(value: Any) -> str:
    """A value from results.csv or a run's files as plain text on one line of report.md.

    Such a value (an error message, a host name) may hold anything; without this, `# x` would start a heading,
    `![x](http://...)` make the viewer fetch a remote image, `<script>` reach a viewer that renders HTML, `|` add a
    table column and a line break end the table. Line breaks and other control characters become spaces; Markdown's
    punctuation gets a backslash; <, > and & become HTML entities. The raw file reads a little noisier for it."""
    flat = "".join(" " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in str(value))
    return html.escape(MARKDOWN_SPECIALS.sub(r"\\\1", flat), quote=False)


def _lines(summary: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in sorted(summary, key=lambda r: r["workers"]):
        lines.setdefault((row["engine"], row["strategy"]), []).append(row)
    return lines


def _values(points: list[dict[str, Any]], measure: str) -> tuple[list[int], list[float], list[float]]:
    """(workers, means, stds) where the mean exists; a missing std is 0 (no bar)."""
    xs, ys, errs = [], [], []
    for p in points:
        mean = as_number(p.get(f"{measure}_mean"))
        if mean is not None:
            xs.append(p["workers"])
            ys.append(mean)
            errs.append(as_number(p.get(f"{measure}_std")) or 0.0)
    return xs, ys, errs


def _speedups(points: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float], int]:
    """Speedup over the line's smallest worker count, its std from the two relative errors; and that count."""
    xs, ts, errs = _values(points, "epoch_time_s")
    base_t, base_err = ts[0], errs[0]
    speedups = [base_t / t for t in ts]
    spread = [s * math.hypot(base_err / base_t, e / t) for s, t, e in zip(speedups, ts, errs)]
    return xs, speedups, spread, xs[0]


MARKERS = {"dptrain": "o", "tutorial": "s", "lightning": "^", "deepspeed": "D"}


def plot_all(summary: list[dict[str, Any]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display: set before pyplot is imported
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FormatStrFormatter

    lines = _lines(summary)
    workers = sorted({r["workers"] for r in summary})
    # One colour per line (tab20 tells up to 20 apart) and one marker per engine, so that a line is found by either.
    colours = plt.get_cmap("tab20")
    style = {key: {"color": colours(i % 20), "marker": MARKERS.get(key[0], "o"), "capsize": 3, "label": " ".join(key)}
             for i, key in enumerate(lines)}

    def axes_for_workers(ax: Any, ylabel: str, log_y: bool = False) -> None:
        ax.set_xscale("log", base=2)
        if log_y:  # a range inside one decade has no major tick: label the minor ones too
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel("workers")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)

    def legend_beside(ax: Any) -> None:  # outside the axes: with many lines, inside it would hide them
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, points in lines.items():
        xs, ys, errs = _values(points, "epoch_time_s")
        ax.errorbar(xs, ys, yerr=errs, **style[key])
        ax.plot(xs, [ys[0] * xs[0] / w for w in xs], linestyle="--", color=style[key]["color"], alpha=0.6)
    axes_for_workers(ax, "time per epoch (s; dashed: ideal)", log_y=True)
    ax.set_title("Time per epoch (timed epochs, training only)")
    legend_beside(ax)
    _save(fig, out_dir / "epoch_time.png", plt)

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for key, points in lines.items():
        xs, speedups, spread, base = _speedups(points)
        left.errorbar(xs, speedups, yerr=spread, **style[key])
        left.plot(xs, [w / base for w in xs], linestyle="--", color=style[key]["color"], alpha=0.6)
        right.errorbar(xs, [s * base / w for s, w in zip(speedups, xs)], yerr=[e * base / w for e, w in zip(spread, xs)],
                       **style[key])
    right.axhline(1.0, linestyle="--", color="grey", alpha=0.6, label="ideal")
    axes_for_workers(left, "speedup (dashed: ideal)")
    axes_for_workers(right, "parallel efficiency")
    right.set_ylim(bottom=0)
    left.set_title("Speedup over the smallest worker count")
    right.set_title("Parallel efficiency")
    legend_beside(right)
    _save(fig, out_dir / "speedup.png", plt)

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for key, points in lines.items():
        left.errorbar(*_values(points, "eval_loss"), **style[key])
        right.errorbar(*_values(points, "eval_acc"), **style[key])
    axes_for_workers(left, "validation loss")
    axes_for_workers(right, "validation accuracy")
    left.set_title("Validation loss (last evaluation)")
    right.set_title("Validation accuracy (last evaluation)")
    legend_beside(right)
    _save(fig, out_dir / "validation.png", plt)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, points in lines.items():
        ax.errorbar(*_values(points, "peak_mem_mb"), **style[key])
    axes_for_workers(ax, "peak memory per worker (MiB)")
    ax.set_title("Peak memory per worker (largest rank)")
    legend_beside(ax)
    _save(fig, out_dir / "memory.png", plt)


def _save(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legend beside the axes is kept
    plt.close(fig)


def _pm(row: dict[str, Any], measure: str, fmt: str) -> str:
    mean, std = as_number(row.get(f"{measure}_mean")), as_number(row.get(f"{measure}_std"))
    if mean is None:
        return "-"
    return format(mean, fmt) + (f" ± {format(std, fmt)}" if std is not None else "")


def table(summary: list[dict[str, Any]]) -> str:
    head = ("| engine | strategy | workers | runs | epoch time (s) | images/s | TFLOPS | of peak | speedup | efficiency | "
            "eval loss | eval acc | peak mem / worker (MiB) |")
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in sorted(summary, key=lambda r: (r["engine"], r["strategy"], r["workers"])):
        speedup, efficiency = as_number(r.get("speedup")), as_number(r.get("efficiency"))
        lines.append(f"| {md_text(r['engine'])} | {md_text(r['strategy'])} | {r['workers']} | {r['runs']} | "
                     f"{_pm(r, 'epoch_time_s', '.3f')} | "
                     f"{_pm(r, 'images_per_s', '.0f')} | {_pm(r, 'achieved_tflops', '.3g')} | "
                     f"{_pm(r, 'fraction_of_peak', '.1%')} | {'-' if speedup is None else f'{speedup:.2f}'} | "
                     f"{'-' if efficiency is None else f'{efficiency:.2f}'} | {_pm(r, 'eval_loss', '.4f')} | "
                     f"{_pm(r, 'eval_acc', '.4f')} | {_pm(r, 'peak_mem_mb', '.0f')} |")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], summary: list[dict[str, Any]], left_out: list[str] | None = None) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    facts = sorted({f"torch {md_text(r['torch'])} on {md_text(r.get('host', ''))}" for r in ok if r.get("torch")})
    batches = sorted({md_text(r["global_batch_size"]) for r in ok if r.get("global_batch_size") not in ("", None)})
    timed = sorted({md_text(r.get("epochs_timed", "")) for r in ok})
    parts = ["# Scaling benchmark", "",
             f"{len(ok)} finished runs ({'; '.join(facts) or 'versions unknown'}), global batch "
             f"{', '.join(batches) or '?'} at every worker count, {', '.join(timed)} timed epochs per run (warm-up "
             f"epochs left out). Per-run numbers: [results.csv](results.csv); means and standard deviations: "
             f"[summary.csv](summary.csv).", ""]
    peaks = sorted({(int(r["workers"]), top) for r in ok if (top := as_number(r.get("peak_tflops"))) is not None})
    if peaks:
        parts += ["Matmul peak (peak.json: the processes of each worker count at once, their TFLOPS together): "
                  + ", ".join(f"{top:.3g} TFLOPS with {w} worker{'s' if w > 1 else ''}" for w, top in peaks) + ".", ""]
    lowest = {(r["engine"], r["strategy"]): min(p["workers"] for p in summary
                                                if (p["engine"], p["strategy"]) == (r["engine"], r["strategy"]))
              for r in summary}
    no_single = sorted(f"{e} {s} (from {w} workers)" for (e, s), w in lowest.items() if w != 1)
    if no_single:
        parts += [f"No 1-worker point for {', '.join(no_single)}: speedup, efficiency and the ideal lines are "
                  f"relative to the smallest worker count measured.", ""]
    for name, title in PLOTS.items():
        parts += [f"## {title}", "", f"![{title}]({name})", ""]
    parts += ["## Summary", "", table(summary), "", HOW_TO_READ, ""]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        parts += ["## Runs that did not finish", "", "| run | status | error |", "| --- | --- | --- |"]
        parts += [f"| {md_text(Path(r.get('run_dir', '')).name)} | {md_text(r['status'])} | "
                  f"{md_text(r.get('error') or 'no error recorded')} |" for r in failed]
        parts.append("")
    if left_out:
        parts += ["## Left out of this report", "", "Not what `dptrain bench` writes, so not counted above:", ""]
        parts += [f"- {md_text(note)}" for note in left_out]
        parts.append("")
    return "\n".join(parts)
