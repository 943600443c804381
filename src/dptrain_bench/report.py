"""BENCH/results.csv -> four PNGs and BENCH/report.md that embeds them with the summary table.

    $ dptrain report runs/bench/fmnist
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dptrain_bench.collect import (SUMMARY_COLUMNS, as_number, collect, positive, read_results,
                                   summarize, write_csv, write_results)
from dptrain_bench.folder import SWEEP_FILE, BenchFolder
from dptrain_bench.hook_probe import read_hooks
from dptrain_bench.link import LINK_FILE, load_link, read_link
from dptrain_bench.scaling_model import STRATEGIES as MODEL_STRATEGIES
from dptrain_bench.scaling_model import (DDP_BUCKET_BYTES, HOOKS, MAX_NODES, Calibration, Measured, Plan, Prediction, Timed,
                                 Workload, calibrate, compute_seconds, curve, fit_basis, named_link,
                                 params_held, predicted, split_for_fit)
from dptrain_bench.peak import MAX_PROCESSES, load_peaks, read_peaks
from dptrain import read_back
from dptrain.config import SPECS
from dptrain.errors import ConfigError
from dptrain.events import read_run_events
from dptrain.files import written_atomically
from dptrain.read_back import BadValue, UnreadableFile
from dptrain.reporting.markdown import md_text, save_figure
from dptrain.run_folder import RunFolder

log = logging.getLogger(__name__)

PLOTS = {
    "epoch_time.png": "Time per epoch",
    "speedup.png": "Speedup and parallel efficiency",
    "validation.png": "Validation loss and accuracy",
    "memory.png": "Peak memory per worker",
}
ACCURACY_PLOT = "accuracy.png"  # with its table (accuracy_markdown)

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


def load_rows(bench_dir: Path, write: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """results.csv, or, when there is none, rebuilt from BENCH/runs (and written, unless `write` is False: another
    sweep's folder, read for --fitted-on); and what was left out of it (rows of results.csv, lines of the runs'
    metrics.jsonl), where and why."""
    if not bench_dir.is_dir():
        raise ConfigError(f"{bench_dir} does not exist; give the --output.dir of a `dptrain bench` sweep.")
    results = BenchFolder(bench_dir).results
    if results.exists():  # a FIFO or a device there is refused by read_results as what it is, not rebuilt over
        rows, left_out = read_results(results)
        if left_out:
            several = len(left_out) > 1  # report.md, when there is one to write, lists every one of them
            log.warning(f"report: {len(left_out)} row{'s' if several else ''} of {results} left out, not being what "
                        f"`dptrain bench` writes ({left_out[0]}{'; ...' if several else ''}).")
        return rows, left_out
    rows = collect(bench_dir)  # collect warns of the lines it skipped itself
    if rows and write:
        write_results(bench_dir, rows)
    return rows, [note for r in rows if (note := r.get("skipped_events"))]


def write_report(bench_dir: Path, link: str | None = None, fitted_on: Path | None = None,
                 accuracy_budget: float | None = None) -> Path:
    """The PNGs and report.md in bench_dir; the path of report.md. With BENCH/link.json, the scaling model's plot and
    tables too, for the measured link and, given its name (`link`, model.NAMED_LINKS), a named one; fitted_on:
    another sweep whose fit predicts every point of this one (scaling_lines)."""
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
                          f"ended); run `dptrain bench sweep --output.dir {bench_dir}` first.")
    lines, notes, links = scaling_lines(bench_dir, rows, link, fitted_on)  # a bad --link or --fitted-on: nothing written
    folder = BenchFolder(bench_dir)
    write_csv(folder.summary, SUMMARY_COLUMNS, summarize(rows))
    plot_all(summary, bench_dir)
    curves = accuracy_curves(bench_dir, rows)
    plot_accuracy(curves, bench_dir)
    if lines:
        plot_scaling(lines, bench_dir)
    scaling = scaling_markdown(lines, notes, links) if links or notes else []
    with written_atomically(folder.report) as tmp:
        tmp.write_text(markdown(rows, summary, left_out, [*accuracy_markdown(bench_dir, summary, accuracy_budget),
                                                          *scaling]))
    return folder.report


# Accuracy against what a strategy sends and the time it takes: the curve of each line's first finished run (its
# evaluations, at each epoch's end), and a table of each line's final accuracy against exact training's.

@dataclass(frozen=True)
class AccuracyCurve:
    """A line's run: (bytes its busiest rank had sent, seconds of training, evaluation accuracy) at each evaluation."""

    label: str
    points: list[tuple[float, float, float]]


