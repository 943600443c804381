"""One rank's life, for training and for evaluation: join the world, do the work, leave. Failures name the rank and phase."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from dptrain import snapshots, config as config_mod
from dptrain.config import RunConfig
from dptrain.distributed.ending import AGENT_PID, agent_restarts_this_worker, exit_deadline
from dptrain.distributed.env import DistEnv
from dptrain.distributed.failures import PeerWatch, Phase, WorkerFailure, end_with_failure, needs_peer_watch, own_client
from dptrain.distributed.hangs import HangWatch, hang_after_s
from dptrain.distributed.world import (barrier, destroy_process_group, host_name, init_process_group, pick_backend,
                                     placement, where_each_rank_runs)
from dptrain.errors import DataError, OutputError
from dptrain.events import (AGENT_RESTARTS, DATA, DEVICE, EVAL_EVENT, EVENT, GLOBAL_BATCH_SIZE, MESSAGE, MODEL, RUN_END_EVENT,
                            RUN_START_EVENT, SLURM_JOB_ID, SLURM_RESTARTS, SNAPSHOT, STEP, STOPPED_EVENT, STRATEGY,
                            TOTAL_STEPS, WORLD_SIZE)
from dptrain.files import written_atomically
from dptrain.metrics import (CONSOLE, EVERY_RANK, EpochLineSink, EventLog, JsonlSink, MetricLineSink, RankEpochSink,
                             gpu_log, run_epochs, tensorboard)
from dptrain.metrics.trackers import open_trackers
from dptrain.run_folder import RunFolder
from dptrain.runtime import (bf16_autocast, keep_freed_memory, pick_device, seed_everything, set_cpu_threads,
                             use_deterministic_kernels)
from dptrain.slurm.env import slurm_count, slurm_value
from dptrain.slurm.requeue import requeue_after_stop
from dptrain.stopping import EXIT_LEFT, EXIT_STOPPED, NodeLeaves, Stopped
from dptrain.strategies.registry import STRATEGIES

log = logging.getLogger("dptrain")


def rank_log(run_dir: Path, global_rank: int) -> Path:
    """logs/rank<R>.log of a run: the rank's log lines, and the stacks of a failed rank that was slow to leave."""
    return RunFolder(run_dir).rank_log(global_rank)


class LogFile(logging.FileHandler):
    """A log file of a run (a rank's, the launcher's) that a full disk leaves quiet: no '--- Logging error ---' traceback
    on stderr per record, which buried the one sentence saying what failed under 78 lines. The lines wait in the file's
    buffer and go out with a later record once the failed write has freed its space (or are lost with the buffer)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not isinstance(sys.exc_info()[1], OSError):  # our own mistakes (a bad format) still say so
            super().handleError(record)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the last buffered lines could not be written either
            super().close()


def setup_logging(run_dir: Path | None, env: DistEnv) -> None:
    """Rank 0 logs INFO to the console, other ranks WARNING and the INFO records marked EVERY_RANK (their epoch lines,
    with output.rank_epoch_lines); with a run_dir, every rank logs INFO to logs/rank<R>.log."""
    from rich.logging import RichHandler

    root = logging.getLogger()
    for handler in list(root.handlers):  # a second run in this process starts afresh
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter(f"%(asctime)s rank{env.global_rank} %(levelname)s %(message)s")
    if run_dir is not None:
        RunFolder(run_dir).logs.mkdir(parents=True, exist_ok=True)
        file_handler = LogFile(rank_log(run_dir, env.global_rank))
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    if CONSOLE.is_terminal and env.is_main:
        console: logging.Handler = RichHandler(console=CONSOLE, show_path=False, markup=False)
    else:  # plain lines for files and pipes (SLURM output, CI): one record per line, parseable
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
    console.setLevel(logging.INFO)
    console.addFilter(functools.partial(on_console, env.is_main))
    root.addHandler(console)


def on_console(is_main: bool, record: logging.LogRecord) -> bool:
    """Whether the console shows a record: never one marked file_only; on rank 0 the rest; on another rank its
    warnings and errors, and what is marked EVERY_RANK."""
    if getattr(record, "file_only", False):
        return False
    return is_main or record.levelno >= logging.WARNING or getattr(record, EVERY_RANK, False)


def environment_record(env: DistEnv, device: torch.device, threads: int, where: dict[str, int]) -> dict[str, Any]:
    """What produced a result: versions, hardware, source revision, where the ranks ran (world.placement) (written as
    env.json)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    return {
        "dptrain_git_sha": sha, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "host": host_name(), "world_size": env.world_size, "launched_by": env.source,
        "device": str(device), "cpu_threads_per_rank": threads, **where,
    }


