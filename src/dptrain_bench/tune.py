"""`dptrain bench tune`: how to run the user's configuration fastest here, or on the SLURM nodes it is given,
from short trial runs of the candidates the scaling model ranks first.

    $ dptrain bench tune --config run.toml                        # this machine's cores
    $ dptrain bench tune --slurm --nodes 2 --config run.toml      # jobs on 2 nodes
    $ dptrain train --config runs/tune/fashion-mnist/tuned.toml   # the choice

What may change is how the run is spread, never what it computes: the strategy (ddp, zero1, fsdp), the ranks per
node (each node's cores are split among them as threads), and DDP's bucket size; the global batch, the model and the
optimizer stay the user's, so the math does too (dptrain's same-math promise over strategies and world sizes). With
--lossy the compressing comm hooks (fp16, bf16, powersgd) are candidates too: they round every gradient.
Candidates that make the same run on the chosen shape (same_run: at one rank DDP's bucket cap and comm hook are never
used) are one candidate, tried once.

How: (1) one rank alone measures the compute per sample (a trial run); (2) the scaling model (dptrain_bench/scaling_model.py) predicts every
candidate over the link (--link NAME, else link.json of the tune folder, else one measured now); (3) the KEEP best
predicted and the user's own configuration (the default) are tried for STEPS steps each, one after another; (4) the
default and the CONTENDERS candidates whose trial beat it run again, in turns, up to REPEATS runs each; a candidate is
chosen only if each of its runs was faster than each of the default's (it beat the default by more than the spread
the runs measured), else the default is kept with the reason. Written into the tune folder: tuned.toml (the user's
configuration with the choice), tune.csv and tune.md (each candidate's predicted images/s and each of its runs).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from dptrain import config as config_mod
from dptrain import read_back
from dptrain_bench import link as link_mod, scaling_model
from dptrain_bench.folder import LOG_FILE, TRIAL_CONFIG_FILE, BenchFolder
from dptrain.config import RunConfig
from dptrain.errors import ConfigError, LaunchError
from dptrain.files import write_atomically, written_atomically
from dptrain.read_back import UnreadableFile
from dptrain.run_folder import RunFolder

log = logging.getLogger(__name__)

STEPS = 30
"""Steps of each trial run; the first WARM_STEPS are left out of its timing (start-up, first allocations)."""
WARM_STEPS = 10
LOG_EVERY = 5  # a step event (its time) every 5 steps: the timing's ticks, at one small loss reduction each
KEEP = 3
"""Candidates tried besides the default: those the model predicts fastest."""
REPEATS = 3
"""Runs a winner and the default each need: a candidate is chosen only if its slowest was faster than the default's
fastest (were the two the same run, all 3 runs of one would beat all 3 of the other 1 time in 20)."""
CONTENDERS = 2
"""Candidates run again beside the default: those whose trial beat it, fastest first (each repeat is a trial run)."""
BUCKETS_MB = (1.0, 4.0)  # DDP bucket caps tried besides DDP's own choice (smaller: more overlap, more messages)
STRATEGIES = ("ddp", "zero1", "fsdp")  # those tried: the parameter server's one link and one process's never win
LOSSY_HOOKS = ("fp16", "bf16", "powersgd")
PERIODIC = ("local_sgd", "diloco")
"""The strategies that delay the gradients (each rank steps alone between exchanges): like the hooks that round them,
candidates only within an accuracy budget."""
PERIODS = (4, 16, 64, 128)
"""Their periods tried: the model ranks the longest first; one out of the budget gives way to the next shorter. 128:
on 2 lab hosts at 100 Mbit/s DiLoCo every 64 steps still ran 0.94-0.98x of the same ranks on one host, every 128
steps 0.98-1.02x, at the same accuracy after 2 epochs (docs/benchmark.md)."""
STREAMED = ("diloco",)
"""The periodic strategies whose exchange can run behind the next steps (strategy.diloco.overlap_steps)."""
STREAMED_SHARE = 4
"""Over several nodes, diloco is tried at each period also with its exchange behind period / STREAMED_SHARE steps: on
2 lab hosts at 100 Mbit/s, 8 steps behind a period of 32 ran 1.16x and 1.22x the same period waited for at once, at
the same accuracy after 2 epochs (docs/benchmark.md)."""
DDP_FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket at its default cap (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def _bucketed(strategy: str) -> bool:
    """Whether the strategy sends its gradients in DDP's buckets (its traffic says so), which a comm hook and a bucket
    cap shape; the other strategies ignore both."""
    traffic = config_mod.SPECS[strategy].traffic
    return traffic is not None and traffic.bucketed


def _gathers_params(strategy: str) -> bool:
    """Whether the strategy gathers sharded parameters to compute (its traffic says so), even on one rank."""
    traffic = config_mod.SPECS[strategy].traffic
    return traffic is not None and traffic.gathers_params


@dataclass(frozen=True)
class Candidate:
    """One way to spread the run: a strategy, ranks on each node, DDP's comm hook and bucket cap (None: dptrain's),
    and for ddp whether each step's update is applied in the next forward (strategy.ddp.update_in_next_forward)."""

    strategy: str
    ranks_per_node: int
    comm_hook: str = "allreduce"
    bucket_mb: float | None = None
    update_in_next_forward: bool = False
    period: int | None = None
    """local_sgd's and diloco's period (PERIODIC); None for the others."""
    overlap_steps: int = 0
    """diloco's steps its exchange runs behind (strategy.diloco.overlap_steps: STREAMED_SHARE of its period)."""

    @property
    def lossy(self) -> bool:
        """Whether it rounds or delays the gradients (a compressing hook, local SGD, DiLoCo): not ddp's math."""
        return self.comm_hook in LOSSY_HOOKS or self.strategy in PERIODIC

    @property
    def name(self) -> str:
        parts = [self.strategy]
        if self.period is not None:
            parts.append(f"h{self.period}")
        if self.overlap_steps:
            parts.append(f"behind{self.overlap_steps}")
        if self.comm_hook != "allreduce":
            parts.append(self.comm_hook)
        if self.bucket_mb is not None:
            parts.append(f"bucket{self.bucket_mb:g}mb")
        if self.update_in_next_forward:
            parts.append("next-forward")
        return "-".join([*parts, f"r{self.ranks_per_node}"])

    def pairs(self) -> list[tuple[str, str]]:
        """The options that make a configuration this candidate."""
        pairs = [("strategy.name", self.strategy), ("launch.nproc_per_node", str(self.ranks_per_node))]
        if _bucketed(self.strategy):  # its table's (strategy.ddp.*, which zero1 reads too)
            table = config_mod.SPECS[self.strategy].table
            pairs.append((f"strategy.{table}.comm_hook", self.comm_hook))
            pairs.append((f"strategy.{table}.bucket_mb", "none" if self.bucket_mb is None else f"{self.bucket_mb:g}"))
        if self.strategy == "ddp":  # zero1 reads strategy.ddp too, but refuses this one
            pairs.append(("strategy.ddp.update_in_next_forward", str(self.update_in_next_forward).lower()))
        if self.period is not None:
            pairs.append((f"strategy.{config_mod.SPECS[self.strategy].table}.period", str(self.period)))
        if self.strategy in STREAMED:
            pairs.append(("strategy.diloco.overlap_steps", str(self.overlap_steps)))
        return pairs

    def plan(self, shared_memory: bool) -> scaling_model.Plan:
        """The model's view of it. shared_memory: ddp's sum on one host goes through /dev/shm in one bucket."""
        bucket = (self.bucket_mb * 2**20 if self.bucket_mb is not None
                  else float("inf") if shared_memory else scaling_model.DDP_BUCKET_BYTES)
        # on one host the option gives way to the shared-memory sum (strategies/ddp.py): the run of plain ddp
        return scaling_model.Plan(strategy=self.strategy, comm_hook=self.comm_hook, bucket_bytes=bucket,
                          update_in_next_forward=self.update_in_next_forward and not (
                              shared_memory and self.comm_hook == "allreduce"), period=self.period or 1,
                          overlap_steps=self.overlap_steps)


