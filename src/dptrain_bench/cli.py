"""The measuring lab's commands, added to `dptrain` through the entry point dptrain.commands (pyproject.toml):
`dptrain bench` (a scaling sweep, or --tune) and `dptrain report` (a sweep's plots and report.md).

    $ dptrain bench --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3
    $ dptrain report runs/bench/fmnist
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from dptrain.command_line import add_job_options, job_lines, job_options_given, split_overrides, submit_overrides
from dptrain.errors import ConfigError
from dptrain.prestart import preflight_job

log = logging.getLogger("dptrain")


def tune_here_or_on_nodes(args: argparse.Namespace, pairs: list[tuple[str, str]]) -> int:
    """`dptrain bench --tune`: probe the candidates, write tuned.toml and the table of what was tried."""
    from dptrain_bench import tune
    from dptrain_bench.sweep import DEFAULT_RUN_TIMEOUT_S

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
        from dptrain_bench import jobs

        jobs.require_clients()
    print(tune.tune(tuner))
    return 0


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    """A scaling sweep of real runs (workers x strategies x repeats), here or as SLURM jobs, then its CSVs; 1 when a
    point failed."""
    from dptrain_bench.collect import write_results
    from dptrain_bench.sweep import DEFAULT_RUN_TIMEOUT_S, run_sweep, sweep_from_options

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
    log.info(f"bench: {len(rows)} runs in {sweep.bench_dir / 'results.csv'}, {len(summary)} points in "
             f"{sweep.bench_dir / 'summary.csv'}; plots: dptrain report {sweep.bench_dir}")
    if failures:
        print(f"dptrain: {len(failures)} of the sweep's runs failed: "
              + "; ".join(f"{p.name}: {e}" for p, e in failures), file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    """Plots and report.md from a sweep's results.csv (rebuilt from its runs when missing), or one run's card."""
    from dptrain_bench.report import write_report
    from dptrain.reporting.run_card import is_run_dir, write_run_card

    if extra:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see dptrain report --help.")
    path = Path(args.bench_dir)
    if is_run_dir(path):
        for given, option in ((args.link, "--link"), (args.fitted_on, "--fitted-on")):
            if given:
                raise ConfigError(f"{option} draws the scaling model of a sweep; {path} is one run's folder, whose "
                                  f"card has no model: drop {option}.")
        log.info(f"report: {path} is one run's folder; its card is `dptrain card {path}` now")
        print(write_run_card(path))
    else:
        print(write_report(path, link=args.link, fitted_on=Path(args.fitted_on) if args.fitted_on else None))
    return 0


def add_commands(sub: Any) -> None:
    """dptrain.commands' entry point: the lab's commands on `dptrain`'s subparsers."""
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
    from dptrain_bench.sweep import OTHER_ENGINES  # no torch: the other engines' strategies, named where they are defined

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