def gpu_index(cfg: RunConfig, env: DistEnv) -> int:
    """The GPU this rank takes where it runs on GPUs, as its strategy says (Strategy.gpu_index: its local rank, or the
    first GPU of those one process drives)."""
    return STRATEGIES[cfg.strategy.name].gpu_index(cfg, env.local_rank)


def join_world(cfg: RunConfig, env: DistEnv, phase: Phase) -> tuple[torch.device, int]:
    """Device, CPU threads, seeds, process group and a first barrier: (device, threads per rank)."""
    with phase("set-up"):
        if cfg.train.deterministic:
            use_deterministic_kernels()
        device = pick_device(cfg.launch.device, gpu_index(cfg, env))
        threads = set_cpu_threads(env)
        keep_freed_memory()
        seed_everything(cfg.train.seed)
    with phase("rendezvous"):
        store = init_process_group(env, device, cfg.launch.timeout_s, cfg.launch.backend)
    if store is not None and env.world_size > 1:  # from now on a failed collective names the silent ranks
        # The survivors of a failure check in within moments of each other; a quarter of a short timeout is plenty.
        phase.world = (store, env, min(5.0, cfg.launch.timeout_s / 4))
        if needs_peer_watch(pick_backend(cfg.launch.backend, device)):
            # Half the timeout: a lost peer is named before NCCL's own watchdog aborts this process unnamed at the
            # timeout; still far above any pause of a live rank's pulse thread.
            silence_s = cfg.launch.timeout_s / 2
            with phase("rendezvous"):
                phase.watch = PeerWatch(own_client(env, silence_s), env, phase, silence_s).start()
        with phase("rendezvous"):  # a collective that overruns ends the run with the ranks' verdict (distributed/hangs.py)
            phase.hang = watch_hangs(cfg, env, phase) if cfg.launch.watch else None
    with phase("first collective"):
        barrier()
    return device, threads


def watch_hangs(cfg: RunConfig, env: DistEnv, phase: Phase) -> HangWatch:
    """This rank's HangWatch, on a store client of its own (a main thread blocked in a store wait must not hold it up)."""
    store = own_client(env, min(5.0, hang_after_s(cfg.launch.timeout_s) / 4))
    metrics = cfg.output.folder.metrics if cfg.output.run_dir is not None else None
    return HangWatch(store, env.global_rank, env.world_size, host_name(), cfg.launch.timeout_s,
                     end=lambda sentence: end_with_failure(WorkerFailure(sentence)), metrics=metrics,
                     phase=lambda: phase.name).start()


@contextlib.contextmanager
def rank_life(cfg: RunConfig, log_dir: Path | None) -> Iterator[tuple[DistEnv, Phase, torch.device, int]]:
    """Start-up and teardown shared by every kind of rank: logging, device, process group; then leave the world.

    Yields (env, phase, device, CPU threads). A failure is logged as its one line in this rank's log, then re-raised.
    """
    env = DistEnv.from_environ()
    phase = Phase(env.global_rank)
    setup_logging(log_dir, env)
    try:
        device, threads = join_world(cfg, env, phase)
        yield env, phase, device, threads
    except Stopped:
        raise
    except Exception as exc:
        # In this rank's log file only, with its traceback: the launcher (or the CLI) prints the one sentence once
        # for all ranks.
        log.error("%s", exc, exc_info=exc, extra={"file_only": True})
        if env.world_size > 1:  # the teardown below may wait on a peer that is gone
            exit_deadline(exc, rank_log(log_dir, env.global_rank) if log_dir is not None else None)
        if phase.watch is not None:  # after the error file: this rank's own failure is the run's first
            phase.watch.stop(finished=False)
        raise
    finally:
        if phase.hang is not None:
            phase.hang.stop()
        if phase.watch is not None:  # finished, or stopped by a signal with the others (after a failure: done above)
            phase.watch.stop(finished=True)
        destroy_process_group()


def started_by(env: DistEnv) -> str:
    """Who started this rank, as the run's first line names it: dptrain's own agent sets AGENT_PID for its workers
    (env.source says torchrun there too, from the variables the agent gives them)."""
    if os.environ.get(AGENT_PID):
        return "dptrain's elastic agent"
    return {"torchrun": "torchrun", "slurm": "srun", "none": "one process"}[env.source]


