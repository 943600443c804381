"""`dptrain submit --rehearse`: short twins of a job, signalled as SLURM signals a job before its time limit, and one
table of what held, before the real job runs.

The twins are the job itself (the same partition, account, container, nodes, options and job script) with a short run
of `--rehearse-steps` steps, each in RUN_DIR/rehearsal/<twin>/, submitted together:
  preempted      with --requeue: SIGUSR1 as the job's --signal sends it (scancel --signal=USR1, to every srun task),
                 `--rehearse-drills` times as a drill (the snapshot is written, training goes on: stopping.DRILLS_VAR),
                 then once more: it stops, rank 0 runs scontrol requeue, and the rerun resumes from that snapshot;
  sigterm        no user signal (--signal-lead-s 0) and a time limit of 1 minute: SLURM itself sends SIGTERM at the
                 time limit, and SIGKILL KillWait seconds later, as on a cluster that sends no user signal (sending
                 SIGTERM with scancel --full instead made srun kill the ranks at once: not what a time limit does);
  uninterrupted  never signalled: its final weights are what the preempted twin's must equal, bit for bit.
One signal at a time: the next is sent once the twin has written the last one's snapshot and trained a step past it.
The ranks time each signal themselves (the `signal` event: when each rank got it, when its snapshot was written);
the exit is when squeue first shows the job no longer running. SLURM makes a requeued job wait for its credential to
expire (AuthInfo cred_expire, 120 s by default) before the rerun, which is most of a rehearsal's time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from dptrain import config as config_mod, read_back
from dptrain.config import RunConfig
from dptrain.errors import ConfigError, SnapshotError, UnsafeFileError
from dptrain.events import (DRILL, RECEIVED_AT, REQUEUE_EVENT, REQUEUE_FAILED_EVENT, RUN_START_EVENT, SIGNAL_EVENT,
                            SLURM_RESTARTS, SNAPSHOT_AT, STEP, STEP_EVENT, STOPPED_EVENT, TIME, read_run_events)
from dptrain.run_folder import RunFolder
from dptrain.safe_load import load_tensors
from dptrain.slurm import queue, script as slurm_script
from dptrain.slurm.job import Job
from dptrain.snapshots import PREFIX, verify
from dptrain.stopping import DRILLS_VAR

PREEMPTED, SIGTERM, UNINTERRUPTED = "preempted", "sigterm", "uninterrupted"
TWINS = (PREEMPTED, SIGTERM, UNINTERRUPTED)
SCRIPT_TWINS = (PREEMPTED,)
FIRST_SIGNAL_AFTER = 2  # steps a twin trains before its first signal
POLL_S = 0.1  # how often the twins' events and states are read while signals are under way
SCRIPT_SIGNAL_AFTER_S = 20.0  # a script's twin: seconds of running before its signal (its steps are not seen)
LEAD_MARGIN = 2.0  # the lead recommended: this many times the p95 of signal to exit
OK, WARN, FAIL = "ok", "WARN", "FAIL"
SIGTERM_LIMIT_MIN = 1  # the sigterm twin's time limit, in minutes (SLURM's smallest)
UNTIL_THE_LIMIT = 10**9  # the sigterm twin's steps: more than it can train before its time limit


def twin_overrides(cfg: RunConfig, job: Job, twin: str, steps: int, drills: int, trainer: bool) -> list[tuple[str, str]]:
    """The options that make the job's twin `twin` (after the job's own): its folder, a time limit that leaves room,
    and for dptrain's training a short run that keeps every snapshot; with a script of the user's, its folder only."""
    if steps < FIRST_SIGNAL_AFTER + drills + 2 or drills < 0:
        raise ConfigError(f"--rehearse-steps {steps} leaves no room for {drills} drills and the stop after "
                                     f"step {FIRST_SIGNAL_AFTER}; give at least {FIRST_SIGNAL_AFTER + drills + 2} "
                                     f"steps, or fewer --rehearse-drills.")
    lead = cfg.slurm.signal_lead_s or 120
    pairs = [("output.dir", str(RunFolder(job.run_dir).rehearsal / twin)),
             ("slurm.time", str(math.ceil(lead / 60) + 10))]  # minutes: SLURM's own signal comes after the rehearsal
    if twin == PREEMPTED:
        pairs += [("slurm.requeue", "true"), ("slurm.signal_lead_s", str(lead))]
    elif twin == SIGTERM:  # trains until SLURM's time limit stops it
        pairs += [("slurm.requeue", "false"), ("slurm.signal_lead_s", "0"), ("slurm.time", str(SIGTERM_LIMIT_MIN))]
        steps = UNTIL_THE_LIMIT
    else:
        pairs += [("slurm.requeue", "false")]
    if trainer:
        pairs += [("train.max_steps", str(steps)), ("train.epochs", str(steps)), ("train.log_every", "1"),
                  ("train.resume", "auto"), ("checkpoint.keep_last", str(drills + 3))]  # every signal's snapshot kept
    return pairs


@dataclass
class Row:
    check: str
    result: str
    seen: str


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    """The timings behind the rows: signal_to_snapshot_s, snapshot_to_exit_s (lists), recommended_lead_s."""

    @property
    def failed(self) -> bool:
        return any(row.result == FAIL for row in self.rows)

    def add(self, check: str, result: str, seen: str) -> None:
        self.rows.append(Row(check, result, seen))

    def markdown(self) -> str:
        lines = ["| check | result | seen |", "| --- | --- | --- |"]
        lines += [f"| {r.check} | {r.result} | {r.seen.replace('|', '/')} |" for r in self.rows]
        return "\n".join(lines) + "\n"


@dataclass
class Twin:
    """One submitted twin and what the driver saw of it."""

    name: str
    job: Job
    job_id: str
    signal: str | None  # the signal the driver sends (USR1), None: none (SLURM's time limit signals the sigterm twin)
    count: int  # the signals it is to get
    sent: list[float] = field(default_factory=list)
    exit_seen: float | None = None  # when squeue first showed it no longer running after its last signal
    state: str | None = "PENDING"  # its last state (None: the scheduler has forgotten it)
    running_since: float | None = None
    verified: dict[int, str | None] = field(default_factory=dict)  # step -> None (verified) or what is wrong

    @property
    def folder(self) -> RunFolder:
        return RunFolder(self.job.run_dir)

    def events(self, kind: str) -> list[dict[str, Any]]:
        if not self.folder.metrics.is_file():
            return []
        try:
            return [e for e in read_run_events(self.folder.metrics)[0] if e.get("event") == kind]
        except (OSError, read_back.UnreadableFile):
            return []


def rehearse(cfg: RunConfig, job: Job, twins: dict[str, tuple[Any, Job, str]], user_script: bool, drills: int,
             bound_s: float = 1800.0) -> Table:
    """Submit the twins (name -> (plan, job, script text)), signal them, wait for their ends, print the table and
    write it beside the job (RUN_DIR/rehearsal.md and .json); the table. LaunchError where sbatch refuses a twin."""
    queue.require_clients("dptrain submit --rehearse")
    started = time.monotonic()
    folder = RunFolder(job.run_dir).rehearsal
    if folder.exists():
        shutil.rmtree(folder)  # an earlier rehearsal's twins: this one's resume must not find their snapshots
    submitted: dict[str, Twin] = {}
    try:
        for name, (run, twin_job, text) in twins.items():
            if name == PREEMPTED and not user_script:
                command = slurm_script.dptrain_training(run.cfg, twin_job)
                said = f"# A rehearsal's drills: the first {drills} signals write their snapshot and the run goes on."
                command = dataclasses.replace(command, environment=(said, f"export {DRILLS_VAR}={drills}"))
                text = slurm_script.render(run.cfg, twin_job, command)
            config_text = None if user_script else config_mod.to_toml(run.given)
            job_id = queue.submit_written(twin_job, text, config_text)
            signal = "USR1" if name == PREEMPTED else None  # the sigterm twin's comes from SLURM
            count = {PREEMPTED: 1 if user_script else drills + 1, SIGTERM: 1}.get(name, 0)
            submitted[name] = Twin(name, twin_job, job_id, signal, count)
        print(f"dptrain: rehearsing the job of {job.run_dir} with {len(submitted)} twins in {folder}: jobs "
              f"{', '.join(f'{t.job_id} ({t.name})' for t in submitted.values())}", flush=True)
        _drive([t for t in submitted.values() if t.count], user_script, started + bound_s)
        if user_script:  # its requeued rerun would run the whole script again: what SLURM counted is enough
            time.sleep(2.0)
            table = _script_table(cfg, submitted)
        else:
            _wait_for_ends(submitted.values(), started + bound_s)
            table = _table(cfg, submitted)
    finally:
        alive = [t.job_id for t in submitted.values() if not queue.has_ended(t.state)]
        if alive:
            subprocess.run(["scancel", *alive], capture_output=True, timeout=60)
    took = time.monotonic() - started
    table.add("rehearsal's wall time", OK, f"{took:.0f} s, submission to the last twin's end")
    text = f"# Rehearsal of the job of {job.run_dir}\n\n{table.markdown()}"
    print(text, end="", flush=True)
    rehearsal_files = RunFolder(job.run_dir)
    rehearsal_files.rehearsal_table.write_text(text)
    rehearsal_files.rehearsal_record.write_text(json.dumps(
        {"rows": [dataclasses.asdict(r) for r in table.rows], "wall_s": round(took, 1), **table.measured,
         "jobs": {t.name: t.job_id for t in submitted.values()}}, indent=1) + "\n")
    return table


def _drive(twins: list[Twin], user_script: bool, deadline: float) -> None:
    """Send each twin its signals, one at a time, until each has had them all and left the running state."""
    while any(t.exit_seen is None and not queue.has_ended(t.state) for t in twins):
        if time.monotonic() > deadline:
            return
        states = queue.job_states([t.job_id for t in twins])
        now = time.time()
        for twin in twins:
            _verify_new(twin)
            twin.state = states.get(twin.job_id)
            if twin.state == "RUNNING" and twin.running_since is None:
                twin.running_since = now
            if twin.signal is None or len(twin.sent) == twin.count:
                if twin.exit_seen is None and twin.state != "RUNNING" and _signals_seen(twin, user_script):
                    twin.exit_seen = now
                continue
            if twin.state == "RUNNING" and _ready(twin, user_script, now):
                _send(twin)
        time.sleep(POLL_S)


def _verify_new(twin: Twin) -> None:
    """Verify each signal's snapshot as soon as its event is written (later ones prune it in time)."""
    for event in twin.events(SIGNAL_EVENT.name)[:twin.count]:
        if event[STEP] not in twin.verified:
            try:
                verify(twin.folder.checkpoints / f"{PREFIX}{event[STEP]:08d}")
                twin.verified[event[STEP]] = None
            except SnapshotError as exc:
                twin.verified[event[STEP]] = str(exc)


