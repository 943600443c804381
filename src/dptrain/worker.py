"""One rank's life: join the world, build the run, fit, leave. Every failure names the rank and phase."""

from __future__ import annotations

import json
import logging
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from dptrain import config as config_mod
from dptrain.config import RunConfig
from dptrain.launch.env import DistEnv
from dptrain.metrics import CONSOLE, EventLog, JsonlSink, MetricLineSink
from dptrain.runtime import (Phase, barrier, destroy_process_group, init_process_group, pick_device, seed_everything,
                             set_cpu_threads, use_deterministic_kernels)
from dptrain.stopping import EXIT_STOPPED, Stopped

log = logging.getLogger("dptrain")


def setup_logging(run_dir: Path | None, env: DistEnv) -> None:
    """Rank 0 logs INFO to the console, other ranks WARNING; with a run_dir, every rank logs INFO to logs/rank<R>.log."""
    from rich.logging import RichHandler

    root = logging.getLogger()
    for handler in list(root.handlers):  # a second run in this process starts afresh
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter(f"%(asctime)s rank{env.global_rank} %(levelname)s %(message)s")
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "logs" / f"rank{env.global_rank}.log")
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    if CONSOLE.is_terminal and env.is_main:
        console: logging.Handler = RichHandler(console=CONSOLE, show_path=False, markup=False)
    else:  # plain lines for files and pipes (SLURM output, CI): one record per line, parseable
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
    console.setLevel(logging.INFO if env.is_main else logging.WARNING)
    root.addHandler(console)


def environment_record(env: DistEnv, device: torch.device, threads: int) -> dict[str, Any]:
    """What produced a result: versions, hardware, source revision (written as env.json)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    return {
        "dptrain_git_sha": sha, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "host": socket.gethostname(), "world_size": env.world_size, "launched_by": env.source,
        "device": str(device), "cpu_threads_per_rank": threads,
    }


def join_world(cfg: RunConfig, env: DistEnv, phase: Phase) -> tuple[torch.device, int]:
    """Device, CPU threads, seeds, process group and a first barrier: (device, threads per rank)."""
    with phase("set-up"):
        if cfg.train.deterministic:
            use_deterministic_kernels()
        device = pick_device(cfg.launch.device, env.local_rank)
        threads = set_cpu_threads(env.local_world_size)
        seed_everything(cfg.train.seed)
    with phase("rendezvous"):
        store = init_process_group(env, device, cfg.launch.timeout_s)
    if store is not None and env.world_size > 1:  # from now on a failed collective names the silent ranks
        phase.world = (store, env, min(5.0, cfg.launch.timeout_s))
    with phase("first collective"):
        barrier()
    return device, threads


def run_worker(cfg_tree: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every rank (called in this process, by the elastic agent, or under torchrun/srun)."""
    cfg = config_mod.from_dict(cfg_tree)
    env = DistEnv.from_environ()
    phase = Phase(env.global_rank)
    run_dir = cfg.output.run_dir
    setup_logging(run_dir, env)
    events = EventLog([JsonlSink(run_dir / "metrics.jsonl"), MetricLineSink()] if env.is_main else [])
    try:
        device, threads = join_world(cfg, env, phase)
        if env.is_main:
            log.info("world size %d (%s), device %s, backend %s, %d CPU threads per rank, run dir %s",
                     env.world_size, env.source, device, torch.distributed.get_backend(), threads, run_dir)
        from dptrain.train import build

        run = build(cfg, env, device, events, phase)
        if env.is_main:  # only now: a refused resume leaves the run directory as it was
            (run_dir / "config.toml").write_text(config_mod.to_toml(cfg))
            (run_dir / "env.json").write_text(json.dumps(environment_record(env, device, threads), indent=2) + "\n")
        events.emit("run_start", world_size=env.world_size, strategy=cfg.strategy.name, model=cfg.model.name,
                    data=run.info.name, global_batch_size=cfg.train.global_batch_size, total_steps=run.total_steps, device=str(device))
        last = run.fit()
        events.emit("run_end", step=run.step)
        return last
    except Stopped as exc:
        events.emit("stopped", step=run.step, message=str(exc))
        log.warning("%s", exc)  # in every rank's log: which rank saw the signal
        if env.is_main:
            print(f"dptrain: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STOPPED) from None  # the same documented code on every rank, under any launcher
    except Exception as exc:
        log.error("%s", exc)  # the one line, also in this rank's log file
        raise
    finally:
        events.close()
        destroy_process_group()