def train_worker(cfg_tree: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every training rank (called in this process, by the elastic agent, or under torchrun/srun)."""
    from dptrain.train import build_trainer

    cfg = config_mod.from_dict(cfg_tree)
    run_dir = cfg.output.run_dir
    events = EventLog([])
    step = 0
    try:
        run = RunFolder(run_dir) if run_dir is not None else None
        # logs/gpu_rank<R>.log on a GPU with NVML, for the rank's whole life; nothing elsewhere
        with rank_life(cfg, run_dir) as (env, phase, device, threads), gpu_log(run, env.global_rank, device):
            if env.is_main:
                events = EventLog([JsonlSink(cfg.output.folder.metrics), MetricLineSink()])
                log.info("world size %d (%s), device %s, backend %s, %d CPU threads per rank, run dir %s",
                         env.world_size, started_by(env), device, torch.distributed.get_backend(), threads, run_dir)
            trainer = build_trainer(cfg, env, device, events, phase)
            step = trainer.state.step
            with phase("placement of the ranks"):
                everyone = where_each_rank_runs()  # every rank: a collective
                where = placement(everyone)
                trainer.hosts = [host for host, _ in everyone]
            if env.is_main:  # only now: a refused resume leaves the run folder as it was
                record = environment_record(env, device, threads, where)
                with phase("writing config.toml and env.json"):
                    write_run_file(cfg.output.folder.config, config_mod.to_toml(cfg))
                    write_run_file(cfg.output.folder.env, json.dumps(record, indent=2) + "\n")
                    make_weights_folder(cfg.output.weights.parent)  # the tutorials' --model_dir, made as their scripts do
                # runs/<name>/tb/: continues the curves of an earlier process from this run's step on
                num_epochs = run_epochs(cfg.train.epochs, trainer.total_steps, len(trainer.train_loader))
                board = tensorboard.open_sink(run_dir, step, config_mod.to_dict(cfg), config_mod.to_toml(cfg), record,
                                              num_epochs)
                if board is not None:
                    events.sinks.append(board)
                events.sinks.extend(open_trackers(cfg))  # output.trackers: MLflow, W&B, each on a thread of its own
                # after the [METRIC] line, which stays as it is: scripts parse that one, people read this one
                events.sinks.append(EpochLineSink(num_epochs))
            # every rank, its own numbers, in its own log (the other ranks' logs had no line per epoch)
            events.sinks.append(RankEpochSink(env.global_rank, lambda: trainer.state, device,
                                              on_console=cfg.output.rank_epoch_lines))
            events.emit(RUN_START_EVENT.name, **{
                WORLD_SIZE: env.world_size, STRATEGY: cfg.strategy.name, MODEL: cfg.model.name, DATA: trainer.info.name,
                GLOBAL_BATCH_SIZE: cfg.train.global_batch_size, TOTAL_STEPS: trainer.total_steps, DEVICE: str(device),
                STEP: step}, **restart_counts())
            try:
                last = trainer.fit()
            finally:
                step = trainer.state.step
            events.emit(RUN_END_EVENT.name, **{STEP: step})
            return last
    except NodeLeaves as exc:  # launch.leave_slow_node: its snapshot is written, on every rank
        events.emit(STOPPED_EVENT.name, **{STEP: step, MESSAGE: str(exc)})
        log.warning("%s", exc, extra={"file_only": True})  # in every rank's log
        env = DistEnv.from_environ()
        if exc.leaving and env.local_rank == 0:  # the leaving node's console; the others' agents say how they go on
            print(f"dptrain: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_LEFT if exc.leaving else EXIT_STOPPED) from None
    except Stopped as exc:
        events.emit(STOPPED_EVENT.name, **{STEP: step, MESSAGE: str(exc)})
        # Where dptrain's agent restarts the workers (a lost node of an elastic run), the stop is no end of the run and
        # the agent's console says how it goes on: "run the same command" would be wrong there.
        goes_on = agent_restarts_this_worker()
        log.warning("%s", exc, extra={"file_only": goes_on})  # in every rank's log: which rank saw the signal
        if DistEnv.from_environ().is_main:
            if not goes_on:
                print(f"dptrain: {exc}", file=sys.stderr, flush=True)
            requeue_after_stop(step, events.emit)
        raise SystemExit(EXIT_STOPPED) from None  # the same documented code on every rank, under any launcher
    finally:
        events.close()


def write_run_file(path: Path, text: str) -> None:
    """One of the run's own files, replaced atomically (a resume rewrites them); a full disk is one sentence."""
    try:
        with written_atomically(path) as tmp:
            tmp.write_text(text)
    except OSError as exc:
        raise OutputError(f"could not write {path} ({exc.strerror or exc}); free space or fix permissions there, "
                          f"then run the same command.") from exc


def make_weights_folder(folder: Path) -> None:
    """The folder output.weights_dir names, made at the start (the preflight checked that it can be): the weights are
    written there at the end, and a missing folder then cost the run (a full disk is one sentence)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"could not make {folder} for the final weights ({exc.strerror or exc}); fix permissions "
                          f"there or give another --output.weights_dir, then run the same command.") from exc


def restart_counts() -> dict[str, int]:
    """How many times this run's processes were started again: by SLURM (a requeue) and by the elastic agent."""
    counts = {}
    if (requeues := slurm_count("restarts")) is not None:
        counts[SLURM_RESTARTS] = requeues
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "").isdigit():
        counts[AGENT_RESTARTS] = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if job_id := slurm_value("job_id"):
        counts.setdefault(SLURM_RESTARTS, 0)
        counts[SLURM_JOB_ID] = job_id
    return counts