def _signals_seen(twin: Twin, user_script: bool) -> bool:
    return user_script or len(twin.events(SIGNAL_EVENT.name)) >= twin.count


def _ready(twin: Twin, user_script: bool, now: float) -> bool:
    """Whether the twin may have its next signal: it has trained past its last signal's snapshot (a script's twin:
    it has run SCRIPT_SIGNAL_AFTER_S)."""
    if user_script:
        return twin.running_since is not None and now - twin.running_since >= SCRIPT_SIGNAL_AFTER_S
    signals = twin.events(SIGNAL_EVENT.name)
    if len(signals) < len(twin.sent):
        return False
    steps = [e[STEP] for e in twin.events(STEP_EVENT.name)]
    last = signals[-1][STEP] if signals else FIRST_SIGNAL_AFTER - 1
    return bool(steps) and max(steps) > last


def _send(twin: Twin) -> None:
    """The signal as the job's --signal=USR1@N sends it: to every srun task (not the job's script)."""
    subprocess.run(["scancel", f"--signal={twin.signal}", twin.job_id], capture_output=True, timeout=60)
    twin.sent.append(time.time())


def _wait_for_ends(twins: Any, deadline: float) -> None:
    waiting = {t.job_id: t for t in twins}
    while waiting and time.monotonic() < deadline:
        states = queue.job_states(list(waiting))
        for job_id, twin in list(waiting.items()):
            twin.state = states.get(job_id)
            if queue.has_ended(twin.state):
                del waiting[job_id]
        time.sleep(1.0)


