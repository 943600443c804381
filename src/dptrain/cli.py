"""The `dptrain` commands: parse the arguments and call one function per command (checks in prestart.py,
launching in launch/).

    $ dptrain train --nproc-per-node 2 --train.epochs 3 --optim.lr 3e-4
    $ dptrain train --config run.toml --strategy.name single
    $ dptrain eval --checkpoint runs/run --nproc-per-node 2
    $ dptrain checkpoint list runs/run
    $ dptrain config --optim.lr 3e-4 > run.toml
    $ dptrain submit --nodes 2 --gpus-per-node 4 --time 02:00:00 --partition gpu --config run.toml
    $ dptrain tensorboard runs/run
    $ dptrain bench --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3
    $ dptrain report runs/bench/fmnist
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from dptrain import checkpoint, config as config_mod, spellings
from dptrain.config import RunConfig, SlurmConfig
from dptrain.data import describe
from dptrain.dist.ending import leave_now, lift_exit_deadline
from dptrain.dist.env import Nodes
from dptrain.dist.failures import WorkerFailure
from dptrain.errors import ConfigError, DataError, LaunchError, SnapshotError
from dptrain.launch.local import run_ranks, world_size_here
from dptrain.launch.rendezvous import rendezvous_times
from dptrain.prestart import (adopt_ds_config, check_elastic, check_predictions_path, preflight, preflight_job, resolve_batch,
                              snapshot_and_its_run)
from dptrain.run_folder import RunFolder
from dptrain.stopping import EXIT_STOPPED, Stopped

log = logging.getLogger("dptrain")

USER_ERRORS = (ConfigError, DataError, LaunchError, SnapshotError, WorkerFailure)


def split_overrides(extra: list[str]) -> list[tuple[str, str]]:
    """['--optim.lr', '3e-4', '--train.bf16=true'] -> [('optim.lr', '3e-4'), ('train.bf16', 'true')]."""
    pairs, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.option value.")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ConfigError(f"option --{key} needs a value, for example --{key} VALUE.")
            value, i = extra[i + 1], i + 1
        pairs.append((key, value))
        i += 1
    spellings.check_known(pairs)
    return pairs


def resolve_config(args: argparse.Namespace, extra: list[str]) -> RunConfig:
    overrides = split_overrides(extra)
    if args.nproc_per_node is not None:
        overrides.append(("launch.nproc_per_node", str(args.nproc_per_node)))
    return adopt_ds_config(config_mod.load(args.config, overrides), args.config, overrides)


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """The multi-node options of `dptrain train`, checked together."""
    return Nodes.from_options(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)


def planned_run(args: argparse.Namespace, extra: list[str]) -> tuple[RunConfig, int, bool, Nodes | None]:
    """(the configuration `dptrain train` runs with these arguments, its world size, whether a launcher outside dptrain
    started this process, its nodes), after every check made before a worker starts; train and config share it, so
    that config prints what train runs (the global batch of a per-rank one) and refuses what train refuses."""
    cfg = resolve_config(args, extra)
    nodes = nodes_of(args)
    world_size, launched_outside = world_size_here(cfg, nodes)
    if nodes is not None and nodes.elastic:
        check_elastic(cfg, nodes.fewest, nodes.count, world_size // nodes.count)
        rendezvous_times(cfg.launch.timeout_s, nodes)  # DPTRAIN_RDZV_*, checked in a dry run too
    cfg = resolve_batch(cfg, world_size)
    preflight(cfg, world_size)
    return cfg, world_size, launched_outside, nodes


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from dptrain.worker import train_worker

    cfg, world_size, launched_outside, nodes = planned_run(args, extra)
    if args.dry_run:
        from dptrain.dry_run import dry_run

        print(dry_run(cfg, world_size, launched_outside, nodes))
        return 0
    run_ranks(train_worker, (config_mod.to_dict(cfg),), cfg, world_size, launched_outside, cfg.output.folder.launcher_log,
              nodes)
    return 0


def cmd_submit(args: argparse.Namespace, extra: list[str]) -> int:
    """Write the run's sbatch script (and its config) into the run directory and submit it; print the job id."""
    from dptrain.slurm import job as slurm_job

    pairs = [*split_overrides(extra), *submit_overrides(args)]
    cfg = adopt_ds_config(config_mod.load(args.config, pairs), args.config, pairs)
    lines = job_lines(args)
    if lines:  # lines on the command line replace the file's list
        cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, **lines))
    workdir = Path.cwd()
    job = slurm_job.job_for(cfg, workdir)
    # job.toml keeps the batch as given: a batch per rank stays one, so that `sbatch --nodes=N job.sbatch` trains
    # N nodes' worth of it, as the tutorials' jobs do (each rank resolves it at the world size it finds)
    given = cfg
    cfg = resolve_batch(cfg, job.world_size)
    preflight_job(cfg, job.world_size)
    script = slurm_job.render(cfg, job, workdir, slurm_job.python_for(cfg.slurm))
    # the dry run too: a job no node can hold is the dry run's to find; where there is no sinfo (no cluster here),
    # nothing is checked, and the dry run prints the script all the same
    slurm_job.check_nodes_fit(cfg.slurm)
    if args.dry_run:
        print(script, end="")
        return 0
    RunFolder(job.run_dir).logs.mkdir(parents=True, exist_ok=True)
    job.config.write_text(config_mod.to_toml(given))
    job.script.write_text(script)
    job_id = slurm_job.submit(job.script)
    print(f"dptrain: submitted job {job_id} ({job.shape}, {job.mode}): {job.script}\n"
          f"  follow it: tail -f {job.output(job_id)}\n  its state: squeue -j {job_id}\n  cancel it: scancel {job_id}")
    return 0


