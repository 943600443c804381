"""metrics.jsonl's events: the schema (each event's name and fields, spelled once here: writers build events with
these names, readers read them with the same), how a reader takes them (which fields are checked, the range of each
measure) and the one read of the file that names the lines it leaves out. Torch-free: the measuring lab and the run
card read runs with it.

    {"event": "step", "time": 1764170000.123, "epoch": 1, "step": 10, "loss": 2.2519, "lr": 0.001}

Rank 0 writes the events (metrics.sinks.EventLog, JsonlSink): every one is a flat JSON object whose first keys are
EVENT and TIME, then its schema's fields in the schema's order. A value dptrain writes is finite
(metrics.finite_or_none turns nan and inf into null) and within its RANGE, so a line outside these rules was not
written by dptrain as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain import read_back
from dptrain.read_back import read_json_lines

_is_number, _shown = read_back.is_number, read_back.shown

# ---- the schema: every field name, once ----------------------------------------------------------------------------

EVENT, TIME = "event", "time"
"""Every event's first two keys: its name, and when rank 0 wrote it (seconds since 1970, to the millisecond)."""

STEP, EPOCH = "step", "epoch"
"""The run's optimizer steps done (every event that has a position), and the epoch, counted from 1."""

# run_start: one process group's start (a resume starts another)
WORLD_SIZE, STRATEGY, MODEL, DATA, DEVICE = "world_size", "strategy", "model", "data", "device"
GLOBAL_BATCH_SIZE, TOTAL_STEPS = "global_batch_size", "total_steps"
SLURM_RESTARTS, AGENT_RESTARTS, SLURM_JOB_ID = "slurm_restarts", "agent_restarts", "slurm_job_id"

# step: one logged step (train.log_every), its loss averaged over the global batch
LOSS, LR = "loss", "lr"

# epoch: the epoch's training, reduced over every rank exactly, and its evaluation where one ran
TRAIN_LOSS, TRAIN_ACC, TRAIN_SAMPLES = "train_loss", "train_acc", "train_samples"
EPOCH_TIME_S, SAMPLES_PER_S, PEAK_MEM_MB = "epoch_time_s", "samples_per_s", "peak_mem_mb"
MODEL_FLOPS_PER_SAMPLE, ACHIEVED_TFLOPS = "model_flops_per_sample", "achieved_tflops"
SKIPPED_STEPS = "skipped_steps"
"""train.fp16: the epoch's optimizer steps whose update the loss scaler skipped (a scaled gradient overflowed)."""
MEM_PARAMS_BYTES, MEM_GRADS_BYTES, MEM_OPTIM_BYTES = "mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes"
COMM_BYTES_PER_STEP = "comm_bytes_per_step"
COMM_MS_PER_STEP, COMM_EXPOSED_MS_PER_STEP = "comm_ms_per_step", "comm_exposed_ms_per_step"
CPU_UTIL_PCT, RSS_MAX_MB = "cpu_util_pct", "rss_max_mb"
GPU_UTIL_MEAN_PCT, GPU_UTIL_MAX_PCT = "gpu_util_mean_pct", "gpu_util_max_pct"
GPU_MEM_USED_MAX_MB, GPU_POWER_MEAN_W, GPU_POWER_MAX_W = "gpu_mem_used_max_mb", "gpu_power_mean_w", "gpu_power_max_w"
EVAL_LOSS, EVAL_ACC, EVAL_COUNT, EVAL_TIME_S = "eval_loss", "eval_acc", "eval_count", "eval_time_s"
OWN_COMPUTE_MS_PER_STEP, OWN_COMPUTE_CPU_MS_PER_STEP = "own_compute_ms_per_step", "own_compute_cpu_ms_per_step"
DATA_WAIT_MS_PER_STEP = "data_wait_ms_per_step"
LINK_PROBE_MS, LINK_PROBE_S = "link_probe_ms", "link_probe_s"
STRAGGLER_RANK, STRAGGLER_HOST, STRAGGLER_PHASE = "straggler_rank", "straggler_host", "straggler_phase"
STRAGGLER_SLOWER_PCT = "straggler_slower_pct"