def accuracy_curves(bench_dir: Path, rows: list[dict[str, Any]]) -> list[AccuracyCurve]:
    """Each line's (engine, strategy, workers) first finished run, as its evaluations over its cumulated bytes and
    training time (epoch_time_s: training only)."""
    first: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (r["engine"], r["strategy"], int(r["workers"]), int(as_number(r.get("repeat")) or 0))):
        if row["status"] == "ok":
            first.setdefault((row["engine"], row["strategy"], int(row["workers"])), row)
    curves = []
    for (engine, strategy, workers), row in first.items():
        folder = _run_folder(bench_dir, row)
        events = read_run_events(folder.metrics)[0] if folder is not None else []
        sent = seconds = 0.0
        step = 0
        points = []
        for e in sorted((e for e in events if e.get("event") == "epoch" and isinstance(e.get("step"), int)),
                        key=lambda e: e["step"]):
            per_step = max((float(v) for v in (e.get("comm_bytes_per_step") if isinstance(
                e.get("comm_bytes_per_step"), list) else [e.get("comm_bytes_per_step")]) if as_number(v) is not None),
                           default=0.0)
            sent += per_step * max(0, e["step"] - step)
            seconds += as_number(e.get("epoch_time_s")) or 0.0
            step = e["step"]
            if (acc := as_number(e.get("eval_acc"))) is not None:
                points.append((sent, seconds, acc))
        if points:
            curves.append(AccuracyCurve(f"{engine} {strategy} w{workers}", points))
    return curves


