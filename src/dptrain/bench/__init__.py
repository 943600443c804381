"""Scaling benchmarks: a sweep of real runs over worker counts and strategies, their CSVs, and a report.

    $ dptrain bench --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3
    $ dptrain report runs/bench/fmnist

sweep.py (grid -> one `dptrain train` subprocess per point, under BENCH/runs/), jobs.py (with --slurm: one SLURM
job per point instead, written and submitted by slurm.job, then waited for), peak.py (a short matmul probe per
worker count, BENCH/peak.json: the denominator of fraction_of_peak), collect.py (run directories -> results.csv and
summary.csv), report.py (CSV -> PNGs and report.md). The other engines, each run under torchrun and
writing the same metrics.jsonl events: tutorial.py (the tutorials' plain loop), lightning_engine.py (Lightning's
Trainer), deepspeed_engine.py (DeepSpeed's engine, ZeRO stages), and engines.py, what they share. This package reads run
directories and the config, and asks the strategies which worker counts they refuse (Strategy.check_world); only the
other engines' own processes import the data and models: never train or worker code.
"""