def eval_worker(cfg_tree: dict[str, Any], snapshot: str, predictions_path: str | None) -> dict[str, Any]:
    """Entry point of every rank of `dptrain eval`: the snapshot's weights in a plain model, on the test split only."""
    from dptrain.data import build_test_loader
    from dptrain.evaluate import evaluate, write_test_predictions
    from dptrain.metrics import metric_line

    cfg = config_mod.from_dict(cfg_tree)
    with rank_life(cfg, None) as (env, phase, device, _):
        with phase("loading the test split"):
            info, loader = build_test_loader(cfg.data, device=device, eval_batch=cfg.train.eval_batch_size,
                                             rank=env.global_rank, world_size=env.world_size, seed=cfg.train.seed,
                                             channels_last=cfg.train.channels_last)
        with phase(f"loading the weights of {snapshot}"):
            model, manifest = snapshots.snapshot_model(cfg, Path(snapshot), info.image_shape, info.num_classes, device)
        autocast = functools.partial(bf16_autocast, device, cfg.train.bf16)
        rows: list[torch.Tensor] | None = [] if predictions_path else None
        with phase("evaluation"):
            result = evaluate(model, loader, autocast, _all_reduce, rows)
        if rows is not None and predictions_path is not None:
            with phase("gathering predictions"):
                mine = torch.cat(rows) if rows else torch.empty(0, 3, dtype=torch.long)
                everyone: list[Any] = [None] * env.world_size
                torch.distributed.all_gather_object(everyone, mine)
                if env.is_main:
                    table = torch.cat(everyone)
                    write_test_predictions(table[table[:, 0].argsort()], Path(predictions_path))
        if env.is_main:
            record = {EVENT: EVAL_EVENT.name, SNAPSHOT: snapshot, STEP: manifest["step"], WORLD_SIZE: env.world_size,
                      **result}
            log.info(metric_line(record))
            if predictions_path:
                log.info("predictions for %d test samples written to %s", result["eval_count"], predictions_path)
        return result


def predict_worker(cfg_tree: dict[str, Any], snapshot: str, input_path: str, input_record: dict[str, Any], output: str,
                   skip_bad: bool) -> None:
    """Entry point of every rank of `dptrain predict`: this rank's share of the inputs, gathered once by rank 0."""
    from dptrain.predict import (InputSpec, merge_shares, open_inputs, predict_share, unreadable_sentence,
                                 write_input_predictions)

    cfg = config_mod.from_dict(cfg_tree)
    spec = InputSpec.from_record(input_record, f"snapshot {snapshot}")
    with rank_life(cfg, None) as (env, phase, device, _):
        with phase(f"loading the weights of {snapshot}"):
            model, _ = snapshots.snapshot_model(cfg, Path(snapshot), spec.shape, spec.num_classes, device)
        with phase(f"opening {input_path}"):
            inputs = open_inputs(Path(input_path), spec)
        autocast = functools.partial(bf16_autocast, device, cfg.train.bf16)
        with phase("prediction"):
            share = predict_share(model, inputs, spec, rank=env.global_rank, world_size=env.world_size,
                                  batch_size=cfg.train.eval_batch_size, device=device, autocast=autocast)
        with phase("gathering predictions"):  # the one collective: every rank's share to rank 0
            shares: list[Any] | None = [None] * env.world_size if env.is_main else None
            torch.distributed.gather_object(share, shares, dst=0)
        if not env.is_main:
            return
        probs, errors = merge_shares(shares or [], len(inputs), spec.num_classes)
        if errors and not skip_bad:  # raised outside a phase: the user reads this sentence alone
            raise DataError(unreadable_sentence(inputs, errors, Path(input_path)))
        with phase(f"writing {output}"):
            write_input_predictions(inputs, probs, errors, Path(output))
        log.info("predictions for %d inputs written to %s%s", len(inputs), output,
                 f" ({len(errors)} unreadable, marked in the error column)" if errors else "")


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor
