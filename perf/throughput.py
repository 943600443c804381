"""dptrain vs the tutorials' plain DataLoader + DistributedSampler + DDP loop, side by side in one run.

Same model (mnist-cnn), data, optimizer (Adam 1e-3), global batch, world size and step count; the
two are run alternately `--repeats` times so that machine noise hits both alike. Both time their
training steps only (from a barrier after set-up to an all-reduce after the last step).

    python perf/throughput.py --nproc 2 --steps 300 --repeats 3

perf/speed.py measures this with the other speed targets; it uses the functions here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent


def plain_command(nproc: int, steps: int, global_batch: int, data: str) -> list[str]:
    """The tutorials' loop (plain_ddp.py) under torchrun, which sets OMP_NUM_THREADS=1 per worker as the tutorials run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(HERE / "plain_ddp.py"), "--steps", str(steps), "--global-batch", str(global_batch), "--data", data]


def run(command: list[str], timeout_s: float = 1800) -> str:
    """Run a command to its end; its stdout, or RuntimeError with its last lines of output."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(command)} exited with status {proc.returncode}:\n{tail}")
    return proc.stdout


def run_plain(nproc: int, steps: int, global_batch: int, data: str) -> float:
    """images/s of the plain loop over its timed steps."""
    out = run(plain_command(nproc, steps, global_batch, data))
    return json.loads(out.strip().splitlines()[-1])["images_per_s"]


def dptrain_command(nproc: int, run_dir: str, args: Sequence[str]) -> list[str]:
    """`dptrain train` on nproc local workers into run_dir, with --section.option VALUE args."""
    return [sys.executable, "-m", "dptrain", "train", "--nproc-per-node", str(nproc), "--output.dir", run_dir, *args]


def step_args(steps: int, global_batch: int, data: str) -> list[str]:
    """dptrain's options for the plain loop's run: `steps` steps of the global batch, one step event at the end."""
    return ["--data.name", data, "--train.max_steps", str(steps), "--train.global_batch_size", str(global_batch),
            "--train.log_every", str(steps)]


def epoch_events(run_dir: str | Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "epoch"]


def run_dptrain(nproc: int, steps: int, global_batch: int, data: str, extra: Sequence[str] = ()) -> dict:
    """The epoch event of `dptrain train` over `steps` steps (samples_per_s, achieved_tflops, rss_max_mb, ...)."""
    with tempfile.TemporaryDirectory() as run_dir:
        run(dptrain_command(nproc, run_dir, [*step_args(steps, global_batch, data), *extra]))
        return epoch_events(run_dir)[0]


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
        plain.append(run_plain(args.nproc, args.steps, args.global_batch, args.data))
        ours.append(run_dptrain(args.nproc, args.steps, args.global_batch, args.data, extra)["samples_per_s"])
        print(f"repeat {i + 1}: plain {plain[-1]:.0f}, dptrain {ours[-1]:.0f} images/s", flush=True)
    print(f"plain DataLoader + DDP: {summary(plain)}")
    print(f"dptrain train:          {summary(ours)}")
    ratios = [o / p for o, p in zip(ours, plain)]
    print(f"ratio dptrain / plain:  {statistics.mean(ratios):.2f} mean, {statistics.median(ratios):.2f} median "
          f"(per repeat: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
