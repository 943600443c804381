"""A sweep as SLURM jobs (`dptrain bench --slurm`): one job per point, all submitted at once, then waited for.

    $ dptrain bench --slurm --workers 1,2,4,8 --nodes 2 --gpus-per-node 4 --partition gpu --time 00:30:00

Each point's folder BENCH/runs/<engine>-<strategy>-w<W>-r<R>/ is the run folder of its job, written as `dptrain
submit` writes one (job.sbatch, job.toml: the resolved config, the job's shape from sweep.job_shape), with the id of
the job submitted for it (job_id.txt); the job's output goes to logs/slurm-<id>.out and .err there. The sweep then
asks the scheduler (slurm.queue.wait_for) until every job has ended, and records a failed one as the local sweep
does (bench_error.txt: its first error line). Running the same command again submits only the points that are
neither done nor still queued or running (it asks the scheduler about job_id.txt's job), and waits for those that are.

A point of another engine (tutorial, lightning, deepspeed) is a job too, launched as that engine's users launch
across nodes: one srun task per node running torchrun, whose agents meet at the first node (c10d rendezvous at
MASTER_ADDR:MASTER_PORT, both from the job as dptrain's own jobs take them), each starting the node's ranks of
`python -m MODULE RUN_DIR`; the engine reads RUN_DIR/config.toml, written before the submission.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import time
from dataclasses import replace
from pathlib import Path

from dptrain import config as config_mod
from dptrain import read_back
from dptrain_bench.folder import JOB_ID_FILE, BenchFolder
from dptrain_bench.sweep import (ERROR_FILE, OTHER_ENGINES, Point, Sweep, check_and_record, describe_plan, error_line,
                                 is_done, job_shape, last_line, plan, record_hooks)
from dptrain.config import RunConfig, SlurmConfig
from dptrain.errors import ConfigError, LaunchError
from dptrain.read_back import UnreadableFile
from dptrain.run_folder import RunFolder
from dptrain.slurm import job as slurm_job, partition as slurm_partition, queue as slurm_queue, script as slurm_script
from dptrain.slurm.env import SLURM_VARS
from dptrain.files import write_atomically

log = logging.getLogger(__name__)



def point_config(sweep: Sweep, point: Point) -> RunConfig:
    """The config a point's job trains from: the shared options, this point's strategy and run folder (absolute:
    the job runs it from the submission's folder), no epoch snapshots (as the local sweep), its job's shape; for
    another engine, that shape as one torchrun per node (peer_shape), which starts launch.nproc_per_node ranks."""
    assert sweep.job is not None, "a sweep of SLURM jobs"
    run_dir = sweep.run_dir(point).resolve()
    cfg = config_mod.load(sweep.config_path, [("checkpoint.every_epochs", "0"), *sweep.train_pairs,
                                              ("strategy.name", point.strategy), ("output.dir", str(run_dir))])
    shape = job_shape(point.workers, sweep.job)
    if point.engine in OTHER_ENGINES:
        shape = peer_shape(shape)
        return replace(cfg, slurm=shape, launch=replace(cfg.launch, nproc_per_node=shape.ranks_here))
    return replace(cfg, slurm=shape)


def peer_shape(shape: SlurmConfig) -> SlurmConfig:
    """A point's job shape for another engine: one task per node (torchrun, given the node's cores and GPUs), no
    snapshot signal and no requeue (the plain loops write no snapshot to resume from, and SIGUSR1 would end
    torchrun at once)."""
    peer = replace(shape, mode="agent", ranks_per_node=shape.ranks_here, signal_lead_s=0, requeue=False)
    asked = shape.sbatch_gpus_per_node()
    if asked is not None and peer.gpus_here != shape.gpus_here:  # gpus-per-task: one task per node would get fewer
        raise ConfigError(f"slurm.sbatch's {asked[0]} gives each task its GPUs, and the other engines run one task "
                          f"per node (torchrun); ask for the GPUs per node (--gpus-per-node N) instead.")
    return peer


def dptrain_points(sweep: Sweep) -> list[Point]:
    """One dptrain point per strategy and worker count."""
    first: dict[tuple[str, int], Point] = {}
    for point in plan(sweep):
        if point.engine not in OTHER_ENGINES:
            first.setdefault((point.strategy, point.workers), point)
    return list(first.values())


def checks(sweep: Sweep) -> list[tuple[RunConfig, int]]:
    """(config, world size) of one dptrain point per strategy and worker count: what `dptrain submit` would check of
    each job (the CLI's preflight), before the first is submitted. The other engines' points were checked by their
    engine's check when the sweep was planned."""
    return [(point_config(sweep, point), point.workers) for point in dptrain_points(sweep)]


def require_clients() -> None:
    slurm_queue.require_clients("dptrain bench --slurm")


def check_nodes_fit(sweep: Sweep) -> None:
    """Every job's shape fits a node of its partition (slurm.partition.check_nodes_fit), before the first is submitted:
    one point of each engine kind (dptrain's ranks as tasks, the others' torchrun per node) and worker count."""
    first: dict[tuple[bool, int], Point] = {}
    for point in plan(sweep):
        first.setdefault((point.engine in OTHER_ENGINES, point.workers), point)
    for point in first.values():
        slurm_partition.check_nodes_fit(point_config(sweep, point).slurm)


def job_of(sweep: Sweep, point: Point) -> tuple[RunConfig, slurm_job.Job, str]:
    """(config, job, script) of a point, as `dptrain submit` would write them from this folder (another engine's:
    peer_command's)."""
    cfg = point_config(sweep, point)
    job = slurm_job.job_for(cfg, Path.cwd())
    command = peer_command(cfg, job, point.engine) if point.engine in OTHER_ENGINES else None
    return cfg, job, slurm_script.render(cfg, job, command)


def peer_command(cfg: RunConfig, job: slurm_job.Job, engine: str) -> slurm_script.TaskCommand:
    """What each task of another engine's job runs: one torchrun per node in place of dptrain's elastic agent, with
    the engine's module, as the engine's users launch it across nodes (the job's #SBATCH lines, set-up lines, first
    node's address and port, and container are dptrain's own). torchrun's c10d rendezvous numbers the nodes, so no
    --node-rank (each task's SLURM_NODEID)."""
    python = slurm_job.python_for(cfg.slurm)
    environment: tuple[str, ...] = ()
    if cfg.slurm.cpus_per_node:
        environment = (
            "# Each rank's share of the node's cores, as dptrain's ranks take theirs from --cpus-per-task (torchrun",
            "# alone gives one thread to each of several ranks, and torch gives one rank every core it sees).",
            f"export OMP_NUM_THREADS={max(1, cfg.slurm.cpus_per_node // job.ranks_per_node)}")
    return slurm_script.TaskCommand(
        f"{engine} engine's training (dptrain bench)",
        (python, "-m", "torch.distributed.run", "--nnodes", str(job.nodes), "--nproc-per-node", str(job.ranks_per_node),
         "--rdzv-backend", "c10d"),
        f'--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_VARS["job_id"]}" '
        f"-m {OTHER_ENGINES[engine].__name__} {shlex.quote(str(job.run_dir))}",
        each="node", environment=environment,
        said_first=("# One torchrun per node, as the engine's users run it on a cluster: the agents meet at "
                    "MASTER_ADDR:MASTER_PORT",
                    "# (c10d rendezvous, hosted by the first node), each starts its node's ranks, which read "
                    "RUN_DIR/config.toml."))


def link_probe_script(sweep: Sweep, nodes: int) -> tuple[slurm_job.Job, str]:
    """The job that probes the link between `nodes` nodes (dptrain_bench/link.py --launched, one rank a node) and adds its
    timings to BENCH/link.json: dptrain's own per-rank job script (its #SBATCH lines, set-up, master address and
    port), with the probe in place of `dptrain train` on its srun line."""
    assert sweep.job is not None, "a sweep of SLURM jobs"
    run_dir = BenchFolder(sweep.bench_dir).link_probe(nodes).resolve()
    cfg = config_mod.load(sweep.config_path, [*sweep.train_pairs, ("output.dir", str(run_dir))])
    cfg = replace(cfg, slurm=replace(sweep.job, nodes=nodes, ranks_per_node=1, mode="per-rank", requeue=False))
    job = slurm_job.job_for(cfg, Path.cwd())
    probe = (slurm_job.python_for(cfg.slurm), "-m", "dptrain_bench.link", "--launched", "--record",
             str(sweep.bench_dir.resolve()))
    return job, slurm_script.render(cfg, job, slurm_script.TaskCommand("dptrain bench's link probe", probe))


def nodes_to_probe(node_counts: set[int], probed_hosts: set[int]) -> list[int]:
    """The node counts of a sweep's points whose link no probe in link.json crossed yet (two nodes or more)."""
    return sorted(n for n in node_counts - probed_hosts if n >= 2)


def record_link_across_nodes(sweep: Sweep) -> None:
    """For every node count of two or more among the points: BENCH/link.json gets a probe of the link between that
    many nodes, from one job each after the points' (the report's scaling model fits the link on all of them); a
    count already probed is not probed again, and a probe that fails leaves the report without a model."""
    from dptrain_bench import link

    assert sweep.job is not None, "a sweep of SLURM jobs"
    record = link.read_link(sweep.bench_dir)
    missing = nodes_to_probe({job_shape(w, sweep.job).nodes for w in sweep.workers},
                             {hosts for hosts, _ in record.probes} if record is not None else set())
    for nodes in missing:
        job, script = link_probe_script(sweep, nodes)
        if job.run_dir.exists():
            shutil.rmtree(job.run_dir)
        RunFolder(job.run_dir).logs.mkdir(parents=True)
        log.info(f"bench: the link between {nodes} nodes: a job of {job.script}")
        job_id, state = run_to_its_end(job, script)
        record = link.read_link(sweep.bench_dir)
        if record is None or (nodes, nodes) not in record.probes:
            log.info(f"bench: the link probe's job {job_id} ended {state or ''} without a probe (see "
                     f"{job.output(job_id)})")
    if missing and (record is None or record.across_hosts is None):
        log.info("bench: link.json holds no fit across nodes; the report draws no scaling model across nodes")


def run_to_its_end(job: slurm_job.Job, script: str) -> tuple[str, str | None]:
    """Write the job's script, submit it and wait until it has ended: (its id, its last state; None where the
    scheduler has forgotten it). Its --time, if any, bounds it."""
    write_atomically(job.script, script)
    job_id = slurm_queue.submit(job.script)
    ended: dict[str, str | None] = {}
    slurm_queue.wait_for([job_id], ended.__setitem__)
    return job_id, ended.get(job_id)


def recorded_job(run_dir: Path) -> str | None:
    """The id of the job last submitted for the point, if any."""
    try:
        text = read_back.read_head(run_dir / JOB_ID_FILE, 256).strip()
    except (FileNotFoundError, UnreadableFile):
        return None
    return text or None


def triage(sweep: Sweep, points: list[Point]) -> tuple[list[tuple[Point, str | None]], dict[str, tuple[Point, str]],
                                                         list[Point]]:
    """(done, with its job id; job id -> (point, state) of the points whose job is still queued or running; the
    points to submit). The scheduler is asked about the recorded jobs of the points not done."""
    done: list[tuple[Point, str | None]] = []
    recorded: dict[str, Point] = {}
    todo: list[Point] = []
    for point in points:
        run_dir = sweep.run_dir(point)
        job_id = recorded_job(run_dir)
        if is_done(run_dir):
            done.append((point, job_id))
        elif job_id is not None:
            recorded[job_id] = point
        else:
            todo.append(point)
    states = slurm_queue.job_states(recorded)
    waiting = {}
    for job_id, point in recorded.items():
        state = states.get(job_id)
        if slurm_queue.has_ended(state):
            todo.append(point)  # it ended without a run_end (failed, cancelled, or its result was cut short): again
        else:
            waiting[job_id] = (point, state)
    order = {point: i for i, point in enumerate(points)}
    return done, waiting, sorted(todo, key=order.__getitem__)


def job_scripts_preview(sweep: Sweep) -> str:
    """What `dptrain bench --slurm --dry-run` prints: the jobs the sweep would submit, each script after a comment
    line naming its point; the points it would not submit, as comment lines."""
    points = plan(sweep)
    try:
        done, waiting, todo = triage(sweep, points)
    except LaunchError:  # no scheduler to ask here: a recorded job counts as ended
        done = [(p, recorded_job(sweep.run_dir(p))) for p in points if is_done(sweep.run_dir(p))]
        waiting, todo = {}, [p for p in points if not is_done(sweep.run_dir(p))]
    text = [f"# {point.name}: done already, not submitted\n" for point, _ in done]
    text += [f"# {point.name}: job {job_id} is {state}, not submitted again\n" for job_id, (point, state) in waiting.items()]
    for point in todo:
        _, job, script = job_of(sweep, point)
        text.append(f"# {point.name}: {job.shape}, would be written to {job.script} and submitted\n{script}")
    return "".join(text)


def submit_point(sweep: Sweep, point: Point) -> tuple[str, slurm_job.Job]:
    """Write the point's job into a fresh run folder and submit it; (job id, job)."""
    run_dir = sweep.run_dir(point)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a job that ended without a run_end: a fresh start, never a resume from a partial run
    cfg, job, script = job_of(sweep, point)
    RunFolder(job.run_dir).logs.mkdir(parents=True)
    write_atomically(job.config, config_mod.to_toml(cfg))
    if point.engine in OTHER_ENGINES:  # what the engine trains (dptrain train writes its own config.toml)
        write_atomically(RunFolder(job.run_dir).config, config_mod.to_toml(cfg))
    write_atomically(job.script, script)
    job_id = slurm_queue.submit(job.script)
    write_atomically(run_dir / JOB_ID_FILE, job_id + "\n")
    return job_id, job


def job_error(run_dir: Path, job_id: str, state: str | None) -> str:
    """Why a job's point is not done: the first error line of its slurm-<id>.err, then .out (as first_error reads a
    local run's output); else its end state and last line of output."""
    texts = []
    for path in (RunFolder(run_dir).job_output(job_id, "err"), RunFolder(run_dir).job_output(job_id, "out")):
        try:  # bounded: a job's output is a log, and a link to /dev/zero planted there must not fill the memory
            texts.append(read_back.read_text(path, read_back.TABLE_BYTES, errors="replace"))
        except (FileNotFoundError, UnreadableFile):
            pass
    output = "\n".join(texts)
    found = error_line(output)
    if found is not None:
        return found
    ended = f"ended {state}" if state else "ended (the scheduler no longer knows it)"
    if state == "COMPLETED":
        return f"job {job_id} {ended} without a run_end event in metrics.jsonl"
    last = last_line(output)
    return f"job {job_id} {ended}" + (f"; last output: {last}" if last else "; no output")


def run_jobs(sweep: Sweep) -> list[tuple[Point, str]]:
    """Submit every point neither done nor queued or running, wait for all the sweep's jobs; the failures, as
    (point, error)."""
    check_and_record(sweep)
    points = plan(sweep)
    done, waiting, todo = triage(sweep, points)
    log.info(f"bench: {describe_plan(sweep, points)} in {sweep.bench_dir} as SLURM jobs; {len(done)} done already, "
             f"{len(waiting)} queued or running, {len(todo)} to submit (no matmul probe: the jobs' nodes are not this "
             f"machine, so peak_tflops and fraction_of_peak stay empty)")
    record_hooks(sweep)
    for point, job_id in done:
        log.info(f"bench: {point.name}: done already{f' (job {job_id})' if job_id else ''}, not submitted")
    for job_id, (point, state) in waiting.items():
        log.info(f"bench: {point.name}: job {job_id} is {state}, not submitted again; waiting for it")
    jobs: dict[str, Point] = {job_id: point for job_id, (point, _) in waiting.items()}
    started = {job_id: time.monotonic() for job_id in jobs}
    failures: list[tuple[Point, str]] = []
    total = len(jobs) + len(todo)
    if not total:
        return failures
    # --one-at-a-time: each job submitted once the one before has ended (those already queued first), for nodes
    # that share one machine's cores (the lab cluster), where jobs side by side would slow each other down.
    batches = ([[]] if jobs else []) + [[point] for point in todo] if sweep.one_at_a_time else [todo]
    log.info(f"bench: {total} job{'s' if total > 1 else ''} to wait for (squeue every {slurm_queue.POLL_S:g} s)"
             + (", submitted one at a time" if sweep.one_at_a_time else "")
             + "; Ctrl-C stops the waiting, not the jobs: run the same command again to wait for them")
    ended = 0

    def on_end(job_id: str, state: str | None) -> None:
        nonlocal ended
        ended += 1
        point = jobs[job_id]
        run_dir = sweep.run_dir(point)
        took = time.monotonic() - started[job_id]
        prefix = f"bench: [{ended}/{total}] {point.name}: job {job_id} {state or 'ended'} after {took:.1f} s"
        if is_done(run_dir):
            log.info(prefix)
            return
        error = job_error(run_dir, job_id, state)
        write_atomically(run_dir / ERROR_FILE, error + "\n")
        failures.append((point, error))
        log.info(f"{prefix}, failed: {error}")

    pending = list(jobs)
    try:
        for batch in batches:
            for point in batch:
                job_id, job = submit_point(sweep, point)
                jobs[job_id], started[job_id] = point, time.monotonic()
                pending.append(job_id)
                log.info(f"bench: submitted job {job_id} for {point.name} ({job.shape}): {job.script}")
            slurm_queue.wait_for(pending, on_end)
            pending = []
        record_link_across_nodes(sweep)  # once the points' jobs have ended: the nodes are free then
    except KeyboardInterrupt:
        log.info("bench: stopped waiting; the jobs go on: run the same command again to wait for them and collect "
                 "the results")
        raise
    return failures
