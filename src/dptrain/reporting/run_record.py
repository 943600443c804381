"""A run read back from its own files, torch-free and offline: metrics.jsonl's events as a timeline of starts, epochs,
steps and ends (an event whose fields are not what dptrain writes is left out and named), config.toml, env.json, the
snapshots' manifests and a peak.json beside the run; and the numbers derived from them (step time, communication
share, achieved TFLOPS against the peak). Everything there is data: JSON and TOML only, no pickle, no torch. The run
card (run_card.py) draws what this reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain import config as config_mod
from dptrain import read_back
from dptrain.errors import ConfigError
from dptrain.events import (ACHIEVED_TFLOPS, AGENT_RESTARTS, COMM_EXPOSED_MS_PER_STEP, DEVICE, ENDINGS, EPOCH,
                            EPOCH_EVENT, EPOCH_TIME_S, EVAL_ACC, EVAL_LOSS, EVENT, FOOTPRINT, GLOBAL_BATCH_SIZE,
                            GPU_UTILISATION, HANG_EVENT, JOB_ID, LOSS, MESSAGE, MODEL_FLOPS_PER_SAMPLE, REASON,
                            REQUEUE_EVENT, REQUEUE_FAILED_EVENT, RUN_END_EVENT, RUN_START_EVENT, SAMPLES_PER_S,
                            SLURM_RESTARTS, STEP, STEP_EVENT, STOPPED_EVENT, TIME, TOTAL_STEPS, TRAIN_ACC, TRAIN_LOSS,
                            TRAIN_SAMPLES, WORLD_SIZE)
from dptrain.read_back import UnreadableFile
from dptrain.reporting.sweep_files import PEAK_FILE, POINT_NAME, Probe, read_peaks
from dptrain.run_folder import SNAPSHOT_LATEST, SNAPSHOT_MANIFEST, SNAPSHOT_PREFIX, RunFolder

SMALL_FILE_BYTES = 1 << 20  # env.json, a manifest, `latest`: a few KiB each; a larger file is refused, not read whole
SNAPSHOTS_LISTED = 100
# Fields of an epoch event the card reads beyond what collect checks: numbers, or a list of one per rank
EPOCH_NUMBERS = (TRAIN_LOSS, TRAIN_ACC, EVAL_LOSS, EVAL_ACC, SAMPLES_PER_S, ACHIEVED_TFLOPS)
RANK_FIELDS = (*FOOTPRINT, *GPU_UTILISATION)
MAX_RANKS = 1 << 16  # a per-rank list longer than any world dptrain runs is not one


def is_run_dir(path: Path) -> bool:
    """Whether `path` is one run's folder (what `dptrain train` writes: metrics.jsonl or env.json at its top), as
    opposed to a `dptrain bench` sweep, whose runs sit under runs/."""
    folder = RunFolder(Path(path))
    return Path(path).is_dir() and (folder.metrics.exists() or folder.env.exists())  # a FIFO there: the reader says so


def as_number(value: Any) -> float | None:
    """A finite int or float as a float, else None (True is an int to Python, not a number in a metrics file)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _text(value: Any) -> str:
    """A text field of an event as dptrain writes it (a device, a message: a string); anything else (a number planted
    where a device or a message belongs) is left out rather than shown as if it were one."""
    return value if isinstance(value, str) else ""


def _integer(value: Any) -> int | None:
    number = as_number(value)
    return int(number) if number is not None and number == int(number) and number >= 0 else None


def as_per_rank(value: Any) -> list[float | None]:
    """A per-rank field as one value per rank (None where a rank has none); a single number is one rank's."""
    return [as_number(v) for v in value] if isinstance(value, list) else ([as_number(value)] if value is not None else [])


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def event_problem(event: dict[str, Any]) -> str | None:
    """Why the card cannot use an event that collect's reader kept, or None: the fields the card reads and collect
    does not check (a step's loss, an epoch's step and curves, the per-rank byte counts, a start's step)."""
    kind = event[EVENT]
    if TIME in event and as_number(event[TIME]) is None:
        return f"{TIME} is {_shown(event[TIME])}, not a number"
    # the events whose step the card reads
    counted = (STEP_EVENT.name, EPOCH_EVENT.name, RUN_START_EVENT.name, RUN_END_EVENT.name, STOPPED_EVENT.name,
               HANG_EVENT.name)
    if kind in counted and STEP in event and _integer(event[STEP]) is None:
        return f"{STEP} is {_shown(event[STEP])}, not an integer"
    if kind in (STEP_EVENT.name, EPOCH_EVENT.name) and STEP not in event:
        return f"it has no {STEP}"
    if kind == RUN_START_EVENT.name and WORLD_SIZE in event and not (_integer(event[WORLD_SIZE]) or 0) >= 1:
        return f"{WORLD_SIZE} is {_shown(event[WORLD_SIZE])}, not a positive integer"
    if kind == STEP_EVENT.name and event.get(LOSS) is not None and as_number(event[LOSS]) is None:
        return f"{LOSS} is {_shown(event[LOSS])}, not a number"
    if kind == EPOCH_EVENT.name:
        for key in EPOCH_NUMBERS:
            if event.get(key) is not None and as_number(event[key]) is None:
                return f"{key} is {_shown(event[key])}, not a number"
        for key in RANK_FIELDS:
            value = event.get(key)
            items = value if isinstance(value, list) else [value]
            if len(items) > MAX_RANKS or not all(v is None or (as_number(v) is not None and v >= 0) for v in items):
                return f"{key} is {_shown(value)}, not a number of zero or more per rank"
    return None