def percentiles(values: list[float]) -> tuple[float, float]:
    """(p50, p95) by the nearest rank: with 20 values or fewer, p95 is the largest."""
    ordered = sorted(values)
    return statistics.median(ordered), ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _reached(twin: Twin, what: str) -> tuple[str, str]:
    signals = twin.events(SIGNAL_EVENT.name)[:twin.count]
    if len(signals) < twin.count:
        sent = f"SIG{twin.signal} sent {len(twin.sent)} times" if twin.signal else "SLURM's time limit came"
        return FAIL, (f"{sent}, the ranks agreed on {len(signals)} signals (job {twin.job_id} ended {twin.state}; "
                      f"see {twin.folder.logs})")
    missed = [(i + 1, r) for i, e in enumerate(signals) for r, t in enumerate(e[RECEIVED_AT]) if t is None]
    ranks = len(signals[0][RECEIVED_AT])
    if missed:
        return FAIL, f"signal {missed[0][0]} did not reach rank {missed[0][1]} of {ranks} before its snapshot ({what})"
    return OK, f"{len(signals)} of {len(signals)} signals reached all {ranks} ranks ({what})"


def _snapshot_rows(table: Table, twins: list[Twin]) -> list[tuple[float, dict[str, Any]]]:
    """The verify row; (signal-to-snapshot seconds, event) of every signal."""
    timed, checked, problem = [], 0, None
    for twin in twins:
        _verify_new(twin)
        for event in twin.events(SIGNAL_EVENT.name)[:twin.count]:
            if twin.verified[event[STEP]] is None:
                checked += 1
            else:
                problem = problem or twin.verified[event[STEP]]
            received = [t for t in event[RECEIVED_AT] if t is not None]
            if received:
                timed.append((event[SNAPSHOT_AT] - min(received), event))
    if problem or not checked:
        table.add("snapshot written whole, verifies", FAIL, problem or "no signal's snapshot to verify")
    else:
        table.add("snapshot written whole, verifies", OK, f"{checked} of {checked} signals' snapshots verify")
    return timed


