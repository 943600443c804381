"""How often the hang verdict and the straggler naming are right, and what watching costs: real runs of the CLI,
many in a row (docs/hangs.md, "How well it works").

    .venv/bin/python perf/diagnosis_trials.py hangs --trials 50 --seed 1 --out /tmp/hangs.json
    .venv/bin/python perf/diagnosis_trials.py stragglers --runs 20 --seed 1 --out /tmp/stragglers.json
    .venv/bin/python perf/diagnosis_trials.py overhead --repeats 5 --out /tmp/overhead.json
    .venv/bin/python perf/diagnosis_trials.py links --runs 20 --seed 1 --out /tmp/links.json    # root: the lab cluster

hangs: each trial draws a world of 2 to 4 ranks, a rank, a fault (a sleep in forward, a Dataset that blocks, an
all-reduce skipped or of another shape, SIGSTOP; faults.py) and the step it strikes at, runs `dptrain train` with
launch.timeout_s 6, and checks the run's last line: exit code 1, the first rank it names is the faulty one, it names
a collective (the one the others wait in: an all_reduce, or DDP's broadcast of a model's buffers), and the hang event
came within launch.timeout_s + 10 s of the last step logged before the fault (or of the run's start).

stragglers: RUNS runs of 4 ranks where one drawn rank computes 30% more (faults.SLOW) and RUNS clean runs, 2 epochs
each; a slowed run counts as named where every epoch names that rank with phase compute, a clean one as false where
any epoch names a rank.

links: on a lab cluster of 4 hosts whose links carry 100 Mbit/s each way (tests/lab_cluster.py), RUNS jobs of 4 nodes
x 1 rank where one drawn host's link carries 77 Mbit/s (its transfers take 1.3 times as long) and RUNS where every
link is alike, interleaved, 2 epochs each; a slowed job counts as named where every epoch names that host's rank in
the link phase, a clean one as false where any epoch names a rank.

overhead: one rank's training step of the tutorials' CNN (batch 64, FashionMNIST's shape) with and without the own
clock's hooks armed, interleaved in one process; then `dptrain train` on 2 ranks with launch.watch true and false,
interleaved, images/s of the last epoch. Ratios, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 6
SYNTHETIC = ["--data.name", "synthetic", "--data.synthetic_train_size", "1200", "--data.synthetic_test_size", "101",
             "--train.global_batch_size", "120"]  # 120: a multiple of 2, 3 and 4
FAULT_KINDS = ("forward", "data", "skip", "mismatch", "sigstop")
COLLECTIVE = re.compile(r"\b(all_reduce|broadcast|all_gather|reduce_scatter|barrier)\b #\d+")  # as the verdict names one


def checkout_env(env: dict[str, str]) -> dict[str, str]:
    """This environment with env added, and the checkout's dptrain and the tests' models importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **env}