NO_END = "no end recorded (still running, or killed)"


@dataclass
class Start:
    """One process group's life in the run: a run_start event and how it ended."""

    step: int
    time: float | None
    world_size: int | None
    device: str
    agent_restarts: int | None
    slurm_restarts: int | None
    ended: str = NO_END
    end_time: float | None = None


@dataclass
class Timeline:
    """The run as its last process sees it: what earlier processes logged past the snapshot a later one resumed
    from was done again, and only the later copy counts (as TensorBoard's curves do)."""

    starts: list[Start] = field(default_factory=list)
    epochs: dict[int, tuple[dict[str, Any], Start | None]] = field(default_factory=dict)  # number -> (event, its start)
    steps: dict[int, float] = field(default_factory=dict)  # global step -> logged loss
    global_batch_size: int | None = None
    total_steps: int | None = None
    left_out: list[str] = field(default_factory=list)


def timeline(events: list[dict[str, Any]]) -> Timeline:
    line = Timeline()
    for event in events:
        kind = event[EVENT]
        problem = event_problem(event)
        if problem:
            where = f"epoch {event.get(EPOCH)}'s event" if kind == EPOCH_EVENT.name else f"a {kind} event"
            line.left_out.append(f"metrics.jsonl, {cut_short(where)}: {problem}")
            continue
        step = _integer(event.get(STEP))
        if kind == RUN_START_EVENT.name:
            start_step = step or 0
            line.epochs = {n: e for n, e in line.epochs.items() if e[0][STEP] <= start_step}
            line.steps = {s: loss for s, loss in line.steps.items() if s <= start_step}
            line.starts.append(Start(step=start_step, time=as_number(event.get(TIME)),
                                     world_size=_integer(event.get(WORLD_SIZE)), device=_text(event.get(DEVICE)),
                                     agent_restarts=_integer(event.get(AGENT_RESTARTS)),
                                     slurm_restarts=_integer(event.get(SLURM_RESTARTS))))
            line.global_batch_size = _integer(event.get(GLOBAL_BATCH_SIZE)) or line.global_batch_size
            line.total_steps = _integer(event.get(TOTAL_STEPS)) or line.total_steps
        elif kind == EPOCH_EVENT.name:
            line.epochs[int(event[EPOCH])] = (event, line.starts[-1] if line.starts else None)
        elif kind == STEP_EVENT.name and as_number(event.get(LOSS)) is not None:
            line.steps[step] = float(event[LOSS])
        elif kind in ENDINGS and line.starts:
            last = line.starts[-1]
            at = f" at step {step}" if step is not None else ""
            ending = {RUN_END_EVENT.name: f"finished{at}",
                      STOPPED_EVENT.name: f"stopped{at}: {_text(event.get(MESSAGE))[:200]}",
                      HANG_EVENT.name: f"hung{at}: {_text(event.get(MESSAGE))[:500]}",
                      REQUEUE_EVENT.name: f"requeued (SLURM job {_text(event.get(JOB_ID))[:40] or '?'})",
                      REQUEUE_FAILED_EVENT.name: f"requeue refused: {_text(event.get(REASON))[:200]}"}[kind]
            # a stop under SLURM is followed by its requeue (or the refusal of one): the card keeps both
            requeue = kind in (REQUEUE_EVENT.name, REQUEUE_FAILED_EVENT.name)
            last.ended = f"{last.ended}; {ending}" if requeue and last.ended != NO_END else ending
            last.end_time = as_number(event.get(TIME))
    return line


# ---- the run's other files ------------------------------------------------------------------------------------------