def _table(cfg: RunConfig, twins: dict[str, Twin]) -> Table:
    table = Table()
    preempted, sigterm, uninterrupted = twins[PREEMPTED], twins[SIGTERM], twins[UNINTERRUPTED]
    table.add("signal reaches every rank: SIGUSR1", *_reached(preempted, "the job's --signal"))
    if sigterm.events(STEP_EVENT.name) or sigterm.events(SIGNAL_EVENT.name):
        table.add("signal reaches every rank: SIGTERM only", *_reached(sigterm, "SLURM's time limit, no user signal"))
    else:  # a job that takes more than its minute to start training (a container pulled, a large set read)
        table.add("signal reaches every rank: SIGTERM only", WARN,
                  f"not rehearsed: its twin had not trained a step when its {SIGTERM_LIMIT_MIN}-minute time limit came "
                  f"(job {sigterm.job_id} ended {sigterm.state}; see {sigterm.folder.logs})")
    timed = _snapshot_rows(table, [preempted, sigterm])
    table.add("requeued, resumed from that snapshot", *_resumed(preempted))
    table.add("resumed run equals the uninterrupted twin", *_equal(preempted, uninterrupted))
    stops = {t.name: _stop_times(t) for t in (preempted, sigterm)}
    to_exit = [stop[1] for stop in stops.values() if stop is not None]
    if not timed or not to_exit:
        table.add("signal → snapshot → exit", FAIL, "too few signals were timed to measure it")
        return table
    snap50, snap95 = percentiles([s for s, _ in timed])
    exit50, exit95 = percentiles(to_exit)
    table.measured = {"signal_to_snapshot_s": [round(s, 3) for s, _ in timed],
                      "snapshot_to_exit_s": [round(e, 3) for e in to_exit]}
    table.add("signal → snapshot", OK, f"p50 {snap50:.2f} s, p95 {snap95:.2f} s over {len(timed)} signals")
    table.add("snapshot → exit", OK, f"p50 {exit50:.2f} s, p95 {exit95:.2f} s over {len(to_exit)} stops (the requeue, "
                                     f"the SIGTERM stop)")
    lead = max(1, math.ceil(LEAD_MARGIN * (snap95 + exit95)))
    table.measured["recommended_lead_s"] = lead
    ours = cfg.slurm.signal_lead_s
    if ours >= lead:
        table.add("--signal-lead-s", OK, f"the job's {ours} s covers the {lead} s recommended "
                                         f"({LEAD_MARGIN:g} x p95 of signal to snapshot, plus snapshot to exit)")
    else:
        table.add("--signal-lead-s", WARN, f"recommended: {lead} s ({LEAD_MARGIN:g} x p95 of signal to snapshot, plus "
                                           f"snapshot to exit); the job asks for {ours or 'no signal'}: give "
                                           f"--signal-lead-s {lead}")
    kill_wait, term = _kill_wait(), stops[SIGTERM]
    if kill_wait is not None and term is not None:
        took = sum(term)
        table.add("SIGTERM only: stop within KillWait", OK if took < kill_wait else FAIL,
                  f"{took:.2f} s from SIGTERM to exit; the cluster's KillWait (SIGTERM to SIGKILL) is {kill_wait} s")
    table.add(f"work lost at checkpoint.every_steps = {cfg.checkpoint.every_steps}", OK, _work_lost(cfg, uninterrupted))
    return table


