"""The measuring lab's commands, added to `dptrain` through the entry point dptrain.commands (pyproject.toml):
`dptrain bench sweep | tune | probe matmul | probe link | probe hooks` and `dptrain report` (a sweep's plots and report.md).

    $ dptrain bench sweep --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3
    $ dptrain bench tune --config run.toml
    $ dptrain bench probe matmul --workers 1,2
    $ dptrain bench probe link --world 2 --record runs/bench/fmnist
    $ dptrain report runs/bench/fmnist

`dptrain` hands everything after `bench` to this module (parse_bench): each subcommand's parser takes only its own
options, so one given to another subcommand is refused here in one sentence that names the subcommand taking it.
The spellings of before the subcommands, `dptrain bench --workers ...` and `dptrain bench --tune ...`, still work,
with one line of note.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dptrain.command_line import add_job_options, job_lines, job_options_given, split_overrides, submit_overrides
from dptrain.errors import ConfigError
from dptrain.prestart import preflight_job

log = logging.getLogger("dptrain")

# What a spelling of before the subcommands means now: `dptrain bench --tune ...` is `bench tune`, any other `bench
# ...` a sweep (its options are those of `bench sweep`)
OLD_TUNE_FLAG = "--tune"
HELP_FLAGS = ("-h", "--help")
SUBCOMMANDS = ("sweep", "tune", "probe")


def cmd_sweep(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """A scaling sweep of real runs (workers x strategies x repeats), here or as SLURM jobs, then its CSVs; 1 when a
    point failed."""
    from dptrain_bench.collect import write_results
    from dptrain_bench.folder import BenchFolder
    from dptrain_bench.sweep import DEFAULT_RUN_TIMEOUT_S, run_sweep, sweep_from_options

    check_job_options(args, pairs)
    if args.slurm and args.run_timeout_s is not None:
        raise ConfigError("--run-timeout-s limits runs on this machine; with --slurm each job's --time limits its run.")
    if args.dry_run and not args.slurm:
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
        from dptrain_bench.sweep import adopt_probes

        copied = adopt_probes(Path(args.probes_from), sweep.bench_dir)
        log.info(f"bench: {', '.join(copied) or 'nothing'} taken from {args.probes_from} (--probes-from)")
    if args.slurm:
        from dptrain_bench import jobs

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
    folder = BenchFolder(sweep.bench_dir)
    log.info(f"bench: {len(rows)} runs in {folder.results}, {len(summary)} points in {folder.summary}; plots: "
             f"dptrain report {sweep.bench_dir}")
    if failures:
        print(f"dptrain: {len(failures)} of the sweep's runs failed: "
              + "; ".join(f"{p.name}: {e}" for p, e in failures), file=sys.stderr)
        return 1
    return 0


def cmd_tune(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """`dptrain bench tune`: try the candidates, write tuned.toml and the table of what was tried."""
    from dptrain_bench import tune
    from dptrain_bench.sweep import DEFAULT_RUN_TIMEOUT_S

    check_job_options(args, pairs, each="trial")
    lines = job_lines(args)
    if lines:  # tune's trial jobs take the [slurm] table of --config as it is (tune.tuner_from_options)
        name = next(iter(lines))
        raise ConfigError(f"--{name} lines are not passed to bench tune's jobs; write them in the --config file's "
                          f"[slurm] table ({name} = [...]) instead.")
    tuner = tune.tuner_from_options(
        config_path=args.config, pairs=pairs, slurm=args.slurm,
        job_pairs=submit_overrides(args) if args.slurm else [], nodes=args.nodes, lossy=args.lossy,
        link_name=args.link, keep=args.candidates, accuracy_budget=args.accuracy_budget,
        accuracy_steps=args.accuracy_steps,
        run_timeout_s=DEFAULT_RUN_TIMEOUT_S if args.run_timeout_s is None else args.run_timeout_s)
    if args.slurm:
        from dptrain_bench import jobs

        jobs.require_clients()
    print(tune.tune(tuner))
    return 0


def check_job_options(args: argparse.Namespace, pairs: list[tuple[str, str]], each: str = "point") -> None:
    """The job options (and --slurm.* pairs) are those of the jobs of --slurm: refused without it, in one sentence.
    Tune's --nodes is left to tune.tuner_from_options, which says what it means there."""
    if args.slurm:
        return
    given = [*job_options_given(args), *(f"--{key}" for key, _ in pairs if key.startswith("slurm."))]
    if each == "trial":
        given = [option for option in given if option != "--nodes"]
    if given:
        raise ConfigError(f"{given[0]} is a job option; add --slurm to run every {each} as a SLURM job, or drop it.")