def read_small_json(path: Path) -> tuple[dict[str, Any], str | None]:
    """A small JSON object file (env.json, a manifest) and why it could not be read, if it could not."""
    try:
        return read_back.read_json_object(path, SMALL_FILE_BYTES), None
    except FileNotFoundError:
        return {}, f"{path.name} is missing"
    except UnreadableFile as exc:
        return {}, f"{path.name} {exc.problem}"


def read_run_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """config.toml's options by dotted name, and why it could not be read, if it could not."""
    try:
        tree = config_mod.read_toml(path, "config.toml")
    except FileNotFoundError:
        return {}, "config.toml is missing"
    except ConfigError as exc:
        return {}, str(exc).split("; ")[0]
    return flatten(tree), None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


@dataclass(frozen=True)
class Snapshot:
    name: str
    step: int | None
    world_size: int | None
    strategy: str
    torch: str
    problem: str | None


def read_snapshots(checkpoints: Path) -> tuple[list[Snapshot], str | None]:
    """Every snapshot folder, newest first, from its manifest alone (`dptrain checkpoint verify` checks the files:
    that reads every byte, and loads tensors, which a card does not), and the name `latest` points to."""
    if not checkpoints.is_dir():
        return [], None
    latest = None
    pointer = checkpoints / SNAPSHOT_LATEST
    if pointer.is_file():
        try:
            with pointer.open("rb") as file:
                latest = file.read(256).decode("utf-8", errors="replace").strip()
        except OSError:
            latest = None
    snapshots = []
    for folder in sorted(checkpoints.glob(f"{SNAPSHOT_PREFIX}*"), reverse=True):
        if folder.is_symlink() or not folder.is_dir():  # never followed: a run refuses such an entry as it starts
            what = "a symbolic link" if folder.is_symlink() else "a file"
            snapshots.append(Snapshot(name=folder.name, step=None, world_size=None, strategy="", torch="",
                                      problem=f"{what}, not a snapshot folder (a run refuses it)"))
            continue
        manifest, problem = read_small_json(folder / SNAPSHOT_MANIFEST)
        snapshots.append(Snapshot(name=folder.name, step=_integer(manifest.get("step")),
                                  world_size=_integer(manifest.get("world_size")),
                                  strategy=str(manifest.get("strategy", "")), torch=str(manifest.get("torch", "")),
                                  problem=problem))
    return snapshots, latest


def read_probes(run_dir: Path) -> tuple[dict[int, Probe], Path | None]:
    """The matmul probes of a peak.json in the run folder, or, for a point of a `dptrain bench` sweep
    (BENCH/runs/<point>), in the sweep's folder; and the file they came from."""
    places = [run_dir]
    if POINT_NAME.match(run_dir.name) and run_dir.parent.name == "runs":
        places.append(run_dir.parent.parent)
    for place in places:
        probes = read_peaks(place)
        if probes:
            return probes, place / PEAK_FILE
    return {}, None


# ---- numbers --------------------------------------------------------------------------------------------------------

def steps_in(event: dict[str, Any], global_batch_size: int | None) -> int | None:
    """An epoch's optimizer steps: its samples over the global batch, the last batch a partial one."""
    return math.ceil(event[TRAIN_SAMPLES] / global_batch_size) if global_batch_size else None


def step_ms(event: dict[str, Any], global_batch_size: int | None) -> float | None:
    steps = steps_in(event, global_batch_size)
    return event[EPOCH_TIME_S] * 1e3 / steps if steps else None


def comm_shares(event: dict[str, Any], global_batch_size: int | None) -> list[float | None]:
    """Per rank: the communication a step waited for (not hidden behind backward) over the step's time."""
    per_step = step_ms(event, global_batch_size)
    exposed = as_per_rank(event.get(COMM_EXPOSED_MS_PER_STEP))
    return [None if e is None or not per_step else e / per_step for e in exposed]


def achieved_tflops(event: dict[str, Any]) -> float | None:
    rate = as_number(event.get(ACHIEVED_TFLOPS))
    if rate is None and (flops := as_number(event.get(MODEL_FLOPS_PER_SAMPLE))) is not None:
        rate = flops * event[TRAIN_SAMPLES] / event[EPOCH_TIME_S] / 1e12
    return rate


def peak_for(probes: dict[int, Probe], start: Start | None) -> Probe | None:
    """The probe of the epoch's world size on the epoch's kind of device (cpu, cuda), if peak.json holds one."""
    if start is None or start.world_size is None:
        return None
    probe = probes.get(start.world_size)
    return probe if probe is not None and start.device.split(":")[0] == probe.device else None


def cut_short(text: str) -> str:
    """Text built from a value of a run's file, cut short; md_text escapes it where it is printed."""
    return text if len(text) <= 80 else text[:77] + "..."