def _stop_times(twin: Twin) -> tuple[float, float] | None:
    """(signal to snapshot, snapshot to exit) of the twin's last signal, the one that stopped it; None if untimed."""
    signals = twin.events(SIGNAL_EVENT.name)
    if len(signals) < twin.count or twin.exit_seen is None:
        return None
    stop = signals[twin.count - 1]
    received = [t for t in stop[RECEIVED_AT] if t is not None]
    if not received or stop[DRILL]:
        return None
    return stop[SNAPSHOT_AT] - min(received), twin.exit_seen - stop[SNAPSHOT_AT]


def _resumed(twin: Twin) -> tuple[str, str]:
    stops, requeues = twin.events(STOPPED_EVENT.name), twin.events(REQUEUE_EVENT.name)
    starts, failed = twin.events(RUN_START_EVENT.name), twin.events(REQUEUE_FAILED_EVENT.name)
    if failed:
        return FAIL, f"scontrol requeue was refused: {failed[0].get('reason')}"
    if not stops or not requeues:
        return FAIL, f"the twin did not stop and requeue (job {twin.job_id} ended {twin.state}; see {twin.folder.logs})"
    restarts = [s.get(SLURM_RESTARTS) for s in starts]
    if len(starts) < 2 or starts[1][STEP] != stops[0][STEP]:
        return FAIL, (f"stopped at step {stops[0][STEP]}, requeued, but the rerun "
                      + (f"started at step {starts[1][STEP]}" if len(starts) > 1 else f"never started (job {twin.state})"))
    if twin.state != "COMPLETED":
        return FAIL, f"the rerun resumed at step {starts[1][STEP]} but the job ended {twin.state}"
    waited = starts[1][TIME] - requeues[0][TIME]
    return OK, (f"requeued after the snapshot of step {stops[0][STEP]}; the rerun (SLURM_RESTART_COUNT {restarts[1]}) "
                f"resumed from it {waited:.0f} s later and completed")


