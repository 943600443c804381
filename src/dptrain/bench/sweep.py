"""The sweep: one real `dptrain train` per (engine, strategy, workers, repeat), one at a time, each in its own folder.

    $ dptrain bench --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir bench/fmnist --train.epochs 3

Every point runs the same config in a subprocess under BENCH/runs/<engine>-<strategy>-w<W>-r<R>/ (its output in
bench.log there). A point is done when its metrics.jsonl holds a run_end event; running the same command again runs
the missing points only, after removing half-done folders. A failing point is recorded (bench_error.txt) and the
sweep goes on.
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

from dptrain import config as config_mod
from dptrain.bench import tutorial
from dptrain.config import ConfigError, RunConfig

log = logging.getLogger(__name__)

ENGINES = ("dptrain", "tutorial")  # tutorial: the tutorials' plain loop (tutorial.py), the baseline
NOT_YET_ENGINES = ("lightning", "deepspeed")
DEFAULT_WORKERS = (1, 2, 4, 8)
DEFAULT_STRATEGIES = ("ddp", "fsdp")
SWEEP_FILE = "sweep.json"  # the sweep's config, so that a resumed sweep runs the same runs and collect knows the warm-up
LOG_FILE = "bench.log"
ERROR_FILE = "bench_error.txt"
POINT_NAME = re.compile(r"^(?P<engine>[a-z0-9_]+)-(?P<strategy>[a-z0-9_]+)-w(?P<workers>\d+)-r(?P<repeat>\d+)$")
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

    def run_dir(self, point: Point) -> Path:
        return self.bench_dir / "runs" / point.name


def split_list(text: str, option: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise ConfigError(f"{option} is empty; give a comma-separated list, for example {option} 1,2.")
    return items


def parse_workers(text: str) -> tuple[int, ...]:
    try:
        workers = tuple(int(s) for s in split_list(text, "--workers"))
    except ValueError:
        raise ConfigError(f"--workers {text} is not a comma-separated list of whole numbers; for example --workers 1,2,4.") from None
    if any(w < 1 for w in workers):
        raise ConfigError(f"--workers {text} holds a count below 1; give worker counts of 1 or more.")
    return tuple(sorted(set(workers)))


def check_engines(engines: tuple[str, ...]) -> None:
    for engine in engines:
        if engine in NOT_YET_ENGINES:
            raise ConfigError(f"--engines {engine} is not yet supported; supported engines: {', '.join(ENGINES)}.")
        if engine not in ENGINES:
            raise ConfigError(f"--engines {engine} is unknown; supported engines: {', '.join(ENGINES)}.")


def default_warmup(epochs: int) -> int:
    """One warm-up epoch when there is more than one, else none (a single epoch is all there is to time)."""
    return 1 if epochs > 1 else 0


def worker_cap(device: str) -> tuple[int, str]:
    """(workers this machine runs without oversubscribing, in words): GPUs on a GPU run, CPU cores on the CPU."""
    from dptrain.runtime import wants_cuda  # imports torch: only once a sweep is planned

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


def build(*, config_path: str | None, pairs: list[tuple[str, str]], workers: str | None, strategies: str,
          repeats: int, warmup_epochs: int | None, engines: str, run_timeout_s: float) -> tuple[Sweep, list[str]]:
    """Check the sweep's options and the shared train options once, before any run; (sweep, notes to print)."""
    notes: list[str] = []
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
    strategy_names = split_list(strategies, "--strategies")
    for name in strategy_names:  # every strategy with the shared options: a mistake is one sentence now, not N failures
        point_cfg = config_mod.load(config_path, [*train_pairs, ("strategy.name", name)])
        if "tutorial" in engine_names:
            tutorial.check(point_cfg)
    cfg = config_mod.load(config_path, train_pairs)
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats} is below 1; give 1 or more.")
    if run_timeout_s <= 0:
        raise ConfigError(f"--run-timeout-s {run_timeout_s} is not positive; give the seconds one run may take.")
    warmup = default_warmup(cfg.train.epochs) if warmup_epochs is None else warmup_epochs
    if not 0 <= warmup < cfg.train.epochs:
        raise ConfigError(f"--warmup-epochs {warmup} leaves no timed epoch of train.epochs {cfg.train.epochs}; "
                          f"give fewer warm-up epochs (0 to {cfg.train.epochs - 1}) or more --train.epochs.")
    if workers is None:
        cap, what = worker_cap(cfg.launch.device)
        counts, dropped = cap_workers(DEFAULT_WORKERS, cap, what)
        if dropped:
            notes.append(dropped)
    else:
        counts = parse_workers(workers)
    gb = cfg.train.global_batch_size
    for w in counts:
        if gb % w:
            raise ConfigError(f"train.global_batch_size {gb} is not divisible by {w} workers; "
                              f"choose a multiple of {w}, or drop {w} from --workers.")
    train_args: list[str] = ["--config", str(Path(config_path).resolve())] if config_path else []
    for key, value in train_pairs:
        train_args += [f"--{key}", value]
    sweep = Sweep(bench_dir=bench_dir or Path("bench") / cfg.data.name, engines=engine_names,
                  strategies=strategy_names, workers=counts, repeats=repeats, warmup_epochs=warmup,
                  run_timeout_s=run_timeout_s, train_args=tuple(train_args), config=cfg)
    return sweep, notes