def plot_accuracy(curves: list[AccuracyCurve], out_dir: Path) -> None:
    """accuracy.png: each line's evaluation accuracy against the bytes its busiest rank sent (log scale; the runs
    that sent nothing, one worker, are left out of that half) and against its training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = plt.get_cmap("tab20")
    for i, curve in enumerate(curves):
        style = {"color": colours(i % 20), "marker": "o", "label": curve.label}
        sent = [(b, a) for b, _, a in curve.points if b > 0]
        if sent:
            by_bytes.plot([b for b, _ in sent], [a for _, a in sent], **style)
        by_time.plot([t for _, t, _ in curve.points], [a for _, _, a in curve.points], **style)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("bytes sent by the busiest rank, cumulated (one worker sends none: not drawn)")
    by_time.set_xlabel("training time, cumulated (s)")
    for ax in (by_bytes, by_time):
        ax.set_ylabel("evaluation accuracy")
        ax.grid(True, alpha=0.3)
    by_bytes.set_title("Accuracy against bytes sent")
    by_time.set_title("Accuracy against training time")
    if curves:
        by_time.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    save_figure(fig, out_dir / ACCURACY_PLOT, plt)


def _exact(strategy: str, workers: int, engine: str, table: dict[str, Any]) -> bool:
    """Whether the line computes exact training's model: not a hook that rounds the gradients, not local SGD or
    DiLoCo (at one worker local SGD and DDP's hooks do nothing), not FSDP's mixed precision; the other engines' are."""
    if engine != "dptrain":
        return True
    plan = _plan(strategy, table) if strategy in MODEL_STRATEGIES else None
    if plan is None:
        return True
    if workers == 1:
        return strategy != "diloco"  # its outer step runs on one rank too
    if plan.own_cpu_key is not None:  # a compressing hook, local SGD, DiLoCo
        return False
    return plan.param_dtype_size in (None, 4) and plan.reduce_dtype_size in (None, 4)


def accuracy_markdown(bench_dir: Path, summary: list[dict[str, Any]], budget: float | None) -> list[str]:
    """The accuracy table: each line's images/s, bytes a step and final evaluation accuracy, and its gap to exact
    training's (the mean of the exact lines'); with a budget, whether it keeps within it."""
    table = _sweep_strategy(bench_dir)
    exact = [acc for r in summary if (acc := as_number(r.get("eval_acc_mean"))) is not None
             and _exact(r["strategy"], int(r["workers"]), r["engine"], table)]
    reference = sum(exact) / len(exact) if exact else None
    lines = ["| " + " | ".join(["engine", "strategy", "workers", "images/s", "bytes a step", "eval acc",
                                 "gap to exact (points)", *(["within the budget"] if budget is not None else [])]) + " |"]
    lines.append("|" + " --- |" * (lines[0].count(" | ") + 1))
    for r in sorted(summary, key=lambda r: (r["engine"], r["strategy"], r["workers"])):
        acc, sent = as_number(r.get("eval_acc_mean")), as_number(r.get("comm_bytes_per_step_mean"))
        is_exact = _exact(r["strategy"], int(r["workers"]), r["engine"], table)
        gap = None if acc is None or reference is None else (reference - acc) * 100
        within = "yes (exact)" if is_exact else "-" if gap is None else "yes" if budget is not None and gap <= budget else "no"
        lines.append(f"| {md_text(r['engine'])} | {md_text(r['strategy'])} | {r['workers']} | "
                     f"{_pm(r, 'images_per_s', '.0f')} | {'-' if sent is None else f'{sent:,.0f}'} | "
                     f"{'-' if acc is None else f'{acc:.4f}'} | {'-' if gap is None else f'{gap:+.2f}'} |"
                     + (f" {within} |" if budget is not None else ""))
    about = (f"Exact training's accuracy: {reference:.4f}, the mean of the {len(exact)} lines that compute its model "
             f"(no hook that rounds the gradients, no local SGD or DiLoCo); the gap is it less each line's."
             if reference is not None else "No line here computes exact training's model, so no gap is given.")
    if budget is not None:
        about += (f" Budget: {budget:g} points (--accuracy-budget): a line that rounds or delays the gradients is "
                  f"within it where its gap is at most that.")
    return ["## Accuracy against bytes and time", "", f"![Accuracy against bytes and time]({ACCURACY_PLOT})", "",
            "Each line's first finished run: its evaluation accuracy after each evaluated epoch against the bytes its "
            "busiest rank had sent (left) and the training time (right); a sweep's runs all train on the same samples. "
            + about, "", *lines, ""]


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
    save_figure(fig, out_dir / "epoch_time.png", plt)

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
    save_figure(fig, out_dir / "speedup.png", plt)

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for key, points in lines.items():
        left.errorbar(*_values(points, "eval_loss"), **style[key])
        right.errorbar(*_values(points, "eval_acc"), **style[key])
    axes_for_workers(left, "validation loss")
    axes_for_workers(right, "validation accuracy")
    left.set_title("Validation loss (last evaluation)")
    right.set_title("Validation accuracy (last evaluation)")
    legend_beside(right)
    save_figure(fig, out_dir / "validation.png", plt)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, points in lines.items():
        ax.errorbar(*_values(points, "peak_mem_mb"), **style[key])
    axes_for_workers(ax, "peak memory per worker (MiB)")
    ax.set_title("Peak memory per worker (largest rank)")
    legend_beside(ax)
    save_figure(fig, out_dir / "memory.png", plt)


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


def markdown(rows: list[dict[str, Any]], summary: list[dict[str, Any]], left_out: list[str] | None = None,
             scaling: list[str] | None = None) -> str:
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
    parts += scaling or []
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


# The scaling model (dptrain_bench/scaling_model.py) against the measured points, once the sweep has measured its link (link.json):
# fitted on the smaller shapes of each dptrain strategy, it predicts the larger ones (the error table) and every node
# count to 256 (the curves), for the measured link and a named one.

SCALING_PLOT = "scaling_model.png"
SCALING_TITLE = "Scaling model: measured and predicted"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # fsdp's param_dtype and reduce_dtype ("auto": the model's)


@dataclass(frozen=True)
class ScalingLine:
    """One dptrain strategy: its plan, the model's calibration on its points, and its predicted curves by link."""

    strategy: str
    plan: Plan
    calibration: Calibration
    measured: list[Measured]
    ranks_per_node: int
    curves: dict[str, list[Prediction]]
    compute_from: str
    fit_source: str | None = None
    """With --fitted-on: what the other sweep's fit rests on (fit_basis), in words."""


def _sweep_strategy(bench_dir: Path) -> dict[str, Any]:
    """sweep.json's [strategy] table as far as the model reads it, each of those options checked; {} where the file
    is missing, and where it holds a value out of its range (a log line says which): the plans keep their defaults."""
    def take(value: Any) -> dict[str, Any]:
        config = read_back.mapping(read_back.field(read_back.mapping(value, "the file"), "config", "the file"), "config")
        table = read_back.mapping(config.get("strategy") or {}, "config.strategy")
        ddp = read_back.mapping(table.get("ddp") or {}, "config.strategy.ddp")
        fsdp = read_back.mapping(table.get("fsdp") or {}, "config.strategy.fsdp")
        name = "config.strategy.{}".format
        if ddp.get("bucket_mb") is not None:  # unset: DDP's own 25 MiB
            read_back.number(ddp["bucket_mb"], name("ddp.bucket_mb"), 0, 1e6, above_low=True)
        _one_of(ddp.get("comm_hook", "allreduce"), name("ddp.comm_hook"), HOOKS)
        read_back.integer(ddp.get("powersgd_rank", 4), name("ddp.powersgd_rank"), 1, 1 << 16)
        _one_of(ddp.get("update_in_next_forward", False), name("ddp.update_in_next_forward"), (True, False))
        _one_of(fsdp.get("reshard_after_forward", True), name("fsdp.reshard_after_forward"), (True, False))
        for key in ("param_dtype", "reduce_dtype"):
            read_back.text(fsdp.get(key, "auto"), name(f"fsdp.{key}"), 40)
        periodic = {}
        for table_name, options in PERIOD_OPTIONS.items():  # local_sgd's and diloco's period, diloco's overlap_steps
            own = read_back.mapping(table.get(table_name) or {}, f"config.strategy.{table_name}")
            for option, low in zip(options, (1, 0)):
                if option in own:
                    read_back.integer(own[option], name(f"{table_name}.{option}"), low, 1 << 30)
            if len(options) == 2:  # the steps behind, fewer than the period (the strategy's own rule)
                strategy = next(n for n, spec in SPECS.items() if spec.table == table_name)
                period, behind = (own.get(option, _default(strategy, option)) for option in options)
                if behind >= period:
                    raise BadValue(f"{name(f'{table_name}.{options[1]}')} = {behind}, not fewer than "
                                   f"{name(f'{table_name}.{options[0]}')} = {period}")
            periodic[table_name] = own
        return {"ddp": ddp, "fsdp": fsdp, **periodic}

    try:
        return read_back.read_json(bench_dir / SWEEP_FILE, take)
    except FileNotFoundError:
        return {}
    except UnreadableFile as exc:
        log.warning(f"{exc.path} {exc.problem}; the model takes each strategy's default options.")
        return {}


PERIOD_OPTIONS = {spec.table: (e.every, *([e.behind] if e.behind else [])) for spec in SPECS.values()
                  if spec.table and spec.traffic for e in spec.traffic.exchanges if e.every}
"""[strategy.<table>] -> its option of the steps between two exchanges (Exchange.every: local_sgd's, diloco's period),
and where it has one, of the steps an exchange runs behind (Exchange.behind: diloco's overlap_steps)."""


def _one_of(value: Any, name: str, choices: tuple[Any, ...]) -> Any:
    if isinstance(value, bool) != isinstance(choices[0], bool) or value not in choices:
        raise BadValue(f"{name} = {read_back.shown(value)}, not one of {', '.join(map(str, choices))}")
    return value


def _plan(strategy: str, table: dict[str, Any]) -> Plan:
    """The model's plan of a strategy, from its own table of [strategy] (SPECS[strategy].table) as _sweep_strategy
    checked it: another strategy's options are not its own, and leave its plan at their defaults."""
    own_table = SPECS[strategy].table
    own = (table.get(own_table) or {}) if own_table is not None else {}
    bucket_mb = own.get("bucket_mb")  # strategy.ddp.bucket_mb; unset, DDP's own 25 MiB
    return Plan(strategy=strategy, bucket_bytes=bucket_mb * 2**20 if bucket_mb else DDP_BUCKET_BYTES,
                comm_hook=own.get("comm_hook", "allreduce"), powersgd_rank=int(own.get("powersgd_rank", 4)),
                reshard_after_forward=own.get("reshard_after_forward", True),
                param_dtype_size=DTYPE_BYTES.get(own.get("param_dtype", "auto")),
                reduce_dtype_size=DTYPE_BYTES.get(own.get("reduce_dtype", "auto")),
                update_in_next_forward=own.get("update_in_next_forward", False) and strategy == "ddp",
                **{option: int(own.get(option, _default(strategy, option)))  # Plan's fields of the same names
                   for option in PERIOD_OPTIONS.get(own_table, ())})


def _default(strategy: str, option: str) -> object:
    """An option of the strategy's own table where sweep.json leaves it at its default: its options' own."""
    options = SPECS[strategy].options
    assert options is not None and SPECS[strategy].table is not None
    return getattr(options(), option)


def _run_folder(bench_dir: Path, row: dict[str, Any]) -> RunFolder | None:
    """A row's run folder; None without one, or where it is not inside bench_dir (only those are read)."""
    run_dir = (bench_dir / str(row.get("run_dir") or "")).resolve()
    if not row.get("run_dir") or not run_dir.is_relative_to(bench_dir.resolve()):
        return None
    return RunFolder(run_dir)


def _last_epoch(bench_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """The last epoch event of a row's run (metrics.jsonl), {} without one."""
    folder = _run_folder(bench_dir, row)
    if folder is None:
        return {}
    events, _ = read_run_events(folder.metrics)
    epochs = [e for e in events if e.get("event") == "epoch"]
    return epochs[-1] if epochs else {}


def _placement(bench_dir: Path, row: dict[str, Any]) -> dict[str, int]:
    """Where a row's ranks ran, from its env.json (worker.environment_record): machines, machine_cores and
    cpu_threads_per_rank, those it holds as positive integers."""
    folder = _run_folder(bench_dir, row)
    try:
        env = read_back.read_json_object(folder.env) if folder else {}
    except (FileNotFoundError, UnreadableFile):
        return {}
    return {key: value for key in ("machines", "machine_cores", "cpu_threads_per_rank")
            if read_back.is_number(value := env.get(key)) and value == int(value) and 0 < value <= MAX_PROCESSES}


def _ranks_total(values: Any, sharded: bool) -> float | None:
    """A per-rank byte count of metrics.jsonl as the whole model's: summed over ranks where the strategy shards it
    (its spec's Traffic.sharded), else the largest rank's."""
    numbers = [float(v) for v in (values if isinstance(values, list) else [values]) if as_number(v) is not None]
    return (sum(numbers) if sharded else max(numbers)) if numbers else None


def _sharded(strategy: str) -> tuple[str, ...]:
    """What each rank of the strategy holds 1/N of between steps (its spec's traffic), none where it states none."""
    traffic = SPECS[strategy].traffic if strategy in SPECS else None
    return traffic.sharded if traffic is not None else ()


def _workload(bench_dir: Path, rows: list[dict[str, Any]],
              table: dict[str, Any]) -> tuple[Workload | None, dict[str, float], str]:
    """The Workload the runs' own accounting gives (parameters, optimizer state, operations per sample, from their
    metrics.jsonl: the parameters of one copy of the model, where a strategy holds more, as _plan(table) of it says),
    PowerSGD's measured bytes by strategy, and why there is none when there is none."""
    params = optim = flops = None
    powersgd: dict[str, float] = {}
    for row in rows:
        epoch = _last_epoch(bench_dir, row)
        if not epoch:
            continue
        strategy, world = row["strategy"], int(row["workers"])
        sharded = _sharded(strategy)
        held = _ranks_total(epoch.get("mem_params_bytes"), "params" in sharded)
        params = params or (held / params_held(_plan(strategy, table), world) if held else None)
        optim = optim or _ranks_total(epoch.get("mem_optim_bytes"), "optim" in sharded)
        flops = flops or as_number(epoch.get("model_flops_per_sample"))
        sent = _ranks_total(epoch.get("comm_bytes_per_step"), False)
        if sent and world > 1 and strategy not in powersgd:
            powersgd[strategy] = sent * world / (2 * (world - 1))  # the buffer a ring all-reduce of `sent` carried
    if not params:
        return None, {}, ("no run holds its parameters' bytes (mem_params_bytes in metrics.jsonl), so the model has no "
                          "communication volume; rerun the sweep, or keep its runs folder beside results.csv")
    batches = [int(b) for r in rows if (b := as_number(r.get("global_batch_size")))]
    peaks = read_peaks(bench_dir)
    shares = {w: p.peak_tflops / (w * peaks[1].peak_tflops) for w, p in peaks.items() if 1 in peaks}
    on_gpu = any(p.device == "cuda" for p in peaks.values())
    per_sample = flops / (peaks[1].peak_tflops * 1e12) if flops and 1 in peaks else 0.0  # peak.json + FLOPs
    cores = next((c for r in rows if (c := _placement(bench_dir, r).get("machine_cores"))), None)
    hooks = read_hooks(bench_dir)
    work = Workload(param_bytes=params, optimizer_bytes=optim, global_batch=batches[0] if batches else 1,
                    compute_s_per_sample=per_sample, rank_share=shares, ranks_share_a_node=not on_gpu,
                    machine_cores=cores, own_cpu_s=dict(hooks.cpu_s) if hooks is not None else {})
    return work, powersgd, ""


def _measured(bench_dir: Path, rows: list[dict[str, Any]]) -> list[Measured]:
    """The line's finished points, the repeats of a shape averaged (images/s, CPU use), with the machines and threads
    of their first run."""
    shapes: dict[tuple[int, int], list[float]] = {}
    cpu: dict[tuple[int, int], list[float]] = {}
    where: dict[tuple[int, int], dict[str, int]] = {}
    for r in rows:
        rate = positive(r.get("images_per_s"))
        if r["status"] == "ok" and rate is not None:
            shape = (int(as_number(r.get("nodes")) or 1), int(r["workers"]))
            shapes.setdefault(shape, []).append(rate)
            if (util := positive(r.get("cpu_util_pct"))) is not None:
                cpu.setdefault(shape, []).append(util)
            where.setdefault(shape, _placement(bench_dir, r))
    return [Measured(n, w, sum(v) / len(v), where[(n, w)].get("machines"), where[(n, w)].get("cpu_threads_per_rank"),
                     sum(cpu[(n, w)]) / len(cpu[(n, w)]) if (n, w) in cpu else None)
            for (n, w), v in sorted(shapes.items())]


def scaling_lines(bench_dir: Path, rows: list[dict[str, Any]], link_name: str | None = None,
                  fitted_on: Path | None = None,
                  hold_out: bool = True) -> tuple[list[ScalingLine], list[str], dict[str, str]]:
    """The model's line of each dptrain strategy it has formulas for; notes on what it could not do; the links used,
    by label, in words. Nothing without link.json. fitted_on: another sweep's folder (another link, say) whose fit
    (compute per sample, overlap), made on every one of its points, predicts every point here, none of which is then
    fitted on. hold_out False: each line fitted on all its points (what --fitted-on reads of the other sweep)."""
    earlier = _fits_of(fitted_on) if fitted_on is not None else None
    named = named_link(link_name) if link_name else None  # an unknown name is refused before anything is read
    record = read_link(bench_dir)
    if record is None:
        return [], [], {}
    across, within = record.across_hosts, record.within_host
    between = across or within
    if between is None:
        return [], [f"{LINK_FILE} holds no timings a link can be fitted on; run the sweep again to probe it"], {}
    links = {"measured": (f"measured ({LINK_FILE}, {'across hosts' if across else 'within one host'}): "
                          f"{between.latency_s * 1e6:.0f} us a message, {between.bandwidth_bps * 8 / 1e9:.3g} Gbit/s")}
    if named is not None:
        links[named.name] = f"{named.name} (assumed): {named.assumption}"
    ours = [r for r in rows if r["engine"] == "dptrain" and r["strategy"] in MODEL_STRATEGIES]
    if not ours:
        return [], ["no dptrain run of a strategy the model knows (" + ", ".join(MODEL_STRATEGIES) + ")"], links
    table, lines, notes = _sweep_strategy(bench_dir), [], []
    work, powersgd, why_not = _workload(bench_dir, ours, table)
    if work is None:
        return [], [why_not], links
    for strategy in sorted({r["strategy"] for r in ours}):
        measured = _measured(bench_dir, [r for r in ours if r["strategy"] == strategy])
        plan = _plan(strategy, table)
        line_work = replace(work, powersgd_bytes=powersgd.get(strategy))
        if earlier is not None:
            source = strategy if strategy in earlier else "ddp" if "ddp" in earlier else None
            if source is None:
                notes.append(f"{strategy}: {fitted_on} has no fit of it, nor of ddp, to predict these points with")
                continue
            if source != strategy:  # the machine's numbers (compute, CPU a byte) are no strategy's own
                notes.append(f"{strategy}: predicted with the fit of ddp in {fitted_on}, which has none of {strategy}")
            fit = earlier[source].calibration
            line_work = replace(line_work, compute_s_per_sample=fit.work.compute_s_per_sample,
                                threads_alone=fit.work.threads_alone, cores_busy_alone=fit.work.cores_busy_alone,
                                comm_cpu_s_per_byte=fit.work.comm_cpu_s_per_byte,
                                own_cpu_s=line_work.own_cpu_s or fit.work.own_cpu_s)
            calibration = Calibration(work=line_work, overlap=fit.overlap, overlap_fitted=fit.overlap_fitted,
                                      fitted_on=[], held_out=predicted(plan, line_work, measured, between, fit.overlap,
                                                                       within))
            lines.append(replace(_line(strategy, plan, calibration, measured, between, within, named,
                                       f"the fit on {fitted_on}"), fit_source=fit_basis(fit.fitted_on)))
            continue
        has_single = any(m.workers == 1 for m in (split_for_fit(measured)[0] if hold_out else measured))
        if not measured or (not has_single and not line_work.compute_s_per_sample):
            notes.append(f"{strategy}: no 1-worker run and no peak.json with the model's operations per sample, so "
                         f"no compute time per sample to start from")
            continue
        try:
            calibration = calibrate(plan, line_work, measured, between, within, hold_out=hold_out)
        except ConfigError as e:  # PowerSGD without its measured bytes, say
            notes.append(f"{strategy}: {e}")
            continue
        lines.append(_line(strategy, plan, calibration, measured, between, within, named,
                           "its 1-worker run" if has_single else "peak.json and the model's operations"))
    return lines, notes, links


def _line(strategy: str, plan: Plan, calibration: Calibration, measured: list[Measured], between: Timed,
          within: Timed | None, named: Timed | None, compute_from: str) -> ScalingLine:
    """A strategy's line: its curves to MAX_NODES over the measured link (and the named one), each node a machine."""
    per_node = max((m.ranks_per_node for m in measured if m.nodes > 1), default=1)
    curves = {"measured": curve(plan, calibration.work, between, per_node, calibration.overlap, local_link=within)}
    if named is not None:
        curves[named.name] = curve(plan, calibration.work, named, per_node, calibration.overlap, local_link=within)
    return ScalingLine(strategy, plan, calibration, measured, per_node, curves, compute_from)


def _fits_of(bench_dir: Path) -> dict[str, ScalingLine]:
    """Another sweep's lines by strategy, for --fitted-on; ConfigError in one sentence where it has none."""
    if not bench_dir.is_dir():
        raise ConfigError(f"--fitted-on {bench_dir} does not exist; give the folder of a sweep whose own report draws "
                          f"the scaling model.")
    try:  # refused in one sentence here, where the report of the sweep itself would leave the file out
        load_link(bench_dir), load_peaks(bench_dir)
    except UnreadableFile as exc:
        raise ConfigError(f"--fitted-on {bench_dir}: {exc.path.name} {exc.problem}; give a sweep's folder whose own "
                          f"report draws the scaling model.") from None
    rows, _ = load_rows(bench_dir, write=False)
    lines, notes, _ = scaling_lines(bench_dir, rows, hold_out=False)
    if not lines:
        why = notes[0] if notes else f"it has no {LINK_FILE}"
        raise ConfigError(f"--fitted-on {bench_dir} gives the model no fit ({why}); give a sweep's folder whose own "
                          f"report draws the scaling model.")
    return {line.strategy: line for line in lines}


def _measured_efficiency(line: ScalingLine, point: Measured) -> float:
    """compute_s / step_s of a measured point, as the model defines efficiency."""
    work = line.calibration.work
    compute = compute_seconds(work, point.nodes, point.ranks_per_node, point.machines, point.threads_per_rank)
    return compute * point.images_per_s / work.batch(point.workers)


def plot_scaling(lines: list[ScalingLine], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, line in enumerate(lines):
        colour = colours(i % 10)
        for (label, predictions), dash in zip(line.curves.items(), ("-", "--", ":")):
            xs = [p.ranks for p in predictions]
            per_node = f"{line.ranks_per_node} rank{'s' if line.ranks_per_node > 1 else ''}/node"
            name = f"{line.strategy}: predicted, {label} link ({per_node})"
            left.plot(xs, [p.images_per_s for p in predictions], dash, color=colour, label=name)
            right.plot(xs, [p.efficiency for p in predictions], dash, color=colour, label=name)
        fitted = line.calibration.fitted_on
        held = [m for m, _ in line.calibration.held_out]
        for points, marker, what in ((fitted, "o", "measured, fitted on"), (held, "s", "measured, held out")):
            if points:
                left.scatter([m.workers for m in points], [m.images_per_s for m in points], marker=marker,
                             color=colour, edgecolors="black", zorder=3, label=f"{line.strategy}: {what}")
                right.scatter([m.workers for m in points], [_measured_efficiency(line, m) for m in points],
                              marker=marker, color=colour, edgecolors="black", zorder=3)
        if line.calibration.held_out:
            left.scatter([m.workers for m, _ in line.calibration.held_out],
                         [p.images_per_s for _, p in line.calibration.held_out], marker="x", s=60, color=colour,
                         zorder=4, label=f"{line.strategy}: predicted at the held-out points")
    from matplotlib.ticker import FuncFormatter, LogLocator

    for ax, label in ((left, "images/s (all ranks)"), (right, "efficiency (compute / step time)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1, 2, 4 ... instead of 2^0, 2^1
        ax.set_xlabel("ranks (nodes x ranks per node)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    left.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.3g}"))
    left.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:.3g}"))
    right.set_ylim(0, 1.05)
    left.set_title("Throughput to 256 nodes")
    right.set_title("Efficiency to 256 nodes")
    handles, labels = left.get_legend_handles_labels()  # one legend for both panels, beside them
    right.legend(handles, labels, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    save_figure(fig, out_dir / SCALING_PLOT, plt)


def scaling_markdown(lines: list[ScalingLine], notes: list[str], links: dict[str, str]) -> list[str]:
    """report.md's sections on the model: the links, the plot, the error table and the predictions."""
    parts = ["## " + SCALING_TITLE, "",
             "The scaling model (docs/scaling-model.md): step time = compute + the communication not hidden behind "
             "it, from the compute per sample, each strategy's collectives and the link. Links: "
             + "; ".join(md_text(text) for text in links.values()) + ".", ""]
    parts += [f"- {md_text(note)}" for note in notes] + ([""] if notes else [])
    if not lines:
        return parts
    for line in lines:
        c = line.calibration
        overlap = (f"overlap {c.overlap:.2f} fitted" if c.overlap_fitted else
                   f"overlap {c.overlap:.2f} assumed (no point of two ranks or more to fit it on)")
        fitted = (f"fitted on {fit_basis(c.fitted_on)}" if c.fitted_on else
                  "fitted on none of these points, every one held out")
        comm_cpu = (f"; moving a byte between nodes took {c.work.comm_cpu_s_per_byte * 1e9:.3g} ns of a rank's CPU"
                    if c.work.comm_cpu_s_per_byte else "")
        source = f", made on all its {md_text(line.fit_source)}" if line.fit_source else ""
        parts.append(f"- {md_text(line.strategy)}: {fitted}; compute {c.work.compute_s_per_sample * 1e3:.3g} ms per "
                     f"sample from {md_text(line.compute_from)}{source}{comm_cpu}; {overlap}.")
        last = max(p.nodes for p in line.curves["measured"])
        if last < MAX_NODES:  # the sweep keeps the global batch: past it, a rank would get no sample
            parts.append(f"  Its curves end at {last} nodes: the global batch of {c.work.global_batch} gives each of "
                         f"{last * line.ranks_per_node} ranks a sample, and no more ranks.")
    parts += ["", f"![{SCALING_TITLE}]({SCALING_PLOT})", "",
              "Filled circles: the measured points the model was fitted on; filled squares: measured points it was "
              "not fitted on; crosses: its predictions of those; lines: its predictions to 256 nodes.", "",
              "## Model error on the points it was not fitted on", ""]
    errors = [(line.strategy, *e) for line in lines for e in line.calibration.errors()]
    if errors:
        parts += ["| strategy | nodes | workers | measured images/s | predicted images/s | error |",
                  "| --- | --- | --- | --- | --- | --- |"]
        parts += [f"| {md_text(s)} | {m.nodes} | {m.workers} | {m.images_per_s:.0f} | {p.images_per_s:.0f} | "
                  f"{error:+.1%} |" for s, m, p, error in errors]
        worst = max(errors, key=lambda e: abs(e[3]))
        parts += ["", f"Largest error: {worst[3]:+.1%} ({md_text(worst[0])} at {worst[1].workers} workers on "
                      f"{worst[1].nodes} node{'s' if worst[1].nodes > 1 else ''})."]
    else:
        parts.append("No point was held out: each line has one shape only, so there is nothing to compare yet.")
    parts += ["", f"## Predicted to {MAX_NODES} nodes", "",
              "| strategy | link | nodes | ranks | images/s | efficiency | exposed comm / step (ms) | "
              "comm CPU / step (ms) | params + grads + optimizer / rank (MiB) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for line in lines:
        for label, predictions in line.curves.items():
            parts += [f"| {md_text(line.strategy)} | {md_text(label)} | {p.nodes} | {p.ranks} | {p.images_per_s:.0f} | "
                      f"{p.efficiency:.2f} | {p.exposed_s * 1e3:.3g} | {p.comm_cpu_s * 1e3:.3g} | "
                      f"{p.memory_bytes / 2**20:.1f} |" for p in predictions]
    parts += ["", "Memory leaves the activations out (they depend on the batch per rank, not on the strategy).", ""]
    return parts