def _equal(twin: Twin, reference: Twin) -> tuple[str, str]:
    if twin.state != "COMPLETED" or reference.state != "COMPLETED":
        return FAIL, f"no final weights to compare (preempted {twin.state}, uninterrupted {reference.state})"
    import torch

    try:
        ours, theirs = load_tensors(twin.folder.model), load_tensors(reference.folder.model)
    except (OSError, UnsafeFileError) as exc:
        return FAIL, f"the final weights could not be read ({exc})"
    differ = [k for k in theirs if k not in ours or not torch.equal(ours[k], theirs[k])]
    if differ or ours.keys() != theirs.keys():
        return FAIL, f"{len(differ)} of {len(theirs)} tensors differ, {differ[0] if differ else 'the names'} first"
    steps = reference.events(RUN_START_EVENT.name)[0]
    return OK, f"all {len(theirs)} tensors torch.equal after {steps.get('total_steps')} steps"


def _work_lost(cfg: RunConfig, twin: Twin) -> str:
    times = [e[TIME] for e in twin.events(STEP_EVENT.name)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    step_s = statistics.median(gaps) if gaps else None
    every = cfg.checkpoint.every_steps
    with_signal = "none when the signal comes in time (the stop's snapshot)"
    if not every:
        return f"{with_signal}; without it, the steps since the last epoch's snapshot (checkpoint.every_steps is 0)"
    cost = f" (≈ {every * step_s:.1f} s at the twins' {step_s * 1000:.0f} ms a step)" if step_s else ""
    return f"{with_signal}; without it, up to {every} steps{cost}"


def _kill_wait() -> int | None:
    """The cluster's KillWait in seconds (scontrol show config), None where it cannot be read."""
    try:
        done = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in done.stdout.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "KillWait" and value.split() and value.split()[0].isdigit():
            return int(value.split()[0])
    return None


def _script_table(cfg: RunConfig, twins: dict[str, Twin]) -> Table:
    """A script of the user's: what SLURM shows of its twin (the signal, how the job ended or went back to the queue);
    whether the signal reached each rank, its snapshots and its resume are the script's own, named as not checked."""
    table = Table()
    twin = twins[PREEMPTED]
    if not twin.sent:
        table.add("signal sent", FAIL, f"the twin ended {twin.state} before it had run {SCRIPT_SIGNAL_AFTER_S:g} s "
                                       f"(job {twin.job_id}); give the script more work to rehearse on")
        return table
    record = queue.job_record(twin.job_id)
    restarts = int(record.get("Restarts", "0") or 0) if record else 0
    ended = f"{record.get('JobState', twin.state)}, exit code {record.get('ExitCode', '?')}"
    lead = cfg.slurm.signal_lead_s
    if twin.exit_seen is None:
        table.add("signal → exit", FAIL, f"job {twin.job_id} went on running after SIGUSR1")
    else:
        took = twin.exit_seen - twin.sent[0]
        table.add("signal → exit", OK if restarts and took < lead else WARN,
                  f"{took:.1f} s from SIGUSR1 to the job leaving the running state ({ended}; the job's lead: {lead} s)")
    table.add("requeued from inside the job", OK if restarts else FAIL,
              f"SLURM counts {restarts} restarts of job {twin.job_id}" + ("" if restarts else
              "; the script's rank 0 runs scontrol requeue where DPTRAIN_REQUEUE is 1, after its snapshot"))
    for check in ("signal reaches every rank", "snapshot written whole, verifies",
                  "resumed run equals the uninterrupted twin"):
        table.add(check, WARN, "not checked: a script of yours keeps its own state")
    return table