def plan(sweep: Sweep) -> list[Point]:
    """Repeat-major, and every other repeat in reverse order: drift on a shared machine spreads over all the points
    instead of landing on the last worker count."""
    points: list[Point] = []
    for repeat in range(1, sweep.repeats + 1):
        one = [Point(e, s, w, repeat) for w in sweep.workers for s in sweep.strategies for e in sweep.engines]
        points += one if repeat % 2 else one[::-1]
    return points


def read_events(run_dir: Path) -> list[dict]:
    """metrics.jsonl's events; a line cut short by a killed run is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def is_done(run_dir: Path) -> bool:
    """Ended with a run_end event, and its command exited 0 (no bench_error.txt)."""
    return not (run_dir / ERROR_FILE).exists() and any(e.get("event") == "run_end" for e in read_events(run_dir))


def sweep_record(sweep: Sweep) -> dict:
    """What makes two sweeps comparable: the shared config, per-point options left out; and the warm-up."""
    tree = json.loads(json.dumps(config_mod.to_dict(sweep.config)))
    tree["strategy"].pop("name")
    tree["launch"].pop("nproc_per_node")
    tree.pop("output")
    return {"config": tree, "train_args": list(sweep.train_args), "warmup_epochs": sweep.warmup_epochs}


def check_and_record(sweep: Sweep) -> None:
    """A resumed sweep must share the runs' config: a mix would be no comparison. The warm-up may change (it only
    selects epochs when collecting)."""
    path = sweep.bench_dir / SWEEP_FILE
    record = sweep_record(sweep)
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except json.JSONDecodeError:
            earlier = None
        if isinstance(earlier, dict) and earlier.get("config") != record["config"]:
            raise ConfigError(f"{sweep.bench_dir} holds a sweep with other train options; run it with the same options "
                              f"to resume it, or choose another --output.dir.")
    sweep.bench_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def read_warmup(bench_dir: Path) -> int | None:
    path = bench_dir / SWEEP_FILE
    try:
        return int(json.loads(path.read_text())["warmup_epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def train_command(sweep: Sweep, point: Point, run_dir: Path) -> list[str]:
    """The command that runs one point (for the tutorial engine, after writing the point's config.toml)."""
    if point.engine == "tutorial":
        cfg = sweep.config
        cfg = replace(cfg, strategy=replace(cfg.strategy, name=point.strategy),
                      launch=replace(cfg.launch, nproc_per_node=point.workers), output=replace(cfg.output, dir=str(run_dir)))
        (run_dir / "config.toml").write_text(config_mod.to_toml(cfg))
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(point.workers),
                "-m", "dptrain.bench.tutorial", str(run_dir)]
    # no epoch snapshots: saving is not what is measured (the user's --checkpoint.every_epochs, given later, wins)
    return [sys.executable, "-m", "dptrain", "train", "--nproc-per-node", str(point.workers),
            "--checkpoint.every_epochs", "0", *sweep.train_args,
            "--strategy.name", point.strategy, "--output.dir", str(run_dir)]


def first_error(output: str, returncode: int) -> str:
    """The line that says why a run failed: dptrain's own `dptrain: error: ...`; else the first exception raised in a
    worker; else torchrun's root cause (a signal, say); else the exit status."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("dptrain:"):
            return line
    for line in lines:
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Failure)\b", line) and "ChildFailedError" not in line:
            return line
    causes = [m[1] for line in lines if (m := re.match(r"^traceback\s*:\s*(.+)", line))]
    if causes:  # torchrun's summary lists the root cause (the first observed failure) last
        return f"worker failed: {causes[-1]}"
    return f"exit status {returncode}" + (f"; last output: {lines[-1]}" if lines else "")


def _stop(proc: subprocess.Popen) -> None:
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
    run_dir.mkdir(parents=True)
    command = train_command(sweep, point, run_dir)
    with (run_dir / LOG_FILE).open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            returncode = proc.wait(timeout=sweep.run_timeout_s)
            error = None if returncode == 0 and is_done(run_dir) else "pending"
        except subprocess.TimeoutExpired:
            _stop(proc)
            returncode, error = proc.returncode, f"timed out after {sweep.run_timeout_s:g} s (--run-timeout-s)"
        except BaseException:  # Ctrl-C: leave no workers behind; the half-done folder is redone on resume
            _stop(proc)
            raise
    if error == "pending":
        error = first_error((run_dir / LOG_FILE).read_text(errors="replace"), returncode)
    if error:
        (run_dir / ERROR_FILE).write_text(error + "\n")
    return error


def run_sweep(sweep: Sweep) -> list[tuple[Point, str]]:
    """Run every missing point, one at a time; the failures, as (point, error)."""
    check_and_record(sweep)
    points = plan(sweep)
    todo = [p for p in points if not is_done(sweep.run_dir(p))]
    log.info(f"bench: {len(points)} points ({len(sweep.engines)} engines x {len(sweep.strategies)} strategies x "
             f"workers {','.join(map(str, sweep.workers))} x {sweep.repeats} repeats) in {sweep.bench_dir}; "
             f"{len(points) - len(todo)} done already, {len(todo)} to run")
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
