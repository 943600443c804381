"""The `dptrain` commands: parse the arguments and call one function per command (checks in prestart.py,
launching in launch/).

    $ dptrain train --nproc-per-node 2 --train.epochs 3 --optim.lr 3e-4
    $ dptrain train --config run.toml --strategy.name single
    $ dptrain train --nproc-per-node 2 -- my_train.py --epochs 5     (a script of yours, as torchrun starts it)
    $ dptrain eval --checkpoint runs/fashion-mnist_mnist-cnn_ddp --nproc-per-node 2
    $ dptrain checkpoint list runs/fashion-mnist_mnist-cnn_ddp
    $ dptrain config --optim.lr 3e-4 > run.toml
    $ dptrain submit --nodes 2 --gpus-per-node 4 --time 02:00:00 --partition gpu --config run.toml
    $ dptrain submit --nodes 2 --gres gpu:4 -- my_train.py --epochs 5     (a script of yours, one torchrun per node)
    $ dptrain tensorboard runs/fashion-mnist_mnist-cnn_ddp
    $ dptrain card runs/fashion-mnist_mnist-cnn_ddp
    $ dptrain doctor --nnodes 2 --node-rank 0 --master-addr node0 --config run.toml
    $ dptrain doctor --slurm --config run.toml     (as a job on the [slurm] table's nodes)
    $ dptrain bench ...; dptrain report ...     (the measuring lab's commands, from dptrain_bench: see its cli.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

from dptrain import config as config_mod, snapshots, spellings, user_script
from dptrain.config import RunConfig
from dptrain.data import describe
from dptrain.distributed.ending import leave_now, lift_exit_deadline
from dptrain.distributed.env import Nodes
from dptrain.distributed.failures import WorkerFailure
from dptrain.command_line import (add_job_options, add_sbatch_names, job_files, job_lines, sbatch_name_pairs,
                                  sbatch_name_words, split_overrides, submit_overrides, with_sbatch_names)
from dptrain.errors import ConfigError, DataError, LaunchError, SnapshotError
from dptrain.launch.local import run_ranks, world_size_here
from dptrain.plan import plan
from dptrain.prestart import (batch_split, check_output_dir, check_predictions_path, refuse_leave_slow_node_for_a_script,
                              snapshot_and_its_run)
from dptrain.run_folder import RunFolder
from dptrain.snapshots import elsewhere
from dptrain.stopping import EXIT_STOPPED, Stopped

log = logging.getLogger("dptrain")

COMMAND_PLUGINS = "dptrain.commands"  # the entry-point group of commands other packages add
USER_ERRORS = (ConfigError, DataError, LaunchError, SnapshotError, WorkerFailure)


def run_overrides(args: argparse.Namespace, extra: list[str]) -> list[tuple[str, str]]:
    """The --section.option pairs of train, config and doctor, --nproc-per-node among them."""
    overrides = split_overrides(extra)
    if args.nproc_per_node is not None:
        overrides.append(("launch.nproc_per_node", str(args.nproc_per_node)))
    return overrides


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """The multi-node options of `dptrain train`, checked together."""
    return Nodes.from_options(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from dptrain.worker import train_worker

    if args.user_script is not None:
        return train_user_script(args, extra)
    run = plan(args.config, run_overrides(args, extra), nodes_of(args))
    if args.dry_run:
        from dptrain.dry_run import dry_run

        print(dry_run(run.cfg, run.world_size, run.launched_outside, run.nodes))
        return 0
    run_ranks(train_worker, (config_mod.to_dict(run.cfg),), run.cfg, run.world_size, run.launched_outside,
              run.cfg.output.folder.launcher_log, run.nodes)
    return 0


def train_user_script(args: argparse.Namespace, extra: list[str]) -> int:
    """`dptrain train [options] -- my_train.py ARGS`: the user's script on this node's workers, as torchrun starts it
    (launch/user_script.py); only --output.*, --launch.* and the node options are dptrain's then."""
    from dptrain.launch.user_script import EXAMPLE, SCRIPT_SECTIONS, run_script

    script = user_script.from_words(args.user_script, Path.cwd(), EXAMPLE, "each worker")
    overrides = run_overrides(args, extra)
    user_script.refuse_trainer_options(overrides, SCRIPT_SECTIONS, "this launch")
    cfg = user_script.named_after(config_mod.load(args.config, overrides), script, overrides)
    refuse_leave_slow_node_for_a_script(cfg)
    return run_script(script, cfg, nodes_of(args), args.dry_run)


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    """Check the world this configuration would train in, from every node: one table, doctor.json; 1 on a failure."""
    from dptrain.doctor.command import run_doctor, run_doctor_job

    nodes = None if args.slurm else nodes_of(args)
    run = plan(args.config, run_overrides(args, extra), nodes, checked=False)  # the doctor's checks are its own
    check_output_dir(run.cfg.output.run_dir)  # doctor.json goes there (and the doctor's job with --slurm)
    if args.slurm:
        given = [f"--{name.replace('_', '-')}" for name in ("nnodes", "node_rank", "master_addr", "master_port",
                                                              "rdzv_endpoint") if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"{given[0]} means nothing with --slurm, whose job places the nodes; give the job's "
                              f"shape as --slurm.nodes N (and the other --slurm.* options) instead.")
        return run_doctor_job(run.given, args.dry_run)
    if args.dry_run:
        raise ConfigError("--dry-run prints the doctor's job script, so it needs --slurm; without it, run the doctor.")
    return run_doctor(run.cfg, run.world_size, run.launched_outside, run.nodes)


