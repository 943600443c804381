"""The small timings that source comments quote, measured side by side in one process (one thread, the CPU):

    .venv/bin/python perf/micro.py                 # every measurement, medians of 7 repeats
    .venv/bin/python perf/micro.py --repeats 3     # quicker

- adam: one optimizer step of the tutorials' CNN (mnist-cnn), torch.optim.Adam fused vs foreach (train.optimizer_spec).
- dropout: the keep-mask of the tutorials' CNN's dropout (64 x 128 and 64 x 9216, p 0.25 and 0.5): bernoulli_ vs
  dptrain's models.layers.keep_mask (models.layers.Dropout).
- linear: the tutorials' fc1 (9216 -> 128, 64 images) forward and both gradients: torch's nn.Linear vs
  models.layers.Linear (oneDNN's inner product where this torch has it).
- tensorboard: what `dptrain tensorboard` pays before it serves (metrics.tensorboard.serve): tensorboard.program's
  import and TensorBoard() with its plugins, in a fresh interpreter.
- launch: a 1-step run of 2 CPU workers through the elastic agent (launch.local.launch_local), workers forked from
  an agent that imported torch and dptrain (WORKER_IMPORTS) vs spawned as fresh interpreters.
- teardown: after a short run, Python's own teardown (freeing torch's objects) vs leaving at once with os._exit
  (dist.ending.leave_now), from the last line of the run to the end of its process.
Each prints the median and the ratio of the two; numbers depend on the CPU (AVX2 vs AVX-512) and on the torch build.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch


def timed(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """Median seconds of one call of fn over `repeats` rounds of `inner` calls (after one warm-up round)."""
    for _ in range(inner):
        fn()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        rounds.append((time.perf_counter() - start) / inner)
    return statistics.median(rounds)


def adam(repeats: int) -> tuple[float, float]:
    from dptrain.config import ModelConfig
    from dptrain.models import build_model

    times = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="mnist-cnn"), (1, 28, 28), 10)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
        times.append(timed(opt.step, repeats, 20))
    return times[0], times[1]


def dropout(repeats: int) -> tuple[float, float]:
    from dptrain.models.layers import keep_mask

    xs = [(torch.randn(64, 128), 0.5), (torch.randn(64, 32, 12, 12), 0.25)]  # fc1's output; conv2's pooled map

    def torchs() -> None:
        for x, p in xs:
            torch.empty_like(x).bernoulli_(1 - p)

    def ours() -> None:
        for x, p in xs:
            keep_mask(x, p)

    return timed(ours, repeats, 50), timed(torchs, repeats, 50)


def linear(repeats: int) -> tuple[float, float]:
    from dptrain.models.layers import Linear

    torch.manual_seed(0)
    x = torch.randn(64, 9216, requires_grad=True)
    times = []
    for cls in (Linear, torch.nn.Linear):
        layer = cls(9216, 128)

        def step() -> None:
            layer(x).sum().backward()

        times.append(timed(step, repeats, 20))
    return times[0], times[1]


def in_fresh_interpreter(code: str, repeats: int) -> float:
    """Median of the number the code prints last, each run in a fresh interpreter."""
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                  .stdout.split()[-1]) for _ in range(repeats)]
    return statistics.median(runs)


TENSORBOARD = """
import time
t = time.perf_counter()
from tensorboard import program
program.TensorBoard().configure(argv=["tensorboard", "--logdir", "."])
print(time.perf_counter() - t)
"""

RUN = [("data.name", "synthetic"), ("data.synthetic_train_size", "64"), ("data.synthetic_test_size", "16"),
       ("train.global_batch_size", "32"), ("train.epochs", "1"), ("train.max_steps", "1"), ("launch.timeout_s", "60")]

LAUNCH = """
import tempfile, time
from dptrain import config
from dptrain.launch.local import launch_local
from dptrain.worker import train_worker
with tempfile.TemporaryDirectory() as d:
    cfg = config.load(None, [*{run}, ("output.dir", d)])
    t = time.perf_counter()
    launch_local(train_worker, (config.to_dict(cfg),), 2, 60, on_cuda={spawn})
    print(time.perf_counter() - t)
"""

TEARDOWN = """
import os, tempfile, time
from dptrain import config
from dptrain.worker import train_worker
d = tempfile.mkdtemp()
train_worker(config.to_dict(config.load(None, [*{run}, ("output.dir", d)])))
print(time.time(), flush=True)
{leave}
"""


def teardown(repeats: int) -> tuple[float, float]:
    times = []
    for leave in ("os._exit(0)", "pass"):
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-c", TEARDOWN.format(run=RUN, leave=leave)], capture_output=True,
                                  text=True, check=True)
            runs.append(time.time() - float(proc.stdout.split()[-1]))
        times.append(statistics.median(runs))
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    fused, foreach = adam(args.repeats)
    rows.append(("adam step, fused vs foreach", fused, foreach))
    ours, torchs = dropout(args.repeats)
    rows.append(("dropout masks, keep_mask vs bernoulli_", ours, torchs))
    ours, torchs = linear(args.repeats)
    rows.append(("fc1 forward+backward, layers.Linear vs nn.Linear", ours, torchs))
    print(f"torch {torch.__version__}, 1 thread, medians of {args.repeats}")
    for name, a, b in rows:
        print(f"{name:52s} {a * 1e3:8.3f} ms vs {b * 1e3:8.3f} ms  ({b / a:.2f}x)")
    forked = in_fresh_interpreter(LAUNCH.format(run=RUN, spawn=False), args.repeats)
    spawned = in_fresh_interpreter(LAUNCH.format(run=RUN, spawn=True), args.repeats)
    print(f"{'1-step 2-worker launch, forked vs spawned workers':52s} {forked:8.3f} s  vs {spawned:8.3f} s")
    leaving, unwinding = teardown(args.repeats)
    print(f"{'end of a run to process end, os._exit vs teardown':52s} {leaving:8.3f} s  vs {unwinding:8.3f} s")
    print(f"{'tensorboard.program + TensorBoard() (fresh process)':52s} {in_fresh_interpreter(TENSORBOARD, args.repeats):8.3f} s")


if __name__ == "__main__":
    main()