# stopped, requeue, requeue_failed: how a process group's life ended, when not with run_end
MESSAGE, JOB_ID, REASON = "message", "job_id", "reason"

# signal: a stop signal every rank agreed on, and the snapshot it wrote (a rehearsal's drill goes on after it)
SIGNAL, RECEIVED_AT, SNAPSHOT_AT, DRILL = "signal", "received_at", "snapshot_at", "drill"
"""The signal's name (SIGUSR1); per rank, when it got it (seconds since 1970, null: never); when the snapshot was
written (rank 0's clock); whether the run went on (a drill, `dptrain submit --rehearse`) rather than stopped."""

# hang: the one sentence a run that hung ended with (distributed/hangs.py), and what it names
HANG_RANKS, COLLECTIVE, WAITED_S, DOING, LINE = "ranks", "collective", "waited_s", "doing", "line"

# eval: `dptrain eval`'s record of a snapshot's evaluation (its [METRIC] line)
SNAPSHOT = "snapshot"

# An epoch event's fields by what measures them; the per-rank ones are lists, one value per global rank.
EPOCH_RATES = (MODEL_FLOPS_PER_SAMPLE, ACHIEVED_TFLOPS)
"""The model's operations per sample and their rate over the epoch (where the model's operations were counted)."""
FOOTPRINT = (MEM_PARAMS_BYTES, MEM_GRADS_BYTES, MEM_OPTIM_BYTES, COMM_BYTES_PER_STEP)
"""Per rank: bytes of parameters, gradients and optimizer state held, and bytes sent per step."""
COMM_TIMING = (COMM_MS_PER_STEP, COMM_EXPOSED_MS_PER_STEP)
"""Per rank, where the strategy times it: milliseconds of gradient communication a step, and those not hidden."""
CPU_UTILISATION = (CPU_UTIL_PCT, RSS_MAX_MB)
GPU_UTILISATION = (GPU_UTIL_MEAN_PCT, GPU_UTIL_MAX_PCT, GPU_MEM_USED_MAX_MB, GPU_POWER_MEAN_W, GPU_POWER_MAX_W)
UTILISATION = CPU_UTILISATION + GPU_UTILISATION
"""Per rank, over the epoch's training: CPU use and resident memory, and the GPU's use where NVML is there."""
EVALUATION = (EVAL_LOSS, EVAL_ACC, EVAL_COUNT, EVAL_TIME_S)
"""The test split's loss, accuracy, samples and seconds (evaluate.evaluate's result)."""
OWN_TIME = (OWN_COMPUTE_MS_PER_STEP, OWN_COMPUTE_CPU_MS_PER_STEP, DATA_WAIT_MS_PER_STEP)
"""Per rank, milliseconds a step of its own work outside the collectives: compute (forward, and backward to its last
gradient), the same compute's CPU time (on CPU only), and the wait for its next batch (metrics.stragglers)."""
STRAGGLER = (STRAGGLER_RANK, STRAGGLER_HOST, STRAGGLER_PHASE, STRAGGLER_SLOWER_PCT)
"""The rank whose own time (or compute's CPU time) a step was more than 20% above the others' median over the epoch,
else the node whose link time was (its first rank), where one was: its rank, host, the phase its extra time went to
(compute, data or link) and how much slower it was, in percent."""
LINK_PROBE = (LINK_PROBE_MS, LINK_PROBE_S)
"""Per node, in a run of 3 nodes or more, its link time: the milliseconds its slower direction took to move the link
probe's 256 KiB (metrics.link_probe); and the seconds the whole probe took the run at the epoch's end (the slowest
node's: what it added to the run's time, outside epoch_time_s)."""
PER_RANK = FOOTPRINT + COMM_TIMING + OWN_TIME + UTILISATION