def cmd_submit(args: argparse.Namespace, extra: list[str]) -> int:
    """Write the run's sbatch script (and its config) into the run folder and submit it; print the job id. With a
    script of the user's after `--`, the job runs that script under one torchrun per node instead, or with --mode
    per-rank as one srun task per rank (slurm/user_script.py). With --rehearse, its twins first (rehearsal.py)."""
    from dptrain.slurm import partition, user_script as job_script

    workdir = Path.cwd()
    overrides = split_overrides(extra)
    script = None if args.user_script is None else job_script.job_script(args.user_script, workdir)
    if script is not None:
        job_script.refuse_options_of_the_trainer(overrides)
    if args.then_submit and not args.rehearse:
        raise ConfigError("--then-submit submits the job after its rehearsal, so it needs --rehearse; without it, "
                          "dptrain submit submits the job at once.")
    pairs = [*overrides, *submit_overrides(args), *sbatch_name_pairs(args)]
    run, job, text = planned_job(args, pairs, script, workdir, job_files(args))
    # the dry run too: a job no node can hold is the dry run's to find; where there is no sinfo (no cluster here),
    # nothing is checked, and the dry run prints the script all the same
    partition.check_nodes_fit(run.cfg.slurm)
    if args.dry_run:
        print(text, end="")
        return 0
    if args.rehearse:
        from dptrain import rehearsal

        twins = {name: planned_job(args, [*pairs, *rehearsal.twin_overrides(run.cfg, job, name, args.rehearse_steps,
                                                                             args.rehearse_drills, script is None)],
                                   script, workdir, {"name": f"{job.name}-{name}"})
                 for name in (rehearsal.TWINS if script is None else rehearsal.SCRIPT_TWINS)}
        table = rehearsal.rehearse(run.cfg, job, twins, script is not None, args.rehearse_drills)
        if table.failed or not args.then_submit:
            return 1 if table.failed else 0
    job_id = submit_job(run, job, text, script is None)
    print(f"dptrain: submitted job {job_id} ({job.shape}, {job.mode}): {job.script}\n"
          f"  follow it: tail -f {job.output(job_id)}\n  its state: squeue -j {job_id}\n  cancel it: scancel {job_id}")
    return 0


