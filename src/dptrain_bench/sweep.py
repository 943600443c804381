"""The sweep: one real `dptrain train` per (engine, strategy, workers, repeat), one at a time, each in its own folder.

    $ dptrain bench sweep --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3

Every point runs the same config in a subprocess under BENCH/runs/<engine>-<strategy>-w<W>-r<R>/ (its output in
bench.log there). With several engines, each runs the strategies it supports and skips the others; a worker count
that dptrain's strategy refuses (ps with a dedicated server at 1 worker) is skipped too: one line says which. Before
the points, the matmul probe (peak.py) of every worker count goes to BENCH/peak.json. A point is done when its
metrics.jsonl holds a run_end event; running the same command again runs the missing points only, after removing half-done folders. A failing point is recorded (bench_error.txt) and the
sweep goes on. With --slurm (jobs.py) every point is a SLURM job instead, of the shape job_shape gives it, the other
engines' too (one torchrun per node); --nodes 1,2,4 then sweeps node counts instead of worker counts (node_sweep).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from dptrain import config as config_mod
from dptrain import read_back
from dptrain_bench import deepspeed_engine, lightning_engine, peak, tutorial
from dptrain_bench.folder import ERROR_FILE, LOG_FILE, SWEEP_FILE, SWEEPS_DIR, BenchFolder
from dptrain.config import RunConfig, SlurmConfig
from dptrain.errors import ConfigError
from dptrain.files import written_atomically
from dptrain.read_back import UnreadableFile
from dptrain.run_folder import RunFolder

log = logging.getLogger(__name__)

# The engines other than `dptrain train`: a module each, run under torchrun as `python -m MODULE RUN_DIR` (engines.py), whose
# STRATEGIES are those it runs and whose check(cfg) refuses in one sentence what it cannot run. tutorial: the
# tutorials' plain loop, the baseline.
OTHER_ENGINES: dict[str, ModuleType] = {"tutorial": tutorial, "lightning": lightning_engine, "deepspeed": deepspeed_engine}
ENGINES = ("dptrain", *OTHER_ENGINES)
DEFAULT_WORKERS = (1, 2, 4, 8)
DEFAULT_RUN_TIMEOUT_S = 3600.0
# Options the sweep sets per point: given to `dptrain bench`, they would silently make every point the same.
OWNED = {"strategy.name": "--strategies", "launch.nproc_per_node": "--workers", "output.name": "--output.dir"}


@dataclass(frozen=True)
class Point:
    engine: str
    strategy: str
    workers: int
    repeat: int

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.strategy}-w{self.workers}-r{self.repeat}"


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """A validated sweep: what to run, where, and the train options every point shares."""

    bench_dir: Path
    engines: tuple[str, ...]
    strategies: tuple[str, ...]
    workers: tuple[int, ...]
    repeats: int
    warmup_epochs: int
    """Leading epochs of each run left out of the timing columns (start-up, allocator and cache warm-up)."""
    run_timeout_s: float
    train_args: tuple[str, ...]
    """--section.option VALUE pairs (and --config FILE) passed to every `dptrain train`."""
    config: RunConfig
    """The shared config as resolved here (strategy ddp, one worker), recorded in sweep.json."""
    config_path: str | None = None
    train_pairs: tuple[tuple[str, str], ...] = ()
    """The --section.option VALUE pairs of every run, as given (train_args holds them as arguments)."""
    job: SlurmConfig | None = None
    """With --slurm: the job options every point's job starts from (job_shape fits them to its worker count)."""
    one_at_a_time: bool = False
    """With --slurm: submit each point's job once the one before has ended (nodes sharing one machine's cores)."""
    skip: frozenset[tuple[str, str, int]] = frozenset()
    """(engine, strategy, workers) left out of the plan: a strategy the engine does not run, or a worker count
    dptrain's strategy refuses (sweep_from_options's notes say which and why)."""

    def run_dir(self, point: Point) -> Path:
        return BenchFolder(self.bench_dir).point(point.name)


