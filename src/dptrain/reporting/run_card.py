"""A run card: RUN_DIR/card/card.md and its PNGs for one run, from the run's own files, offline.

    $ dptrain card runs/fashion-mnist_mnist-cnn_ddp

It reads the run through run_record.py (config.toml, env.json, metrics.jsonl and the snapshots' manifest.json
files), and writes the configuration, the environment, the loss and
accuracy curves, throughput, fraction of peak (where a peak.json of the run's machine sits beside the run),
communication share, utilisation and memory per rank, and the run's starts, stops and snapshots. Everything in those
files is data: the card parses JSON and TOML only (no pickle, no torch), escapes every value it prints into Markdown
(reporting.markdown.md_text), and leaves out, and names, an event whose fields are not what dptrain writes.
Importing this module imports neither torch nor matplotlib; drawing imports matplotlib (Agg: files, no display).
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dptrain import config as config_mod
from dptrain.errors import ConfigError, OutputError
from dptrain.events import (COMM_BYTES_PER_STEP, COMM_EXPOSED_MS_PER_STEP, COMM_MS_PER_STEP, CPU_UTIL_PCT, EPOCH,
                            EPOCH_TIME_S, EVAL_ACC, EVAL_LOSS, GPU_MEM_USED_MAX_MB, GPU_POWER_MEAN_W, GPU_UTIL_MEAN_PCT,
                            MEM_GRADS_BYTES, MEM_OPTIM_BYTES, MEM_PARAMS_BYTES, PEAK_MEM_MB, RSS_MAX_MB, STEP, TRAIN_ACC,
                            TRAIN_LOSS, TRAIN_SAMPLES, DATA_WAIT_MS_PER_STEP, OWN_COMPUTE_CPU_MS_PER_STEP,
                            OWN_COMPUTE_MS_PER_STEP, STRAGGLER_HOST, STRAGGLER_PHASE, STRAGGLER_RANK,
                            STRAGGLER_SLOWER_PCT, read_run_events)
from dptrain.files import write_atomically
from dptrain.reporting.markdown import md_text, save_figure
from dptrain.reporting.sweep_files import Probe
from dptrain.run_folder import RunFolder
from dptrain.reporting.run_record import (SNAPSHOTS_LISTED, Snapshot, Start, Timeline, achieved_tflops, as_number,
                                         as_per_rank, comm_shares, cut_short, flatten, peak_for, read_probes,
                                         read_run_config, read_small_json, read_snapshots, step_ms, timeline)

CARD = "card.md"
LOSS_PLOT, THROUGHPUT_PLOT, COMM_PLOT, UTIL_PLOT = ("loss_accuracy.png", "throughput.png", "communication.png",
                                                    "utilisation.png")
SECTIONS = ("Configuration", "Environment", "Loss and accuracy", "Throughput and fraction of peak", "Communication",
            "Utilisation and memory per rank", "Starts, stops and snapshots")
RANKS_LISTED = 32  # per-rank table rows up to this many ranks; beyond, the lowest, mean and highest over the ranks
RANKS_DRAWN = 16  # one line per rank up to this many; beyond, the lowest, mean and highest over the ranks
VALUE_CHARS = 120  # a config or env value longer than this is cut in the card (the file itself holds it whole)
HEADLINE_OPTIONS = ("data.name", "model.name", "strategy.name", "launch.nproc_per_node", "train.global_batch_size",
                    "train.epochs", "train.max_steps", "optim.name", "optim.lr", "optim.schedule", "train.bf16",
                    "train.seed")


def shown_value(value: Any) -> str:
    """A config or env value as TOML would spell it (strings quoted), cut to VALUE_CHARS; md_text escapes it."""
    if value is None:  # an option left unset (TOML has no null; config.toml leaves it out), or JSON's null
        return "none"
    text = json.dumps(value, default=str) if not isinstance(value, bool) else str(value).lower()
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS - 3] + "..."


def utc(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    try:
        return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "-"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mib(value: float | None) -> str:
    return fmt(None if value is None else value / 2**20, ".1f")


def rank_columns(rows: list[list[float | None]]) -> list[list[float]]:
    """Per rank, its values over the rows (epochs), Nones left out."""
    ranks = max((len(r) for r in rows), default=0)
    return [[r[i] for r in rows if i < len(r) and r[i] is not None] for i in range(ranks)]


# ---- the card -------------------------------------------------------------------------------------------------------

def write_run_card(run_dir: Path) -> Path:
    """RUN_DIR/card/card.md and its PNGs; the path of card.md. ConfigError in one sentence where RUN_DIR is no
    run, OutputError where the card cannot be written."""
    run_dir = Path(run_dir)
    folder = RunFolder(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} does not exist; give the --output.dir of a `dptrain train` run.")
    if not folder.metrics.exists():  # whatever else is there (a FIFO, a device) is refused by its reader, as what it is
        raise ConfigError(f"{run_dir} has no metrics.jsonl, so there is nothing to report; give the folder of a run "
                          f"that started training (its --output.dir).")
    events, skipped = read_run_events(folder.metrics)
    line = timeline(events)
    line.left_out[:0] = [f"metrics.jsonl {note}" for note in skipped]
    if not line.starts and not line.epochs:
        raise ConfigError(f"{folder.metrics} holds no run_start or epoch event dptrain can read"
                          f"{f' ({len(skipped)} lines left out, the first as {skipped[0]})' if skipped else ''}; "
                          f"give the folder of a run that started training.")
    options, config_problem = read_run_config(folder.config)
    env, env_problem = read_small_json(folder.env)
    snapshots, latest = read_snapshots(folder.checkpoints)
    probes, peak_file = read_probes(run_dir)
    out = folder.card
    try:
        out.mkdir(exist_ok=True)
        drawn = draw(line, probes, out)
        for name in {LOSS_PLOT, THROUGHPUT_PLOT, COMM_PLOT, UTIL_PLOT} - drawn:  # an earlier card's, no longer true
            (out / name).unlink(missing_ok=True)
        text = card_markdown(run_dir, line, options, config_problem, env, env_problem, snapshots, latest, probes,
                             peak_file, drawn)
        path = out / CARD
        write_atomically(path, text)
    except OSError as exc:
        raise OutputError(f"could not write the run card in {out} ({exc.strerror or exc}); free space or fix "
                          f"permissions there, then run the same command.") from None
    return path


def card_markdown(run_dir: Path, line: Timeline, options: dict[str, Any], config_problem: str | None,
                  env: dict[str, Any], env_problem: str | None, snapshots: list[Snapshot], latest: str | None,
                  probes: dict[int, Probe], peak_file: Path | None, drawn: set[str]) -> str:
    parts = [f"# Run card: {md_text(run_dir.resolve().name)}", "", summary_sentence(line), ""]
    parts += configuration_section(options, config_problem)
    parts += environment_section(env, env_problem)
    parts += loss_section(line, drawn)
    parts += throughput_section(line, probes, peak_file, drawn)
    parts += communication_section(line, drawn)
    parts += utilisation_section(line, drawn)
    parts += starts_section(line, snapshots, latest)
    if line.left_out:  # config.toml's and env.json's own problems are said in their sections
        parts += ["## Left out of this card", "", "Not what dptrain writes, so not counted above:", ""]
        parts += [f"- {md_text(note)}" for note in line.left_out] + [""]
    return "\n".join(parts)


def epochs_in_order(line: Timeline) -> list[tuple[int, dict[str, Any], Start | None]]:
    return [(n, e, s) for n, (e, s) in sorted(line.epochs.items())]


def summary_sentence(line: Timeline) -> str:
    last = line.starts[-1] if line.starts else None
    state = last.ended if last else "no run_start event"
    epochs = epochs_in_order(line)
    step = max([s.step for s in line.starts] + [int(e[STEP]) for _, e, _ in epochs] + list(line.steps), default=0)
    of = f" of {line.total_steps}" if line.total_steps else ""
    evaluated = [e for _, e, _ in epochs if as_number(e.get(EVAL_ACC)) is not None]
    last = evaluated[-1] if evaluated else {}
    last_eval = (f"; last evaluation (epoch {last[EPOCH]}): loss {fmt(as_number(last.get(EVAL_LOSS)), '.4f')}, "
                 f"accuracy {fmt(as_number(last.get(EVAL_ACC)), '.4f')}" if evaluated else "")
    starts, resumes = len(line.starts), max(len(line.starts) - 1, 0)
    return (f"State: {md_text(state)}. Step {step}{of}, {len(epochs)} epoch{'s' if len(epochs) != 1 else ''} "
            f"logged, {starts} start{'s' if starts != 1 else ''} ({resumes} resume{'s' if resumes != 1 else ''})"
            f"{last_eval}. Written from the run's own files by `dptrain card`; the PNGs sit beside this file.")


def configuration_section(options: dict[str, Any], problem: str | None) -> list[str]:
    parts = [f"## {SECTIONS[0]}", ""]
    if problem:
        return parts + [f"Not shown: {md_text(problem)}.", ""]
    # as TOML reads them back: lists where the dataclasses hold tuples, so that [1, 28, 28] equals (1, 28, 28)
    defaults = flatten(json.loads(json.dumps(config_mod.to_dict(config_mod.RunConfig()))))
    parts += ["The resolved configuration is [config.toml](../config.toml). The main options:", "",
              "| option | value |", "| --- | --- |"]
    parts += [f"| {name} | {md_text(shown_value(options.get(name, defaults.get(name))))} |"
              for name in HEADLINE_OPTIONS]
    changed = [n for n in sorted(options) if n not in HEADLINE_OPTIONS and options[n] != defaults.get(n, object())]
    if changed:
        parts += ["", "The other options set differently from the defaults:", "", "| option | value | default |",
                  "| --- | --- | --- |"]
        parts += [f"| {md_text(n)} | {md_text(shown_value(options[n]))} | "
                  f"{md_text(shown_value(defaults[n])) if n in defaults else 'not an option of this dptrain'} |"
                  for n in changed]
    return parts + [""]


def environment_section(env: dict[str, Any], problem: str | None) -> list[str]:
    parts = [f"## {SECTIONS[1]}", ""]
    if problem:
        return parts + [f"Not shown: {md_text(problem)}.", ""]
    parts += ["From [env.json](../env.json), written by the run's latest start:", "", "| field | value |",
              "| --- | --- |"]
    parts += [f"| {md_text(cut_short(str(k)))} | {md_text(shown_value(v))} |" for k, v in list(env.items())[:50]]
    return parts + [""]


def loss_section(line: Timeline, drawn: set[str]) -> list[str]:
    parts = [f"## {SECTIONS[2]}", ""]
    if LOSS_PLOT in drawn:
        parts += [f"![Loss and accuracy]({LOSS_PLOT})", "",
                  "Left: the loss of every logged step (train.log_every) and each epoch's mean training loss and "
                  "evaluation loss; right: each epoch's training and evaluation accuracy. Dotted lines: where a "
                  "later start resumed.", ""]
    epochs = epochs_in_order(line)
    if not epochs:
        return parts + ["No epoch finished: no per-epoch numbers yet.", ""]
    parts += ["| epoch | step | train loss | train acc | eval loss | eval acc | epoch time (s) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    parts += [f"| {n} | {int(e[STEP])} | {fmt(as_number(e.get(TRAIN_LOSS)), '.4f')} | "
              f"{fmt(as_number(e.get(TRAIN_ACC)), '.4f')} | {fmt(as_number(e.get(EVAL_LOSS)), '.4f')} | "
              f"{fmt(as_number(e.get(EVAL_ACC)), '.4f')} | {e[EPOCH_TIME_S]:.2f} |" for n, e, _ in epochs]
    return parts + [""]


def throughput_section(line: Timeline, probes: dict[int, Probe], peak_file: Path | None, drawn: set[str]) -> list[str]:
    parts = [f"## {SECTIONS[3]}", ""]
    epochs = epochs_in_order(line)
    if not epochs:
        return parts + ["No epoch finished: no throughput yet.", ""]
    if THROUGHPUT_PLOT in drawn:
        parts += [f"![Throughput]({THROUGHPUT_PLOT})", ""]
    samples, seconds = sum(e[TRAIN_SAMPLES] for _, e, _ in epochs), sum(e[EPOCH_TIME_S] for _, e, _ in epochs)
    later = epochs[1:]
    sentence = f"{samples / seconds:.0f} images/s over all {len(epochs)} epochs (training steps only)"
    if later:
        rate = sum(e[TRAIN_SAMPLES] for _, e, _ in later) / sum(e[EPOCH_TIME_S] for _, e, _ in later)
        sentence += f", {rate:.0f} after the first (which pays for warm-up)"
    parts += [sentence + ".", ""]
    fractions = {n: (rate / probe.peak_tflops, probe) for n, e, s in epochs
                 if (rate := achieved_tflops(e)) is not None and (probe := peak_for(probes, s)) is not None}
    parts += ["| epoch | world size | images/s | step time (ms) | TFLOPS | of peak |",
              "| --- | --- | --- | --- | --- | --- |"]
    parts += [f"| {n} | {fmt(s.world_size if s else None, 'd')} | {e[TRAIN_SAMPLES] / e[EPOCH_TIME_S]:.0f} | "
              f"{fmt(step_ms(e, line.global_batch_size), '.1f')} | {fmt(achieved_tflops(e), '.3g')} | "
              f"{fmt(fractions[n][0] if n in fractions else None, '.1%')} |" for n, e, s in epochs]
    parts.append("")
    if fractions:
        used = sorted({(p.workers, p.device, p.dtype, p.peak_tflops) for _, p in fractions.values()})
        parts += ["TFLOPS is the model's own arithmetic (model_flops_per_sample) at the epoch's images/s, over all "
                  "ranks; \"of peak\" divides it by what the same number of processes got together from square "
                  f"matmuls on this machine ({md_text(str(peak_file))}: "
                  + ", ".join(f"{t:.3g} TFLOPS with {w} {d} process{'es' if w > 1 else ''} in {d_type}"
                              for w, d, d_type, t in used) + ").", ""]
    else:
        parts += ["TFLOPS is the model's own arithmetic (model_flops_per_sample) at the epoch's images/s, over all "
                  "ranks. Fraction of peak: not measured. It needs a matmul probe of the run's own machine, with the "
                  "run's number of processes (a `peak.json` as `dptrain bench` writes, in the run folder); the card "
                  "does not probe the machine it is written on, which need not be the run's and would cost seconds.",
                  ""]
    return parts


def communication_section(line: Timeline, drawn: set[str]) -> list[str]:
    parts = [f"## {SECTIONS[4]}", ""]
    epochs = epochs_in_order(line)
    timed = [(n, e) for n, e, _ in epochs if any(v is not None for v in as_per_rank(e.get(COMM_EXPOSED_MS_PER_STEP)))]
    sent = [(n, e) for n, e, _ in epochs if any(v is not None for v in as_per_rank(e.get(COMM_BYTES_PER_STEP)))]
    if sent:
        n, e = sent[-1]
        per_rank = [v for v in as_per_rank(e.get(COMM_BYTES_PER_STEP)) if v is not None]
        parts += [f"Each rank sends {mib(max(per_rank))} MiB of gradients or parameters a step (epoch {n}, the "
                  f"largest rank).", ""]
    if not timed:
        return parts + ["Communication time: not measured. Only ddp and zero1 time their gradients' communication "
                        "(comm_ms_per_step, comm_exposed_ms_per_step); this run's epochs carry none.", ""]
    if COMM_PLOT in drawn:
        parts += [f"![Communication]({COMM_PLOT})", ""]
    parts += ["Communication share: the time a step waited for communication (comm_exposed_ms_per_step, what backward "
              "did not hide) over the step's time (the epoch's training time over its steps). Per epoch, the mean and "
              "the largest over ranks:", "",
              "| epoch | step time (ms) | comm / step (ms) | exposed / step (ms) | share, mean | share, largest |",
              "| --- | --- | --- | --- | --- | --- |"]
    for n, e in timed:
        shares = [s for s in comm_shares(e, line.global_batch_size) if s is not None]
        comm = [v for v in as_per_rank(e.get(COMM_MS_PER_STEP)) if v is not None]
        exposed = [v for v in as_per_rank(e.get(COMM_EXPOSED_MS_PER_STEP)) if v is not None]
        parts.append(f"| {n} | {fmt(step_ms(e, line.global_batch_size), '.1f')} | "
                     f"{fmt(statistics.fmean(comm) if comm else None, '.2f')} | {statistics.fmean(exposed):.2f} | "
                     f"{fmt(statistics.fmean(shares) if shares else None, '.2%')} | "
                     f"{fmt(max(shares) if shares else None, '.2%')} |")
    return parts + [""]


RANK_TABLE = (  # (column, epoch field, how the epochs combine, format)
    ("CPU util (% of a core)", CPU_UTIL_PCT, "mean", ".1f"),
    ("RSS max (MiB)", RSS_MAX_MB, "max", ".1f"),
    ("params (MiB)", MEM_PARAMS_BYTES, "last", "bytes"),
    ("grads (MiB)", MEM_GRADS_BYTES, "last", "bytes"),
    ("optimizer (MiB)", MEM_OPTIM_BYTES, "last", "bytes"),
    ("comm exposed / step (ms)", COMM_EXPOSED_MS_PER_STEP, "mean", ".2f"),
    ("own compute / step (ms)", OWN_COMPUTE_MS_PER_STEP, "mean", ".1f"),
    ("own compute CPU / step (ms)", OWN_COMPUTE_CPU_MS_PER_STEP, "mean", ".1f"),
    ("data wait / step (ms)", DATA_WAIT_MS_PER_STEP, "mean", ".2f"),
    ("GPU util (%)", GPU_UTIL_MEAN_PCT, "mean", ".1f"),
    ("GPU memory max (MiB)", GPU_MEM_USED_MAX_MB, "max", ".0f"),
    ("GPU power (W)", GPU_POWER_MEAN_W, "mean", ".0f"),
)


def rank_values(epochs: list[dict[str, Any]], key: str, how: str) -> list[float | None]:
    columns = rank_columns([as_per_rank(e.get(key)) for e in epochs])
    combine = {"mean": statistics.fmean, "max": max, "last": lambda values: values[-1]}[how]
    return [combine(values) if values else None for values in columns]


def utilisation_section(line: Timeline, drawn: set[str]) -> list[str]:
    parts = [f"## {SECTIONS[5]}", ""]
    epochs = [e for _, e, _ in epochs_in_order(line)]
    if not epochs:
        return parts + ["No epoch finished: no per-rank numbers yet.", ""]
    if UTIL_PLOT in drawn:
        parts += [f"![Utilisation and memory per rank]({UTIL_PLOT})", ""]
    every = [(title, rank_values(epochs, key, how), spec) for title, key, how, spec in RANK_TABLE]
    columns = [(title, values, spec) for title, values, spec in every if any(v is not None for v in values)]
    peaks = [v for e in epochs if (v := as_number(e.get(PEAK_MEM_MB))) is not None]
    if peaks:
        parts += [f"Peak memory of the largest rank: {max(peaks):.0f} MiB (allocated CUDA memory on a GPU, resident "
                  f"memory on the CPU).", ""]
    named = [(n, e) for n, e, _ in epochs_in_order(line) if e.get(STRAGGLER_RANK) is not None]
    if named:
        parts += ["Stragglers (a rank more than 20% slower than the others in its own time over an epoch, "
                  "dptrain's docs/hangs.md says how it is measured): " + "; ".join(
                      f"epoch {n}: rank {e[STRAGGLER_RANK]} ({e.get(STRAGGLER_HOST)}), "
                      f"{as_number(e.get(STRAGGLER_SLOWER_PCT)) or 0:.0f}% slower in {e.get(STRAGGLER_PHASE)}"
                      for n, e in named) + ".", ""]
    if not columns:
        return parts + ["The epochs carry no per-rank numbers.", ""]
    ranks = max(len(values) for _, values, _ in columns)
    parts += ["Over the epochs: CPU and GPU utilisation and exposed communication are means, RSS and GPU memory the "
              "largest, the bytes of parameters, gradients and optimizer state the last epoch's.", ""]

    def cell(value: float | None, spec: str) -> str:
        return mib(value) if spec == "bytes" else fmt(value, spec)

    parts += ["| rank | " + " | ".join(title for title, _, _ in columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    if ranks <= RANKS_LISTED:
        for rank in range(ranks):
            parts.append(f"| {rank} | " + " | ".join(cell(values[rank] if rank < len(values) else None, spec)
                                                    for _, values, spec in columns) + " |")
    else:
        for label, combine in (("lowest", min), ("mean", statistics.fmean), ("highest", max)):
            parts.append(f"| {label} of {ranks} | " + " | ".join(
                cell(combine(known) if (known := [v for v in values if v is not None]) else None, spec)
                for _, values, spec in columns) + " |")
    return parts + [""]


def starts_section(line: Timeline, snapshots: list[Snapshot], latest: str | None) -> list[str]:
    parts = [f"## {SECTIONS[6]}", ""]
    if line.starts:
        parts += ["Each start of the run's processes (the first, then each resume or restart from the newest "
                  "snapshot):", "",
                  "| start | at (UTC) | from step | world size | device | agent restarts | SLURM restarts | ended | "
                  "wall time (s) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, s in enumerate(line.starts, start=1):
            wall = s.end_time - s.time if s.end_time is not None and s.time is not None else None
            parts.append(f"| {i} | {utc(s.time)} | {s.step} | {fmt(s.world_size, 'd')} | "
                         f"{md_text(s.device[:40]) or '-'} | {fmt(s.agent_restarts, 'd')} | "
                         f"{fmt(s.slurm_restarts, 'd')} | {md_text(s.ended)} | {fmt(wall, '.1f')} |")
        parts.append("")
    if not snapshots:
        return parts + ["No snapshot in checkpoints/.", ""]
    parts += ["Snapshots in checkpoints/, newest first, as their manifests say (`dptrain checkpoint list` verifies "
              "their files):", "", "| snapshot | step | world size | strategy | torch | |",
              "| --- | --- | --- | --- | --- | --- |"]
    for snap in snapshots[:SNAPSHOTS_LISTED]:
        note = "latest" if snap.name == latest else ""
        if snap.problem:
            note = f"{note}{'; ' if note else ''}{snap.problem}"
        parts.append(f"| {md_text(snap.name)} | {fmt(snap.step, 'd')} | {fmt(snap.world_size, 'd')} | "
                     f"{md_text(snap.strategy[:40]) or '-'} | {md_text(snap.torch[:40]) or '-'} | {md_text(note)} |")
    if len(snapshots) > SNAPSHOTS_LISTED:
        parts.append(f"| and {len(snapshots) - SNAPSHOTS_LISTED} older | | | | | |")
    return parts + [""]


# ---- the PNGs -------------------------------------------------------------------------------------------------------

def draw(line: Timeline, probes: dict[int, Probe], out: Path) -> set[str]:
    """The card's PNGs in `out`, each only when there is something to draw in it; the names of those drawn. No text
    from the run reaches a plot (matplotlib reads `$...$` in a label as mathematics)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display: set before pyplot is imported
    import matplotlib.pyplot as plt

    drawn = set()
    epochs = epochs_in_order(line)
    resumes = [s.step for s in line.starts[1:]]
    if epochs or line.steps:
        _loss_plot(plt, line, epochs, resumes, out / LOSS_PLOT)
        drawn.add(LOSS_PLOT)
    if epochs:
        _throughput_plot(plt, line, epochs, probes, out / THROUGHPUT_PLOT)
        drawn.add(THROUGHPUT_PLOT)
    if any(any(v is not None for v in as_per_rank(e.get(COMM_EXPOSED_MS_PER_STEP))) for _, e, _ in epochs):
        _comm_plot(plt, line, epochs, out / COMM_PLOT)
        drawn.add(COMM_PLOT)
    if any(as_per_rank(e.get(CPU_UTIL_PCT)) or as_per_rank(e.get(RSS_MAX_MB)) for _, e, _ in epochs):
        _util_plot(plt, epochs, out / UTIL_PLOT)
        drawn.add(UTIL_PLOT)
    return drawn


