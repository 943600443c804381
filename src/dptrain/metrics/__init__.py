"""Metrics: one event stream -> sinks (metrics.jsonl, `[METRIC]` lines, TensorBoard), progress, utilisation.

    sinks.py        EventLog, JsonlSink, MetricLineSink, metric_line: what rank 0 writes
    tensorboard.py  TensorBoardSink (runs/<name>/tb/), `dptrain tensorboard` (imports tensorboard lazily)
    progress.py     ProgressBar: a rich bar in a terminal, plain progress lines in files and pipes
    utilisation.py  UtilisationSampler: per-rank CPU, memory and GPU use over an epoch; peak_memory_mb
"""

from dptrain.metrics.progress import ProgressBar, progress_line
from dptrain.metrics.sinks import CONSOLE, EventLog, JsonlSink, MetricLineSink, Sink, finite_or_none, metric_line
from dptrain.metrics.utilisation import UtilisationSampler, peak_memory_mb, per_rank

__all__ = ["CONSOLE", "EventLog", "JsonlSink", "MetricLineSink", "ProgressBar", "Sink", "UtilisationSampler",
           "finite_or_none", "metric_line", "peak_memory_mb", "per_rank", "progress_line"]
