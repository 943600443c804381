"""Rehearsed preemptions on the private SLURM cluster, many in a row: `dptrain submit --rehearse` of the smallest job
that shows them (2 nodes x 1 rank, the synthetic set, 200 steps), ROUNDS times, and what they add up to.

    .venv/bin/python perf/rehearsals.py --rounds 10 --out /tmp/rehearsals.json     # as root, with Debian's SLURM

Each round is one rehearsal: 4 SIGUSR1 drills and a SIGUSR1 stop with its requeue and resume (compared bit for bit
with an uninterrupted twin), and a SIGTERM-only stop at SLURM's 1-minute time limit: 2 preemptions a round, so 10
rounds rehearse 20. Even rounds take a snapshot every step (--checkpoint.every_steps 1: a signal then often lands
while a periodic snapshot is being written), odd ones every 10 steps. Prints, and writes to --out, each round's rows
that were not ok, the count of verified snapshots and bit-equal resumes, the signal-to-snapshot and snapshot-to-exit
p50 and p95 over every signal of every round, the largest lead recommended and each rehearsal's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--data.name", "synthetic", "--data.synthetic_train_size", "1920", "--data.synthetic_test_size", "64",
       "--train.global_batch_size", "32", "--launch.timeout_s", "60", "--nodes", "2", "--cpus-per-node", "1",
       "--requeue", "--signal-lead-s", "60"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # tests/slurm_cluster.py
    from dptrain.cli import main as dptrain
    from dptrain.rehearsal import percentiles
    from tests.slurm_cluster import SlurmCluster

    records = []
    with tempfile.TemporaryDirectory() as tmp, SlurmCluster.start(Path(tmp) / "slurm") as cluster:
        os.environ.update(cluster.env)
        os.chdir(tmp)
        for round_ in range(args.rounds):
            every = "1" if round_ % 2 == 0 else "10"
            with contextlib.redirect_stdout(io.StringIO()):
                code = dptrain(["submit", "--rehearse", *JOB, "--checkpoint.every_steps", every,
                                "--output.name", f"round{round_}"])
            record = json.loads((Path(tmp) / "runs" / f"round{round_}" / "rehearsal.json").read_text())
            record.update(round=round_, every_steps=int(every), exit_code=code)
            records.append(record)
            not_ok = [(r["check"], r["result"], r["seen"]) for r in record["rows"] if r["result"] != "ok"]
            print(f"round {round_}: exit {code}, {record['wall_s']:.0f} s, every_steps {every}, not ok: {not_ok}",
                  flush=True)
    verified = sum(1 for r in records for row in r["rows"] if row["check"].startswith("snapshot written")
                   and row["result"] == "ok")
    equal = sum(1 for r in records for row in r["rows"] if row["check"].startswith("resumed run equals")
                and row["result"] == "ok")
    to_snapshot = [s for r in records for s in r.get("signal_to_snapshot_s", [])]
    to_exit = [s for r in records for s in r.get("snapshot_to_exit_s", [])]
    summary = {"rounds": len(records), "preemptions": 2 * len(records),
               "rounds_whose_snapshots_all_verify": verified, "resumes_bit_equal": equal,
               "signals_timed": len(to_snapshot), "signal_to_snapshot_p50_p95_s": percentiles(to_snapshot),
               "stops_timed": len(to_exit), "snapshot_to_exit_p50_p95_s": percentiles(to_exit),
               "largest_recommended_lead_s": max(r.get("recommended_lead_s", 0) for r in records),
               "wall_s": [r["wall_s"] for r in records]}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "records": records}, indent=1) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
