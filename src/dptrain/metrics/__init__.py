"""Metrics: one event stream -> sinks (metrics.jsonl, `[METRIC]` lines, TensorBoard), progress, utilisation.

    sinks.py        EventLog, JsonlSink, MetricLineSink, metric_line: what rank 0 writes
    epoch_account.py  EpochAccount: one epoch's count on a rank (steps, clock); its event's training fields
    tensorboard.py  TensorBoardSink (runs/<name>/tb/), `dptrain tensorboard` (imports tensorboard lazily)
    epoch_lines.py  EpochLineSink (`Epoch 01/05 | train loss ...` on rank 0), RankEpochSink (each rank's own, in its log;
                    on the console too with output.rank_epoch_lines)
    gpu_log.py      gpu_log(): logs/gpu_rank<R>.log, NVML samples every few seconds as `nvidia-smi dmon` writes them
    progress.py     ProgressBar: a rich bar in a terminal, plain progress lines in files and pipes
    profiler.py     StepProfiler: train.profile's torch.profiler over a range of steps, each rank's trace in tb/profile/
    utilisation.py  UtilisationSampler: per-rank CPU, memory and GPU use over an epoch; peak_memory_mb
"""

from dptrain.metrics.epoch_lines import EVERY_RANK, EpochLineSink, RankEpochSink, epoch_line, rank_epoch_line, run_epochs
from dptrain.metrics.gpu_log import gpu_log
from dptrain.metrics.progress import ProgressBar, progress_line
from dptrain.metrics.sinks import CONSOLE, EventLog, JsonlSink, MetricLineSink, Sink, finite_or_none, metric_line
from dptrain.metrics.utilisation import UtilisationSampler, peak_memory_mb, per_rank

__all__ = ["CONSOLE", "EVERY_RANK", "EpochLineSink", "EventLog", "JsonlSink", "MetricLineSink", "ProgressBar", "RankEpochSink", "Sink",
           "UtilisationSampler", "epoch_line", "finite_or_none", "gpu_log", "metric_line", "peak_memory_mb", "per_rank",
           "progress_line", "rank_epoch_line", "run_epochs"]