def _from_zero(ax: Any) -> None:
    """The y axis from 0, with room above the highest point (set_ylim(bottom=0) alone puts it on the top edge)."""
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08 or 1.0)


def _epoch_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are integers: no tick at 1.2
    ax.grid(True, alpha=0.3)


def _mark_resumes(ax: Any, resumes: list[int]) -> None:
    for i, step in enumerate(resumes):
        ax.axvline(step, linestyle=":", color="grey", label="resumed here" if i == 0 else None)


def _loss_plot(plt: Any, line: Timeline, epochs: list, resumes: list[int], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    if line.steps:
        steps = sorted(line.steps)
        left.plot(steps, [line.steps[s] for s in steps], ".-", color="tab:blue", alpha=0.5, linewidth=1,
                  label="step loss (logged steps)")
    for key, colour, label in ((TRAIN_LOSS, "tab:blue", "epoch train loss"),
                               (EVAL_LOSS, "tab:orange", "eval loss")):
        points = [(int(e[STEP]), v) for _, e, _ in epochs if (v := as_number(e.get(key))) is not None]
        if points:
            left.plot(*zip(*points), marker="o", color=colour, label=label)
    for key, colour, label in ((TRAIN_ACC, "tab:blue", "train accuracy"),
                               (EVAL_ACC, "tab:orange", "eval accuracy")):
        points = [(int(e[STEP]), v) for _, e, _ in epochs if (v := as_number(e.get(key))) is not None]
        if points:
            right.plot(*zip(*points), marker="o", color=colour, label=label)
    for ax, ylabel, title in ((left, "loss", "Loss"), (right, "accuracy", "Accuracy")):
        _mark_resumes(ax, resumes)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    save_figure(fig, path, plt)


def _throughput_plot(plt: Any, line: Timeline, epochs: list, probes: dict[int, Probe], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    numbers = [n for n, _, _ in epochs]
    left.plot(numbers, [e[TRAIN_SAMPLES] / e[EPOCH_TIME_S] for _, e, _ in epochs], marker="o")
    left.set_ylabel("images/s (all ranks, training steps)")
    left.set_title("Throughput per epoch")
    _from_zero(left)
    rates = [(n, rate, peak_for(probes, s)) for n, e, s in epochs if (rate := achieved_tflops(e)) is not None]
    if rates:
        right.plot([n for n, _, _ in rates], [r for _, r, _ in rates], marker="o", label="achieved TFLOPS")
        with_peak = [(n, r / p.peak_tflops) for n, r, p in rates if p is not None]
        if with_peak:
            twin = right.twinx()
            twin.plot(*zip(*with_peak), marker="s", color="tab:red", label="fraction of peak")
            twin.set_ylabel("fraction of the matmul peak")
            _from_zero(twin)
            # one legend for both axes: with the peak steady the two lines lie on top of each other
            handles = [h for ax in (right, twin) for h in ax.get_legend_handles_labels()[0]]
            right.legend(handles, [h.get_label() for h in handles], fontsize="small", loc="lower right")
        _from_zero(right)
    right.set_ylabel("achieved TFLOPS (model arithmetic)")
    right.set_title("Model TFLOPS per epoch" + (" and fraction of peak" if any(p for _, _, p in rates) else ""))
    for ax in (left, right):
        _epoch_axis(ax)
    save_figure(fig, path, plt)


def _per_rank_lines(ax: Any, epochs: list, values_of: Any) -> None:
    """One line per rank (up to RANKS_DRAWN), else the lowest, mean and highest over the ranks, per epoch."""
    numbers = [n for n, _, _ in epochs]
    rows = [values_of(e) for _, e, _ in epochs]
    ranks = max((len(r) for r in rows), default=0)
    if ranks <= RANKS_DRAWN:
        for rank in range(ranks):
            points = [(n, r[rank]) for n, r in zip(numbers, rows) if rank < len(r) and r[rank] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"rank {rank}")
    else:
        known = [(n, [v for v in r if v is not None]) for n, r in zip(numbers, rows)]
        known = [(n, v) for n, v in known if v]
        xs = [n for n, _ in known]
        ax.fill_between(xs, [min(v) for _, v in known], [max(v) for _, v in known], alpha=0.3,
                        label=f"lowest to highest of {ranks} ranks")
        ax.plot(xs, [statistics.fmean(v) for _, v in known], marker="o", label="mean over ranks")
    _epoch_axis(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _comm_plot(plt: Any, line: Timeline, epochs: list, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    numbers = [n for n, _, _ in epochs]
    left.plot(numbers, [step_ms(e, line.global_batch_size) for _, e, _ in epochs], marker="o", label="step time")
    for key, label in ((COMM_MS_PER_STEP, "communication (mean over ranks)"),
                       (COMM_EXPOSED_MS_PER_STEP, "exposed communication (mean over ranks)")):
        points = [(n, statistics.fmean(known)) for n, e, _ in epochs
                  if (known := [v for v in as_per_rank(e.get(key)) if v is not None])]
        if points:
            left.plot(*zip(*points), marker="o", label=label)
    _epoch_axis(left)
    left.set_ylabel("ms per step")
    left.set_title("Step time and its communication")
    _from_zero(left)
    left.legend(fontsize="small")
    _per_rank_lines(right, epochs, lambda e: [None if s is None else 100 * s for s in
                                              comm_shares(e, line.global_batch_size)])
    right.set_ylabel("exposed communication / step time (%)")
    right.set_title("Communication share per rank")
    _from_zero(right)
    save_figure(fig, path, plt)


def _util_plot(plt: Any, epochs: list, path: Path) -> None:
    gpu = any(as_per_rank(e.get(GPU_UTIL_MEAN_PCT)) for _, e, _ in epochs)
    panels = [(CPU_UTIL_PCT, "CPU utilisation (% of one core)", "CPU utilisation per rank"),
              (RSS_MAX_MB, "largest resident set (MiB)", "Resident memory per rank")]
    if gpu:
        panels += [(GPU_UTIL_MEAN_PCT, "GPU utilisation, mean (%)", "GPU utilisation per rank"),
                   (GPU_MEM_USED_MAX_MB, "GPU memory used, max (MiB)", "GPU memory per rank")]
    if any(as_per_rank(e.get(OWN_COMPUTE_MS_PER_STEP)) for _, e, _ in epochs):  # a straggler stands above the others
        panels += [(OWN_COMPUTE_MS_PER_STEP, "own compute a step (ms)", "Own compute per rank"),
                   (DATA_WAIT_MS_PER_STEP, "wait for data a step (ms)", "Data wait per rank")]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    for ax, (key, ylabel, title) in zip(axes.flat, panels):
        _per_rank_lines(ax, epochs, lambda e, key=key: as_per_rank(e.get(key)))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        _from_zero(ax)
    save_figure(fig, path, plt)
