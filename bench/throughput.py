"""dptrain vs the tutorials' plain DataLoader + DistributedSampler + DDP loop, side by side in one run.

Same model (mnist-cnn), data, optimizer (Adam 1e-3), global batch, world size and step count; the
two are run alternately `--repeats` times so that machine noise hits both alike. Both time their
training steps only (from a barrier after set-up to an all-reduce after the last step).

    python bench/throughput.py --nproc 2 --steps 300 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_plain(args: argparse.Namespace) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
         str(HERE / "plain_ddp.py"), "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--data", args.data],
        capture_output=True, text=True, check=True, timeout=1800,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["images_per_s"]


def run_dptrain(args: argparse.Namespace, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, "-m", "dptrain", "train", "--nproc-per-node", str(args.nproc), "--data.name", args.data,
             "--train.max_steps", str(args.steps), "--train.global_batch_size", str(args.global_batch),
             "--train.log_every", str(args.steps), "--output.dir", run_dir, *extra],
            capture_output=True, text=True, check=True, timeout=1800,
        )
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        epoch = [e for e in map(json.loads, lines) if e["event"] == "epoch"][0]
        return epoch["samples_per_s"]


def summary(xs: list[float]) -> str:
    spread = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):7.0f} ± {spread:4.0f} images/s  ({', '.join(f'{x:.0f}' for x in xs)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="fashion-mnist")
    args, extra = parser.parse_known_args()  # anything else goes to dptrain, e.g. --train.channels_last false
    plain, ours = [], []
    for i in range(args.repeats):
        plain.append(run_plain(args))
        ours.append(run_dptrain(args, extra))
        print(f"repeat {i + 1}: plain {plain[-1]:.0f}, dptrain {ours[-1]:.0f} images/s", flush=True)
    print(f"plain DataLoader + DDP: {summary(plain)}")
    print(f"dptrain train:          {summary(ours)}")
    ratios = [o / p for o, p in zip(ours, plain)]
    print(f"ratio dptrain / plain:  {statistics.mean(ratios):.2f} mean, {statistics.median(ratios):.2f} median "
          f"(per repeat: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