def default_candidate(cfg: RunConfig, ranks_per_node: int) -> Candidate:
    """The user's own configuration, as a candidate."""
    ddp_like = _bucketed(cfg.strategy.name)
    table = cfg.strategy.spec.table
    return Candidate(cfg.strategy.name, ranks_per_node, cfg.strategy.ddp.comm_hook if ddp_like else "allreduce",
                     cfg.strategy.ddp.bucket_mb if ddp_like else None,
                     cfg.strategy.name == "ddp" and cfg.strategy.ddp.update_in_next_forward,
                     getattr(cfg.strategy, table).period if cfg.strategy.name in PERIODIC else None,
                     cfg.strategy.diloco.overlap_steps if cfg.strategy.name in STREAMED else 0)


def candidates(default: Candidate, max_ranks: int, nodes: int, global_batch: int, lossy: bool,
               cores_per_node: int | None = None) -> list[Candidate]:
    """Every candidate to rank, the default first: each strategy at each rank count up to max_ranks per node (1, 2,
    4, ... and max_ranks) whose world splits the global batch, ddp and zero1 with each bucket cap (and with each
    lossy hook where allowed); over several nodes ddp also with its update in the next forward, with DDP's buckets
    (and each lossy hook where allowed), where each rank has scaling_model.NEXT_FORWARD_CORES of cores_per_node
    (None: not known, not limited). On one node it would give way to the shared-memory sum: not a candidate. Where
    lossy ones are allowed, local_sgd and diloco too, at each of PERIODS, on two ranks or more; over several nodes
    diloco also with its exchange behind period / STREAMED_SHARE steps."""
    ranks = sorted({r for r in (*(2**i for i in range(max_ranks.bit_length())), max_ranks) if 1 <= r <= max_ranks})
    found = [default]
    for strategy in STRATEGIES:
        for r in ranks:
            if global_batch % (nodes * r):
                continue
            if not _bucketed(strategy):
                found.append(Candidate(strategy, r))
                continue
            # the user's own cap first: at every rank count, a candidate that keeps it
            caps = dict.fromkeys((default.bucket_mb if _bucketed(default.strategy) else None, None, *BUCKETS_MB))
            found += [Candidate(strategy, r, bucket_mb=b) for b in caps]
            if lossy:
                found += [Candidate(strategy, r, comm_hook=h) for h in LOSSY_HOOKS]
            spare_core = cores_per_node is None or cores_per_node // r >= scaling_model.NEXT_FORWARD_CORES
            if strategy == "ddp" and nodes > 1 and spare_core:
                found += [Candidate(strategy, r, comm_hook=h, update_in_next_forward=True)
                          for h in ("allreduce", *(LOSSY_HOOKS if lossy else ()))]
    if lossy:  # nothing to average on one rank
        found += [Candidate(strategy, r, period=h, overlap_steps=t) for strategy in PERIODIC for r in ranks
                  if nodes * r > 1 and not global_batch % (nodes * r) for h in PERIODS
                  for t in (0, *([h // STREAMED_SHARE] if strategy in STREAMED and nodes > 1 else []))]
    return list(dict.fromkeys(found))


def workload(cfg: RunConfig, compute_s_per_sample: float) -> scaling_model.Workload:
    """What a step of cfg's model computes and sends, for the model: its parameters and their matrices."""
    from dptrain.data import describe
    from dptrain.models import build_model

    info = describe(cfg.data)
    net = build_model(cfg.model, info.image_shape, info.num_classes)
    params = [p for p in net.parameters() if p.requires_grad]
    matrices = tuple((p.shape[0], p.numel() // p.shape[0]) for p in params if p.dim() >= 2)
    units = sum(1 for child in net.children() if any(True for _ in child.parameters()))
    return scaling_model.Workload(param_bytes=float(sum(p.numel() * p.element_size() for p in params)),
                          element_size=params[0].element_size() if params else 4,  # what fp16/bf16/PowerSGD count in
                          global_batch=cfg.train.global_batch_size, compute_s_per_sample=compute_s_per_sample,
                          matrices=matrices, fsdp_units=max(1, units),
                          buffer_bytes=float(sum(b.numel() * b.element_size() for b in net.buffers())))


def rank_by_model(found: list[Candidate], work: scaling_model.Workload, link: scaling_model.Timed, nodes: int,
                  local_link: scaling_model.Timed | None, overlap: float) -> list[tuple[Candidate, scaling_model.Prediction]]:
    """Each candidate with its prediction, fastest first (the order of `found` among equals)."""
    predicted = [(c, scaling_model.predict(c.plan(shared_memory=nodes == 1), work, link, nodes, c.ranks_per_node, overlap,
                                   local_link)) for c in found]
    return sorted(predicted, key=lambda cp: -cp[1].images_per_s)


def same_run(candidate: Candidate, nodes: int, gradient_bytes: float) -> Candidate:
    """The run the candidate makes on `nodes` nodes: candidates with the same one compute the same thing the same way,
    so probing each would only measure the machine's noise as a difference between them.

    - At world size 1 (one node, one rank) DDP.wrap returns the bare model before it builds a bucket or installs a
      comm hook: ddp's and zero1's bucket cap and hook are never used, and ddp is then the single strategy (the bare
      model, the plain optimizer, no collective). zero1 stays its own run (its ZeroRedundancyOptimizer still wraps the
      optimizer), and so does fsdp (its parameters are sharded over a mesh of one).
    - Only ddp and zero1 read a comm hook or a bucket cap; the other strategies ignore both.
    - A bucket cap only groups the gradients: where they all fit within the first bucket of every cap in question
      (DDP's own 1 MiB, the cap where smaller), each cap makes one bucket, the same run at any world size.
    """
    world = nodes * candidate.ranks_per_node
    strategy = "ddp" if world == 1 and candidate.strategy == "single" else candidate.strategy
    if world == 1 or not _bucketed(strategy):
        return Candidate(strategy, candidate.ranks_per_node, period=candidate.period,
                         overlap_steps=candidate.overlap_steps)
    cap = float("inf") if candidate.bucket_mb is None else candidate.bucket_mb * 2**20
    one_bucket = gradient_bytes < min(DDP_FIRST_BUCKET_BYTES, cap)
    return replace(candidate, bucket_mb=None if one_bucket else candidate.bucket_mb)


def distinct(found: list[Candidate], nodes: int, gradient_bytes: float) -> dict[Candidate, list[Candidate]]:
    """Each run among `found` once (same_run), as the first candidate that makes it (the default, first in `found`,
    stands for its own run), with the other candidates that make the same run."""
    by_run: dict[Candidate, list[Candidate]] = {}
    for candidate in found:
        by_run.setdefault(same_run(candidate, nodes, gradient_bytes), []).append(candidate)
    return {same[0]: same[1:] for same in by_run.values()}


Runs = dict[Candidate, list[float | None]]
"""Each tried candidate's runs in images/s, in the order they ran (None: a run that failed)."""


def rates(runs: list[float | None]) -> list[float]:
    """The runs that gave a rate."""
    return [r for r in runs if r is not None]


def ahead_of(theirs: list[float | None], default: list[float | None]) -> bool:
    """Whether each of a candidate's runs was faster than each of the default's (none failed, one at least each). More
    runs can only undo this, never restore it: a candidate no longer ahead is not run again."""
    if not theirs or not default or None in theirs or None in default:
        return False
    return min(rates(theirs)) > max(rates(default))


def contenders(default: Candidate, runs: Runs) -> list[Candidate]:
    """The candidates worth running again beside the default: the CONTENDERS fastest of those ahead of it (ahead_of),
    and beside each, the candidate that differs from it only in keeping the user's bucket cap, where that one was
    tried and is ahead too (choose() keeps the user's cap unless the other wins beyond the spread)."""
    ahead = [c for c in runs if c != default and ahead_of(runs[c], runs[default])]
    fastest = sorted(ahead, key=lambda c: -statistics.fmean(rates(runs[c])))[:CONTENDERS]
    keeping = [replace(c, bucket_mb=default.bucket_mb) for c in fastest]
    return list(dict.fromkeys([*fastest, *(c for c in keeping if c in ahead)]))


def changed(candidate: Candidate, default: Candidate) -> list[str]:
    """The settings of the user's configuration that the candidate changes, by their option's last word."""
    fields = ("strategy", "ranks_per_node", "comm_hook", "bucket_mb", "update_in_next_forward", "period",
              "overlap_steps")
    return [f for f in fields if getattr(candidate, f) != getattr(default, f)]


def least_changed(default: Candidate, winners: list[Candidate], runs: Runs) -> Candidate:
    """Of the winners, the one that changes the fewest of the user's settings (the fastest on average of those); one
    that changes more takes its place only if it is ahead of it beyond the spread (ahead_of). A setting the runs cannot
    tell from the user's own stays the user's: a bucket cap that only noise favoured is not written into tuned.toml."""
    mean = {c: statistics.fmean(rates(runs[c])) for c in winners}
    picked = min(winners, key=lambda c: (len(changed(c, default)), -mean[c]))
    while ahead := [c for c in winners if ahead_of(runs[c], runs[picked])]:  # ends: ahead_of is a strict order
        picked = max(ahead, key=mean.__getitem__)
    return picked


def choose(default: Candidate, runs: Runs) -> tuple[Candidate, str]:
    """The candidate to run and why: of those with REPEATS runs each faster than each of the default's REPEATS or more
    (ahead_of), the fastest on average; else the default, the reason naming the closest candidate and both spreads."""
    ours = runs[default]
    winners = [c for c in runs if c != default and len(runs[c]) >= REPEATS and ahead_of(runs[c], ours)]
    if len(ours) >= REPEATS and winners:
        best = least_changed(default, winners, runs)
        ratio = statistics.fmean(rates(runs[best])) / statistics.fmean(rates(ours))
        reason = (f"{best.name} ran {ratio:.2f}x your configuration, each of its {len(runs[best])} runs faster than "
                  f"each of yours ({spread(runs[best])}, against {spread(ours)})")
        fastest = max(winners, key=lambda c: statistics.fmean(rates(runs[c])))
        if fastest != best:  # faster on average, within the spread: where it differs is noise's choice
            differs = [f"{f} = {getattr(fastest, f)}" for f in changed(fastest, best)]
            reason += (f"; {fastest.name} was faster on average but not beyond the spread of their runs "
                       f"({spread(runs[fastest])}), so its {', '.join(differs)} {'is' if len(differs) == 1 else 'are'} "
                       f"not taken")
        return best, reason
    if None in ours:
        return default, (f"a run of your configuration failed ({spread(ours)}), so no candidate can be shown faster "
                         f"than it, and your configuration is kept")
    ran = {c: rs for c, rs in runs.items() if c != default and rates(rs)}
    if not ran:
        return default, "no other candidate's trial gave a rate, so your configuration is kept"
    repeated = [c for c in ran if len(ran[c]) > 1]
    if not repeated:
        closest = max(ran, key=lambda c: max(rates(ran[c])))
        return default, (f"no candidate's trial was faster than your configuration (the fastest, {closest.name}: "
                         f"{spread(ran[closest])}, against your {spread(ours)}), so your configuration is kept")
    closest = max(repeated, key=lambda c: statistics.fmean(rates(ran[c])))
    return default, (f"no candidate beat your configuration by more than the spread of their runs (the closest, "
                     f"{closest.name}: {spread(ran[closest])}, against your {spread(ours)}), so your configuration "
                     f"is kept")


def spread(runs: list[float | None]) -> str:
    """A candidate's runs as a reader compares them: its one rate, or its slowest to its fastest; any that failed."""
    measured = rates(runs)
    failed = len(runs) - len(measured)
    if not measured:
        return f"no rate ({failed} failed)"
    if len(measured) == 1:
        return f"{measured[0]:,.0f} images/s" + (f" over 1 run, {failed} failed" if failed else "")
    return (f"{min(measured):,.0f}-{max(measured):,.0f} images/s over {len(measured)} runs"
            + (f", {failed} failed" if failed else ""))


def images_per_s(run_dir: Path, global_batch: int) -> float | None:
    """A trial run's rate from its step events: the global batches between its first step event after WARM_STEPS and
    its last, over the time between them; None where it has fewer than two such events."""
    ticks = []
    try:
        events, _ = read_back.read_json_lines(RunFolder(run_dir).metrics)
    except UnreadableFile:
        return None
    for event in events:
        step, time_s = event.get("step"), event.get("time")
        if event.get("event") == "step" and isinstance(step, int) and not isinstance(step, bool) \
                and step >= WARM_STEPS and read_back.is_number(time_s):
            ticks.append((step, float(time_s)))
    if len(ticks) < 2 or ticks[-1][1] <= ticks[0][1]:
        return None
    (first_step, first_time), (last_step, last_time) = ticks[0], ticks[-1]
    return (last_step - first_step) * global_batch / (last_time - first_time)


@dataclass
class Tuner:
    """One tuning: the user's configuration, where it runs, and what was measured."""

    cfg: RunConfig
    config_path: str | None
    user_pairs: list[tuple[str, str]]
    tune_dir: Path
    nodes: int
    max_ranks: int
    slurm: bool
    lossy: bool = False
    link_name: str | None = None
    run_timeout_s: float = 300.0
    keep: int = KEEP
    run: Callable[["Tuner", Candidate, str], float | None] | None = None
    """How a trial runs (None: run_trial): the tests swap in runs whose speed they control."""
    shares: dict[int, float] | None = None
    """R ranks on a node -> each one's rate over one rank's alone (None: rank_shares measures them)."""
    own_cpu: dict[str, float] | None = None
    """Plan.own_cpu_key -> its CPU seconds (None: the hook probe measures them where lossy candidates are allowed)."""
    accuracy_budget: float | None = None
    """--accuracy-budget: the points of evaluation accuracy a lossy candidate may lose against exact ddp's; None: no
    lossy candidate is chosen."""
    accuracy_steps: int | None = None
    """The steps of each accuracy probe (None: an epoch's, at most the run's)."""
    run_accuracy: Callable[["Tuner", Candidate], Accuracy | None] | None = None
    """How an accuracy probe runs (None: run_accuracy_probe): the tests swap in probes whose accuracy they control."""
    accuracy: dict[Candidate, Accuracy | None] = dataclasses.field(default_factory=dict)
    """The accuracy probes made: REFERENCE's and the lossy candidates'."""
    rows: list[dict] = dataclasses.field(default_factory=list)

    def trial_config(self, candidate: Candidate, label: str, steps: int = STEPS, nodes: int | None = None) -> RunConfig:
        """cfg as the candidate, for a trial of `steps` steps in its own folder, saving nothing (nodes: on SLURM, that
        many instead of the tuned ones)."""
        pairs = [*self.user_pairs, *candidate.pairs(), ("train.max_steps", str(steps)),
                 ("train.log_every", str(LOG_EVERY)), ("checkpoint.every_epochs", "0"),
                 ("checkpoint.every_steps", "0"), ("train.eval_every_epochs", "0"), ("train.resume", "never"),
                 ("output.dir", str(BenchFolder(self.tune_dir).point(f"{label}-{candidate.name}").resolve()))]
        return self.config_of(candidate, pairs, nodes)

    def config_of(self, candidate: Candidate, pairs: list[tuple[str, str]], nodes: int | None = None) -> RunConfig:
        """The user's configuration with `pairs` (the candidate's among them), on SLURM in the candidate's job shape."""
        cfg = config_mod.load(self.config_path, pairs)
        if self.slurm:
            cfg = replace(cfg, slurm=replace(cfg.slurm, nodes=nodes or self.nodes,
                                             ranks_per_node=candidate.ranks_per_node))
        return cfg

    def measure(self, candidate: Candidate, label: str) -> float | None:
        rate = (self.run or run_trial)(self, candidate, label)
        log.info(f"tune: {label} {candidate.name}: "
                 + (f"{rate:,.0f} images/s" if rate is not None else "failed (see its bench.log)"))
        return rate

    def measure_accuracy(self, candidate: Candidate) -> Accuracy | None:
        """The candidate's accuracy probe, made once (REFERENCE's: exact ddp's)."""
        if candidate not in self.accuracy:
            got = (self.run_accuracy or run_accuracy_probe)(self, candidate)
            self.accuracy[candidate] = got
            log.info(f"tune: accuracy {candidate.name}: " + (f"{got.acc:.4f} (loss {got.loss:.4f})" if got else
                                                             "failed (see its bench.log)"))
        return self.accuracy[candidate]

    def gap(self, candidate: Candidate) -> float | None:
        """ddp's accuracy less the candidate's, in points, where both were probed."""
        reference, theirs = self.accuracy.get(REFERENCE), self.accuracy.get(candidate)
        return None if reference is None or theirs is None or not candidate.lossy else (reference.acc - theirs.acc) * 100

    def within_budget(self, candidate: Candidate) -> bool:
        """Whether a lossy candidate's probe kept within the budget of ddp's (both probed now where they were not)."""
        if self.accuracy_budget is None:
            return False
        reference, theirs = self.measure_accuracy(REFERENCE), self.measure_accuracy(candidate)
        return reference is not None and theirs is not None and gap_of(reference, theirs, self.accuracy_budget)[1]

    def may_choose(self, candidate: Candidate, default: Candidate) -> bool:
        """Exact candidates, the user's own configuration, and lossy ones whose probe kept within the budget."""
        return not candidate.lossy or candidate == default or (
            candidate in self.accuracy and self.within_budget(candidate))

    @property
    def probe_steps(self) -> int:
        """The steps of an accuracy probe: --accuracy-steps, else an epoch's, at most the run's."""
        if self.accuracy_steps is not None:
            return self.accuracy_steps
        from dptrain.data import describe

        epoch = math.ceil(describe(self.cfg.data).train_size / self.cfg.train.global_batch_size)
        return max(1, min(epoch, self.cfg.train.max_steps or epoch * self.cfg.train.epochs))


def run_accuracy_probe(tuner: Tuner, candidate: Candidate) -> Accuracy | None:
    """The candidate trained probe_steps steps (the same global batches as every probe's: the same seed, the first
    probe_steps of the run), then evaluated on the test split; REFERENCE on one node. None where it failed."""
    nodes = 1 if candidate == REFERENCE else None
    cfg = tuner.trial_config(candidate, "accuracy", steps=tuner.probe_steps, nodes=nodes)
    run_dir = cfg.output.run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    RunFolder(run_dir).logs.mkdir(parents=True)
    ok = _run_job(cfg) if tuner.slurm else _run_here(cfg, run_dir, tuner.run_timeout_s)
    if not ok:
        return None
    try:
        events, _ = read_back.read_json_lines(RunFolder(run_dir).metrics)
    except UnreadableFile:
        return None
    evaluated = [e for e in events if e.get("event") == "epoch" and read_back.is_number(e.get("eval_acc"))]
    if not evaluated:
        return None
    last = evaluated[-1]
    return Accuracy(acc=float(last["eval_acc"]), loss=float(last["eval_loss"]), count=int(last["eval_count"]))


def run_trial(tuner: Tuner, candidate: Candidate, label: str) -> float | None:
    """Run the candidate's trial (here, or as a SLURM job) in a fresh folder; its images/s, None where it failed."""
    cfg = tuner.trial_config(candidate, label)
    run_dir = cfg.output.run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    RunFolder(run_dir).logs.mkdir(parents=True)
    if tuner.slurm:
        ok = _run_job(cfg)
    else:
        ok = _run_here(cfg, run_dir, tuner.run_timeout_s)
    return images_per_s(run_dir, cfg.train.global_batch_size) if ok else None


def _run_here(cfg: RunConfig, run_dir: Path, timeout_s: float) -> bool:
    trial_toml = run_dir / TRIAL_CONFIG_FILE
    write_atomically(trial_toml, config_mod.to_toml(cfg))
    command = [sys.executable, "-m", "dptrain", "train", "--config", str(trial_toml)]
    with (run_dir / LOG_FILE).open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            from dptrain_bench.sweep import stop_run

            stop_run(proc)
            return False


def _run_job(cfg: RunConfig) -> bool:
    """The trial as a job, waited for (its --time, if any, bounds it, as a --slurm sweep's jobs)."""
    from dptrain_bench.jobs import run_to_its_end
    from dptrain.slurm import job as slurm_job, script as slurm_script

    workdir = Path.cwd()
    job = slurm_job.job_for(cfg, workdir)
    write_atomically(job.config, config_mod.to_toml(cfg))
    _, state = run_to_its_end(job, slurm_script.render(cfg, job))
    return state == "COMPLETED"


def find_link(tuner: Tuner) -> tuple[scaling_model.Timed, scaling_model.Timed | None, str]:
    """(the link between nodes, the one within a node or None, where they came from)."""
    if tuner.link_name is not None:
        named = scaling_model.named_link(tuner.link_name)
        return named, None, f"the named link {named.name} ({named.assumption})"
    record = link_mod.read_link(tuner.tune_dir)
    if record is None or (tuner.nodes > 1 and record.across_hosts is None):
        if tuner.nodes > 1:
            raise ConfigError(f"bench tune over {tuner.nodes} nodes needs the link between them: give --link NAME "
                              f"({', '.join(scaling_model.NAMED_LINKS)}), or measure it first into {tuner.tune_dir}/link.json "
                              f"(srun -N {tuner.nodes} dptrain bench probe link --launched --record "
                              f"{tuner.tune_dir}).")
        record, _ = link_mod.record(tuner.tune_dir, "cpu", worlds=(2,))
    between = record.for_nodes(tuner.nodes)
    assert between is not None, "a record holds a probe"
    return between, record.within_host, f"{tuner.tune_dir / link_mod.LINK_FILE}"


def tune(tuner: Tuner) -> Path:
    """Probe, run the contenders again, choose; write tuned.toml, tune.csv and tune.md into the tune folder; the path of
    tuned.toml."""
    base = workload(tuner.cfg, 1.0)  # the data and the model: a mistake there is one sentence now, not a failed trial
    tuner.tune_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    user = default_candidate(tuner.cfg, min(tuner.max_ranks, _user_ranks(tuner)))
    # one rank's compute: the user's strategy, unless it gathers its parameters even alone (fsdp), then ddp's bare model
    alone = Candidate(user.strategy if not _gathers_params(user.strategy) else "ddp", 1)
    first = alone if tuner.nodes == 1 else user  # over nodes, the compute trial is the user's own configuration
    one_rank_rate = tuner.measure(first, "compute")
    if one_rank_rate is None:
        raise LaunchError(f"the first trial run failed, so nothing can be tuned; see "
                          f"{tuner.tune_dir / 'runs'}/compute-*/bench.log.")
    between, within, link_source = find_link(tuner)
    if tuner.nodes == 1:  # one rank alone: its time per sample is the compute of every candidate
        compute_s = 1 / one_rank_rate
    else:  # the user's run over the nodes: its compute per sample as if communication were free (overlap 0)
        compute_s = _compute_from(user, one_rank_rate, tuner, base, between, within)
    work = replace(base, compute_s_per_sample=compute_s,
                   rank_share=rank_shares(tuner) if tuner.shares is None else tuner.shares,
                   own_cpu_s=own_cpu(tuner, user) if tuner.own_cpu is None else tuner.own_cpu)
    same = distinct(candidates(user, tuner.max_ranks, tuner.nodes, tuner.cfg.train.global_batch_size, tuner.lossy,
                               node_cores(tuner)), tuner.nodes, base.param_bytes)
    ranked = rank_by_model(list(same), work, between, tuner.nodes, within, overlap=0.5)
    predicted = dict(ranked)
    runs: Runs = {c: [] for c in same}
    first_run = same_run(first, tuner.nodes, base.param_bytes)
    for candidate in same:  # the compute trial is a run of the candidate that makes the same run, if one does
        if same_run(candidate, tuner.nodes, base.param_bytes) == first_run:
            runs[candidate].append(one_rank_rate)
    for candidate in trial_order(user, ranked, tuner.keep, with_lossy_kinds=tuner.accuracy_budget is not None):
        if not runs[candidate]:
            runs[candidate].append(tuner.measure(candidate, "trial"))
    if not rates(runs[user]):
        raise LaunchError(f"the trial of your own configuration ({user.name}) failed, so nothing can be compared; see "
                          f"{tuner.tune_dir / 'runs'}/trial-{user.name}/bench.log.")
    if tuner.accuracy_budget is not None:
        probe_accuracy(tuner, user, runs, list(same))
    eligible = {c: r for c, r in runs.items() if tuner.may_choose(c, user)}
    run_again(tuner, user, eligible)
    final, reason = choose(user, eligible)
    for candidate, prediction in ranked:
        measured = rates(runs[candidate])
        gap = tuner.gap(candidate)
        tuner.rows.append({"candidate": candidate.name, "strategy": candidate.strategy,
                           "ranks_per_node": candidate.ranks_per_node, "comm_hook": candidate.comm_hook,
                           "bucket_mb": "" if candidate.bucket_mb is None else candidate.bucket_mb,
                           "period": "" if candidate.period is None else candidate.period,
                           "overlap_steps": candidate.overlap_steps if candidate.strategy in STREAMED else "",
                           "same_run": " ".join(c.name for c in same[candidate]),
                           "predicted_images_per_s": round(prediction.images_per_s, 1),
                           "bytes_per_step": round(prediction.bytes_sent),
                           "runs": " ".join("failed" if r is None else f"{r:.1f}" for r in runs[candidate]),
                           "measured_images_per_s": _cell(statistics.fmean(measured) if measured else None),
                           "min_images_per_s": _cell(min(measured, default=None)),
                           "max_images_per_s": _cell(max(measured, default=None)),
                           "accuracy_gap_points": "" if gap is None else round(gap, 3),
                           "why": why(tuner, candidate, user, final, runs),
                           "default": candidate == user, "chosen": candidate == final})
    tuned = _write_tuned(tuner, final, kept=final == user)
    _write_tables(tuner, reason, link_source, time.monotonic() - started, predicted[user])
    log.info(f"tune: {reason}; {tuned} (dptrain {'submit' if tuner.slurm else 'train'} --config {tuned})")
    return tuned


def trial_order(user: Candidate, ranked: list[tuple[Candidate, scaling_model.Prediction]], keep: int,
                with_lossy_kinds: bool) -> list[Candidate]:
    """The candidates given a trial run, in order: the user's, the model's `keep` fastest; with an accuracy budget
    also the fastest of each lossy kind (each hook, local_sgd, diloco) not among them, so that a kind the budget
    rules out never takes every place."""
    order = [user, *[c for c, _ in ranked if c != user][:keep]]
    if with_lossy_kinds:
        tried = {lossy_kind(c) for c in order if c.lossy}
        for c, _ in ranked:  # fastest first
            if c.lossy and lossy_kind(c) not in tried:
                tried.add(lossy_kind(c))
                order.append(c)
    return list(dict.fromkeys(order))


def lossy_kind(candidate: Candidate) -> str:
    """What rounds or delays its gradients: its hook (fp16, bf16, powersgd), or its strategy (local_sgd, diloco), a
    streamed diloco a kind of its own (the model credits its streaming nothing on a one-core rank: a trial measures
    it)."""
    if candidate.strategy in PERIODIC:
        return f"{candidate.strategy}-behind" if candidate.overlap_steps else candidate.strategy
    return candidate.comm_hook


@dataclass(frozen=True)
class Accuracy:
    """An accuracy probe's evaluation at its end: accuracy (0 to 1), loss, and the test samples counted."""

    acc: float
    loss: float
    count: int


def gap_of(reference: Accuracy, theirs: Accuracy, budget: float) -> tuple[float, bool, str]:
    """(ddp's accuracy less theirs, in points; within the budget; in what): the accuracy, or, where one test sample
    is more than half the budget (a short probe's few samples cannot resolve it), the loss: at most `budget` percent
    above ddp's."""
    gap = (reference.acc - theirs.acc) * 100
    if 100 / max(1, reference.count) <= budget / 2:
        return gap, gap <= budget, "accuracy"
    return gap, theirs.loss <= reference.loss * (1 + budget / 100), "loss"


REFERENCE = Candidate("ddp", 1)
"""The accuracy probes' reference: exact ddp's math, on one rank of one node (every exact strategy trains the same
model at any world size, dptrain's first promise), the cheapest run of it."""


def probe_accuracy(tuner: "Tuner", default: Candidate, runs: Runs, known: list[Candidate]) -> None:
    """The accuracy of each tried lossy candidate whose trial beat the default's, fastest first, against exact ddp's
    (REFERENCE, probed once); a local_sgd or diloco candidate out of the budget gives way to the same at the next
    shorter period among `known`, tried, then probed where its trial beat the default too."""
    def ahead(c: Candidate) -> bool:
        return c != default and c.lossy and ahead_of(runs[c], runs[default])

    waiting = sorted((c for c in runs if ahead(c)), key=lambda c: -statistics.fmean(rates(runs[c])))
    while waiting:
        candidate = waiting.pop(0)
        if tuner.within_budget(candidate) or candidate.period is None:
            continue
        shorter = [c for c in known if (c.strategy, c.ranks_per_node, bool(c.overlap_steps))
                   == (candidate.strategy, candidate.ranks_per_node, bool(candidate.overlap_steps))
                   and c.period is not None and c.period < candidate.period]
        if not shorter:
            continue
        next_one = max(shorter, key=lambda c: c.period or 0)
        if not runs.setdefault(next_one, []):
            runs[next_one].append(tuner.measure(next_one, "trial"))
        if ahead(next_one):
            waiting.insert(0, next_one)


def why(tuner: "Tuner", c: Candidate, default: Candidate, final: Candidate, runs: Runs) -> str:
    """Why the candidate was or was not chosen, in a few words (tune.md's last column)."""
    if c == final:
        return "chosen" + (" (your configuration)" if c == default else "")
    if c == default:
        return "your configuration, kept for comparison"
    if not runs.get(c):
        return "not tried: the model ranked it below the tried ones"
    if not rates(runs[c]):
        return "its run failed"
    if not ahead_of(runs[c][:1], runs[default][:1]):
        return "its trial was no faster than yours"
    gap = tuner.gap(c)
    if c.lossy and gap is not None and not tuner.within_budget(c):
        return f"out of the accuracy budget ({gap:+.2f} points from ddp's, budget {tuner.accuracy_budget:g})"
    if c.lossy and gap is None:
        return "rounds or delays the gradients: chosen only with --accuracy-budget" if tuner.accuracy_budget is None \
            else "no accuracy probe gave a number"
    return "not faster than yours beyond the spread of the runs, or another was"


def run_again(tuner: Tuner, default: Candidate, runs: Runs) -> None:
    """Run the default and its contenders (contenders()) again, in turns, until each has REPEATS runs; a contender no
    longer ahead of the default (ahead_of) runs no more, and a failed run of the default ends the repeats."""
    ahead = contenders(default, runs)
    while ahead and None not in runs[default]:
        behind = [c for c in [default, *ahead] if len(runs[c]) < REPEATS]
        if not behind:
            return
        for candidate in behind:
            runs[candidate].append(tuner.measure(candidate, f"repeat{len(runs[candidate]) + 1}"))
        ahead = [c for c in ahead if ahead_of(runs[c], runs[default])]


def rank_shares(tuner: Tuner) -> dict[int, float]:
    """R ranks on a node -> each one's compute rate over one rank's alone, from the matmul probe of 1 to max_ranks
    processes (peak.json of the tune folder, measured on this machine: on SLURM, the nodes are taken to be like it).
    Ranks on one CPU split its cores but each thread does not scale as well as a process: this is what makes more
    ranks per node worth their communication, or not. Empty where the probe fails (the model then splits evenly)."""
    from dptrain_bench import peak
    from dptrain.runtime import wants_cuda

    device: peak.Device = "cuda" if wants_cuda(tuner.cfg.launch.device) else "cpu"
    try:
        probes, _ = peak.record(tuner.tune_dir, device, "bfloat16" if tuner.cfg.train.bf16 else "float32",
                                tuple(range(1, tuner.max_ranks + 1)))
    except RuntimeError as e:
        log.info(f"tune: no matmul probe ({e}); the model takes R ranks on a node to split it evenly")
        return {}
    if 1 not in probes:
        return {}
    return {r: p.peak_tflops / (r * probes[1].peak_tflops) for r, p in probes.items()}


def node_cores(tuner: Tuner) -> int:
    """A node's cores for the tuned run: the job's --cpus-per-node (1 where not given) under --slurm, else this
    machine's usable cores."""
    from dptrain_bench.peak import usable_cores

    return (tuner.cfg.slurm.cpus_per_node or 1) if tuner.slurm else usable_cores()


def own_cpu(tuner: Tuner, user: Candidate) -> dict[str, float]:
    """What the hooks, local SGD's averaging and DiLoCo's outer step cost a rank's CPU (the hook probe, hooks.json of
    the tune folder, on this machine: on SLURM the nodes are taken to be like it), where lossy candidates are
    allowed; empty otherwise, or where the probe fails (then they cost none in the model)."""
    if not tuner.lossy:
        return {}
    from dptrain.data import describe
    from dptrain_bench import hook_probe

    cores = node_cores(tuner)
    info = describe(tuner.cfg.data)
    ranks = max(2, tuner.nodes * user.ranks_per_node)
    wanted = hook_probe.HookProbe(model=tuner.cfg.model.name, image_shape=tuple(info.image_shape),
                                  num_classes=info.num_classes,
                                  batch=hook_probe.batch_per_rank(tuner.cfg.train.global_batch_size, ranks),
                                  threads=max(1, cores // user.ranks_per_node),
                                  powersgd_rank=tuner.cfg.strategy.ddp.powersgd_rank, cpu_s={})
    try:
        probe = hook_probe.record(tuner.tune_dir, wanted)
    except RuntimeError as e:
        log.info(f"tune: {e}; the model takes the hooks and averagings to cost no CPU of their own")
        return {}
    log.info(f"tune: hook probe: {hook_probe.describe(probe)}")
    return dict(probe.cpu_s)


def _user_ranks(tuner: Tuner) -> int:
    if tuner.slurm:
        return tuner.cfg.slurm.ranks_here
    from dptrain.prestart import local_workers

    return local_workers(tuner.cfg.launch, tuner.cfg.strategy)


def _compute_from(user: Candidate, rate: float, tuner: Tuner, work: scaling_model.Workload, between: scaling_model.Timed,
                  within: scaling_model.Timed | None) -> float:
    """The compute per sample that makes the model predict the user's measured rate over the nodes with no overlap:
    the measured step less its modelled communication, per sample of one rank."""
    nothing = scaling_model.predict(user.plan(shared_memory=False), replace(work, compute_s_per_sample=0.0), between,
                            tuner.nodes, user.ranks_per_node, 0.0, within)
    step_s = tuner.cfg.train.global_batch_size / rate
    compute_step = max(step_s - nothing.comm_s, step_s * 0.05)  # never below a twentieth: a link fit off by a lot
    world = tuner.nodes * user.ranks_per_node
    return compute_step * world * work.share(user.ranks_per_node) / tuner.cfg.train.global_batch_size


def _cell(value: float | None) -> str | float:
    return "" if value is None else round(value, 1)


def _write_tuned(tuner: Tuner, chosen: Candidate, kept: bool) -> Path:
    """The user's configuration with the chosen candidate's options: what `dptrain train --config` runs. kept: the
    choice is the user's own configuration, which the header says rather than presenting it as a finding."""
    cfg = tuner.config_of(chosen, [*tuner.user_pairs, *chosen.pairs()])
    path = BenchFolder(tuner.tune_dir).tuned
    header = (f"# dptrain bench tune kept your configuration ({chosen.name}): see tune.md beside this file for why"
              if kept else f"# dptrain bench tune chose {chosen.name}: see tune.md beside this file")
    with written_atomically(path) as tmp:
        tmp.write_text(f"{header}\n" + config_mod.to_toml(cfg))
    return path


COLUMNS = ("candidate", "strategy", "ranks_per_node", "comm_hook", "bucket_mb", "period", "overlap_steps",
           "same_run", "predicted_images_per_s", "bytes_per_step", "runs", "measured_images_per_s", "min_images_per_s",
           "max_images_per_s", "accuracy_gap_points", "why", "default", "chosen")
"""tune.csv: one row per distinct run (same_run: the other candidates that make it, not tried apart); bytes_per_step:
what a rank sends a step, as the model counts it; runs: each run's images/s in the order they ran ("failed" for one
that failed), measured: their mean, min and max; accuracy_gap_points: exact ddp's evaluation accuracy less the
candidate's, in points, after the accuracy probe's steps (lossy candidates probed only); why: chosen or not, why."""


def _write_tables(tuner: Tuner, reason: str, link_source: str, took_s: float, user_prediction: scaling_model.Prediction) -> None:
    folder = BenchFolder(tuner.tune_dir)
    with written_atomically(folder.tune_table) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(tuner.rows)
    where = f"{tuner.nodes} SLURM nodes" if tuner.slurm else "this machine"
    lines = [f"# dptrain bench tune on {where}", "",
             f"Chosen: {reason}. Took {took_s:.0f} s. Link: {link_source}. Each trial: {STEPS} steps, timed from step "
             f"{WARM_STEPS}; the global batch ({tuner.cfg.train.global_batch_size}) is the same in every candidate.", "",
             "| candidate | predicted images/s | bytes a step | each run, images/s | slowest-fastest | accuracy gap "
             "| | why |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in tuner.rows:
        marks = ", ".join(m for m, on in (("default", row["default"]), ("chosen", row["chosen"])) if on)
        name = row["candidate"] + (f" (the same run: {row['same_run'].replace(' ', ', ')})" if row["same_run"] else "")
        each = "; ".join(r if r == "failed" else f"{float(r):,.0f}" for r in row["runs"].split())
        rated = sum(1 for r in row["runs"].split() if r != "failed")
        slowest_fastest = f"{row['min_images_per_s']:,.0f}-{row['max_images_per_s']:,.0f}" if rated > 1 else ""
        gap = "" if row["accuracy_gap_points"] == "" else f"{row['accuracy_gap_points']:+.2f}"
        lines.append(f"| {name} | {row['predicted_images_per_s']:,.0f} | {row['bytes_per_step']:,} | {each} | "
                     f"{slowest_fastest} | {gap} | {marks} | {row['why']} |")
    lines += ["", f"A candidate is chosen only if each of its {REPEATS} runs was faster than each of your "
              f"configuration's {REPEATS}: your configuration and the {CONTENDERS} fastest candidates whose trial beat "
              f"it ran again, in turns, a candidate stopping at its first run no faster than one of yours.", "",
              "The same run: candidates that compute the same thing the same way on this shape (at one rank DDP wraps "
              "nothing, so its bucket cap and comm hook are never used; gradients under 1 MiB make one bucket whatever "
              "the cap), tried once as the first one named.", "",
              "Candidates without a run were ranked below the tried ones by the model and not run."]
    lines += accuracy_notes(tuner)
    with written_atomically(folder.tune_notes) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def accuracy_notes(tuner: Tuner) -> list[str]:
    """tune.md's words on the accuracy budget: what was compared, and ddp's accuracy."""
    if tuner.accuracy_budget is None:
        return ["", "Without --accuracy-budget only candidates that compute what ddp computes are chosen: no hook "
                "that rounds the gradients, no local SGD or DiLoCo."]
    reference = tuner.accuracy.get(REFERENCE)
    seen = (f"exact ddp's accuracy after {tuner.probe_steps} steps: {reference.acc:.4f} (loss {reference.loss:.4f}, "
            f"{reference.count:,} test images), on one rank" if reference is not None else
            "exact ddp's accuracy probe gave no number, so no lossy candidate could be chosen")
    return ["", f"Accuracy budget: {tuner.accuracy_budget:g} points. A candidate that rounds or delays the gradients "
            f"(fp16, bf16, PowerSGD, local SGD, DiLoCo) is chosen only where its accuracy probe, {tuner.probe_steps} "
            f"steps on the same global batches as ddp's, ends within the budget of ddp's evaluation accuracy (or, "
            f"where one test image is more than half the budget, its loss within the budget in percent of ddp's). "
            f"Probed: the lossy candidates whose trial beat yours, fastest first; one of local SGD or DiLoCo out of the "
            f"budget gave way to the same at the next shorter period. The gap column is ddp's accuracy less theirs. "
            f"{seen[0].upper()}{seen[1:]} (every exact strategy trains the same model at any world size)."]


def tuner_from_options(*, config_path: str | None, pairs: list[tuple[str, str]], slurm: bool,
                       job_pairs: list[tuple[str, str]], nodes: str | None, lossy: bool, link_name: str | None,
                       run_timeout_s: float, keep: int = KEEP, accuracy_budget: float | None = None,
                       accuracy_steps: int | None = None) -> Tuner:
    """Check what `dptrain bench tune` was given, once, before any trial; the Tuner."""
    tune_dir: Path | None = None
    user_pairs = []
    for key, value in pairs:
        if key == "output.dir":  # the tune folder; tuned.toml keeps the configuration's own output.dir
            tune_dir = Path(value)
        else:  # the user's strategy and ranks are the default candidate; the trials set their steps and saving
            user_pairs.append((key, value))
    if keep < 1:
        raise ConfigError(f"--candidates {keep} tries nothing but your own configuration; give 1 or more.")
    if lossy and accuracy_budget is None:
        raise ConfigError("--lossy candidates round or delay the gradients and are chosen only within an accuracy "
                          "budget; add --accuracy-budget POINTS (0.5, say), or drop --lossy.")
    if accuracy_budget is not None and not 0 < accuracy_budget <= 100:
        raise ConfigError(f"--accuracy-budget {accuracy_budget:g} is no number of accuracy points between 0 and 100; "
                          f"give the points you would lose at most, 0.5 say.")
    if accuracy_steps is not None and accuracy_budget is None:
        raise ConfigError("--accuracy-steps is the length of the accuracy probes of --accuracy-budget; add "
                          "--accuracy-budget POINTS, or drop it.")
    if accuracy_steps is not None and accuracy_steps < 1:
        raise ConfigError(f"--accuracy-steps {accuracy_steps} trains nothing; give 1 or more.")
    if link_name is not None:
        scaling_model.named_link(link_name)  # one sentence for a name the model does not know
    node_count = 1
    if slurm:
        if nodes is not None and ("," in nodes or not nodes.strip().isdigit() or int(nodes) < 1):
            raise ConfigError(f"bench tune --nodes {nodes!r} is the one node count to tune for (e.g. 2), not a list.")
        node_count = int(nodes) if nodes else 1
    elif nodes is not None:
        raise ConfigError("--nodes of bench tune is the SLURM nodes to tune for; add --slurm, or drop --nodes.")
    cfg = config_mod.load(config_path, [*user_pairs, *(job_pairs if slurm else [])])
    if slurm:
        user_pairs += [pair for pair in job_pairs if pair[0] != "slurm.nodes"]
        max_ranks = max(cfg.slurm.ranks_here, cfg.slurm.cpus_per_node or 1)
    else:
        from dptrain_bench.peak import usable_cores
        from dptrain.runtime import wants_cuda

        if wants_cuda(cfg.launch.device):
            import torch

            max_ranks = max(1, torch.cuda.device_count())
        else:
            max_ranks = usable_cores()
    return Tuner(cfg=cfg, config_path=config_path, user_pairs=user_pairs,
                 tune_dir=tune_dir or Path("runs") / "tune" / cfg.data.name, nodes=node_count, max_ranks=max_ranks,
                 slurm=slurm, lossy=accuracy_budget is not None, link_name=link_name, run_timeout_s=run_timeout_s,
                 keep=keep, accuracy_budget=accuracy_budget, accuracy_steps=accuracy_steps)