def cmd_probe_matmul(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """The matmul probe of each process count, in a fresh Python (peak.measure), printed."""
    from dptrain_bench import peak
    from dptrain_bench.sweep import parse_counts

    counts = parse_counts(args.workers, "--workers", "process")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is below 1; give the threads of each process, or drop it.")
    try:
        probes = peak.measure(counts, args.device, args.dtype, threads=args.threads)
    except RuntimeError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({str(w): p.to_dict() for w, p in probes.items()}) if args.json else peak.describe(probes))
    return 0


def cmd_probe_link(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """The link probe between processes of this machine (in a fresh Python, link.measure), or as one rank of the
    world a launcher started (--launched); printed, and added to BENCH/link.json with --record."""
    from dptrain_bench import link
    from dptrain_bench.sweep import parse_counts

    sizes = parse_counts(args.sizes, "--sizes", "byte") if args.sizes else None
    if args.min_s <= 0:
        raise ConfigError(f"--min-s {args.min_s} is not positive; give the seconds of calls per round, e.g. 0.05.")
    try:
        if args.launched:
            launched = link.probe_launched(sizes, args.min_s)
            if launched is None:  # a rank other than 0 of the launched world: rank 0 prints and records
                return 0
            probes = [launched]
        else:
            worlds = parse_counts(args.world, "--world", "process")
            if worlds[0] < 2:
                raise ConfigError(f"--world {args.world}: a link needs two processes or more; give counts of 2 or "
                                  f"more.")
            probes = list(link.measure(worlds, args.device, sizes=sizes, min_s=args.min_s).values())
    except RuntimeError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    if args.record:
        link.record_probes(Path(args.record), probes)
    print(link.show(probes, args.json))
    return 0


def cmd_probe_hooks(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """The hook probe on the run's model (--config and --section.option pairs), in a fresh Python; printed, and
    written into BENCH/hooks.json with --record."""
    from dptrain import config as config_mod
    from dptrain.data import describe
    from dptrain_bench import hook_probe

    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is below 1; give the threads of a rank, or drop it.")
    if args.ranks < 2:
        raise ConfigError(f"--ranks {args.ranks}: the hooks exchange between 2 ranks or more; give 2 or more.")
    cfg = config_mod.load(args.config, pairs)
    info = describe(cfg.data)
    wanted = hook_probe.HookProbe(model=cfg.model.name, image_shape=tuple(info.image_shape),
                                  num_classes=info.num_classes,
                                  batch=hook_probe.batch_per_rank(cfg.train.global_batch_size, args.ranks),
                                  threads=args.threads, powersgd_rank=cfg.strategy.ddp.powersgd_rank, cpu_s={})
    try:
        probe = hook_probe.record(Path(args.record), wanted) if args.record else hook_probe.measure(wanted)
    except RuntimeError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(probe.to_dict()) if args.json else hook_probe.describe(probe))
    return 0


def add_sweep_options(sweep: argparse.ArgumentParser) -> None:
    from dptrain_bench.sweep import OTHER_ENGINES  # no torch: the other engines' strategies, named where they are defined

    sweep.add_argument("--config", help="TOML file with [section] tables of options, for every run")
    sweep.add_argument("--workers", help="comma-separated worker counts (default 1,2,4,8, without those above the "
                       "machine's CPU cores, or GPUs on a GPU run)")
    sweep.add_argument("--strategies", default="ddp,fsdp", help="comma-separated strategies (default ddp,fsdp)")
    sweep.add_argument("--repeats", type=int, default=1, help="runs of every point (default 1; 3 or more for error bars)")
    sweep.add_argument("--warmup-epochs", type=int, help="leading epochs of each run left out of the timing "
                       "(default 1 when train.epochs > 1, else 0)")
    peers = ", ".join(f"{name} ({', '.join(engine.STRATEGIES)})" for name, engine in OTHER_ENGINES.items())
    sweep.add_argument("--engines", default="dptrain", help=f"comma-separated engines: dptrain (the default), {peers}; "
                       f"tutorial is the tutorials' plain loop. With several, each runs the strategies it supports and "
                       f"skips the others")
    sweep.add_argument("--run-timeout-s", type=float,
                       help="seconds one run may take before it is stopped and recorded as failed (default 3600; "
                       "not with --slurm, where --time limits each job)")
    sweep.add_argument("--slurm", action="store_true", help="run every point as a SLURM job, submitted with sbatch")
    sweep.add_argument("--probes-from", metavar="DIR",
                       help="take this machine's matmul and link probes (peak.json, link.json) from an earlier sweep's "
                            "folder DIR instead of probing again; what they lack is still probed")
    sweep.add_argument("--one-at-a-time", action="store_true",
                       help="with --slurm: submit each job once the one before has ended, for nodes that share one "
                            "machine's cores (the lab cluster of docs/lab-cluster.md) or to time each point alone")
    sweep.add_argument("--dry-run", action="store_true", help="with --slurm: print the jobs it would submit; write and "
                       "submit nothing")
    add_job_options(sweep, "the jobs of --slurm (sbatch's options, as dptrain submit takes them)",
                    {"nodes": "comma-separated node counts, each point on that many whole nodes of --ranks-per-node "
                              "ranks (e.g. 1,2,4); with --workers, one number: the most nodes a point may "
                              "take"}, as_text=("nodes",))


def add_tune_options(tune: argparse.ArgumentParser) -> None:
    tune.add_argument("--config", help="TOML file with [section] tables of options: the configuration to tune")
    tune.add_argument("--accuracy-budget", type=float, metavar="POINTS",
                      help="also try what rounds or delays the gradients (the fp16, bf16 and powersgd hooks, local_sgd "
                      "and diloco at several periods), each chosen only where a short accuracy probe ends within "
                      "POINTS of exact ddp's evaluation accuracy (default: exact candidates only)")
    tune.add_argument("--accuracy-steps", type=int, metavar="N",
                      help="steps of each accuracy probe (default: an epoch's, at most the run's)")
    tune.add_argument("--lossy", "--tune-lossy", dest="lossy", action="store_true",
                      help="the candidates of --accuracy-budget, which it needs (kept for the spelling of before)")
    tune.add_argument("--candidates", "--tune-candidates", dest="candidates", type=int, default=3, metavar="N",
                      help="the candidates tried besides your configuration, the model's N best (default 3)")
    tune.add_argument("--link", metavar="NAME", help="the link between nodes for the model: 100mbit, 1gbit, 10gbit, "
                      "100gbit (default: link.json of the tune folder, measured here on one node)")
    tune.add_argument("--run-timeout-s", type=float,
                      help="seconds one trial run may take before it is stopped and counted as failed (default 3600)")
    tune.add_argument("--slurm", action="store_true", help="run every trial as a SLURM job, submitted with sbatch")
    add_job_options(tune, "the jobs of --slurm (sbatch's options, as dptrain submit takes them; --setup and --sbatch "
                    "lines go in the --config file's [slurm] table)",
                    {"nodes": "the one node count to tune for (e.g. 2)"}, as_text=("nodes",))


def bench_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of everything after `dptrain bench`, and each subcommand's own parser by its words ("sweep",
    "tune", "probe matmul", "probe link")."""
    from dptrain_bench import link, peak

    parser = argparse.ArgumentParser(
        prog="dptrain bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The measuring lab: a scaling sweep of real runs, the tuning of one configuration, and the probes\n"
        "the scaling model stands on. `dptrain bench SUBCOMMAND --help` gives each one's options.")
    commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    sweep = commands.add_parser(
        "sweep",
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
        "too: one torchrun per node, meeting at the first node.")
    add_sweep_options(sweep)
    sweep.set_defaults(run=cmd_sweep)
    tune = commands.add_parser(
        "tune",
        help="find how to run one configuration fastest, from short trial runs the scaling model picks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find how to run this configuration fastest (strategy, ranks per node, DDP's bucket size; the\n"
        "math stays) from short trial runs the scaling model picks, here or as SLURM jobs on --nodes nodes; write\n"
        "OUTPUT_DIR/tuned.toml (your configuration with the choice), tune.csv and tune.md (what was tried, and why).\n"
        "--output.dir is the tune folder (default runs/tune/<data.name>); every other --section.option VALUE is\n"
        "your configuration (see docs/benchmark.md).")
    add_tune_options(tune)
    tune.set_defaults(run=cmd_tune)
    probe = commands.add_parser(
        "probe", help="the matmul, link or hook probe alone: what the processes compute, how fast they talk",
        description="The probes a sweep runs before its points, run alone and printed.")
    probes = probe.add_subparsers(dest="probe", metavar="PROBE", required=True)
    matmul = probes.add_parser(
        "matmul", help="what W processes of this machine get together from square matmuls (peak.json's probe)",
        description="What W processes of this machine get together from square matmuls, W at once as a point's W "
        "ranks run: the denominator of fraction_of_peak (a sweep records it in BENCH/peak.json).")
    peak.add_options(matmul)
    matmul.set_defaults(run=cmd_probe_matmul)
    link_probe = probes.add_parser(
        "link", help="the collectives' times between processes, fitted to a latency and a bandwidth (link.json's probe)",
        description="The times of all_reduce, reduce_scatter, all_gather and broadcast between W processes at a few "
        "sizes, fitted to a latency and a bandwidth: the scaling model's link (docs/scaling-model.md). Across hosts, "
        "start it as one task per host (srun, or torchrun --no-python) with --launched.")
    link.add_options(link_probe)
    link_probe.set_defaults(run=cmd_probe_link)
    hooks = probes.add_parser(
        "hooks", help="what the compressing hooks, local SGD's averaging and DiLoCo's outer step cost a rank's CPU "
        "(hooks.json's probe)",
        description="What each way of exchanging with work of its own costs a rank's CPU besides its bytes, on the "
        "run's model (--config, --section.option): the fp16, bf16 and PowerSGD hooks a step, local SGD's averaging and "
        "DiLoCo's outer step each time: the scaling model's own CPU (docs/scaling-model.md).")
    hooks.add_argument("--config", help="TOML file with [section] tables of options: the run whose model is probed")
    hooks.add_argument("--threads", type=int, default=1, help="CPU threads of a rank (default 1)")
    hooks.add_argument("--ranks", type=int, default=2, help="ranks sharing the global batch: a rank's batch is its "
                       "share (default 2)")
    hooks.add_argument("--record", metavar="BENCH", help="write the probe into BENCH/hooks.json")
    hooks.add_argument("--json", action="store_true", help="print the probe as JSON")
    hooks.set_defaults(run=cmd_probe_hooks)
    return parser, {"sweep": sweep, "tune": tune, "probe matmul": matmul, "probe link": link_probe,
                    "probe hooks": hooks}


def with_subcommand(words: list[str]) -> list[str]:
    """The words after `dptrain bench`, a spelling of before the subcommands turned into the subcommand it means,
    with one line of note: `bench --tune ...` is `bench tune ...`, any other `bench ...` is `bench sweep ...`."""
    if words and (words[0] in SUBCOMMANDS or words[0] in HELP_FLAGS):
        return words
    if OLD_TUNE_FLAG in words:
        log.info("bench: note: `dptrain bench --tune ...` is `dptrain bench tune ...` now; read as that")
        return ["tune", *[word for word in words if word != OLD_TUNE_FLAG]]
    log.info("bench: note: `dptrain bench ...` without a subcommand is `dptrain bench sweep ...` now; read as that")
    return ["sweep", *words]


def refuse_other_commands_options(commands: dict[str, argparse.ArgumentParser], this: str, extra: list[str]) -> None:
    """An option of another subcommand, which this one's parser left over: one sentence naming the ones taking it."""
    takers: dict[str, list[str]] = {}
    for name, command in commands.items():
        for action in command._actions:  # argparse keeps a parser's options there; no public accessor
            for option in action.option_strings:
                takers.setdefault(option, []).append(name)
    for word in extra:
        option = word.split("=", 1)[0]
        if option == OLD_TUNE_FLAG:  # `bench sweep --tune`: the flag of before the subcommands, after one
            raise ConfigError(f"--tune is the subcommand `dptrain bench tune` now; run that instead of `dptrain bench "
                              f"{this}`.")
        if option in takers and this not in takers[option]:
            named = [f"`dptrain bench {name}`" for name in takers[option]]
            others = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
            raise ConfigError(f"{option} is an option of {others}, not of `dptrain bench {this}`; drop it, or run "
                              f"{'that subcommand' if len(takers[option]) == 1 else 'one of those'}.")