@dataclass(frozen=True)
class EventSchema:
    """One event: its name and its fields in the order they are written (after EVENT and TIME), of which `optional`
    may be left out."""

    name: str
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()
    timed: bool = True
    """Whether it carries TIME (every event EventLog writes does; `dptrain eval`'s record does not)."""

    def __post_init__(self) -> None:
        assert set(self.optional) <= set(self.fields), f"{self.name}: an optional field that is no field"

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(f for f in self.fields if f not in self.optional)

    def problem(self, record: dict[str, Any]) -> str | None:
        """Why `record` is not such an event as dptrain writes it (names and order of its keys), or None."""
        head = [EVENT, TIME] if self.timed else [EVENT]
        keys = list(record)
        if keys[:len(head)] != head or record[EVENT] != self.name:
            return f"it does not start with {', '.join(head)} = {self.name!r}"
        unknown = [k for k in keys[len(head):] if k not in self.fields]
        missing = [k for k in self.required if k not in record]
        if unknown or missing:
            return f"{self.name}: unknown {unknown}, missing {missing}"
        written = [k for k in keys if k in self.required]
        if written != list(self.required):
            return f"{self.name}: fields {written} out of the order {list(self.required)}"
        return None


RUN_START_EVENT = EventSchema("run_start", (WORLD_SIZE, STRATEGY, MODEL, DATA, GLOBAL_BATCH_SIZE, TOTAL_STEPS, DEVICE,
                                            STEP, SLURM_RESTARTS, AGENT_RESTARTS, SLURM_JOB_ID),
                              optional=(SLURM_RESTARTS, AGENT_RESTARTS, SLURM_JOB_ID))
STEP_EVENT = EventSchema("step", (EPOCH, STEP, LOSS, LR, *STRAGGLER), optional=STRAGGLER)
"""STRAGGLER: the window of steps since the last log step's straggler, where one was (metrics.stragglers)."""
EPOCH_EVENT = EventSchema("epoch", (EPOCH, STEP, TRAIN_LOSS, TRAIN_ACC, TRAIN_SAMPLES, EPOCH_TIME_S, SAMPLES_PER_S,
                                    *EPOCH_RATES, PEAK_MEM_MB, LR, SKIPPED_STEPS, *FOOTPRINT, *COMM_TIMING,
                                    *OWN_TIME, *LINK_PROBE, *STRAGGLER, *UTILISATION, *EVALUATION),
                          optional=(*EPOCH_RATES, SKIPPED_STEPS, *COMM_TIMING, *OWN_TIME, *LINK_PROBE, *STRAGGLER,
                                    *UTILISATION, *EVALUATION))
RUN_END_EVENT = EventSchema("run_end", (STEP,))
STOPPED_EVENT = EventSchema("stopped", (STEP, MESSAGE))
SIGNAL_EVENT = EventSchema("signal", (STEP, SIGNAL, RECEIVED_AT, SNAPSHOT_AT, DRILL))
REQUEUE_EVENT = EventSchema("requeue", (STEP, JOB_ID))
REQUEUE_FAILED_EVENT = EventSchema("requeue_failed", (STEP, JOB_ID, REASON))
HANG_EVENT = EventSchema("hang", (STEP, MESSAGE, HANG_RANKS, WAITED_S, COLLECTIVE, DOING, LINE),
                         optional=(COLLECTIVE, DOING, LINE))
"""A collective overran and the ranks compared: MESSAGE is the run's sentence; HANG_RANKS the ranks it blames, WAITED_S
how long the others waited, COLLECTIVE the one they waited in (all_reduce #12), DOING and LINE where the first
blamed rank's main thread was."""
EVAL_EVENT = EventSchema("eval", (SNAPSHOT, STEP, WORLD_SIZE, *EVALUATION), timed=False)
"""`dptrain eval`'s record, which goes to its [METRIC] line (not to a run's metrics.jsonl)."""

SCHEMAS = {s.name: s for s in (RUN_START_EVENT, STEP_EVENT, EPOCH_EVENT, RUN_END_EVENT, STOPPED_EVENT, SIGNAL_EVENT,
                               REQUEUE_EVENT, REQUEUE_FAILED_EVENT, HANG_EVENT, EVAL_EVENT)}
ENDINGS = (RUN_END_EVENT.name, STOPPED_EVENT.name, REQUEUE_EVENT.name, REQUEUE_FAILED_EVENT.name, HANG_EVENT.name)
"""The events that end a process group's life: finished, stopped by a signal, requeued, its requeue refused, hung."""