def planned_job(args: argparse.Namespace, pairs: list[tuple[str, str]], script: Any, workdir: Path,
                files: dict[str, str | None]) -> tuple[Any, Any, str]:
    """(the plan, the job, its script's text) of `dptrain submit` with these option pairs: a script of the user's
    (script) or dptrain's training; files: the job's own --job-name, --output and --error."""
    from dptrain.slurm import job as slurm_job, script as slurm_script, user_script as job_script

    job: slurm_job.Job | None = None

    def shape(cfg: RunConfig) -> tuple[RunConfig, int]:
        """The job's options in cfg, then its job and world size."""
        nonlocal job
        lines = job_lines(args)
        if lines:  # lines on the command line replace the file's list
            cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, **lines))
        if script is not None:  # its shape first: --cpus-per-task is then per torchrun, one a node
            given = {key.removeprefix("slurm.") for key, _ in pairs if key.startswith("slurm.")}
            cfg = dataclasses.replace(cfg, slurm=job_script.user_script_shape(cfg.slurm, given))
        cfg = dataclasses.replace(cfg, slurm=with_sbatch_names(args, cfg.slurm))
        if script is not None:
            cfg = user_script.named_after(cfg, script, pairs)
        job = slurm_job.job_for(cfg, workdir, **files)
        return cfg, job.world_size

    # the trainer's job: the strategy's files taken in, the batch resolved and checked (its job.toml keeps the batch
    # as given: a batch per rank stays one, so that `sbatch --nodes=N job.sbatch` trains N nodes' worth of it, as the
    # tutorials' jobs do); a script's: its options are its own
    run = plan(args.config, pairs, job=shape, trainer=script is None)
    assert job is not None
    if script is None:
        return run, job, slurm_script.render(run.cfg, job)
    # no job.toml: the script reads its own options; its logs/ and job.sbatch go to its run folder
    check_output_dir(job.run_dir)
    return run, job, slurm_script.render(run.cfg, job, job_script.script_command(run.cfg, job, script))


def submit_job(run: Any, job: Any, text: str, writes_config: bool) -> str:
    """Write the job's files (job.toml where writes_config, job.sbatch) and sbatch it: its id."""
    from dptrain.slurm import queue

    return queue.submit_written(job, text, config_mod.to_toml(run.given) if writes_config else None)


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
        count = snapshots.export_weights(cfg, snapshot, manifest, Path(args.output))
        reader = ("safetensors.torch.load_file" if Path(args.output).suffix == snapshots.SAFETENSORS
                  else "torch.load(weights_only=True)")
        print(f"{args.output}: {count} tensors of {snapshot}'s model ({cfg.model.name}), for {reader} and load_state_dict")
        return 0
    if args.python is not None and args.action != "verify":
        raise ConfigError(f"--python names the interpreter checkpoint verify loads the snapshot in; checkpoint "
                          f"{args.action} takes no --python.")
    if args.output is not None:
        raise ConfigError(f"unexpected argument {args.output!r}; checkpoint {args.action} takes one path.")
    if args.action == "verify":
        python = elsewhere.interpreter(args.python) if args.python is not None else None
        manifest = snapshots.verify(path)
        print(f"{path}: ok: step {manifest['step']}, world size {manifest['world_size']}, strategy {manifest['strategy']}, "
              f"{len(manifest['files'])} files verified (written by torch {manifest.get('torch', 'unknown')})")
        if python is None:
            return 0
        there = elsewhere.probe_with(python, path)
        print(f"under {python} (torch {there['torch']}):")
        for part, status, detail in there["parts"]:
            print(f"  {part}: {status}: {detail}")
        failed = [part for part, status, _ in there["parts"] if status != "ok"]
        if failed:
            print(f"dptrain: {len(failed)} of {len(there['parts'])} parts of {path} do not load under torch "
                  f"{there['torch']} ({failed[0]} first); resume or evaluate it with torch {manifest.get('torch')}.",
                  file=sys.stderr)
        return 1 if failed else 0
    root = RunFolder(path).checkpoints if RunFolder(path).checkpoints.is_dir() else path
    rows = snapshots.list_snapshots(root)
    if not rows:
        raise ConfigError(f"no snapshots in {root}; give a run folder or its checkpoints folder.")
    latest = (root / snapshots.LATEST).read_text().strip() if (root / snapshots.LATEST).is_file() else None
    for snapshot, status in rows:
        print(f"{snapshot}{'  (latest)' if snapshot.name == latest else ''}: {status}")
    return 0


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    """Print the config that `dptrain train` with the same arguments would run, as TOML that --config reads back."""
    planned = plan(args.config, run_overrides(args, extra), nodes_of(args))
    # a comment that --config reads past: how the batch is shared out at this world size
    print(f"# batches: {batch_split(planned.cfg, planned.world_size)}, at world size {planned.world_size}")
    print(config_mod.to_toml(planned.cfg), end="")
    return 0