def parse_bench(words: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """The words after `dptrain bench` -> (the subcommand's options, with its function as .run; the --section.option
    pairs of sweep and tune). ConfigError in one sentence for an option of another subcommand."""
    parser, commands = bench_parsers()
    args, extra = parser.parse_known_args(with_subcommand(words))
    this = args.subcommand if args.subcommand != "probe" else f"probe {args.probe}"
    refuse_other_commands_options(commands, this, extra)
    if args.subcommand == "probe" and args.probe != "hooks":  # the probes of the machine take no --section.option
        if extra:
            raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain bench {this} --help.")
        return args, []
    return args, split_overrides(extra)


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    """`dptrain bench ...`: everything after `bench` reaches here unparsed (the parser `dptrain` registers takes no
    options), and the lab's own parser reads it."""
    bench_args, pairs = parse_bench(extra)
    return bench_args.run(bench_args, pairs)


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    """Plots and report.md from a sweep's results.csv (rebuilt from its runs when missing); given one run's folder,
    its card, with a note that `dptrain card` is its command now."""
    from dptrain_bench.report import write_report
    from dptrain.reporting.run_card import write_run_card
    from dptrain.reporting.run_record import is_run_dir

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain report --help.")
    path = Path(args.bench_dir)
    if is_run_dir(path):
        for given, option in ((args.link, "--link"), (args.fitted_on, "--fitted-on"),
                              (args.accuracy_budget, "--accuracy-budget")):
            if given:
                raise ConfigError(f"{option} draws the scaling model of a sweep; {path} is one run's folder, whose "
                                  f"card has no model: drop {option}.")
        log.info(f"report: {path} is one run's folder; its card is `dptrain card {path}` now")
        print(write_run_card(path))
    else:
        if args.accuracy_budget is not None and not 0 < args.accuracy_budget <= 100:
            raise ConfigError(f"--accuracy-budget {args.accuracy_budget:g} is no number of accuracy points between 0 "
                              f"and 100; give the points a line may lose at most, 0.5 say.")
        print(write_report(path, link=args.link, fitted_on=Path(args.fitted_on) if args.fitted_on else None,
                           accuracy_budget=args.accuracy_budget))
    return 0


def add_commands(sub: Any) -> None:
    """dptrain.commands' entry point: the lab's commands on `dptrain`'s subparsers. `bench` takes no options of its
    own there: everything after it goes to parse_bench (dptrain's main() parses with parse_known_args)."""
    bench = sub.add_parser("bench", add_help=False,
                           help="the measuring lab: bench sweep | tune | probe matmul | probe link (bench --help)")
    bench.set_defaults(func=cmd_bench)
    report = sub.add_parser(
        "report",
        help="plots and report.md of a bench sweep",
        description="Write BENCH_DIR/{epoch_time,speedup,validation,memory,accuracy}.png and BENCH_DIR/report.md (which embeds "
        "them with the summary table, and the scaling model where link.json is there) from BENCH_DIR/results.csv, "
        "rebuilt from BENCH_DIR/runs when missing. (One run's card is `dptrain card RUN_DIR`.)",
    )
    report.add_argument("bench_dir", metavar="BENCH_DIR", help="a `dptrain bench sweep`'s --output.dir")
    report.add_argument("--link", metavar="NAME", help="with the sweep's link.json: also predict for a named link, "
                        "100mbit, 1gbit, 10gbit or 100gbit (docs/scaling-model.md)")
    report.add_argument("--fitted-on", metavar="BENCH_DIR", help="predict every point of this sweep with the model "
                        "fitted on another sweep's folder (a sweep over another link, say) and give the errors")
    report.add_argument("--accuracy-budget", type=float, metavar="POINTS", help="mark each line that rounds or "
                        "delays the gradients (a compressing hook, local_sgd, diloco) within POINTS of exact "
                        "training's evaluation accuracy, or not")
    report.set_defaults(func=cmd_report)
