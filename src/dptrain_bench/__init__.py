"""The measuring lab: scaling sweeps of real runs over worker counts, nodes, strategies and engines, their CSVs, a
report with the scaling model, the matmul and link probes, and `bench tune`. It stands on the library (dptrain) and the
library never imports it: its commands reach `dptrain` through the entry point dptrain.commands (cli.py), and it
starts every run as a `dptrain train` subprocess, never importing the training loop, the workers or the launchers
(pyproject.toml's import contracts).

    $ dptrain bench sweep --workers 1,2 --strategies ddp,fsdp --repeats 2 --output.dir runs/bench/fmnist --train.epochs 3
    $ dptrain report runs/bench/fmnist
    $ dptrain bench tune --config run.toml
    $ dptrain bench probe matmul --workers 1,2; dptrain bench probe link --world 2

sweep.py (grid -> one `dptrain train` subprocess per point, under BENCH/runs/), jobs.py (with --slurm: one SLURM
job per point instead, written by slurm.script, submitted through slurm.queue, then waited for), peak.py (a short matmul probe per
worker count, BENCH/peak.json: the denominator of fraction_of_peak), link.py (the link probe, BENCH/link.json),
collect.py (run folders -> results.csv and summary.csv), model.py (the scaling model), report.py (CSV -> PNGs
and report.md), tune.py (bench tune), folder.py (BenchFolder: every file of a sweep's folder named once). The other
engines, each run under torchrun and writing the same metrics.jsonl events: tutorial.py (the tutorials' plain loop),
lightning_engine.py (Lightning's Trainer), deepspeed_engine.py (DeepSpeed's engine, ZeRO stages), and engines.py,
what they share.
"""