JobOptionKind = Literal["value", "flag", "lines"]


def job_options(kind: JobOptionKind) -> list[str]:
    """The job options of one kind (add_job_options), in the order of SlurmConfig's fields: valued ones, flags (a
    bool field), repeatable lines (a list field)."""
    hints = typing.get_type_hints(SlurmConfig)
    return [f.name for f in dataclasses.fields(SlurmConfig) if job_option_kind(hints[f.name]) == kind]


def job_option_kind(tp: Any) -> JobOptionKind:
    if tp is bool:
        return "flag"
    return "lines" if typing.get_origin(tp) is tuple else "value"


def submit_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The job options (add_job_options) as slurm.* overrides (they win over the file's [slurm] table)."""
    pairs = [(f"slurm.{name}", str(getattr(args, name))) for name in job_options("value") if getattr(args, name) is not None]
    pairs += [(f"slurm.{flag}", "true") for flag in job_options("flag") if getattr(args, flag)]
    return pairs


def job_lines(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The repeatable job options given (--setup, --sbatch): they replace the file's lists of the same name."""
    return {name: tuple(getattr(args, name)) for name in job_options("lines") if getattr(args, name)}


def job_options_given(args: argparse.Namespace) -> list[str]:
    """The job options given on the command line, as they were spelled (--nodes, --setup, ...)."""
    given = [name for name in job_options("value") if getattr(args, name) is not None]
    given += [name for name in (*job_options("flag"), *job_options("lines")) if getattr(args, name)]
    return ["--" + name.replace("_", "-") for name in given]


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    """Evaluate a snapshot on the test split, sharded over the workers, with the run's own configuration."""
    from dptrain.worker import eval_worker

    predictions = str(Path(args.predictions).resolve()) if args.predictions else None
    if predictions:
        check_predictions_path(Path(predictions))
    snapshot, cfg, _ = snapshot_and_its_run(Path(args.checkpoint), split_overrides(extra), args.nproc_per_node, "eval")
    world_size, launched_outside = world_size_here(cfg)
    describe(cfg.data)  # the test split is there, before any worker starts
    run_ranks(eval_worker, (config_mod.to_dict(cfg), str(snapshot), predictions), cfg, world_size, launched_outside)
    return 0


def cmd_predict(args: argparse.Namespace, extra: list[str]) -> int:
    """Class probabilities of new inputs from a snapshot, sharded over the workers; one CSV row per input, in order."""
    from dptrain.predict import check_output_path, open_inputs, resolve_input, snapshot_input
    from dptrain.worker import predict_worker

    output = Path(args.output).resolve()
    check_output_path(output)
    snapshot, cfg, manifest = snapshot_and_its_run(Path(args.checkpoint), split_overrides(extra), args.nproc_per_node, "predict")
    world_size, launched_outside = world_size_here(cfg)
    spec = snapshot_input(manifest, cfg, snapshot)
    input_path = resolve_input(args.input)
    open_inputs(input_path, spec)  # a missing, damaged or wrong-shaped input file is refused here
    run_ranks(predict_worker, (config_mod.to_dict(cfg), str(snapshot), str(input_path), spec.record(), str(output),
                               args.skip_bad), cfg, world_size, launched_outside)
    return 0


def cmd_checkpoint(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain checkpoint --help.")
    path = Path(args.path)
    if args.action == "export":
        if args.output is None:
            raise ConfigError("checkpoint export needs a file to write: dptrain checkpoint export SNAPSHOT model.pt.")
        snapshot, cfg, manifest = snapshot_and_its_run(path, [], 1, "export")
        count = checkpoint.export_weights(cfg, snapshot, manifest, Path(args.output))
        print(f"{args.output}: {count} tensors of {snapshot}'s model ({cfg.model.name}), for torch.load(weights_only=True) "
              f"and load_state_dict")
        return 0
    if args.output is not None:
        raise ConfigError(f"unexpected argument {args.output!r}; checkpoint {args.action} takes one path.")
    if args.action == "verify":
        manifest = checkpoint.verify(path)
        print(f"{path}: ok: step {manifest['step']}, world size {manifest['world_size']}, strategy {manifest['strategy']}, "
              f"{len(manifest['files'])} files verified")
        return 0
    root = RunFolder(path).checkpoints if RunFolder(path).checkpoints.is_dir() else path
    rows = checkpoint.list_snapshots(root)
    if not rows:
        raise ConfigError(f"no snapshots in {root}; give a run directory or its checkpoints folder.")
    latest = (root / checkpoint.LATEST).read_text().strip() if (root / checkpoint.LATEST).is_file() else None
    for snapshot, status in rows:
        print(f"{snapshot}{'  (latest)' if snapshot.name == latest else ''}: {status}")
    return 0


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    """Print the config that `dptrain train` with the same arguments would run, as TOML that --config reads back."""
    cfg, _, _, _ = planned_run(args, extra)
    print(config_mod.to_toml(cfg), end="")
    return 0


def cmd_tensorboard(args: argparse.Namespace, extra: list[str]) -> int:
    """TensorBoard on 127.0.0.1 over one or more run directories' tb/ folders, until Ctrl-C."""
    from dptrain.metrics.tensorboard import serve

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain tensorboard --help.")
    return serve([Path(p) for p in args.run_dirs], args.port)


def tune_here_or_on_nodes(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """`dptrain bench --tune`: probe the candidates, write tuned.toml and the table of what was tried."""
    from dptrain.bench import tune
    from dptrain.bench.sweep import DEFAULT_RUN_TIMEOUT_S

    sweep_only = [option for option, given in (("--workers", args.workers), ("--repeats", args.repeats != 1),
                                               ("--engines", args.engines != "dptrain"),
                                               ("--strategies", args.strategies != "ddp,fsdp"),
                                               ("--dry-run", args.dry_run)) if given]
    if sweep_only:
        raise ConfigError(f"{sweep_only[0]} is an option of a sweep, not of --tune, which picks the strategy and the "
                          f"ranks itself; drop it.")
    tuner = tune.tuner_from_options(
        config_path=args.config, pairs=pairs, slurm=args.slurm,
        job_pairs=submit_overrides(args) if args.slurm else [], nodes=args.nodes, lossy=args.tune_lossy,
        link_name=args.link, keep=args.tune_candidates,
        run_timeout_s=DEFAULT_RUN_TIMEOUT_S if args.run_timeout_s is None else args.run_timeout_s)
    if args.slurm:
        from dptrain.bench import jobs

        jobs.require_clients()
    print(tune.tune(tuner))
    return 0


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    """A scaling sweep of real runs (workers x strategies x repeats), here or as SLURM jobs, then its CSVs; 1 when a
    point failed."""
    from dptrain.bench.collect import write_results
    from dptrain.bench.sweep import DEFAULT_RUN_TIMEOUT_S, run_sweep, sweep_from_options

    pairs = split_overrides(extra)
    if args.tune:
        if args.probes_from is not None:
            raise ConfigError("--probes-from is an option of a sweep, not of --tune (which reads link.json from its "
                              "own folder); drop it.")
        return tune_here_or_on_nodes(args, pairs)
    tune_only = [o for o, given in (("--tune-lossy", args.tune_lossy), ("--link", args.link),
                                     ("--tune-candidates", args.tune_candidates != 3)) if given]
    if tune_only:
        raise ConfigError(f"{tune_only[0]} is an option of --tune; add --tune, or drop it.")
    if args.slurm:
        if args.run_timeout_s is not None:
            raise ConfigError("--run-timeout-s limits runs on this machine; with --slurm each job's --time limits "
                              "its run.")
    else:
        given = [*job_options_given(args), *(f"--{key}" for key, _ in pairs if key.startswith("slurm."))]
        if given:
            raise ConfigError(f"{given[0]} is a job option; add --slurm to run every point as a SLURM job, or drop it.")
        if args.dry_run:
            raise ConfigError("--dry-run prints the jobs a --slurm sweep would submit; add --slurm, or drop it.")
    sweep, notes = sweep_from_options(config_path=args.config, pairs=pairs, workers=args.workers,
                                      strategies=args.strategies, repeats=args.repeats,
                                      warmup_epochs=args.warmup_epochs, engines=args.engines,
                                      run_timeout_s=DEFAULT_RUN_TIMEOUT_S if args.run_timeout_s is None else args.run_timeout_s,
                                      # bench's --nodes is a list (sweep.node_sweep), not slurm.nodes itself
                                      job_pairs=[pair for pair in submit_overrides(args) if pair[0] != "slurm.nodes"]
                                      if args.slurm else None,
                                      job_lines=job_lines(args), nodes=args.nodes, one_at_a_time=args.one_at_a_time)
    for note in notes:
        log.info(f"bench: {note}")
    if args.probes_from is not None:
        from dptrain.bench.sweep import adopt_probes

        copied = adopt_probes(Path(args.probes_from), sweep.bench_dir)
        log.info(f"bench: {', '.join(copied) or 'nothing'} taken from {args.probes_from} (--probes-from)")
    if args.slurm:
        from dptrain.bench import jobs

        if not args.dry_run:
            jobs.require_clients()
        for cfg, world_size in jobs.checks(sweep):  # every job's run, as dptrain submit checks it, before the first
            preflight_job(cfg, world_size)
        if args.dry_run:
            print(jobs.job_scripts_preview(sweep), end="")
            return 0
        jobs.check_nodes_fit(sweep)
        failures = jobs.run_jobs(sweep)
    else:
        failures = run_sweep(sweep)
    rows, summary = write_results(sweep.bench_dir)
    log.info(f"bench: {len(rows)} runs in {sweep.bench_dir / 'results.csv'}, {len(summary)} points in "
             f"{sweep.bench_dir / 'summary.csv'}; plots: dptrain report {sweep.bench_dir}")
    if failures:
        print(f"dptrain: {len(failures)} of the sweep's runs failed: "
              + "; ".join(f"{p.name}: {e}" for p, e in failures), file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    """Plots and report.md from a sweep's results.csv (rebuilt from its runs when missing), or one run's card."""
    from dptrain.bench.report import write_report
    from dptrain.bench.run_card import is_run_dir, write_run_card

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain report --help.")
    path = Path(args.bench_dir)
    if is_run_dir(path):
        for given, option in ((args.link, "--link"), (args.fitted_on, "--fitted-on")):
            if given:
                raise ConfigError(f"{option} draws the scaling model of a sweep; {path} is one run's folder, whose "
                                  f"card has no model: drop {option}.")
        print(write_run_card(path))
    else:
        print(write_report(path, link=args.link, fitted_on=Path(args.fitted_on) if args.fitted_on else None))
    return 0


def add_snapshot_options(command: argparse.ArgumentParser) -> None:
    """The options of the commands that run a snapshot's model (eval, predict); snapshot_and_its_run reads them."""
    command.add_argument("--checkpoint", required=True, help="a snapshot folder, or a run directory (its newest valid snapshot)")
    command.add_argument("--nproc-per-node", type=int, help="local workers to start (default 1)")


# What one item of a repeatable job option is, as --help names it: a LINE of the script unless said here.
JOB_ITEM_METAVARS = {"sbatch": "OPTION"}


def add_job_options(command: argparse.ArgumentParser, title: str, meaning: dict[str, str] | None = None,
                    as_text: tuple[str, ...] = ()) -> None:
    """The job's options, shared by submit and bench --slurm: one per field of SlurmConfig (--gpus-per-node sets
    slurm.gpus_per_node), its docstring as help unless `meaning` gives the command's own; submit_overrides and job_lines
    read them. Each defaults to None (or no flag, no line): the --config file's [slurm] table then decides. The
    fields in as_text are taken as text, which the command reads itself (bench's --nodes 1,2,4)."""
    job = command.add_argument_group(title)
    docs = config_mod.field_docs(SlurmConfig)
    hints = typing.get_type_hints(SlurmConfig)
    for f in dataclasses.fields(SlurmConfig):
        tp = hints[f.name]
        kind = job_option_kind(tp)
        text = " ".join((meaning or {}).get(f.name, docs.get(f.name, "")).split()).replace("%", "%%")  # % is argparse's
        option = "--" + f.name.replace("_", "-")
        if kind == "flag":
            job.add_argument(option, action="store_true", help=text)
        elif kind == "lines":
            job.add_argument(option, action="append", default=[], metavar=JOB_ITEM_METAVARS.get(f.name, "LINE"),
                             help=f"{text} (repeatable)")
        else:  # None where not given: the file's value, else the field's default (shown where there is one)
            shown = "" if f.default is None else f" (default: {f.default})"
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            typed = int if tp is int and f.name not in as_text else None
            job.add_argument(option, type=typed, choices=choices, help=text + shown)


def add_node_options(command: argparse.ArgumentParser) -> None:
    """torchrun's options for a run over several nodes (train's; config's too, as they set the world size);
    nodes_of reads them."""
    nodes = command.add_argument_group("several nodes (torchrun's options, same meaning; run the same command on every node)")
    nodes.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes of the run; each starts --nproc-per-node workers. MIN:MAX "
                       "(with --launch.max_restarts): after losing a node the run goes on with the others, from its "
                       "last snapshot, while MIN remain")
    nodes.add_argument("--node-rank", type=int, help="this node's index, 0 on the node at --master-addr (default under "
                       "srun: SLURM_NODEID)")
    nodes.add_argument("--master-addr", help="node 0's address, reachable from every node; its agent hosts the rendezvous there")
    nodes.add_argument("--master-port", type=int, help="the rendezvous port on node 0 (default 29500)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="--master-addr and --master-port in one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dptrain", description="Data-parallel training of image classifiers.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_run_options(command: argparse.ArgumentParser) -> None:
        """--config, --nproc-per-node, and, for --help only, every --section.option (split_overrides parses those)."""
        command.add_argument("--config", help="TOML file with [section] tables of options")
        command.add_argument("--nproc-per-node", help="local workers to start, or auto (same as --launch.nproc_per_node)")
        for section, text in config_mod.options_help().items():
            command.add_argument_group(f"[{section}] options", text)
        command.add_argument_group("the tutorials' spellings", spellings.help_text())

    overrides = ("Every option below can be set in the --config file's [section] table, or as\n"
                 "--section.option VALUE (or --section.option=VALUE), which wins over the file.")
    train = sub.add_parser("train", help="train a model", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=f"Train a model.\n{overrides}")
    add_run_options(train)
    train.add_argument("--dry-run", action="store_true",
                       help="check everything (config, world, data, model on one batch, output folder, snapshot to resume "
                            "from), print what the run would do, and exit without writing anything")
    add_node_options(train)
    train.set_defaults(func=cmd_train)
    submit = sub.add_parser(
        "submit",
        help="write the run's SLURM job script and submit it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check the run as `dptrain train` would, write RUN_DIR/job.sbatch and RUN_DIR/job.toml, submit the\n"
        "script with sbatch and print the job id. The options below set the [slurm] table's options of\n"
        "the same name (--slurm.OPTION VALUE works too); every other --section.option goes to the run.\n"
        "With slurm.signal_lead_s (default 120) the ranks write a snapshot before the time limit; with\n"
        f"--requeue the job then queues itself again and resumes.\n{overrides}",
    )
    submit.add_argument("--config", help="TOML file with [section] tables of options, [slurm] included")
    submit.add_argument("--dry-run", action="store_true", help="print the job script; write and submit nothing")
    add_job_options(submit, "the job (sbatch's options)")
    submit.set_defaults(func=cmd_submit)
    resolved = sub.add_parser(
        "config",
        help="print the resolved config as TOML",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print as TOML the config that `dptrain train` would run with these arguments, after the checks\n"
        f"train makes before it starts a worker; start nothing. Save it and run it with --config.\n{overrides}",
    )
    add_run_options(resolved)
    add_node_options(resolved)  # they set the world size, and with it the global batch of a per-rank one
    resolved.set_defaults(func=cmd_config)
    evaluation = sub.add_parser(
        "eval",
        help="evaluate a snapshot on the test split",
        description="Evaluate a snapshot on the test split, sharded over the workers with exact counts. "
        "Options of the run's config.toml can be overridden as --section.option VALUE (for example --data.root); "
        "dptrain train --help lists them all.",
    )
    add_snapshot_options(evaluation)
    evaluation.add_argument("--predictions", help="write index,label,predicted for every test sample to this CSV file")
    evaluation.set_defaults(func=cmd_eval)
    prediction = sub.add_parser(
        "predict",
        help="predict the classes of new inputs with a snapshot",
        description="Write class probabilities for new inputs (an IDX images file, a .npy array of pixel values 0..255, "
        "or a folder of PNG/JPEG images, resized), normalised as the training data was, sharded over the workers: "
        "one row per input, in input order. Options of the run's config.toml can be overridden as --section.option VALUE.",
    )
    add_snapshot_options(prediction)
    prediction.add_argument("--input", required=True, help="an IDX images file (.gz or raw), a .npy array, or a folder of PNG/JPEG images")
    prediction.add_argument("--output", required=True, help="the CSV file to write: index,source,predicted,prob_0..prob_K-1,error")
    prediction.add_argument("--skip-bad", action="store_true",
                            help="predict the readable inputs and mark unreadable ones in the error column (default: refuse)")
    prediction.set_defaults(func=cmd_predict)
    ckpt = sub.add_parser("checkpoint", help="list, verify or export snapshots")
    ckpt.add_argument("action", choices=("list", "verify", "export"),
                      help="list: every snapshot of a run; verify: check one; export: its model's weights as one file")
    ckpt.add_argument("path", help="list: a run directory (or its checkpoints folder); verify, export: a snapshot folder "
                                   "(export: or a run directory, for its newest valid snapshot)")
    ckpt.add_argument("output", nargs="?", help="export: the file to write (a new one), e.g. model.pt")
    ckpt.set_defaults(func=cmd_checkpoint)
    board = sub.add_parser(
        "tensorboard",
        help="watch runs in TensorBoard (on 127.0.0.1; prints the ssh tunnel line)",
        description="Start TensorBoard on 127.0.0.1 over the runs' tb/ folders, reloading every second, and print its "
        "URL and the ssh command that reaches it from a laptop. Runs until Ctrl-C.",
    )
    board.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, such as runs/run")
    board.add_argument("--port", type=int, help="the port to listen on (default: a free one)")
    board.set_defaults(func=cmd_tensorboard)
    bench = sub.add_parser(
        "bench",
        help="measure scaling: one run per worker count, strategy and repeat",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run `dptrain train` once per point of workers x strategies x repeats, one at a time, under\n"
        "OUTPUT_DIR/runs/<engine>-<strategy>-w<W>-r<R>/, then write OUTPUT_DIR/results.csv and summary.csv.\n"
        "Running it again runs only the points not yet finished. Before the points, a short matmul probe per worker\n"
        "count goes to OUTPUT_DIR/peak.json (results.csv's peak_tflops and fraction_of_peak). --output.dir is the\n"
        "sweep's folder (default runs/bench/<data.name>); every other --section.option VALUE goes to every run (see\n"
        "dptrain train --help).\n"
        "With --slurm every point is a SLURM job (as dptrain submit writes it), all submitted at once, then\n"
        "waited for; --nodes 1,2,4 runs each point on that many whole nodes of R ranks (--ranks-per-node, else\n"
        "--gpus-per-node, else 1). With --workers instead, a point of W workers takes W/R nodes (W a multiple of R),\n"
        "or W ranks on one node when W < R, and --nodes is the most a point may take. The other engines run as jobs\n"
        "too: one torchrun per node, meeting at the first node.",
    )
    bench.add_argument("--config", help="TOML file with [section] tables of options, for every run")
    bench.add_argument("--workers", help="comma-separated worker counts (default 1,2,4,8, without those above the "
                       "machine's CPU cores, or GPUs on a GPU run)")
    bench.add_argument("--strategies", default="ddp,fsdp", help="comma-separated strategies (default ddp,fsdp)")
    bench.add_argument("--repeats", type=int, default=1, help="runs of every point (default 1; 3 or more for error bars)")
    bench.add_argument("--warmup-epochs", type=int, help="leading epochs of each run left out of the timing "
                       "(default 1 when train.epochs > 1, else 0)")
    from dptrain.bench.sweep import OTHER_ENGINES  # no torch: the other engines' strategies, named where they are defined

    peers = ", ".join(f"{name} ({', '.join(engine.STRATEGIES)})" for name, engine in OTHER_ENGINES.items())
    bench.add_argument("--engines", default="dptrain", help=f"comma-separated engines: dptrain (the default), {peers}; "
                       f"tutorial is the tutorials' plain loop. With several, each runs the strategies it supports and "
                       f"skips the others")
    bench.add_argument("--run-timeout-s", type=float,
                       help="seconds one run may take before it is stopped and recorded as failed (default 3600; "
                       "not with --slurm, where --time limits each job)")
    bench.add_argument("--slurm", action="store_true", help="run every point as a SLURM job, submitted with sbatch")
    bench.add_argument("--probes-from", metavar="DIR",
                       help="take this machine's matmul and link probes (peak.json, link.json) from an earlier sweep's "
                            "folder DIR instead of probing again; what they lack is still probed")
    bench.add_argument("--one-at-a-time", action="store_true",
                       help="with --slurm: submit each job once the one before has ended, for nodes that share one "
                            "machine's cores (the lab cluster of docs/lab-cluster.md) or to time each point alone")
    bench.add_argument("--tune", action="store_true",
                       help="instead of a sweep: find how to run this configuration fastest (strategy, ranks per node, "
                            "DDP's bucket size; the math stays) from short probes the scaling model picks; writes "
                            "tuned.toml (see docs/benchmark.md)")
    bench.add_argument("--tune-lossy", action="store_true",
                       help="with --tune: also try the compressing comm hooks fp16, bf16, powersgd (they round the gradients)")
    bench.add_argument("--tune-candidates", type=int, default=3, metavar="N",
                       help="with --tune: the candidates probed besides your configuration, the model's N best (default 3)")
    bench.add_argument("--link", metavar="NAME", help="with --tune: the link between nodes for the model: 100mbit, "
                       "1gbit, 10gbit, 100gbit (default: link.json of the tune folder, measured here on one node)")
    bench.add_argument("--dry-run", action="store_true", help="with --slurm: print the jobs it would submit; write and "
                       "submit nothing")
    add_job_options(bench, "the jobs of --slurm (sbatch's options, as dptrain submit takes them)",
                    {"nodes": "comma-separated node counts, each point on that many whole nodes of --ranks-per-node "
                              "ranks (e.g. 1,2,4); with --workers, one number: the most nodes a point may "
                              "take"}, as_text=("nodes",))
    bench.set_defaults(func=cmd_bench)
    report = sub.add_parser(
        "report",
        help="plots and report.md of a bench sweep, or one run's card",
        description="Of a sweep: write BENCH_DIR/{epoch_time,speedup,validation,memory}.png and BENCH_DIR/report.md "
        "(which embeds them with the summary table, and the scaling model where link.json is there) from "
        "BENCH_DIR/results.csv, rebuilt from BENCH_DIR/runs when missing. Of one run: its card, RUN_DIR/report/report.md "
        "with its plots (configuration, environment, curves, throughput, communication, memory, starts and snapshots).",
    )
    report.add_argument("bench_dir", metavar="BENCH_DIR|RUN_DIR", help="a `dptrain bench` sweep's --output.dir (its "
                        "plots and report.md), or one run's folder (its card: RUN_DIR/report/report.md)")
    report.add_argument("--link", metavar="NAME", help="with the sweep's link.json: also predict for a named link, "
                        "100mbit, 1gbit, 10gbit or 100gbit (docs/scaling-model.md)")
    report.add_argument("--fitted-on", metavar="BENCH_DIR", help="predict every point of this sweep with the model "
                        "fitted on another sweep's folder (a sweep over another link, say) and give the errors")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:  # a spelling refused by translate is a user error like any other below
        args, extra = parser.parse_known_args(spellings.translate(sys.argv[1:] if argv is None else argv))
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        return args.func(args, extra)
    except USER_ERRORS as exc:
        print(f"dptrain: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (ConfigError, DataError, SnapshotError)) else 1
    except Stopped as exc:
        print(f"dptrain: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("dptrain: interrupted", file=sys.stderr)
        return 130
    finally:  # a failed rank's teardown is over: this process leaves now (run) or lives on (a caller in tests)
        lift_exit_deadline()


def run() -> None:
    """The `dptrain` program: main(), then leave at once, without Python's teardown (see dist.ending.leave_now)."""
    try:
        code = main()
    except BrokenPipeError:  # `dptrain ... | head -3`: the reader has what it wanted; no traceback, as `cat` gives none
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush on the way out goes nowhere
        code = 1
    leave_now(code)


if __name__ == "__main__":
    run()