def cmd_tensorboard(args: argparse.Namespace, extra: list[str]) -> int:
    """TensorBoard on 127.0.0.1 over one or more run folders' tb/ folders, until Ctrl-C."""
    from dptrain.metrics.tensorboard import serve

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain tensorboard --help.")
    return serve([Path(p) for p in args.run_dirs], args.port)


def cmd_card(args: argparse.Namespace, extra: list[str]) -> int:
    """One run's card: RUN_DIR/card/card.md and its plots, from the run's own files."""
    from dptrain.reporting.run_card import write_run_card

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain card --help.")
    print(write_run_card(Path(args.run_dir)))
    return 0


def add_plugin_commands(sub: Any) -> None:
    """The commands other installed packages add (entry points of the group dptrain.commands, each a function
    that takes the subparsers): the measuring lab's `dptrain bench` and `dptrain report` come this way, so that the
    library never imports the lab."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMAND_PLUGINS), key=lambda e: e.name):
        entry.load()(sub)


def add_snapshot_options(command: argparse.ArgumentParser) -> None:
    """The options of the commands that run a snapshot's model (eval, predict); snapshot_and_its_run reads them."""
    command.add_argument("--checkpoint", required=True, help="a snapshot folder, or a run folder (its newest valid snapshot)")
    command.add_argument("--nproc-per-node", type=int, help="local workers to start (default 1)")


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
                           description=f"Train a model.\n{overrides}\n\n"
        "dptrain train [--nproc-per-node N] [node options] -- my_train.py --epochs 5 (or -- python my_train.py ...,\n"
        "-- -m pkg.train ...) runs a training script of your own on N local workers, as torchrun starts it (a\n"
        "free port, RANK, LOCAL_RANK, WORLD_SIZE); only --output.* and --launch.* are dptrain's then.")
    add_run_options(train)
    train.add_argument("--dry-run", action="store_true",
                       help="check everything (config, world, data, model on one batch, output folder, snapshot to resume "
                            "from), print what the run would do, and exit without writing anything")
    add_node_options(train)
    train.set_defaults(func=cmd_train, user_script=None)  # the words after --: main() takes them
    submit = sub.add_parser(
        "submit",
        help="write the run's SLURM job script and submit it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check the run as `dptrain train` would, write RUN_DIR/job.sbatch and RUN_DIR/job.toml, submit the\n"
        "script with sbatch and print the job id. The options below set the [slurm] table's options of\n"
        "the same name (--slurm.OPTION VALUE works too); every other --section.option goes to the run.\n"
        "With slurm.signal_lead_s (default 120) the ranks write a snapshot before the time limit; with\n"
        "--requeue the job then queues itself again and resumes.\n\n"
        "dptrain submit [job options] -- my_train.py --epochs 5 (or -- python my_train.py ..., -- -m pkg.train ...)\n"
        "runs a training script of your own in the same job, under one torchrun per node (rank 0 on the first\n"
        "node); only the job's options and --output.* are dptrain's then, the rest after -- is the script's.\n"
        f"{overrides}",
    )
    submit.add_argument("--config", help="TOML file with [section] tables of options, [slurm] included")
    submit.add_argument("--dry-run", action="store_true", help="print the job script; write and submit nothing")
    rehearse = submit.add_argument_group("a rehearsal of the job's preemption (before the job itself)")
    rehearse.add_argument("--rehearse", action="store_true",
                          help="submit short twins of the job instead (same partition, account, container, nodes and "
                               "options), signal them as SLURM would before the time limit, and print one table: the "
                               "signal on every rank, the snapshot verified, the requeue and its resume, equal to an "
                               "uninterrupted twin, signal-to-snapshot times and the --signal-lead-s they need; written "
                               "to RUN_DIR/rehearsal.md; the job itself is not submitted unless --then-submit")
    rehearse.add_argument("--then-submit", action="store_true", help="submit the job after a rehearsal that found no failure")
    rehearse.add_argument("--rehearse-steps", type=int, default=200, metavar="N",
                          help="steps each twin trains (default 200): room for the signals, then the resume")
    rehearse.add_argument("--rehearse-drills", type=int, default=4, metavar="N",
                          help="signals before the stop that write their snapshot and let the twin go on, for the "
                               "timing's p50 and p95 (default 4)")
    submit.set_defaults(user_script=None)  # the words after --: main() takes them (user_script_words)
    add_job_options(submit, "the job (sbatch's options)")
    add_sbatch_names(submit)
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
    ckpt.add_argument("path", help="list: a run folder (or its checkpoints folder); verify, export: a snapshot folder "
                                   "(export: or a run folder, for its newest valid snapshot)")
    ckpt.add_argument("output", nargs="?", help="export: the file to write (a new one), e.g. model.pt, or model.safetensors "
                                                "for safetensors")
    ckpt.add_argument("--python", metavar="PATH", help="verify: also load the snapshot's parts in this interpreter or "
                                                       "virtual environment (another torch) and report each")
    ckpt.set_defaults(func=cmd_checkpoint)
    board = sub.add_parser(
        "tensorboard",
        help="watch runs in TensorBoard (on 127.0.0.1; prints the ssh tunnel line)",
        description="Start TensorBoard on 127.0.0.1 over the runs' tb/ folders, reloading every second, and print its "
        "URL and the ssh command that reaches it from a laptop. Runs until Ctrl-C.",
    )
    board.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                       help="run folders, such as runs/fashion-mnist_mnist-cnn_ddp")
    board.add_argument("--port", type=int, help="the port to listen on (default: a free one)")
    board.set_defaults(func=cmd_tensorboard)
    doctor = sub.add_parser(
        "doctor", help="check the nodes, network, files and devices a run would use, before it hangs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start the ranks as `dptrain train` would with the same options (local workers, --nnodes/\n"
        "--node-rank/--master-addr on each node, or under torchrun or srun), check what would break or slow a\n"
        "multi-node run (names, ports, the interface, versions, the run folder, the dataset, disk, /dev/shm, GPUs,\n"
        "a straggler node or link), print one table on node 0 and write RUN_DIR/doctor.json; exit 1 when a check\n"
        "fails. Bounded: ranks that never all meet are named within --launch.timeout_s (30 s at most).\n\n"
        + overrides)
    add_run_options(doctor)
    doctor.add_argument("--slurm", action="store_true",
                        help="run it as a SLURM job on the nodes of the config's [slurm] table (--slurm.nodes 2, ...), "
                             "started as `dptrain submit` starts training; wait for its end and print node 0's table")
    doctor.add_argument("--dry-run", action="store_true", help="with --slurm: print the job's script; submit nothing")
    add_node_options(doctor)
    doctor.set_defaults(func=cmd_doctor)
    card = sub.add_parser(
        "card",
        help="one run's card: RUN_DIR/card/card.md with its plots",
        description="Write RUN_DIR/card/card.md with its plots (configuration, environment, curves, throughput, "
        "communication, memory, starts and snapshots) from the run's own files, offline; prints its path.",
    )
    card.add_argument("run_dir", metavar="RUN_DIR", help="a run's folder, such as runs/fashion-mnist_mnist-cnn_ddp")
    card.set_defaults(func=cmd_card)
    add_plugin_commands(sub)
    return parser


def translated(argv: list[str]) -> list[str]:
    """argv as the parser reads it, with the tutorials' spellings read as dptrain's (spellings.translate); submit's
    sbatch names (--gpus, --gres: command_line.SBATCH_NAMES) are submit's own options, left as they are, and the words
    after submit's -- (the user's script and its arguments: user_script_words) are left out, its own."""
    argv, _ = user_script_words(argv)
    if argv[:1] != ["submit"]:
        return spellings.translate(argv)
    named, rest = sbatch_name_words(argv[1:])
    return [*spellings.translate(["submit", *rest]), *named]


def user_script_words(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(argv up to `dptrain submit`'s or `dptrain train`'s --, the words after it: the user's training command, left
    untranslated, as the script's own options; None without a --)."""
    if argv[:1] not in (["submit"], ["train"]) or "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:  # a spelling refused by translate is a user error like any other below
        words, script_words = user_script_words(sys.argv[1:] if argv is None else argv)
        args, extra = parser.parse_known_args(translated(words))
        if script_words is not None:
            args.user_script = script_words
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
