"""The speed targets (throughput, efficiency, start-up, memory, growth), measured side by side in one run: one
markdown table, printed and written to --output.

    python perf/speed.py                  # the defaults: about 8 minutes on this project's 2-core machine
    python perf/speed.py --quick          # one repeat, short runs, target 5 at 1-2 (tests/perf/test_speed.py): about 45 s
    python perf/speed.py --repeats 7 --steps 200 --output /tmp/speed.md

1. Throughput, 2 workers on the CPU, the tutorials' CNN on FashionMNIST, global batch 128: in every repeat the plain
   loop (plain_ddp.py under torchrun), dptrain fp32 and dptrain --train.bf16 true, one after the other (medians over
   the repeats; the ratio is the median of each repeat's own ratio); then the eval accuracy after 2 epochs, fp32 and bf16.
2. Efficiency: the dptrain runs' achieved_tflops against the matmul probe (dptrain_bench.peak) of 2 processes at once
   with a rank's threads, fp32 and bf16, probed in every repeat right after its runs.
3. Start-up: from just before launching `dptrain train --nproc-per-node 2` to the first step event's time.
4. Memory: psutil samples every 0.1 s of the agent (`dptrain train` itself) and its workers over the fp32 2-epoch run.
5. Growth: per-rank throughput on synthetic data at a fixed per-rank batch with 1, 2 and 4 workers, and the time of an
   epoch of 1x, 2x and 4x the synthetic training set at 2 workers (its second epoch: the first warms up).
The functions that run the plain loop and dptrain are perf/throughput.py's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import psutil

import throughput
from dptrain_bench import peak

HERE = Path(__file__).resolve().parent
WORKERS = 2
GLOBAL_BATCH = 128
PER_RANK_BATCH = 64  # target 5: the batch each rank takes at every worker count
GROWTH_WORKERS = (1, 2, 4)
SIZE_FACTORS = (1, 2, 4)
MIB = 2**20
SAMPLE_EVERY_S = 0.1
WORKERS_MEMORY_TARGET_MIB = 1e9 / MIB  # "under 1 GB"
BF16 = ("--train.bf16", "true")
DTYPES: tuple[peak.Dtype, ...] = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run of this script measures, from its options (--quick shortens every part)."""

    repeats: int
    steps: int
    """Steps of each throughput run (target 1)."""
    accuracy_args: tuple[str, ...]
    """The options of the fp32 and bf16 accuracy runs: 2 epochs (a few steps with --quick)."""
    accuracy_label: str
    growth_steps: int
    growth_repeats: int
    size_base: int
    """Synthetic training samples of the 1x epoch (target 5)."""
    growth_workers: tuple[int, ...] = GROWTH_WORKERS
    size_factors: tuple[int, ...] = SIZE_FACTORS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
        steps = args.steps if args.steps is not None else (20 if args.quick else 100)
        if args.quick:
            return cls(repeats=repeats, steps=steps, accuracy_args=("--train.max_steps", str(steps)),
                       accuracy_label=f"after {steps} steps (--quick)", growth_steps=max(4, steps // 2),
                       growth_repeats=repeats, size_base=512,
                       growth_workers=GROWTH_WORKERS[:2], size_factors=SIZE_FACTORS[:2])  # a launch each: the cost
        return cls(repeats=repeats, steps=steps, accuracy_args=("--train.epochs", "2"), accuracy_label="after 2 epochs",
                   growth_steps=max(4, steps * 2 // 5), growth_repeats=max(1, math.ceil(repeats / 2)), size_base=2048)


# ---- running dptrain with a clock and a memory sampler


@dataclass
class Memory:
    """Maxima over the samples, MiB: the agent's own, each worker's (by pid), and the sum over the workers."""

    agent_rss: float = 0.0
    agent_pss: float = 0.0
    worker_rss: dict[int, float] = field(default_factory=dict)
    workers_rss_sum: float = 0.0
    workers_pss_sum: float = 0.0
    samples: int = 0

    def sample(self, agent: psutil.Process) -> None:
        """One sample: the agent's RSS and PSS (shared pages counted once, shared by the processes mapping them), and
        its children's, the workers (forked from it: they share torch's code pages with it and with each other)."""
        info = agent.memory_full_info()
        self.agent_rss, self.agent_pss = max(self.agent_rss, info.rss / MIB), max(self.agent_pss, info.pss / MIB)
        rss_sum = pss_sum = 0.0
        for worker in agent.children(recursive=True):
            try:
                info = worker.memory_full_info()
            except psutil.Error:  # gone between the listing and the read
                continue
            self.worker_rss[worker.pid] = max(self.worker_rss.get(worker.pid, 0.0), info.rss / MIB)
            rss_sum, pss_sum = rss_sum + info.rss / MIB, pss_sum + info.pss / MIB
        self.workers_rss_sum, self.workers_pss_sum = max(self.workers_rss_sum, rss_sum), max(self.workers_pss_sum, pss_sum)
        self.samples += 1


class Sampler(threading.Thread):
    """Memory.sample of a process every SAMPLE_EVERY_S, until stop() or the process ends."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.agent, self.memory, self.done = psutil.Process(pid), Memory(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.memory.sample(self.agent)
            except psutil.Error:  # the agent has ended
                return
            self.done.wait(SAMPLE_EVERY_S)

    def stop(self) -> Memory:
        self.done.set()
        self.join()
        return self.memory


@dataclass
class Run:
    events: list[dict]
    launched: float
    """time.time() just before the command was started."""
    memory: Memory | None

    def epochs(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "epoch"]

    def first_step_s(self) -> float:
        return next(e for e in self.events if e["event"] == "step")["time"] - self.launched


def train(nproc: int, args: Sequence[str], sample_memory: bool = False, timeout_s: float = 1800) -> Run:
    """`dptrain train` on nproc workers in a fresh folder; its events, launch time and (if asked) memory."""
    with tempfile.TemporaryDirectory() as scratch:
        # The run gets a folder of its own: dptrain refuses a run folder that holds other files (output.log).
        run_dir = Path(scratch) / "run"
        command = throughput.dptrain_command(nproc, str(run_dir), ["--checkpoint.every_epochs", "0", *args])
        with open(Path(scratch) / "output.log", "w+") as out:
            launched = time.time()
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            sampler = Sampler(proc.pid) if sample_memory else None
            if sampler:
                sampler.start()
            try:
                returncode = proc.wait(timeout=timeout_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
                memory = sampler.stop() if sampler else None
            if returncode != 0:
                out.seek(0)
                tail = "\n".join(out.read().strip().splitlines()[-5:])
                raise RuntimeError(f"{' '.join(command)} exited with status {returncode}:\n{tail}")
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(events, launched, memory)


# ---- numbers to cells


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float], fmt: str, unit: str = "") -> str:
    """'min-max over N' (one run: '1 run')."""
    if len(xs) < 2:
        return "1 run"
    return f"{format(min(xs), fmt)}-{format(max(xs), fmt)}{unit} over {len(xs)}"


def shown(command: Sequence[str]) -> str:
    """A command as a person would type it: dptrain and torchrun by name, no temporary run folder."""
    words, skip = [], False
    for i, word in enumerate(command):
        if skip:
            skip = False
            continue
        if word == "--output.dir":
            skip = True
            continue
        if word == sys.executable and command[i + 1: i + 3] in (["-m", "dptrain"], ["-m", "torch.distributed.run"]):
            continue
        if word == "-m" and i > 0 and command[i - 1] == sys.executable:
            continue
        words.append({"torch.distributed.run": "torchrun", str(HERE / "plain_ddp.py"): "perf/plain_ddp.py"}.get(word, word))
    return "`" + " ".join(words) + "`"


def dptrain_shown(nproc: int, args: Sequence[str]) -> str:
    return shown(throughput.dptrain_command(nproc, "-", args))


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def table(rows: list[tuple[str, str, str, str]], machine: str) -> str:
    lines = ["# Speed targets", "", machine, "", "| target | value | spread | command |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- the targets


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def throughput_and_efficiency(plan: Plan) -> list[tuple[str, str, str, str]]:
    """Targets 1 (rates and ratio) and 2 (achieved over the probe's peak), interleaved repeat by repeat."""
    plain, fp32, bf16 = [], [], []
    peaks: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    sizes: dict[str, list[dict[int, float]]] = {dtype: [] for dtype in DTYPES}
    for i in range(plan.repeats):
        plain.append(throughput.run_plain(WORKERS, plan.steps, GLOBAL_BATCH, "fashion-mnist"))
        fp32.append(throughput.run_dptrain(WORKERS, plan.steps, GLOBAL_BATCH, "fashion-mnist"))
        bf16.append(throughput.run_dptrain(WORKERS, plan.steps, GLOBAL_BATCH, "fashion-mnist", BF16))
        for dtype in DTYPES:
            probe = peak.measure((WORKERS,), "cpu", dtype)[WORKERS]
            peaks[dtype].append(probe.peak_tflops)
            sizes[dtype].append(probe.tflops_by_size)
        log(f"repeat {i + 1}/{plan.repeats}: plain {plain[-1]:.0f}, dptrain {fp32[-1]['samples_per_s']:.0f}, "
            f"bf16 {bf16[-1]['samples_per_s']:.0f} images/s; matmul peak {peaks['float32'][-1]:.3f} (fp32), "
            f"{peaks['bfloat16'][-1]:.3f} (bf16) TFLOPS")
    ours = [e["samples_per_s"] for e in fp32]
    fast = [e["samples_per_s"] for e in bf16]
    ratios = [o / p for o, p in zip(ours, plain)]
    bf16_ratios = [f / p for f, p in zip(fast, plain)]
    plain_cmd = shown(throughput.plain_command(WORKERS, plan.steps, GLOBAL_BATCH, "fashion-mnist"))
    args = throughput.step_args(plan.steps, GLOBAL_BATCH, "fashion-mnist")
    fp32_cmd, bf16_cmd = dptrain_shown(WORKERS, args), dptrain_shown(WORKERS, [*args, *BF16])
    threads = peak.cpu_threads(peak.usable_cores(), WORKERS)
    rows = [
        ("1. plain DataLoader + DistributedSampler + DDP, fp32", f"{median(plain):.0f} images/s", spread(plain, ".0f"),
         plain_cmd),
        ("1. dptrain, fp32", f"{median(ours):.0f} images/s", spread(ours, ".0f"), fp32_cmd),
        ("1. dptrain / plain, fp32 (target >= 1.5x)", f"{median(ratios):.2f}x ({met(median(ratios) >= 1.5)})",
         spread(ratios, ".2f", "x"), "both above, each repeat's ratio"),
        ("1. dptrain, bf16 autocast", f"{median(fast):.0f} images/s ({median(fast) / median(ours):.2f}x dptrain fp32, "
         f"{median(bf16_ratios):.2f}x plain)", spread(fast, ".0f"), bf16_cmd),
    ]
    for dtype, runs, cmd in (("float32", fp32, fp32_cmd), ("bfloat16", bf16, bf16_cmd)):
        achieved = [e["achieved_tflops"] for e in runs]
        fractions = [a / p for a, p in zip(achieved, peaks[dtype])]
        by_size = {n: median([s[n] for s in sizes[dtype]]) for n in sizes[dtype][0]}
        rows += [
            (f"2. matmul peak, {dtype}, {WORKERS} processes x {threads} thread{'s' if threads > 1 else ''} at once",
             f"{median(peaks[dtype]):.3f} TFLOPS", "by size: " + ", ".join(f"{n}: {t:.3f}" for n, t in by_size.items())
             + f"; best {spread(peaks[dtype], '.3f')}",
             f"`dptrain bench probe matmul --workers {WORKERS} --dtype {dtype}`"),
            (f"2. dptrain achieved / peak, {dtype}", f"{median(fractions):.1%} ({median(achieved):.3f} TFLOPS of "
             f"{runs[0]['model_flops_per_sample'] / 1e6:.1f} MFLOP per sample)", spread([100 * f for f in fractions], ".1f", "%"),
             cmd),
        ]
    return rows


def accuracy_and_memory(plan: Plan) -> list[tuple[str, str, str, str]]:
    """Target 1's eval accuracy (fp32 and bf16, one run each), and target 4 over the fp32 run."""
    rows = []
    runs: dict[str, Run] = {}
    for name, extra in (("fp32", ()), ("bf16", BF16)):
        args = [*plan.accuracy_args, *extra]
        run = runs[name] = train(WORKERS, args, sample_memory=name == "fp32")
        last = run.epochs()[-1]
        log(f"accuracy {name} {plan.accuracy_label}: {last['eval_acc']:.4f}")
        rows.append((f"1. eval accuracy {plan.accuracy_label}, {name}", f"{last['eval_acc']:.4f} (loss {last['eval_loss']:.4f}; "
                     f"last epoch {last['samples_per_s']:.0f} images/s)", "1 run", dptrain_shown(WORKERS, args)))
    memory, cmd = runs["fp32"].memory, dptrain_shown(WORKERS, plan.accuracy_args)
    assert memory is not None, "sampled"
    own = [max(e["rss_max_mb"][rank] for e in runs["fp32"].epochs()) for rank in range(WORKERS)]
    workers = ", ".join(f"{rss:.0f}" for _, rss in sorted(memory.worker_rss.items()))
    rows += [
        ("4. agent (`dptrain train` itself), max RSS / PSS", f"{memory.agent_rss:.0f} / {memory.agent_pss:.0f} MiB",
         f"{memory.samples} samples, every {SAMPLE_EVERY_S} s", cmd),
        ("4. each worker, max RSS", f"{workers} MiB", "per worker (by pid)", cmd),
        ("4. workers together, max over time of the sum: RSS / PSS (target < 1 GB)",
         f"{memory.workers_rss_sum:.0f} / {memory.workers_pss_sum:.0f} MiB "
         f"(PSS {met(memory.workers_pss_sum < WORKERS_MEMORY_TARGET_MIB)}, RSS "
         f"{met(memory.workers_rss_sum < WORKERS_MEMORY_TARGET_MIB)})", "RSS counts the shared pages in each worker",
         cmd),
        ("4. workers' own rss_max_mb (epoch events)", ", ".join(f"{v:.0f}" for v in own) + " MiB", "per rank", cmd),
    ]
    return rows


def startup(plan: Plan) -> list[tuple[str, str, str, str]]:
    """Target 3: launch to the first step event, over the repeats."""
    args = ["--train.max_steps", "1", "--train.log_every", "1"]
    seconds = []
    for _ in range(plan.repeats):
        seconds.append(train(WORKERS, args).first_step_s())
    log(f"start-up: {', '.join(f'{s:.2f}' for s in seconds)} s")
    return [("3. start-up: launch to the first step (target <= 5 s)", f"{median(seconds):.2f} s ({met(median(seconds) <= 5)})",
             spread(seconds, ".2f", " s"), dptrain_shown(WORKERS, args))]


def growth_args(workers: int, steps: int) -> list[str]:
    return ["--data.name", "synthetic", "--data.synthetic_train_size", str(PER_RANK_BATCH * workers * steps),
            "--train.epochs", "1", "--train.global_batch_size", str(PER_RANK_BATCH * workers),
            "--train.log_every", str(steps)]


def size_args(size: int) -> list[str]:
    return ["--data.name", "synthetic", "--data.synthetic_train_size", str(size), "--train.epochs", "2",
            "--train.eval_every_epochs", "0", "--train.log_every", "1000000"]


def growth(plan: Plan) -> list[tuple[str, str, str, str]]:
    """Target 5: per-rank throughput at 1, 2, 4 workers (fixed per-rank batch); epoch time at 1x, 2x, 4x the data
    (--quick: 1 and 2 workers, 1x and 2x)."""
    per_rank: dict[int, list[float]] = {w: [] for w in plan.growth_workers}
    seconds: dict[int, list[float]] = {f: [] for f in plan.size_factors}
    for i in range(plan.growth_repeats):
        for w in plan.growth_workers:
            per_rank[w].append(train(w, growth_args(w, plan.growth_steps)).epochs()[0]["samples_per_s"] / w)
        for f in plan.size_factors:
            seconds[f].append(train(WORKERS, size_args(plan.size_base * f)).epochs()[-1]["epoch_time_s"])
        log(f"growth repeat {i + 1}/{plan.growth_repeats}: per rank " + ", ".join(f"{w}w {per_rank[w][-1]:.0f}"
            for w in plan.growth_workers) + " images/s; epoch " + ", ".join(f"{f}x {seconds[f][-1]:.2f}" for f in plan.size_factors) + " s")
    cores = peak.usable_cores()
    rows = []
    for w in plan.growth_workers:
        threads = peak.cpu_threads(cores, w)
        over = f", oversubscribed: {w} workers on {cores} cores" if w > cores else ""
        rows.append((f"5. per-rank images/s, synthetic, {PER_RANK_BATCH} per rank, {w} worker{'s' if w > 1 else ''} x "
                     f"{threads} thread{'s' if threads > 1 else ''}{over}",
                     f"{median(per_rank[w]):.0f} ({median(per_rank[w]) / median(per_rank[1]):.2f}x 1 worker's)",
                     spread(per_rank[w], ".0f"), dptrain_shown(w, growth_args(w, plan.growth_steps))))
    base = median(seconds[1])
    for f in plan.size_factors:
        ratios = [s / b for s, b in zip(seconds[f], seconds[1])]
        rows.append((f"5. epoch time, {f}x the synthetic set ({plan.size_base * f} samples), {WORKERS} workers",
                     f"{median(seconds[f]):.2f} s ({median(seconds[f]) / base:.2f}x the 1x epoch; linear: {f}x)",
                     spread(seconds[f], ".2f", " s") + (f"; ratio {spread(ratios, '.2f', 'x')}" if f > 1 else ""),
                     dptrain_shown(WORKERS, size_args(plan.size_base * f))))
    return rows


def machine(load_start: tuple[float, ...]) -> str:
    load_end = os.getloadavg()
    return (f"Machine: {peak.cpu_model()}, {peak.usable_cores()} cores usable, torch "
            f"{importlib.metadata.version('torch')}, Python {sys.version.split()[0]}. Load average (1 min) "
            f"{load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end: a shared machine's other work slows "
            f"every row alike within a repeat, not alike across runs of this script.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, help="repeats of the interleaved runs (default 5; 1 with --quick)")
    parser.add_argument("--steps", type=int, help="steps of each throughput run (default 100; 20 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one repeat, short runs, accuracy after --steps steps")
    parser.add_argument("--output", default=str(HERE / "speed.md"), help="the table's file (default perf/speed.md)")
    args = parser.parse_args(argv)
    plan = Plan.from_args(args)
    if plan.repeats < 1 or plan.steps < 1:
        parser.error(f"--repeats {plan.repeats} and --steps {plan.steps} must be 1 or more")
    load_start, start = os.getloadavg(), time.perf_counter()
    rows = throughput_and_efficiency(plan)
    rows += accuracy_and_memory(plan)
    rows += startup(plan)
    rows += growth(plan)
    rows.sort(key=lambda row: row[0][:2])  # by target, in the order measured within one
    text = table(rows, machine(load_start) + f" This table took {time.perf_counter() - start:.0f} s.")
    print(text, end="")
    Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
