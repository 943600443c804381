"""metrics.jsonl's events as a reader takes them: which fields of which event are checked, the range of each
measure, and the one read of the file that names the lines it leaves out. Torch-free: the measuring lab and the
run card read runs with it.

Rank 0 writes the events (metrics.sinks.JsonlSink); a value dptrain writes is finite (metrics.finite_or_none turns
nan and inf into null) and within its RANGE, so a line outside these rules was not written by dptrain as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptrain import read_back
from dptrain.read_back import read_json_lines

_is_number, _shown = read_back.is_number, read_back.shown

# The measures an epoch event may carry, each one number or a per-rank list (null where a rank has none). All of them
# are zero or more; dptrain writes a nan or inf as null (metrics.finite_or_none), so a nan here was not written by it.
# Each lies in its RANGE (zero to BIGGEST where not named): no run measures beyond them, and a report that divides by
# an epoch of 1e-320 s, or sums CPU uses of 1e308 %, showed 0.000 s and a speedup of 0.00, or overflowed.
EPOCH_MEASURES = ("model_flops_per_sample", "cpu_util_pct", "eval_loss", "eval_acc", "peak_mem_mb", "rss_max_mb",
                  "comm_ms_per_step", "comm_exposed_ms_per_step")
BIGGEST = 1e15
RANGE = {"epoch_time_s": (1e-6, 1e8), "images_per_s": (1e-6, 1e12), "train_samples": (1.0, 1e12),
         "cpu_util_pct": (0.0, 1e6), "eval_acc": (0.0, 1.0), "fraction_of_peak": (0.0, 1e3)}


def flat_numbers(values: Any) -> list[float]:
    """A per-rank list, or one number, as floats (None and missing left out)."""
    items = values if isinstance(values, list) else [values]
    return [float(v) for v in items if _is_number(v)]


def event_problem(event: dict[str, Any]) -> str | None:
    """Why an event of metrics.jsonl cannot be read, or None. Only the events and fields the lab's collect and the
    run card read are checked: a run_start's global_batch_size, and an epoch's number, time, samples and measures."""
    kind = event.get("event")
    if not isinstance(kind, str):
        return "it has no event name"
    if kind == "run_start":
        size = event.get("global_batch_size")
        if size is not None and not (_is_number(size) and size == int(size) and size >= 1):
            return f"global_batch_size is {_shown(size)}, not a positive whole number"
    if kind != "epoch":
        return None
    number = event.get("epoch")
    if not (_is_number(number) and number == int(number) and number >= 0):
        return f"epoch is {_shown(number)}, not a whole number" if "epoch" in event else "it has no epoch"
    for key in ("epoch_time_s", "train_samples"):  # a rate divides one by the other: both must be above zero
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