def schema_problem(record: dict[str, Any]) -> str | None:
    """Why `record` is not an event dptrain writes, by its schema (names and order of keys, not values), or None."""
    schema = SCHEMAS.get(str(record.get(EVENT)))
    return schema.problem(record) if schema is not None else f"no event is named {_shown(record.get(EVENT))}"


# ---- reading: the fields a reader checks ---------------------------------------------------------------------------

# The measures an epoch event may carry, each one number or a per-rank list (null where a rank has none). All of them
# are zero or more; dptrain writes a nan or inf as null (metrics.finite_or_none), so a nan here was not written by it.
# Each lies in its RANGE (zero to BIGGEST where not named): no run measures beyond them, and a report that divides by
# an epoch of 1e-320 s, or sums CPU uses of 1e308 %, showed 0.000 s and a speedup of 0.00, or overflowed.
EPOCH_MEASURES = (MODEL_FLOPS_PER_SAMPLE, CPU_UTIL_PCT, EVAL_LOSS, EVAL_ACC, PEAK_MEM_MB, RSS_MAX_MB, COMM_MS_PER_STEP,
                  COMM_EXPOSED_MS_PER_STEP, *OWN_TIME)
BIGGEST = 1e15
# images_per_s and fraction_of_peak: the lab's measures of a run (dptrain_bench.collect), read from these
RANGE = {EPOCH_TIME_S: (1e-6, 1e8), "images_per_s": (1e-6, 1e12), TRAIN_SAMPLES: (1.0, 1e12),
         CPU_UTIL_PCT: (0.0, 1e6), EVAL_ACC: (0.0, 1.0), "fraction_of_peak": (0.0, 1e3)}


def flat_numbers(values: Any) -> list[float]:
    """A per-rank list, or one number, as floats (None and missing left out)."""
    items = values if isinstance(values, list) else [values]
    return [float(v) for v in items if _is_number(v)]


def event_problem(event: dict[str, Any]) -> str | None:
    """Why an event of metrics.jsonl cannot be read, or None. Only the events and fields the lab's collect and the
    run card read are checked: a run_start's global_batch_size, and an epoch's number, time, samples and measures."""
    kind = event.get(EVENT)
    if not isinstance(kind, str):
        return "it has no event name"
    if kind == RUN_START_EVENT.name:
        size = event.get(GLOBAL_BATCH_SIZE)
        if size is not None and not (_is_number(size) and size == int(size) and size >= 1):
            return f"{GLOBAL_BATCH_SIZE} is {_shown(size)}, not a positive integer"
    if kind != EPOCH_EVENT.name:
        return None
    number = event.get(EPOCH)
    if not (_is_number(number) and number == int(number) and number >= 0):
        return f"{EPOCH} is {_shown(number)}, not an integer" if EPOCH in event else f"it has no {EPOCH}"
    for key in (EPOCH_TIME_S, TRAIN_SAMPLES):  # a rate divides one by the other: both must be above zero
        if key not in event:
            return f"it has no {key}"
        if not in_range(key, event[key]):
            return f"{key} is {_shown(event[key])}, {range_words(key)}"
    for key in EPOCH_MEASURES:
        value = event.get(key)
        items = value if isinstance(value, list) else [value]
        if not all(v is None or in_range(key, v) for v in items):
            return f"{key} is {_shown(value)}, {range_words(key)}"
    return None


def in_range(measure: str, value: Any) -> bool:
    """value is a finite number within measure's RANGE."""
    low, high = RANGE.get(measure, (0.0, BIGGEST))
    return _is_number(value) and low <= value <= high


def range_words(measure: str) -> str:
    low, high = RANGE.get(measure, (0.0, BIGGEST))
    return f"not a number from {low:g} to {high:g}"


def read_run_events(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The usable events of a metrics.jsonl, and where and why the others were skipped ("line 7: ..."), by
    read_back.read_json_lines' rule, event_problem saying what a reader cannot use."""
    return read_json_lines(path, event_problem)