def dptrain(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> tuple[int, str, float]:
    """`python -m dptrain ARGS` with the tests' models importable: (exit code, stderr, seconds)."""
    # src first: the checkout's dptrain, whichever the venv was installed from
    full = {**checkout_env(env), "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "dptrain", *args], cwd=cwd, env=full, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # a run that hung for good: a wrong trial, not the end of the trials
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return -1, err + f"\n(killed after {timeout:g} s)", time.monotonic() - began
    return done.returncode, done.stderr, time.monotonic() - began


def events(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def fault_run(kind: str, rank: int, at: int, world: int) -> tuple[list[str], dict[str, str]]:
    """The options and environment of one fault on one rank at one step (or call), in a world of `world` ranks."""
    if kind == "forward":
        return ["--model.name", "tests.user_code:SleepsInForward"], {"DPTRAIN_TEST_FAULT": f"forward:{rank}:{at}:120"}
    if kind == "data":  # TinyNet on batches of 12: each sample of the rank's share is a __getitem__ call
        share = 12 // world
        return (["--data.name", "tests.user_code:BlocksInData", "--model.name", "tests.user_code:TinyNet",
                 "--train.global_batch_size", "12"], {"DPTRAIN_TEST_FAULT": f"data:{rank}:{share * (at - 1) + 1}:120"})
    if kind in ("skip", "mismatch"):
        return [], {"DPTRAIN_TEST_FAULT": f"{kind}:{rank}:{at}"}
    return [], {"DPTRAIN_TEST_SIGNAL_AT": f"{rank}:{at}:SIGSTOP:self"}


def hangs(trials: int, seed: int, work: Path) -> dict:
    draw = random.Random(seed)
    rows = []
    for trial in range(trials):
        world = draw.randint(2, 4)
        rank, kind, at = draw.randrange(world), draw.choice(FAULT_KINDS), draw.randint(2, 6)
        args, env = fault_run(kind, rank, at, world)
        run = work / f"hang{trial}"
        code, err, seconds = dptrain(["train", "--nproc-per-node", str(world), *SYNTHETIC, "--train.max_steps", "40",
                                      "--train.log_every", "1", *args, "--launch.timeout_s", str(TIMEOUT_S),
                                      "--output.dir", str(run)], work, env)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        found = re.match(r"dptrain: error: (?:the ranks' collectives no longer match: )?rank (\d+)", last)
        seen = events(run)
        hang = [e for e in seen if e["event"] == "hang"]
        # from the last step logged before the fault (or the start, for a fault in the first step) to the verdict
        before = [e for e in seen if e["event"] in ("step", "run_start")]
        latency = hang[0]["time"] - before[-1]["time"] if hang and before else None
        right = (code == 1 and found is not None and int(found.group(1)) == rank and COLLECTIVE.search(last) is not None
                 and latency is not None and latency <= TIMEOUT_S + 10)
        rows.append({"trial": trial, "world": world, "rank": rank, "fault": kind, "at": at, "exit_code": code,
                     "named_rank": int(found.group(1)) if found else None, "latency_s": latency, "right": right,
                     "seconds": round(seconds, 1), "line": last})
        print(f"hang {trial}: {kind} on rank {rank} of {world} at {at}: {'right' if right else 'WRONG'} "
              f"({latency if latency is None else round(latency, 1)} s) {last[:160]}", flush=True)
    right = sum(r["right"] for r in rows)
    return {"trials": rows, "right": right, "of": len(rows), "share": right / max(len(rows), 1),
            "latency_s_max": max((r["latency_s"] for r in rows if r["latency_s"] is not None), default=None)}


STRAGGLER_RUN = ["--data.name", "synthetic", "--train.epochs", "2", "--train.global_batch_size", "128",
                 "--nproc-per-node", "4"]


def stragglers(runs: int, seed: int, work: Path) -> dict:
    draw = random.Random(seed)
    rows = []
    for index in range(2 * runs):
        slowed = index % 2 == 0  # interleaved: the machine's load falls on both kinds alike
        rank = draw.randrange(4) if slowed else None
        run = work / f"straggler{index}"
        code, err, _ = dptrain(["train", *STRAGGLER_RUN, "--output.dir", str(run)], work,
                               {"DPTRAIN_TEST_SLOW": f"{rank}:0.3"} if slowed else {})
        epochs = [e for e in events(run) if e["event"] == "epoch"]
        named = [(e.get("straggler_rank"), e.get("straggler_phase"), e.get("straggler_slower_pct")) for e in epochs]
        if slowed:
            ok = code == 0 and len(epochs) == 2 and all(n[:2] == (rank, "compute") for n in named)
        else:
            ok = code == 0 and len(epochs) == 2 and all(n[0] is None for n in named)
        rows.append({"run": index, "slowed_rank": rank, "exit_code": code, "named": named, "ok": ok,
                     "cpu_ms": [e.get("own_compute_cpu_ms_per_step") for e in epochs]})
        print(f"straggler run {index}: {'rank ' + str(rank) + ' 30% slower' if slowed else 'clean'}: named {named}: "
              f"{'ok' if ok else 'WRONG'}", flush=True)
    return tally(rows, "slowed_rank")


def tally(rows: list[dict], slowed: str) -> dict:
    """The rows, how many slowed runs (`slowed` not None) named the right one and how many clean runs named anyone."""
    slowed_rows = [r for r in rows if r[slowed] is not None]
    clean_rows = [r for r in rows if r[slowed] is None]
    return {"runs": rows, "named": sum(r["ok"] for r in slowed_rows), "slowed": len(slowed_rows),
            "false": sum(not r["ok"] for r in clean_rows), "clean": len(clean_rows)}


LINK_RATE, SLOWER_LINK_RATE = "100mbit", "77mbit"
LINK_JOB = ["--data.name", "synthetic", "--data.synthetic_train_size", "512", "--data.synthetic_test_size", "64",
            "--train.epochs", "2", "--train.global_batch_size", "128", "--nodes", "4", "--cpus-per-node", "1"]


def links(runs: int, seed: int, work: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.lab_cluster import LabCluster

    draw = random.Random(seed)
    rows = []
    with LabCluster.start(work / "lab", hosts=4, rate=LINK_RATE) as lab:
        for index in range(2 * runs):
            slowed = draw.randrange(1, 5) if index % 2 == 0 else None  # interleaved, as stragglers()
            lab.network.shape(LINK_RATE)
            if slowed is not None:
                lab.network.shape(SLOWER_LINK_RATE, hosts=[slowed])
            name = f"links{index}"
            done = subprocess.run([sys.executable, "-m", "dptrain", "submit", "--output.name", name, *LINK_JOB],
                                  cwd=work, env=checkout_env(lab.env), capture_output=True, text=True, timeout=120)
            match = re.search(r"submitted job (\d+)", done.stdout)
            job = lab.wait(int(match.group(1)), timeout=600) if match else {"JobState": done.stderr.strip()[-200:]}
            epochs = [e for e in events(work / "runs" / name) if e["event"] == "epoch"]
            named = [(e.get("straggler_host"), e.get("straggler_phase"), e.get("straggler_slower_pct")) for e in epochs]
            done = job.get("JobState") == "COMPLETED" and len(epochs) == 2
            if slowed is not None:
                ok = done and all(n[:2] == (f"host{slowed}", "link") for n in named)
            else:
                ok = done and all(n[0] is None for n in named)
            rows.append({"run": index, "slowed_host": slowed, "state": job.get("JobState"), "named": named, "ok": ok,
                         "link_ms": [e.get("link_probe_ms") for e in epochs],
                         "cpu_ms": [e.get("own_compute_cpu_ms_per_step") for e in epochs]})
            print(f"link run {index}: {'host' + str(slowed) + ' at ' + SLOWER_LINK_RATE if slowed else 'clean'}: "
                  f"named {named}, link ms {rows[-1]['link_ms']}: {'ok' if ok else 'WRONG'}", flush=True)
    return tally(rows, "slowed_host")


def clock_overhead(repeats: int, steps: int = 50) -> dict:
    """One process, one thread: the tutorials' CNN's training step with the own clock armed and without, interleaved."""
    import torch

    from dptrain.metrics.stragglers import OwnClock
    from dptrain.models.mnist_cnn import MnistCNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MnistCNN()
    optimizer = torch.optim.Adam(model.parameters())
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    for _ in range(10):
        step()
    ratios = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(steps):
            step()
        bare = time.perf_counter() - began
        clock = OwnClock(model, torch.device("cpu"))
        began = time.perf_counter()
        for _ in clock.batches(range(steps)):
            with clock.step():
                step()
        timed = time.perf_counter() - began
        clock.close()
        ratios.append(timed / bare)
    # What the clock adds to a step, counted apart from the step's own noise: its hooks called as a step calls them
    # (one forward pre-hook, one gradient hook a parameter), many times over, against the bare step's time.
    clock = OwnClock(model, torch.device("cpu"))
    params = sum(1 for p in model.parameters() if p.requires_grad)
    clock.armed = True
    calls = 20000
    began = time.perf_counter()
    for _ in range(calls):
        clock._forward_starts(model, ())
        for p in range(params):
            clock._gradient_ready(images)
        clock._close_interval()
    hooks_us = 1e6 * (time.perf_counter() - began) / calls
    clock.close()
    return {"step_ms_bare": 1e3 * bare / steps, "ratios": [round(r, 4) for r in ratios],
            "median_ratio": statistics.median(ratios), "hooks_us_per_step": hooks_us,
            "hooks_share_of_step": hooks_us / (1e6 * bare / steps)}


def watch_overhead(looks: int = 2000) -> dict:
    """The hang watch's look at the store, as it makes one every period (on a thread of its own, bounded by within()),
    against a real store on loopback: microseconds a look, and the share of a core at the default launch.timeout_s
    (300 s) and at the tests' 6 s."""
    import datetime

    import torch.distributed as dist

    from dptrain.distributed.hangs import HangWatch, period_s, within

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    watch = HangWatch(store, 0, 2, "host", 300.0, end=lambda sentence: None)
    began = time.perf_counter()
    for _ in range(looks):
        within(watch.tick, 5.0)
    look_us = 1e6 * (time.perf_counter() - began) / looks
    return {"look_us": look_us, **{f"core_share_at_{t:g}_s": look_us / 1e6 / period_s(t) for t in (300.0, 6.0)}}


def run_overhead(repeats: int, work: Path) -> dict:
    rates: dict[str, list[float]] = {"true": [], "false": []}
    for index in range(repeats):
        for watch in ("true", "false") if index % 2 == 0 else ("false", "true"):
            run = work / f"overhead{index}-{watch}"
            code, err, _ = dptrain(["train", "--nproc-per-node", "2", "--data.name", "fashion-mnist", "--train.epochs",
                                    "1", "--train.global_batch_size", "128", "--train.log_every", "100",
                                    "--train.eval_every_epochs", "0", "--launch.watch", watch, "--output.dir", str(run)],
                                   work, {})
            epochs = [e for e in events(run) if e["event"] == "epoch"]
            if code != 0 or not epochs:
                raise SystemExit(f"the overhead run {run} failed: {err.strip()[-500:]}")
            rates[watch].append(epochs[-1]["samples_per_s"])
        print(f"overhead repeat {index}: watched {rates['true'][-1]:.0f} images/s, unwatched {rates['false'][-1]:.0f}",
              flush=True)
    ratios = [w / u for w, u in zip(rates["true"], rates["false"])]
    return {"images_per_s": rates, "ratios": [round(r, 4) for r in ratios], "median_ratio": statistics.median(ratios)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("hangs", "stragglers", "links", "overhead"))
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.what == "hangs":
            result = hangs(args.trials, args.seed, work)
            summary = f"hangs: {result['right']} of {result['of']} right, latest verdict {result['latency_s_max']} s"
        elif args.what in ("stragglers", "links"):
            result = (stragglers if args.what == "stragglers" else links)(args.runs, args.seed, work)
            summary = (f"{args.what}: named in {result['named']} of {result['slowed']} slowed runs, "
                       f"{result['false']} false in {result['clean']} clean runs")
        else:
            result = {"clock": clock_overhead(args.repeats), "watch": watch_overhead(),
                      "runs": run_overhead(args.repeats, work)}
            clock, watch = result["clock"], result["watch"]
            summary = (f"overhead: own clock x{clock['median_ratio']:.4f} of a bare step ({clock['step_ms_bare']:.1f} "
                       f"ms), its hooks {clock['hooks_us_per_step']:.1f} us a step "
                       f"({100 * clock['hooks_share_of_step']:.3f}%); the watch's look {watch['look_us']:.0f} us "
                       f"({100 * watch['core_share_at_300_s']:.3f}% of a core at the default timeout); "
                       f"runs watched/unwatched images/s "
                       f"x{result['runs']['median_ratio']:.4f}")
    result |= {"seconds": round(time.monotonic() - began, 1), "summary": summary}
    print(summary)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
