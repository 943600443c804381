"""TensorBoard: rank 0's event files in runs/<name>/tb/, and `dptrain tensorboard RUN_DIR...` to watch them.

    $ dptrain tensorboard runs/fashion-mnist_mnist-cnn_ddp  # http://127.0.0.1:PORT/, and the ssh tunnel line to reach it
    $ dptrain tensorboard runs/a runs/b --port 6006

Every point's x value is the run's global optimizer step, so a resumed run continues the same curves: its writer
purges whatever an earlier process wrote after the snapshot's step (SummaryWriter's purge_step), so that no step
has two points. tensorboard is imported only here, when a run starts on rank 0 (~0.2 s), or by the command.

A full disk under tb/ does not stop the run: it says so in one warning line and goes on without TensorBoard files.
Unlike metrics.jsonl, whose loss fails the run (MetricsWriteError), nothing is lost with them: every point they hold
is also a line of metrics.jsonl, and a stop would cost the steps since the last snapshot (on every rank) for a copy.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.events import (ACHIEVED_TFLOPS, EPOCH_EVENT, EPOCH_TIME_S, EVAL_ACC, EVAL_LOSS, EVAL_TIME_S, EVENT, LOSS,
                            LR, PEAK_MEM_MB, RUN_END_EVENT, SAMPLES_PER_S, SKIPPED_STEPS, STEP, STEP_EVENT,
                            STOPPED_EVENT, TRAIN_ACC, TRAIN_LOSS, UTILISATION)
from dptrain.metrics.epoch_lines import epoch_line
from dptrain.run_folder import RunFolder

log = logging.getLogger("dptrain")

STEP_SCALARS = (LOSS, LR)
"""A step event's scalars, as train/<key>."""
EPOCH_SCALARS = (TRAIN_LOSS, TRAIN_ACC, EVAL_LOSS, EVAL_ACC, LR, SAMPLES_PER_S, EPOCH_TIME_S, EVAL_TIME_S, PEAK_MEM_MB,
                 ACHIEVED_TFLOPS, SKIPPED_STEPS)
"""An epoch event's scalars, as epoch/<key>; its per-rank utilisation lists go to util/<key>/rank<R>."""
EPOCH_LINES_TAG = "epoch lines"
"""The text tab's entry of each epoch's `Epoch 01/05 | train loss ...` line, at its step (the tutorials' log there)."""
FINAL_METRICS = (TRAIN_LOSS, TRAIN_ACC, EVAL_LOSS, EVAL_ACC, SAMPLES_PER_S)
"""The last epoch's values shown next to the run's hyperparameters (HPARAMS tab), as hparams/<key>."""


def _markdown_code(text: str) -> str:
    # TensorBoard's text tab renders markdown: indented lines keep their layout.
    return "\n".join("    " + line for line in text.splitlines())


WRITER_THREAD_MODULE = "tensorboard.summary.writer.event_file_writer"
"""Where tensorboard's writer thread (_AsyncWriterThread) is defined: its disk errors are said by the sink instead."""


class _QuietWriterDiskErrors:
    """threading.excepthook that drops an OSError of tensorboard's writer thread and passes on everything else.

    The writer thread keeps the OSError it met (a full disk) and re-raises it in the thread too: Python printed
    "Exception in thread" and ~40 lines of traceback. The writer raises the same exception again at the sink's next
    add, flush or close, where it becomes one warning line; so the thread's copy says nothing new. Any other
    thread's failure, and any other error of this one (a bug), goes to the hook that was there before.
    """

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__ == WRITER_THREAD_MODULE and issubclass(args.exc_type, OSError):
            return
        self.previous(args)


def _quiet_writer_disk_errors() -> None:
    """Installs _QuietWriterDiskErrors once per process (each sink calls it; a resumed run in one process makes two)."""
    if not isinstance(threading.excepthook, _QuietWriterDiskErrors):
        threading.excepthook = _QuietWriterDiskErrors(threading.excepthook)


