"""The GPU check: what only a GPU shows of dptrain's GPU paths, one verdict line per check (PASS, FAIL, SKIP or INFO),
within a time budget (checks start within 420 s, and a run started then may take 45 s more: 8 minutes in all). CI has
no GPU, so this runs by hand; the CPU tests (tests/test_gpu_paths.py, tests/strategies/test_gpu_rules.py) cover the
logic that decides each path.

    python3 perf/gpu_check.py [--data-root data] [--out runs/gpu-check] [--parts findings ranks speed resume eval]
    python3 perf/gpu_check.py --device cpu --quick     # a rehearsal on the CPU: the command lines and the verdicts

Parts:
  findings  in this process, on the GPU: a user Dataset's batches and evaluation make no host sync per batch;
            nn.DataParallel's replica threads run under train.bf16's bfloat16; auto starts one worker for single and dp
  ranks     several ranks on one GPU over gloo with CUDA tensors (nccl refuses two ranks on one device), through the
            elastic agent's spawned workers: ddp with each hook, zero1, fsdp, each against one rank; ring and ps refused
            there; more nccl workers than GPUs refused; model.sync_batchnorm against one rank in float64; ps and
            deepspeed on one GPU; an asynchronous snapshot; with 2+ GPUs also dp's nn.DataParallel, ddp on nccl, and a
            rank lost on nccl, timed and named
  speed     the main command's model on one GPU: epoch times, eager and as a CUDA graph
  resume    deterministic kernels: the same run twice, and a run stopped at a snapshot and resumed, end torch.equal;
            train.fp16 (float16 with a loss scaler): it trains and counts skipped steps, and resumes torch.equal
  eval      `dptrain eval` of resume's snapshot, with its predictions file
Exit code 1 when a check failed. Every run's output is in OUT/<check>.log, its run folder OUT/<check>/.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = ["--data.name", "synthetic", "--data.synthetic_train_size", "4096", "--data.synthetic_test_size", "1000"]
RUN_TIMEOUT_S = 120  # one run at most; a stuck run is a FAIL, not the end of the check
RUN_OVER_BUDGET_S = 45  # how far past the budget a run started within it may go (the budget leaves room for it)
RUN_AT_LEAST_S = 15  # what a check's later run gets once the budget is spent
LEFT_FOR_A_CHECK_S = 25  # a check starts only with this much of the budget left


@dataclass
class Run:
    name: str
    returncode: int
    output: str
    run_dir: Path
    seconds: float

    def events(self, kind: str) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events("step")]

    def rank0_log(self) -> str:
        log = self.run_dir / "logs" / "rank0.log"
        return log.read_text(errors="replace") if log.is_file() else ""

    def error(self) -> str:
        """The run's one sentence, else its last line: what a FAIL shows."""
        lines = [line for line in self.output.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("dptrain: error:")]
        return (said or lines or ["(no output)"])[-1][:300]