def split_list(text: str, option: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise ConfigError(f"{option} is empty; give a comma-separated list, for example {option} 1,2.")
    return items


def parse_counts(text: str, option: str, what: str) -> tuple[int, ...]:
    """A comma-separated list of counts of 1 or more (--workers, --nodes), sorted, each once."""
    try:
        counts = tuple(int(s) for s in split_list(text, option))
    except ValueError:
        raise ConfigError(f"{option} {text} is not a comma-separated list of integers; for example {option} "
                          f"1,2,4.") from None
    if any(c < 1 for c in counts):
        raise ConfigError(f"{option} {text} holds a count below 1; give {what} counts of 1 or more.")
    return tuple(sorted(set(counts)))


def parse_workers(text: str) -> tuple[int, ...]:
    return parse_counts(text, "--workers", "worker")


def node_sweep(nodes: str, workers: str | None) -> tuple[int, tuple[int, ...] | None]:
    """(the most nodes a point may take, the node counts to sweep) of bench's --nodes: `--nodes 1,2,4` runs every
    point on that many whole nodes; with --workers, --nodes is one number, the most nodes (job_shape), and there
    are no node counts of its own (None)."""
    counts = parse_counts(nodes, "--nodes", "node")
    if workers is None:
        return max(counts), counts
    if len(counts) > 1:
        raise ConfigError(f"--nodes {nodes} sweeps node counts and --workers {workers} sweeps worker counts; give one "
                          f"of them (with --workers, --nodes is one number: the most nodes a point may take).")
    return counts[0], None


def check_engines(engines: tuple[str, ...]) -> None:
    for engine in engines:
        if engine not in ENGINES:
            raise ConfigError(f"--engines {engine} is unknown; supported engines: {', '.join(ENGINES)}.")


def unsupported_pairs(engines: tuple[str, ...], strategies: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (engine, strategy) pairs a sweep of several engines skips: the strategies another engine does not run. An engine
    that runs none of them is refused in one sentence; a sweep of one engine skips nothing (its check refuses what it
    does not run: the pairing was asked for by name)."""
    if len(engines) < 2:
        return []
    skipped = []
    for engine in engines:
        if engine not in OTHER_ENGINES:
            continue
        runs = OTHER_ENGINES[engine].STRATEGIES
        missing = [s for s in strategies if s not in runs]
        if len(missing) == len(strategies):
            raise ConfigError(f"--engines {engine} runs strategies {', '.join(runs)} only, none of --strategies "
                              f"{','.join(strategies)}; add one of them to --strategies or drop {engine} from --engines.")
        skipped += [(engine, s) for s in missing]
    return skipped


def refused_worlds(cfgs: dict[str, RunConfig], counts: tuple[int, ...], on_cpu: bool) -> dict[tuple[str, int], str]:
    """(strategy, workers) -> why, for the worker counts a dptrain strategy refuses (its Strategy.check_world, as every
    run checks it); a strategy refused at every count is refused in one sentence."""
    import torch

    from dptrain.strategies.registry import STRATEGIES  # imports torch: only once a sweep is planned

    refused: dict[tuple[str, int], str] = {}
    for name, cfg in cfgs.items():
        reasons = {}
        for w in counts:
            try:
                STRATEGIES[name].check_world(cfg.strategy, w, on_cpu, torch.__version__)
            except ConfigError as e:
                reasons[w] = str(e)
        if counts and len(reasons) == len(counts):
            raise ConfigError(reasons[counts[0]])
        refused |= {(name, w): why for w, why in reasons.items()}
    return refused


def runs_on_cpu(cfg: RunConfig, slurm: bool) -> bool:
    """Whether the points' workers run on the CPU: a job's on the GPUs it asks for, here on what launch.device gives."""
    if slurm:
        return not (cfg.slurm.gpus_here > 0 and cfg.launch.device != "cpu")  # an --sbatch gres=gpu:N line counts
    from dptrain.runtime import wants_cuda

    return not wants_cuda(cfg.launch.device)


def default_warmup(epochs: int) -> int:
    """One warm-up epoch when there is more than one, else none (a single epoch is all there is to time)."""
    return 1 if epochs > 1 else 0


def worker_cap(device: str) -> tuple[int, str]:
    """(workers this machine runs without oversubscribing, in words): GPUs on a GPU run, CPU cores on the CPU."""
    from dptrain.runtime import wants_cuda

    if wants_cuda(device):
        import torch

        return torch.cuda.device_count(), "GPUs"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU cores"


def cap_workers(workers: tuple[int, ...], cap: int, what: str) -> tuple[tuple[int, ...], str | None]:
    """The worker counts that fit, and one line naming the dropped ones (None when none is)."""
    kept = tuple(w for w in workers if w <= cap)
    dropped = [w for w in workers if w > cap]
    if not dropped:
        return kept, None
    return kept, (f"dropped workers {','.join(map(str, dropped))}: this machine has {cap} {what} "
                  f"(one worker each); ask for them with --workers to run them oversubscribed")


def job_shape(workers: int, job: SlurmConfig) -> SlurmConfig:
    """The job of a point of `workers` ranks, from the sweep's job options: R ranks per node (--ranks-per-node, else
    --gpus-per-node, else 1, as dptrain submit) on workers / R nodes; below R workers, one node with that many ranks
    and their share of its GPUs and cores. --nodes is the most nodes a point may take."""
    per_node = job.ranks_here
    if workers < per_node:  # part of one node: each rank keeps the GPUs and cores it has on a full node
        asked = job.sbatch_gpus_per_node()
        if asked is not None:  # the line asks for a whole node's GPUs, and the job would hold them for fewer ranks
            raise ConfigError(f"{workers} workers take part of a node of {per_node} ranks, but slurm.sbatch's {asked[0]} "
                              f"asks for a whole node's GPUs; ask for them with --gpus-per-node N instead, which a "
                              f"point on part of a node shares out, or give worker counts of {per_node} or more.")
        nodes, ranks = 1, workers
        gpus = -(-job.gpus_per_node * workers // per_node)
        cpus = job.cpus_per_node // per_node * workers
    elif workers % per_node:
        raise ConfigError(f"{workers} workers do not fill whole nodes of {per_node} ranks (--ranks-per-node, else "
                          f"--gpus-per-node); give worker counts below {per_node} or multiples of {per_node}.")
    else:
        nodes, ranks, gpus, cpus = workers // per_node, per_node, job.gpus_per_node, job.cpus_per_node
    if nodes > job.nodes:
        raise ConfigError(f"{workers} workers take {nodes} nodes of {per_node} rank{'s' if per_node > 1 else ''} and "
                          f"--nodes is {job.nodes}; give --nodes {nodes}, or drop {workers} from --workers.")
    return replace(job, nodes=nodes, ranks_per_node=ranks, gpus_per_node=gpus, cpus_per_node=cpus)


def cap_jobs(workers: tuple[int, ...], job: SlurmConfig) -> tuple[tuple[int, ...], str | None]:
    """The default worker counts that a job of at most --nodes nodes runs, and one line naming the dropped ones."""
    kept, dropped = [], []
    for w in workers:
        try:
            job_shape(w, job)
            kept.append(w)
        except ConfigError:
            dropped.append(w)
    if not dropped:
        return tuple(kept), None
    return tuple(kept), (f"dropped workers {','.join(map(str, dropped))}: --nodes {job.nodes} x {job.ranks_here} ranks per "
                         f"node do not hold them; ask for them with --workers and --nodes")


def sweep_from_options(*, config_path: str | None, pairs: list[tuple[str, str]], workers: str | None, strategies: str,
          repeats: int, warmup_epochs: int | None, engines: str, run_timeout_s: float,
          job_pairs: list[tuple[str, str]] | None = None,
          job_lines: dict[str, tuple[str, ...]] | None = None, nodes: str | None = None,
          one_at_a_time: bool = False) -> tuple[Sweep, list[str]]:
    """Check the sweep's options and the shared train options once, before any run; (sweep, notes to print).
    job_pairs: the job options as slurm.* pairs, for a sweep of SLURM jobs (None: runs here); job_lines: the --setup
    and --sbatch lines given, which replace the file's; nodes: bench's --nodes as given (node_sweep reads it);
    one_at_a_time: --one-at-a-time, for a sweep of jobs."""
    if one_at_a_time and job_pairs is None:
        raise ConfigError("--one-at-a-time submits a --slurm sweep's jobs one after another (a sweep here runs its "
                          "points one at a time anyway); add --slurm, or drop it.")
    notes: list[str] = []
    node_counts = None
    if nodes is not None and job_pairs is not None:
        most, node_counts = node_sweep(nodes, workers)
        job_pairs = [*job_pairs, ("slurm.nodes", str(most))]
    bench_dir: Path | None = None
    train_pairs = []
    for key, value in pairs:
        if key == "output.dir":
            bench_dir = Path(value)
        elif key in OWNED:
            raise ConfigError(f"--{key} is set by the sweep for each point; use {OWNED[key]} instead.")
        else:
            train_pairs.append((key, value))
    engine_names = split_list(engines, "--engines")
    check_engines(engine_names)
    others = [engine for engine in engine_names if engine in OTHER_ENGINES]
    strategy_names = split_list(strategies, "--strategies")
    skipped_pairs = unsupported_pairs(engine_names, strategy_names)
    point_cfgs = {}
    for name in strategy_names:  # every strategy with the shared options: a mistake is one sentence now, not N failures
        point_cfgs[name] = config_mod.load(config_path, [*train_pairs, ("strategy.name", name)])
        for engine in others:
            if (engine, name) not in skipped_pairs:
                OTHER_ENGINES[engine].check(point_cfgs[name])
    cfg = config_mod.load(config_path, [*train_pairs, *(job_pairs or [])])
    if job_pairs is not None and job_lines:  # lines on the command line replace the file's lists
        cfg = replace(cfg, slurm=replace(cfg.slurm, **job_lines))
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats} is below 1; give 1 or more.")
    if run_timeout_s <= 0:
        raise ConfigError(f"--run-timeout-s {run_timeout_s} is not positive; give the seconds one run may take.")
    warmup = default_warmup(cfg.train.epochs) if warmup_epochs is None else warmup_epochs
    if not 0 <= warmup < cfg.train.epochs:
        raise ConfigError(f"--warmup-epochs {warmup} leaves no timed epoch of train.epochs {cfg.train.epochs}; "
                          f"give fewer warm-up epochs (0 to {cfg.train.epochs - 1}) or more --train.epochs.")
    if node_counts:  # whole nodes of R ranks each (--ranks-per-node, else --gpus-per-node, else 1)
        counts = tuple(n * cfg.slurm.ranks_here for n in node_counts)
    elif workers is None and job_pairs is not None:
        counts, dropped = cap_jobs(DEFAULT_WORKERS, cfg.slurm)
        if dropped:
            notes.append(dropped)
        if not counts:
            job_shape(DEFAULT_WORKERS[0], cfg.slurm)  # one sentence: why not even one worker fits
    elif workers is None:
        cap, what = worker_cap(cfg.launch.device)
        counts, dropped = cap_workers(DEFAULT_WORKERS, cap, what)
        if dropped:
            notes.append(dropped)
    else:
        counts = parse_workers(workers)
    if job_pairs is not None:
        for w in counts:
            job_shape(w, cfg.slurm)
    gb = cfg.train.global_batch_size
    for w in counts:
        if gb % w:
            drop = f"{w // cfg.slurm.ranks_here} from --nodes" if node_counts else f"{w} from --workers"
            raise ConfigError(f"train.global_batch_size {gb} is not divisible by {w} workers; "
                              f"choose a multiple of {w}, or drop {drop}.")
    refused = {}
    if "dptrain" in engine_names:
        refused = refused_worlds(point_cfgs, counts, runs_on_cpu(cfg, job_pairs is not None))
    if skipped_pairs:
        notes.append("skipped the strategies these engines do not run: "
                     + ", ".join(f"{engine} {strategy}" for engine, strategy in skipped_pairs))
    if refused:
        notes.append("skipped the worker counts dptrain's strategy refuses: " + "; ".join(
            f"dptrain {s} at {w} worker{'s' if w > 1 else ''} ({why})" for (s, w), why in refused.items()))
    skip = {(e, s, w) for e, s in skipped_pairs for w in counts} | {("dptrain", s, w) for s, w in refused}
    train_args: list[str] = ["--config", str(Path(config_path).resolve())] if config_path else []
    for key, value in train_pairs:
        train_args += [f"--{key}", value]
    sweep = Sweep(bench_dir=bench_dir or SWEEPS_DIR / cfg.data.name, engines=engine_names,
                  strategies=strategy_names, workers=counts, repeats=repeats, warmup_epochs=warmup,
                  run_timeout_s=run_timeout_s, train_args=tuple(train_args), config=cfg, config_path=config_path,
                  train_pairs=tuple(train_pairs), job=cfg.slurm if job_pairs is not None else None,
                  one_at_a_time=one_at_a_time, skip=frozenset(skip))
    return sweep, notes


def plan(sweep: Sweep) -> list[Point]:
    """Repeat-major, and every other repeat in reverse order: drift on a shared machine spreads over all the points
    instead of landing on the last worker count."""
    points: list[Point] = []
    for repeat in range(1, sweep.repeats + 1):
        one = [Point(e, s, w, repeat) for w in sweep.workers for s in sweep.strategies for e in sweep.engines
               if (e, s, w) not in sweep.skip]
        points += one if repeat % 2 else one[::-1]
    return points


def describe_plan(sweep: Sweep, points: list[Point]) -> str:
    """'N points (E engines x S strategies x workers ... x R repeats[, K skipped])', for the sweep's first log line."""
    skipped = len(sweep.engines) * len(sweep.strategies) * len(sweep.workers) * sweep.repeats - len(points)
    return (f"{len(points)} points ({len(sweep.engines)} engines x {len(sweep.strategies)} strategies x workers "
            f"{','.join(map(str, sweep.workers))} x {sweep.repeats} repeats{f', {skipped} skipped' if skipped else ''})")


def read_events(run_dir: Path) -> list[dict]:
    """metrics.jsonl's events (read_back.read_json_lines: bounded; a line cut short by a killed run is skipped)."""
    return read_back.read_json_lines(RunFolder(run_dir).metrics)[0]


def is_done(run_dir: Path) -> bool:
    """Ended with a run_end event, and its command exited 0 (no bench_error.txt)."""
    return not (run_dir / ERROR_FILE).exists() and any(e.get("event") == "run_end" for e in read_events(run_dir))


def sweep_record(sweep: Sweep) -> dict:
    """What makes two sweeps comparable: the shared config, per-point options left out; and the warm-up."""
    tree = json.loads(json.dumps(config_mod.to_dict(sweep.config)))
    return {"config": shared_options(tree), "train_args": list(sweep.train_args), "warmup_epochs": sweep.warmup_epochs,
            "slurm": sweep.job is not None}


def shared_options(tree: dict) -> dict:
    """A config tree without the options a point sets itself, which two comparable sweeps may differ in."""
    # slurm.nodes: the most nodes a point may take; a point's job does not depend on it (job_shape)
    for section, key in (("strategy", "name"), ("launch", "nproc_per_node"), ("slurm", "nodes")):
        if isinstance(tree.get(section), dict):
            tree[section].pop(key, None)
    tree.pop("output", None)
    return tree


def check_and_record(sweep: Sweep) -> None:
    """A resumed sweep must share the runs' config: a mix would be no comparison. The warm-up may change (it only
    selects epochs when collecting)."""
    path = sweep.bench_dir / SWEEP_FILE
    record = sweep_record(sweep)
    earlier = None
    try:
        earlier = read_back.read_json(path, lambda value: value, advice="delete it to start the sweep afresh, or "
                                      "choose another --output.dir")
    except FileNotFoundError:
        pass
    if earlier is not None:
        # config_mod.upgraded: a sweep recorded before the strategy tables wrote strategy.comm_hook for strategy.ddp.comm_hook
        recorded = config_mod.upgraded(earlier.get("config")) if isinstance(earlier, dict) else None
        if isinstance(earlier, dict) and (not isinstance(recorded, dict) or shared_options(recorded) != record["config"]):
            raise ConfigError(f"{sweep.bench_dir} holds a sweep with other train options; run it with the same options "
                              f"to resume it, or choose another --output.dir.")
        if isinstance(earlier, dict) and bool(earlier.get("slurm")) != record["slurm"]:
            where = ("as SLURM jobs", "without --slurm") if earlier.get("slurm") else ("on this machine", "with --slurm")
            raise ConfigError(f"{sweep.bench_dir} holds a sweep run {where[0]}; run it {where[1]} to resume it, or "
                              f"choose another --output.dir.")
    sweep.bench_dir.mkdir(parents=True, exist_ok=True)
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


def read_warmup(bench_dir: Path) -> int | None:
    """sweep.json's warm-up epochs; None where it has none (collect then takes its default)."""
    def take(value: Any) -> int:
        data = read_back.mapping(value, "the file")
        return read_back.integer(read_back.field(data, "warmup_epochs", "the file"), "warmup_epochs", 0, 1 << 20)

    try:
        return read_back.read_json(bench_dir / SWEEP_FILE, take)
    except (FileNotFoundError, UnreadableFile):
        return None


def train_command(sweep: Sweep, point: Point, run_dir: Path) -> list[str]:
    """The command that runs one point (for another engine, after writing the point's config.toml)."""
    if point.engine in OTHER_ENGINES:
        cfg = sweep.config
        cfg = replace(cfg, strategy=replace(cfg.strategy, name=point.strategy),
                      launch=replace(cfg.launch, nproc_per_node=point.workers), output=replace(cfg.output, dir=str(run_dir)))
        with written_atomically(RunFolder(run_dir).config) as tmp:
            tmp.write_text(config_mod.to_toml(cfg))
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(point.workers),
                "-m", OTHER_ENGINES[point.engine].__name__, str(run_dir)]
    # no epoch snapshots: saving is not what is measured (the user's --checkpoint.every_epochs, given later, wins)
    return [sys.executable, "-m", "dptrain", "train", "--nproc-per-node", str(point.workers),
            "--checkpoint.every_epochs", "0", *sweep.train_args,
            "--strategy.name", point.strategy, "--output.dir", str(run_dir)]