def flat_hparams(tree: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}: the values the hparams plugin takes (None and lists as text)."""
    flat: dict[str, bool | int | float | str] = {}
    for section, options in tree.items():
        for key, value in options.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return flat


class TensorBoardSink:
    """Rank 0's TensorBoard writer: step loss and lr, each epoch's metrics and utilisation, the config and the
    environment as text, each epoch's line as text (the console's `Epoch NN/NN | ...`, of num_epochs), and at the
    run's end its hyperparameters with the final metrics.

    Flushed after every epoch, at the end and every `flush_every_s` seconds in between (step events), so that a
    `dptrain tensorboard` started beside the run shows it live. Its constructor raises OSError where the files
    cannot be started (open_sink says it); a write that fails later is said in one warning line, and the sink then
    writes nothing more (the writer would raise the same error at every call).
    """

    def __init__(self, log_dir: Path, start_step: int, config: dict[str, Any], config_toml: str,
                 environment: dict[str, Any], num_epochs: int, flush_every_s: float = 5.0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard and protobuf, on rank 0 only

        _quiet_writer_disk_errors()  # before the writer starts its thread: its first write may already fail
        self.log_dir = log_dir
        # purge_step: points at steps after the snapshot this run resumes from (written by a process that went on
        # after it, then died) are dropped from the earlier files, so every step keeps one point.
        self.writer: Any = SummaryWriter(str(log_dir), purge_step=start_step + 1, flush_secs=flush_every_s)
        self.hparams = flat_hparams(config)
        self.num_epochs = num_epochs
        self.step = start_step
        """The last event's step: where a failure shows, in its warning."""
        self.last_epoch: dict[str, Any] = {}
        try:
            self.writer.add_text("config", _markdown_code(config_toml), start_step)
            self.writer.add_text("environment", _markdown_code(json.dumps(environment, indent=2)), start_step)
            self.writer.flush()
        except OSError:
            self._stop_writer()
            raise

    def write(self, event: dict[str, Any]) -> None:
        if self.writer is None:  # stopped by a failed write, said then
            return
        step = self.step = event.get(STEP, self.step)
        try:
            self._write(event[EVENT], step, event)
        except OSError as exc:
            log.warning("%s", cannot_write(self.log_dir, exc, step))
            self._stop_writer()

    def _write(self, kind: str, step: int, event: dict[str, Any]) -> None:
        if kind == STEP_EVENT.name:
            for key in STEP_SCALARS:
                if event.get(key) is not None:  # a diverged loss is null
                    self.writer.add_scalar(f"train/{key}", event[key], step)
        elif kind == EPOCH_EVENT.name:
            self.last_epoch = event
            for key in EPOCH_SCALARS:
                if event.get(key) is not None:
                    self.writer.add_scalar(f"epoch/{key}", event[key], step)
            for key in UTILISATION:
                for rank, value in enumerate(event.get(key, ())):
                    self.writer.add_scalar(f"util/{key}/rank{rank}", value, step)
            self.writer.add_text(EPOCH_LINES_TAG, epoch_line(event, self.num_epochs), step)
            self.writer.flush()
        elif kind == RUN_END_EVENT.name:
            self._write_hparams(step)
            self.writer.flush()
        elif kind == STOPPED_EVENT.name:
            self.writer.flush()

    def _write_hparams(self, step: int) -> None:
        """The run's options and final metrics in the HPARAMS tab (its metric values are the hparams/* scalars)."""
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"hparams/{k}": self.last_epoch[k] for k in FINAL_METRICS if self.last_epoch.get(k) is not None}
        if not metrics:  # nothing trained in this process (an already complete run)
            return
        for summary in hparams(self.hparams, metrics):
            self.writer.file_writer.add_summary(summary, step)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.close()  # the last flush: the points since the last epoch's
        except OSError as exc:
            log.warning("%s", cannot_write(self.log_dir, exc, self.step))
            self._stop_writer()
        self.writer = None

    def _stop_writer(self) -> None:
        """Ends the writer's thread and file, quietly: its error has been said (SummaryWriter.close would raise it
        again at its flush, before closing anything)."""
        with contextlib.suppress(OSError):
            self.writer.file_writer.close()
        self.writer = None


def cannot_write(log_dir: Path, exc: OSError, step: int) -> str:
    """The one line a failed TensorBoard write is: the run goes on (why: this module's docstring). The step is where
    the failure showed; the writer's thread may have lost a few points before it."""
    return (f"TensorBoard files cannot be written to {log_dir} at step {step} ({exc.strerror or exc}); the run goes on "
            f"without them: metrics.jsonl keeps every point.")