@dataclass
class Check:
    args: argparse.Namespace
    data: list[str]
    gpus: int
    verdicts: list[tuple[str, str, str]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def on_cuda(self) -> bool:
        return self.args.device == "cuda"

    def verdict(self, status: str, name: str, detail: str) -> None:
        line = f"[{status}] {name}: {detail}"
        print(line, flush=True)
        self.verdicts.append((status, name, detail))
        with open(self.args.out / "verdicts.txt", "a") as f:
            f.write(line + "\n")

    def time_left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def run(self, name: str, argv: list[str], env: dict[str, str] | None = None, command: str = "train",
            run_dir: Path | None = None) -> Run:
        """`dptrain COMMAND ARGV`; train: with the check's data and device, in a fresh run folder OUT/name, or in
        run_dir as it is (a resume). A run goes on past the budget by RUN_OVER_BUDGET_S at most."""
        if command == "train":
            fresh = run_dir is None
            run_dir = self.args.out / name if run_dir is None else run_dir
            if fresh:
                shutil.rmtree(run_dir, ignore_errors=True)
            argv = [*self.data, "--output.dir", str(run_dir), "--train.resume", "never" if fresh else "auto",
                    "--launch.device", self.args.device, *argv]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        start = time.monotonic()
        timeout = min(RUN_TIMEOUT_S, max(RUN_AT_LEAST_S, self.time_left() + RUN_OVER_BUDGET_S))
        try:
            done = subprocess.run([sys.executable, "-m", "dptrain", command, *argv], cwd=REPO, env=full_env,
                                  capture_output=True, text=True, timeout=timeout)
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:  # its output comes as bytes, text=True or not
            parts = (exc.stdout, exc.stderr)
            said = b"".join(part if isinstance(part, bytes) else part.encode() for part in parts if part)
            returncode, output = 124, f"{said.decode(errors='replace')}\n(killed after {exc.timeout:.0f} s)"
        (self.args.out / f"{name}.log").write_text(output)
        return Run(name, returncode, output, run_dir or self.args.out / name, time.monotonic() - start)

    def one_gpu_env(self) -> dict[str, str]:
        """Several local ranks on one GPU: the first visible one alone (each rank takes cuda:0 then, over gloo)."""
        if not self.on_cuda:
            return {}
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        return {"CUDA_VISIBLE_DEVICES": first}


def guarded(check: Check, name: str, body: Callable[[], None], needs: str | None = None,
            takes_s: float = LEFT_FOR_A_CHECK_S) -> None:
    """One check: SKIP where what it needs is missing or less than takes_s of the budget is left, FAIL on an
    unexpected error."""
    if needs is not None:
        check.verdict("SKIP", name, needs)
        return
    if check.time_left() < takes_s:
        check.verdict("SKIP", name, f"the time budget of {check.args.budget_s:.0f} s is spent")
        return
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - a check's own failure is a FAIL line, the next check still runs
        check.verdict("FAIL", name, f"the check itself failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def worst_relative(losses: list[float], reference: list[float]) -> tuple[float, int]:
    """The largest |loss - reference| / |reference| over the steps, and its step (1-based)."""
    worst, at = 0.0, 0
    for step, (got, ref) in enumerate(zip(losses, reference), start=1):
        diff = abs(got - ref) / max(abs(ref), 1e-12)
        if diff > worst:
            worst, at = diff, step
    return worst, at


# ---------------------------------------------------------------------------------------------------------- findings

def sync_warnings(body: Callable[[], object]) -> int:
    """How many synchronizing CUDA calls body makes (torch's sync debug mode, which warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            body()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


class Images(torch.utils.data.Dataset):
    """A user's map-style Dataset: float images of the tutorials' shape, labels 0-9."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 28, 28), i / self.size), i % 10


def check_findings(check: Check) -> None:
    names = ("loader: no host sync per batch (finding 6)", "eval: no host-to-device copy per batch (finding 10)",
             "dp: replica threads run in bfloat16 under train.bf16 (finding 4)")
    if not check.on_cuda:
        for name in names:
            check.verdict("SKIP", name, "needs CUDA")
    else:
        device = torch.device("cuda", 0)
        guarded(check, names[0], lambda: loader_syncs(check, names[0], device))
        guarded(check, names[1], lambda: evaluation_syncs(check, names[1], device))
        guarded(check, names[2], lambda: replica_dtype(check, names[2], device))
    guarded(check, "auto: one worker for single and dp, one per GPU for ddp (finding 2)", lambda: auto_workers(check))


def loader_syncs(check: Check, name: str, device: torch.device) -> None:
    from dptrain.data.loader import DatasetLoader

    def epoch(samples: int) -> Callable[[], None]:
        loader = DatasetLoader(Images(samples), device, global_batch=64, rank=0, world_size=1, seed=0, shuffle=True,
                               num_workers=0)
        return lambda: [batch for batch in loader.epoch_batches(0)]

    epoch(128)()  # warm-up: CUDA's first allocations and pinned blocks
    two, eight = sync_warnings(epoch(128)), sync_warnings(epoch(512))
    old = sync_warnings(lambda: [torch.tensor(list(range(64)), device=device) for _ in range(6)])
    status = "PASS" if two == eight and old >= 6 else "FAIL"
    check.verdict(status, name, f"synchronizing calls in an epoch of 2 batches: {two}, of 8: {eight} (the indices made "
                                f"as before, torch.tensor(list, device=cuda), 6 times: {old})")


def evaluation_syncs(check: Check, name: str, device: torch.device) -> None:
    from dptrain.data.loader import Batch
    from dptrain.evaluate import evaluate

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).to(device)

    class Batches:
        def __init__(self, count: int) -> None:
            self.batches = [Batch(torch.rand(64, 1, 28, 28, device=device), torch.randint(0, 10, (64,), device=device),
                                  64 * count, torch.arange(64, device=device)) for _ in range(count)]

        def __len__(self) -> int:
            return len(self.batches)

        def epoch_batches(self, epoch: int, start_batch: int = 0):
            return iter(self.batches)

    def evaluation(count: int) -> Callable[[], object]:
        loader = Batches(count)
        return lambda: evaluate(model, loader, lambda: torch.autocast("cuda", enabled=False), lambda t: t)

    evaluation(2)()
    two, six = sync_warnings(evaluation(2)), sync_warnings(evaluation(6))
    check.verdict("PASS" if two == six else "FAIL", name,
                  f"synchronizing calls in an evaluation of 2 batches: {two}, of 6: {six} (the same: none per batch)")


def replica_dtype(check: Check, name: str, device: torch.device) -> None:
    from torch.nn.parallel import parallel_apply

    from dptrain.strategies.dp.strategy import AutocastDataParallel, in_callers_autocast

    model = torch.nn.Linear(16, 16).to(device)
    replicas = [model, copy.deepcopy(model)]
    inputs = [(torch.randn(8, 16, device=device),), (torch.randn(8, 16, device=device),)]
    on = [device.index, device.index]  # two replica threads on one GPU: what parallel_apply does on two
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bare = [out.dtype for out in parallel_apply(replicas, inputs, None, on)]
        ours = [out.dtype for out in parallel_apply(in_callers_autocast(replicas, "cuda"), inputs, None, on)]
        wrapped = "needs 2 GPUs"
        if check.gpus >= 2:  # the whole nn.DataParallel forward, as dp builds it
            dp = AutocastDataParallel(model, device_ids=[0, 1], output_device=0)
            wrapped = str(dp(torch.randn(8, 16, device=device)).dtype)
    ok = ours == [torch.bfloat16] * 2 and wrapped in ("needs 2 GPUs", str(torch.bfloat16))
    check.verdict("PASS" if ok else "FAIL", name, f"replica outputs {ours} (torch's own hand-over gives {bare}); "
                                                 f"AutocastDataParallel on GPUs 0,1: {wrapped}")


def auto_workers(check: Check) -> None:
    from dptrain import config as config_mod
    from dptrain.prestart import local_workers

    launch = config_mod.load(None, [("launch.device", check.args.device)]).launch
    got = {name: local_workers(launch, config_mod.load(None, [("strategy.name", name)]).strategy)
           for name in ("single", "dp", "ddp")}
    expected = {"single": 1, "dp": 1, "ddp": max(1, check.gpus) if check.on_cuda else 1}
    detail = f"{check.gpus} GPUs: workers {got}" + ("" if check.gpus >= 2 else " (with fewer than 2 GPUs 1 either way)")
    check.verdict("PASS" if got == expected else "FAIL", "auto: one worker for single and dp, one per GPU for ddp "
                  "(finding 2)", detail)


# ------------------------------------------------------------------------------------------------------------- ranks

def base_args(check: Check) -> list[str]:
    """The runs compared with one rank: SGD (no Adam to amplify rounding), no dropout, deterministic kernels."""
    return ["--optim.name", "sgd", "--optim.lr", "0.01", "--model.dropout", "false", "--train.deterministic", "true",
            "--train.log_every", "1", "--checkpoint.every_epochs", "0", "--train.max_steps", str(check.args.steps)]


# Allowances, not derived bounds, and not yet measured on a GPU: a rank's share of the batch changes the order of
# CUDA's float32 sums; the 16-bit hooks round every gradient; PowerSGD approximates it (loss within 25%, and falling).
ALLOWANCE = {"allreduce": 1e-4, "fp16": 1e-2, "bf16": 5e-2}


def compared(check: Check, name: str, run: Run, reference: Run | None, relative: float | None, ranks: int) -> None:
    """A verdict on a run against the one-rank reference: its exit, its world, each step's loss."""
    if run.returncode != 0:
        check.verdict("FAIL", name, f"exit {run.returncode}: {run.error()}")
        return
    start = run.events("run_start")
    world = start[0]["world_size"] if start else None
    device = start[0]["device"] if start else None
    losses = run.losses()
    if world != ranks or (check.on_cuda and not str(device).startswith("cuda")):
        check.verdict("FAIL", name, f"ran on world size {world}, device {device}, not {ranks} ranks on the GPU")
        return
    if reference is None or reference.returncode != 0 or not reference.losses():
        check.verdict("FAIL", name, "no reference run of one rank to compare with")
        return
    expected = reference.losses()
    if len(losses) != len(expected):
        check.verdict("FAIL", name, f"{len(losses)} steps logged, the reference {len(expected)}")
        return
    worst, step = worst_relative(losses, expected)
    if relative is None:  # powersgd: an approximation
        ok = losses[-1] < losses[0] and abs(losses[-1] - expected[-1]) <= 0.25 * expected[-1]
        detail = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (one rank: -> {expected[-1]:.4f})"
    else:
        ok = worst <= relative
        detail = f"every step's loss within {relative:g} of one rank's: worst {worst:.2e} at step {step}"
    check.verdict("PASS" if ok else "FAIL", name, f"{ranks} rank{'s' if ranks > 1 else ''} on {device}: {detail} "
                                                 f"({run.seconds:.0f} s)")


def comm_timing(check: Check, name: str, run: Run) -> None:
    """Finding 3, as far as a run shows it: DDP's GPU-timed communication is there and consistent with the step."""
    epochs = [e for e in run.events("epoch") if "comm_ms_per_step" in e]
    if run.returncode != 0 or not epochs:
        check.verdict("FAIL", name, f"no comm_ms_per_step in the run's epoch events (exit {run.returncode})")
        return
    last = epochs[-1]
    total, exposed = last["comm_ms_per_step"], last["comm_exposed_ms_per_step"]
    step_ms = last["epoch_time_s"] * 1e3 / max(1, check.args.steps)
    ok = all(0 < t <= step_ms and 0 <= e <= t for t, e in zip(total, exposed))
    check.verdict("PASS" if ok else "FAIL", name, f"comm_ms_per_step {total}, exposed {exposed}, a step "
                                                 f"{step_ms:.2f} ms (a consistency check: each rank's 0 < exposed <= "
                                                 f"total <= step)")


def refused(check: Check, name: str, run: Run, sentence: str) -> None:
    said = [line for line in run.output.splitlines() if line.startswith("dptrain: error:")]
    ok = run.returncode == 2 and len(said) == 1 and sentence in said[0] and "Traceback" not in run.output
    check.verdict("PASS" if ok else "FAIL", name, f"exit {run.returncode}: {said[0] if said else run.error()}")


def trained(run: Run, steps: int) -> tuple[bool, str]:
    """Whether a run ended well with its steps logged and its loss lower at the end; what it shows."""
    losses = run.losses()
    shown = f"exit {run.returncode}, {len(losses)} steps"
    if losses:
        shown += f", loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if run.returncode != 0:
        shown += f": {run.error()}"
    return run.returncode == 0 and len(losses) == steps and losses[-1] < losses[0], shown


def check_ranks(check: Check) -> None:
    base, shared = base_args(check), check.one_gpu_env()
    two = ["--nproc-per-node", "2", "--launch.backend", "gloo"]
    reference: list[Run] = []

    def one_rank() -> None:
        run = check.run("one-rank", ["--strategy.name", "single", *base])
        reference.append(run)
        ok, shown = trained(run, check.args.steps)
        check.verdict("PASS" if ok else "FAIL", "reference: one rank", shown)

    guarded(check, "reference: one rank", one_rank)
    ref = reference[0] if reference else None

    where = ("2 ranks sharing one GPU over gloo, elastic agent, spawned workers" if check.on_cuda
             else "2 CPU ranks (gloo)")
    for hook in ("allreduce", "fp16", "bf16", "powersgd"):
        name = f"ddp + {hook} hook: {where}"
        if hook == "powersgd":
            name += " (finding 7: PowerSGD's buckets in order on gloo)"

        def ddp(hook: str = hook, name: str = name) -> None:
            run = check.run(f"ddp-{hook}", [*two, *base, "--strategy.ddp.comm_hook", hook], env=shared)
            compared(check, name, run, ref, ALLOWANCE.get(hook), 2)
            if hook == "allreduce":
                comm_timing(check, f"ddp's communication time (finding 3), {where}", run)

        guarded(check, name, ddp)
    for strategy in ("zero1", "fsdp"):
        name = f"{strategy}: {where}"
        if strategy == "fsdp" and check.on_cuda:
            name += " (its channels_last input hook on CUDA)"
        guarded(check, name, lambda s=strategy, n=name: compared(
            check, n, check.run(s, [*two, *base, "--strategy.name", s], env=shared), ref, ALLOWANCE["allreduce"], 2))

    # Refused before any worker starts: (name, run's folder, its arguments, what the sentence says, what it needs)
    send_recv = None if check.on_cuda else "needs CUDA (on the CPU gloo's send and recv take the tensors as they are)"
    refusals = [
        ("ring hook on gloo with CUDA tensors refused before start (finding 8)", "ring-gloo",
         [*two, *base, "--strategy.ddp.comm_hook", "ring"], "strategy ddp with comm_hook ring cannot run on GPUs",
         send_recv),
        ("ps on gloo with CUDA tensors refused before start (finding 8)", "ps-gloo",
         [*two, *base, "--strategy.name", "ps"], "strategy ps cannot run on GPUs", send_recv),
        ("2 nccl workers on one visible GPU refused before start (finding 9)", "nccl-one-gpu",
         ["--nproc-per-node", "2", *base], "2 workers on this node would share the 1 GPU",
         None if check.on_cuda else "needs CUDA"),
    ]
    for name, folder, argv, sentence, needs in refusals:
        guarded(check, name, lambda n=name, f=folder, a=argv, w=sentence:
                refused(check, n, check.run(f, a, env=shared), w), needs)

    one = "one rank on the GPU" if check.on_cuda else "one CPU rank"
    guarded(check, f"ps: {one}", lambda: compared(
        check, f"ps: {one}", check.run("ps-one", ["--strategy.name", "ps", *base]), ref, ALLOWANCE["allreduce"], 1))

    sync = f"model.sync_batchnorm: resnet18 on {where}, float64, against one rank (and without it: apart)"
    guarded(check, sync, lambda: sync_batchnorm(check, sync, two, shared),
            takes_s=LEFT_FOR_A_CHECK_S if check.on_cuda else 0)

    def deepspeed() -> None:  # its own optimizer (Adam) and defaults: no comparison, it must train
        run = check.run("deepspeed-one", ["--strategy.name", "deepspeed", "--model.dropout", "false",
                                          "--train.log_every", "1", "--checkpoint.every_epochs", "0",
                                          "--train.max_steps", str(check.args.steps)])
        ok, shown = trained(run, check.args.steps)
        check.verdict("PASS" if ok else "FAIL", f"deepspeed: {one} (ZeRO-2, Adam)", shown)

    guarded(check, f"deepspeed: {one} (ZeRO-2, Adam)", deepspeed)

    def async_snapshots() -> None:
        every = max(2, check.args.steps // 3)
        run = check.run("async-save", [*base, "--strategy.name", "single", "--checkpoint.async_save", "true",
                                       "--checkpoint.every_steps", str(every)])
        snapshots = sorted(p.name for p in (run.run_dir / "checkpoints").glob("step-*"))
        verified = check.run("async-save-verify", ["verify", str(run.run_dir / "checkpoints" / snapshots[-1])],
                             command="checkpoint") if snapshots else None
        ok = run.returncode == 0 and len(snapshots) >= 2 and verified is not None and verified.returncode == 0
        check.verdict("PASS" if ok else "FAIL", f"checkpoint.async_save: {one}",
                      f"exit {run.returncode}, snapshots {snapshots}, newest verified: "
                      f"{'exit ' + str(verified.returncode) if verified else 'none'}")

    guarded(check, f"checkpoint.async_save: {one}", async_snapshots)

    two_gpus = None if check.on_cuda and check.gpus >= 2 else "needs 2 GPUs"

    def dp() -> None:  # without --nproc-per-node: auto gives dp one process (finding 2)
        run = check.run("dp", [*base, "--strategy.name", "dp", "--train.bf16", "true"])
        log = run.rank0_log()
        ok = run.returncode == 0 and "one process driving GPUs" in log and run.events("run_start")[0]["world_size"] == 1
        check.verdict("PASS" if ok else "FAIL", "dp: nn.DataParallel over the GPUs, bf16, auto workers",
                      f"exit {run.returncode}" + (f", {len(run.losses())} steps" if ok else f": {run.error()}"))

    guarded(check, "dp: nn.DataParallel over the GPUs, bf16, auto workers", dp, two_gpus)

    def ddp_nccl() -> None:
        run = check.run("ddp-nccl", ["--nproc-per-node", "2", *base])
        compared(check, "ddp on nccl: 2 GPUs", run, ref, ALLOWANCE["allreduce"], 2)
        comm_timing(check, "ddp's communication time (finding 3), nccl", run)

    guarded(check, "ddp on nccl: 2 GPUs", ddp_nccl, two_gpus)
    # On the CPU (gloo: a failed collective names the peer) it rehearses the processes and the verdict.
    guarded(check, lost_rank_name(check), lambda: lost_rank(check), two_gpus if check.on_cuda else None,
            takes_s=LOST_RANK_TAKES_S)


# resnet18 on small CIFAR-shaped batches, every process in float64 (tests/float64/sitecustomize.py): the same math
# differs by rounding only, far below 1e-10 of the loss (the CPU parity tests' bound).
SYNC_BATCHNORM_RUN = ["--data.name", "synthetic", "--data.synthetic_shape", "3,32,32", "--data.synthetic_train_size",
                      "512", "--data.synthetic_test_size", "64", "--model.name", "resnet18",
                      "--train.global_batch_size", "64", "--train.max_steps", "6"]
FLOAT64 = {"PYTHONPATH": str(REPO / "tests" / "float64")}


def sync_batchnorm(check: Check, name: str, two: list[str], shared: dict[str, str]) -> None:
    """model.sync_batchnorm on 2 ranks trains what one process trains on the same global batch (float64-equal), where
    per-rank BatchNorm statistics do not; on the CPU it is refused (torch's SyncBatchNorm takes no CPU tensors)."""
    args = [*base_args(check), *SYNC_BATCHNORM_RUN]
    if not check.on_cuda:
        refused(check, name, check.run("sync-batchnorm-cpu", [*two, *args, "--model.sync_batchnorm", "true"]),
                "model.sync_batchnorm needs GPUs")
        return
    one = check.run("sync-batchnorm-one-rank", ["--strategy.name", "single", *args], env=FLOAT64)
    synced = check.run("sync-batchnorm", [*two, *args, "--model.sync_batchnorm", "true"], env={**shared, **FLOAT64})
    compared(check, name, synced, one, 1e-10, 2)
    apart = check.run("sync-batchnorm-off", [*two, *args], env={**shared, **FLOAT64})
    if apart.returncode == 0 and one.returncode == 0 and len(apart.losses()) == len(one.losses()) > 0:
        worst, step = worst_relative(apart.losses(), one.losses())
        check.verdict("PASS" if worst > 1e-6 else "FAIL", f"{name}: per-rank BatchNorm without it",
                      f"the losses differ from one rank's by {worst:.2e} at step {step} (more than 1e-6: the "
                      f"comparison above can tell)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOST_RANK_TAKES_S = 110  # start-up, 20 steps, the 30 s of silence, and room


def lost_rank_name(check: Check) -> str:
    backend = "nccl" if check.on_cuda else "gloo (a CPU rehearsal of the nccl check)"
    return f"a rank lost on {backend}, named within launch.timeout_s (finding 5)"


def lost_rank(check: Check) -> None:
    """Two ranks started as srun starts them (no agent sees the other die), nccl, launch.timeout_s 60: rank 1 kills
    itself after step 20, and rank 0, blocked in CUDA behind a collective towards it, must name it within 60 s."""
    name, timeout_s = lost_rank_name(check), 60
    run_dir = check.args.out / "lost-rank"
    shutil.rmtree(run_dir, ignore_errors=True)
    port = str(free_port())
    argv = [sys.executable, "-m", "dptrain", "train", *check.data, "--output.dir", str(run_dir), "--train.resume",
            "never", "--launch.device", check.args.device, "--launch.timeout_s", str(timeout_s), "--train.epochs",
            "100", "--train.log_every", "1", "--checkpoint.every_epochs", "0"]
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "DPTRAIN_TEST_SIGNAL_AT": "1:20:SIGKILL:self"}
        log = open(check.args.out / f"lost-rank{rank}.log", "w")  # noqa: SIM115 - closed below
        ranks.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    (rank0, log0), (rank1, log1) = ranks
    deadline = time.monotonic() + LOST_RANK_TAKES_S - timeout_s  # rank 1's start-up and 20 steps
    while rank1.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    lost_at = time.monotonic()
    while rank0.poll() is None and time.monotonic() < lost_at + timeout_s:
        time.sleep(0.1)
    named_after = time.monotonic() - lost_at
    for process, log in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
        log.close()
    said = [line for line in (check.args.out / "lost-rank0.log").read_text(errors="replace").splitlines()
            if line.startswith("dptrain: error:")]
    ok = (rank1.returncode == -signal.SIGKILL and rank0.returncode == 1 and named_after < timeout_s
          and any("rank 1 did not answer (dead or stuck)" in line for line in said))
    check.verdict("PASS" if ok else "FAIL", name, f"rank 1 exit {rank1.returncode}, rank 0 exit {rank0.returncode} "
                  f"{named_after:.1f} s after: {said[0] if said else '(no sentence)'}")


# ------------------------------------------------------------------------------------------------ speed, resume, eval

def epoch_detail(run: Run) -> str:
    epochs = run.events("epoch")
    times = ", ".join(f"{e['epoch_time_s']:.3f}" for e in epochs)
    return f"epoch times {times} s" if epochs else run.error()


def check_speed(check: Check) -> None:
    # The main command's model and data on one GPU: epoch time (the goal: at most 0.5 s an epoch with the graph).
    length = ["--train.max_steps", "30"] if check.args.quick else ["--train.epochs", "3"]
    runs = {
        "single-fp32": ["--strategy.name", "single"],
        "single-graph": ["--strategy.name", "single", "--train.cuda_graph", "true"],
        "main-command-graph": ["--train.cuda_graph", "true", "--nproc-per-node", "1"],  # ddp, world size 1: bare model
        "single-bs512": ["--strategy.name", "single", "--train.global_batch_size", "512"],
        "single-bs512-graph": ["--strategy.name", "single", "--train.global_batch_size", "512", "--train.cuda_graph",
                               "true"],
        "single-bf16-graph": ["--strategy.name", "single", "--train.bf16", "true", "--train.cuda_graph", "true"],
    }
    for name, extra in runs.items():
        def speed(name: str = name, extra: list[str] = extra) -> None:
            run = check.run(name, [*length, "--checkpoint.every_epochs", "0", *extra])
            graphed = "cuda_graph" in " ".join(extra) and check.on_cuda
            captured = "training step captured" in run.rank0_log()
            ok = run.returncode == 0 and (captured or not graphed)
            note = (", step captured as a CUDA graph" if captured else ", not captured") if graphed else ""
            check.verdict("PASS" if ok else "FAIL", f"speed {name}",
                          f"exit {run.returncode}, {epoch_detail(run)}{note}")

        guarded(check, f"speed {name}", speed)


def same_weights(a: Run, b: Run) -> tuple[bool, float]:
    """torch.equal on every tensor of the two runs' final weights, and the worst difference in units of the scale."""
    wa, wb = (torch.load(r.run_dir / "model.pt", map_location="cpu") for r in (a, b))
    equal = all(torch.equal(wa[k], wb[k]) for k in wa)
    worst = max(((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-12)).item()
                for k in wa if wa[k].is_floating_point())
    return equal, worst


def check_resume(check: Check, snapshot_for_eval: list[Path]) -> None:
    total = 40 if check.args.quick else 300
    half = total // 2
    common = ["--nproc-per-node", "1", "--checkpoint.every_epochs", "0"]

    def nondeterministic() -> None:
        a, b = (check.run(n, [*common, "--train.max_steps", str(total)]) for n in ("whole", "whole-again"))
        if a.returncode or b.returncode:
            check.verdict("FAIL", "default kernels: the same run twice", f"exit {a.returncode}, {b.returncode}")
            return
        equal, worst = same_weights(a, b)
        check.verdict("INFO", "default kernels: the same run twice", f"torch.equal {equal}; worst difference "
                      f"{worst:.2e} of a tensor's scale (CUDA's default kernels add in varying order)")

    guarded(check, "default kernels: the same run twice", nondeterministic)
    det = [*common, "--train.deterministic", "true"]
    runs: dict[str, Run] = {}

    def twice() -> None:
        runs["det"], again = (check.run(n, [*det, "--train.max_steps", str(total)]) for n in ("det", "det-again"))
        shown = f"exit {runs['det'].returncode}, {again.returncode}"
        ok = runs["det"].returncode == 0 == again.returncode
        if ok:
            ok, worst = same_weights(runs["det"], again)
            shown += f"; worst difference {worst:.2e}"
        check.verdict("PASS" if ok else "FAIL", "deterministic kernels: the same run twice ends torch.equal", shown)

    guarded(check, "deterministic kernels: the same run twice ends torch.equal", twice)

    def resumed() -> None:
        part = check.run("part", [*det, "--train.max_steps", str(half), "--checkpoint.every_steps", str(half)])
        rest = check.run("part-resume", [*det, "--train.max_steps", str(total), "--checkpoint.every_steps", str(half)],
                         run_dir=part.run_dir)
        ok = part.returncode == 0 and rest.returncode == 0 and "det" in runs and same_weights(runs["det"], part)[0]
        check.verdict("PASS" if ok else "FAIL", f"a run snapshotted at step {half} and resumed ends torch.equal to one "
                      f"never stopped", f"exit {part.returncode}, {rest.returncode}")
        if part.returncode == 0:
            snapshot_for_eval.append(part.run_dir)

    guarded(check, f"a run snapshotted at step {half} and resumed ends torch.equal to one never stopped", resumed)
    check_fp16(check, det, total)


def check_fp16(check: Check, det: list[str], total: int) -> None:
    """train.fp16 (float16 autocast, torch.amp.GradScaler): it trains, counts the steps its scaler skipped (the
    first ones usually, while the scale of 65536 comes down), and a run snapshotted half-way resumes torch.equal (the
    scaler's state is a snapshot part); ddp over gloo on 2 ranks sharing the GPU trains too. On the CPU it is refused:
    its rehearsal checks the sentence."""
    half = total // 2
    fp16 = [*det, "--train.fp16", "true", "--strategy.name", "single"]
    name = f"train.fp16: one GPU trains, skipped steps counted, snapshotted at step {half} and resumed ends torch.equal"

    def resumed() -> None:
        whole = check.run("fp16-whole", [*fp16, "--train.max_steps", str(total)])
        part = check.run("fp16-part", [*fp16, "--train.max_steps", str(half), "--checkpoint.every_steps", str(half)])
        rest = check.run("fp16-part-resume", [*fp16, "--train.max_steps", str(total), "--checkpoint.every_steps",
                                              str(half)], run_dir=part.run_dir)
        epochs = whole.events("epoch")
        skipped = [e.get("skipped_steps") for e in epochs]
        losses = whole.losses()
        ok = (whole.returncode == part.returncode == rest.returncode == 0 and bool(losses) and losses[-1] < losses[0]
              and all(isinstance(n, int) for n in skipped) and same_weights(whole, part)[0])
        check.verdict("PASS" if ok else "FAIL", name, f"exit {whole.returncode}, {part.returncode}, {rest.returncode}; "
                      f"skipped_steps by epoch {skipped}; loss {losses[0] if losses else '?'} -> "
                      f"{losses[-1] if losses else '?'}")

    guarded(check, name, resumed, None if check.on_cuda else "needs CUDA (train.fp16 is refused on the CPU)")
    ddp = "train.fp16: ddp on 2 ranks sharing the GPU over gloo trains"

    def two_ranks() -> None:
        run = check.run("fp16-ddp", ["--nproc-per-node", "2", "--launch.backend", "gloo", *base_args(check),
                                     "--train.fp16", "true"], env=check.one_gpu_env())
        ok, shown = trained(run, check.args.steps)
        check.verdict("PASS" if ok else "FAIL", ddp, shown)

    guarded(check, ddp, two_ranks, None if check.on_cuda else "needs CUDA")
    cpu = "train.fp16 refused on the CPU in one sentence"
    guarded(check, cpu, lambda: refused(check, cpu, check.run("fp16-cpu", ["--train.fp16", "true", *base_args(check)]),
                                        "train.fp16 scales float16 losses on GPUs, and this run is on the CPU"),
            None if not check.on_cuda else "needs the CPU (the rehearsal)")


def check_eval(check: Check, snapshot_for_eval: list[Path]) -> None:
    name = "dptrain eval of the resumed run's snapshot, with predictions"

    def evaluation() -> None:
        predictions = check.args.out / "predictions.csv"
        predictions.unlink(missing_ok=True)
        run = check.run("eval", ["--checkpoint", str(snapshot_for_eval[0]), "--nproc-per-node", "1", "--predictions",
                                 str(predictions), "--launch.device", check.args.device], command="eval")
        rows = len(predictions.read_text().splitlines()) - 1 if predictions.is_file() else 0
        counted = [line for line in run.output.splitlines() if "eval_count=" in line]
        count = int(counted[-1].split("eval_count=")[1].split()[0]) if counted else -1
        ok = run.returncode == 0 and rows == count > 0
        check.verdict("PASS" if ok else "FAIL", name,
                      f"exit {run.returncode}, eval_count {count}, {rows} prediction rows")

    guarded(check, name, evaluation, None if snapshot_for_eval else "needs resume's snapshot")


# -------------------------------------------------------------------------------------------------------------- main

PARTS = ("findings", "ranks", "speed", "resume", "eval")


def data_args(root: str) -> tuple[list[str], str]:
    """FashionMNIST under root where it is there, else the synthetic dataset (the GPU machine may have no copy)."""
    from dptrain.config import DataConfig
    from dptrain.data import describe
    from dptrain.errors import ConfigError, DataError

    root = str(Path(root).resolve())  # the runs start in the repository's root
    try:
        describe(DataConfig(root=root))
        return ["--data.root", root], f"FashionMNIST (data.root {root})"
    except (ConfigError, DataError):
        return SYNTHETIC, f"synthetic data (no FashionMNIST found with data.root {root})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--parts", nargs="+", default=list(PARTS),
                        help=f"any of {', '.join(PARTS)} (strategies: ranks)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a rehearsal of the command lines and verdicts")
    parser.add_argument("--steps", type=int, default=40, help="steps of the runs compared with one rank (10 at least: "
                        "DDP times its 10th step)")
    parser.add_argument("--quick", action="store_true", help="shorter speed and resume runs (for a rehearsal)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="checks still to start after this many seconds "
                        "are skipped (a run started within it may go on 45 s more: 8 minutes in all)")
    args = parser.parse_args(argv)
    parts = {"ranks" if p == "strategies" else p for p in args.parts}
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run with --device cpu for a rehearsal.", file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verdicts.txt").unlink(missing_ok=True)
    data, where = data_args(args.data_root)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    nccl = torch.cuda.nccl.version() if gpus else None
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "no GPU (rehearsal)"
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, nccl {nccl}, {gpus} GPUs ({names}); "
          f"{where}; budget {args.budget_s:.0f} s", flush=True)
    check = Check(args, data, gpus)
    snapshot_for_eval: list[Path] = []
    if "findings" in parts:
        check_findings(check)
    if "ranks" in parts:
        check_ranks(check)
    if "speed" in parts:
        check_speed(check)
    if "resume" in parts or "eval" in parts:
        check_resume(check, snapshot_for_eval)
    if "eval" in parts:
        check_eval(check, snapshot_for_eval)
    counts = {status: sum(1 for s, _, _ in check.verdicts if s == status)
              for status in ("PASS", "FAIL", "SKIP", "INFO")}
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, {counts['INFO']} "
          f"for information, in {time.monotonic() - check.started:.0f} s; verdicts in {args.out / 'verdicts.txt'}",
          flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