def error_line(output: str) -> str | None:
    """The line that says why a run failed: dptrain's own `dptrain: error: ...`; else the first exception raised in a
    worker; else torchrun's root cause (a signal, say); None when there is none of them."""
    # torchrun prefixes a worker's lines that reach it with "[rank0]: "
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("dptrain:"):
            return line
    for line in lines:
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Failure)\b", line) and "ChildFailedError" not in line:
            return line
    causes = [m[1] for line in lines if (m := re.match(r"^traceback\s*:\s*(.+)", line))]
    if causes:  # torchrun's summary lists the root cause (the first observed failure) last
        return f"worker failed: {causes[-1]}"
    return None


def last_line(output: str) -> str | None:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else None


def first_error(output: str, returncode: int) -> str:
    """error_line, else the exit status and the last line of output."""
    found = error_line(output)
    if found is not None:
        return found
    last = last_line(output)
    return f"exit status {returncode}" + (f"; last output: {last}" if last else "")


def stop_run(proc: subprocess.Popen) -> None:
    """End the run and the workers it started: they share its process group (start_new_session)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_point(sweep: Sweep, point: Point) -> str | None:
    """Run one point in a fresh folder; None when it ended with run_end, else the one-line error (also in
    bench_error.txt)."""
    run_dir = sweep.run_dir(point)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # half done: a fresh start, never a resume from a partial run
    RunFolder(run_dir).logs.mkdir(parents=True)  # a run's folder, which `dptrain train --output.dir` takes as one
    command = train_command(sweep, point, run_dir)
    # the command's output as it runs (tail -f), so not written atomically; the folder was made afresh just above
    with (run_dir / LOG_FILE).open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            returncode = proc.wait(timeout=sweep.run_timeout_s)
            error = None if returncode == 0 and is_done(run_dir) else "pending"
        except subprocess.TimeoutExpired:
            stop_run(proc)
            returncode, error = proc.returncode, f"timed out after {sweep.run_timeout_s:g} s (--run-timeout-s)"
        except BaseException:  # Ctrl-C: leave no workers behind; the half-done folder is redone on resume
            stop_run(proc)
            raise
    if error == "pending":
        error = first_error((run_dir / LOG_FILE).read_text(errors="replace"), returncode)
    if error:
        with written_atomically(run_dir / ERROR_FILE) as tmp:
            tmp.write_text(error + "\n")
    return error


def record_peaks(sweep: Sweep) -> None:
    """The matmul probe (peak.py) of every worker count not yet in BENCH/peak.json, on the points' device and dtype
    (bfloat16 with train.bf16): once per sweep and worker count, since W ranks sharing a machine's cores and memory
    get neither W times one process's peak nor one process's. A probe that fails leaves the columns empty."""
    from dptrain.runtime import wants_cuda

    device: peak.Device = "cuda" if wants_cuda(sweep.config.launch.device) else "cpu"
    dtype: peak.Dtype = "bfloat16" if sweep.config.train.bf16 else "float32"
    start = time.perf_counter()
    try:
        probes, measured = peak.record(sweep.bench_dir, device, dtype, sweep.workers)
    except RuntimeError as e:
        log.info(f"bench: {e}; peak_tflops and fraction_of_peak stay empty")
        return
    if measured:
        log.info(f"bench: matmul peak ({device}, {dtype}) in {time.perf_counter() - start:.1f} s: "
                 + ", ".join(f"{probes[w].peak_tflops:.3g} TFLOPS with {w} worker{'s' if w > 1 else ''}" for w in measured)
                 + f" ({BenchFolder(sweep.bench_dir).peak})")


def adopt_probes(source: Path, bench_dir: Path) -> list[str]:
    """--probes-from: this machine's matmul, link and hook probes (peak.json, link.json, hooks.json) from an earlier
    sweep's folder,
    copied into bench_dir where it has none of its own, so that the sweep probes only what they lack (about 10 s
    saved a sweep on 2 cores). The names copied; ConfigError in one sentence where source holds neither file in a
    form the bench reads (only JSON is read: nothing there can run code)."""
    from dptrain_bench import hook_probe, link

    try:  # each file read whole and checked, value by value: a planted one is refused, not copied
        readable = {peak.PEAK_FILE: bool(peak.load_peaks(source)), link.LINK_FILE: link.load_link(source) is not None,
                    hook_probe.HOOKS_FILE: hook_probe.read_hooks(source) is not None}
    except UnreadableFile as exc:
        raise ConfigError(f"--probes-from {source}: {exc.path.name} {exc.problem}; give the folder of an earlier sweep "
                          f"on this machine, or drop --probes-from to probe afresh.") from None
    if not any(readable.values()):
        raise ConfigError(f"--probes-from {source} holds no {peak.PEAK_FILE} or {link.LINK_FILE} a sweep wrote; give "
                          f"the folder of an earlier sweep on this machine, or drop it to probe afresh.")
    copied = []
    for name, ok in readable.items():
        if ok and not (bench_dir / name).exists():  # the sweep's own probes are kept
            bench_dir.mkdir(parents=True, exist_ok=True)
            with written_atomically(bench_dir / name) as tmp:
                tmp.write_bytes(read_back.read_bytes(source / name))
            copied.append(name)
    return copied


def record_link(sweep: Sweep) -> None:
    """The link probe (link.py) between the ranks of this machine, for every worker count above 1 not yet in
    BENCH/link.json: the report's scaling model times the strategies' collectives with its fit. A probe that fails
    leaves the report without the model."""
    from dptrain_bench import link
    from dptrain.runtime import wants_cuda

    worlds = tuple(w for w in sweep.workers if w > 1)
    if not worlds:
        return
    try:
        link.record(sweep.bench_dir, "cuda" if wants_cuda(sweep.config.launch.device) else "cpu", worlds)
    except RuntimeError as e:
        log.info(f"bench: {e}; the report draws no scaling model")


def hooks_wanted(sweep: Sweep) -> Any:
    """The hook probe (hook_probe.py) a sweep needs: where one of its dptrain strategies exchanges in a way of its own
    (a compressing comm hook, local SGD's averaging, DiLoCo's outer step), its model, a rank's batch at the fewest
    ranks above one and a rank's threads; None where none does."""
    from dptrain_bench import hook_probe
    from dptrain_bench.scaling_model import STRATEGIES as MODEL_STRATEGIES, Plan

    hook = sweep.config.strategy.ddp.comm_hook
    keyed = [s for s in sweep.strategies if "dptrain" in sweep.engines and s in MODEL_STRATEGIES
             and Plan(strategy=s, comm_hook=hook if config_mod.SPECS[s].table == "ddp" else "allreduce").own_cpu_key]
    if not keyed:
        return None
    from dptrain.data import describe

    info = describe(sweep.config.data)
    ranks = min((w for w in sweep.workers if w > 1), default=2)
    if sweep.job is not None:
        threads = max(1, (sweep.job.cpus_per_node or 1) // max(1, sweep.job.ranks_here))
    else:
        threads = peak.cpu_threads(peak.usable_cores(), ranks)
    return hook_probe.HookProbe(model=sweep.config.model.name, image_shape=tuple(info.image_shape),
                                num_classes=info.num_classes, batch=hook_probe.batch_per_rank(
                                    sweep.config.train.global_batch_size, ranks), threads=threads,
                                powersgd_rank=sweep.config.strategy.ddp.powersgd_rank, cpu_s={})


def record_hooks(sweep: Sweep) -> None:
    """The hook probe into BENCH/hooks.json where the sweep needs one (hooks_wanted), on this machine (a --slurm
    sweep's nodes are taken to be like it): the scaling model's CPU of a hook's or an averaging's own work. A probe
    that fails leaves it out of the model, saying so."""
    from dptrain_bench import hook_probe

    wanted = hooks_wanted(sweep)
    if wanted is None:
        return
    start = time.perf_counter()
    try:
        probe = hook_probe.record(sweep.bench_dir, wanted)
    except RuntimeError as e:
        log.info(f"bench: {e}; the model takes the hooks and averagings to cost no CPU of their own")
        return
    log.info(f"bench: hook probe ({time.perf_counter() - start:.1f} s): {hook_probe.describe(probe)}")


def run_sweep(sweep: Sweep) -> list[tuple[Point, str]]:
    """Run every missing point, one at a time; the failures, as (point, error)."""
    check_and_record(sweep)
    points = plan(sweep)
    todo = [p for p in points if not is_done(sweep.run_dir(p))]
    log.info(f"bench: {describe_plan(sweep, points)} in {sweep.bench_dir}; {len(points) - len(todo)} done already, "
             f"{len(todo)} to run")
    record_peaks(sweep)
    record_link(sweep)
    record_hooks(sweep)
    failures = []
    for i, point in enumerate(todo, 1):
        start = time.perf_counter()
        error = run_point(sweep, point)
        took = time.perf_counter() - start
        if error:
            failures.append((point, error))
            log.info(f"bench: [{i}/{len(todo)}] {point.name} failed after {took:.1f} s: {error}")
        else:
            log.info(f"bench: [{i}/{len(todo)}] {point.name} done in {took:.1f} s")
    return failures