def open_sink(run_dir: Path, start_step: int, config: dict[str, Any], config_toml: str,
              environment: dict[str, Any], num_epochs: int) -> TensorBoardSink | None:
    """The sink for runs/<name>/tb/, or None with one warning line when tensorboard cannot be imported or its files
    cannot be started (a full disk)."""
    started = time.perf_counter()
    try:
        sink = TensorBoardSink(RunFolder(run_dir).tb, start_step, config, config_toml, environment, num_epochs)
    except ImportError as exc:
        log.warning("no TensorBoard files: %s (pip install tensorboard)", exc)
        return None
    except OSError as exc:
        log.warning("%s", cannot_write(RunFolder(run_dir).tb, exc, start_step))
        return None
    log.info("TensorBoard files in %s (%.2f s to start the writer); watch them with: dptrain tensorboard %s",
             RunFolder(run_dir).tb, time.perf_counter() - started, run_dir)
    return sink


def logdir_args(run_dirs: list[Path]) -> list[str]:
    """TensorBoard's --logdir_spec name:path,... over the runs' tb/ folders, each named by its run folder (made unique):
    TensorBoard lists a run as its name, where a plain --logdir of one tb/ folder listed it as "."."""
    for run_dir in run_dirs:
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"{run_dir} is a file, not a run folder; give a run folder, runs/<name> or an "
                              f"--output.dir.")
        if not run_dir.is_dir():
            raise ConfigError(f"the run folder {run_dir} does not exist; give a run folder, runs/<name> or an "
                              f"--output.dir.")
        if not RunFolder(run_dir).tb.is_dir():
            raise ConfigError(f"{run_dir} has no tb/ folder: no run with TensorBoard files has been written there yet.")
        if "," in str(run_dir.resolve()):  # --logdir_spec splits on commas
            raise ConfigError(f"{run_dir}: TensorBoard cannot take a run folder whose path holds a comma; rename "
                              f"it.")
    names: dict[str, Path] = {}
    for run_dir in run_dirs:
        name, n = run_dir.resolve().name, 2
        while name in names:
            name, n = f"{run_dir.resolve().name}-{n}", n + 1
        names[name] = RunFolder(run_dir).tb
    return ["--logdir_spec", ",".join(f"{name}:{path.resolve()}" for name, path in names.items())]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """ConfigError in one sentence where 127.0.0.1:port cannot be bound. Checked before TensorBoard starts: its own
    failure comes after it has started its data server and printed notes, as a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TensorBoard's server binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on 127.0.0.1 is taken by another program; choose another --port, or "
                                  f"leave it out for a free one.") from None
            raise ConfigError(f"TensorBoard cannot listen on 127.0.0.1:{port} ({exc.strerror}); choose another --port, "
                              f"or leave it out for a free one.") from None


def serve(run_dirs: list[Path], port: int | None = None) -> int:
    """TensorBoard on 127.0.0.1 only (reached from elsewhere through an ssh tunnel), reloading every second,
    until Ctrl-C."""
    if port is not None and not 0 <= port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port; pick one from 1024 to 65535, or leave --port out for a free one.")
    if port:
        check_port_free(port)
    args = logdir_args(run_dirs)
    from tensorboard import program  # lazy: 0.30 s with TensorBoard()'s plugins (perf/micro.py, tensorboard)

    # At INFO its data server logs every reload (once a second); warnings and errors still show.
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    board = program.TensorBoard()
    board.configure(argv=["tensorboard", *args, "--host", "127.0.0.1", "--port", str(port or free_port()),
                          "--reload_interval", "1"])
    url = board.launch()  # the server runs on its own thread
    bound = url.rstrip("/").rsplit(":", 1)[-1]
    print(f"TensorBoard for {', '.join(map(str, run_dirs))} at {url} (reloads every second; Ctrl-C stops it)", flush=True)
    print(f"from your laptop: ssh -N -L {bound}:127.0.0.1:{bound} {getpass.getuser()}@{socket.gethostname()}  "
          f"then open http://127.0.0.1:{bound}/", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # the way to stop it, not a failure
        print("TensorBoard stopped", flush=True)
        return 0
