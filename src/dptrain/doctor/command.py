"""`dptrain doctor`: on each node, its own facts first (facts.py); then the ranks started as training starts them
(rank.py), within the doctor's bound; then, on node 0, the table of checks printed and doctor.json written into the
run folder. A node that never comes, or a master no node reaches, still ends in a table: this node's own checks and
the launcher's sentence, within the rendezvous's bound.

`dptrain doctor --slurm` (run_doctor_job) runs the same on the nodes of the run's [slurm] job: the job `dptrain
submit` would write, with `dptrain doctor` in place of `dptrain train` in each task (slurm.script.dptrain_command),
its files in RUN_DIR/doctor-job/; it submits it, waits for its end and prints node 0's table from its output.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

from dptrain import config as config_mod
from dptrain.config import RunConfig
from dptrain.distributed.env import DistEnv, Nodes
from dptrain.distributed.failures import WorkerFailure
from dptrain.doctor.checks import Check, Findings, failed, judge
from dptrain.doctor.facts import node_facts
from dptrain.doctor.rank import doctor_worker, write_report
from dptrain.errors import LaunchError
from dptrain.launch.local import run_ranks
from dptrain.launch.rendezvous import is_address_of_this_host
from dptrain.read_back import UnreadableFile, read_json_object
from dptrain.run_folder import RunFolder
from dptrain.read_back import read_head
from dptrain.runtime import wants_cuda
from dptrain.slurm import job as slurm_job, partition, queue, script as slurm_script

DOCTOR_TIMEOUT_S = 30.0  # the rendezvous and the store: a node that has not come by then is named, not waited for
MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}
SHOWN_OUTPUT = 1 << 20  # of the job's output, printed: node 0's table and the other nodes' lines fit well within


def run_doctor(cfg: RunConfig, world_size: int, launched_outside: bool, nodes: Nodes | None) -> int:
    """Check the world this configuration would train in; print the table on node 0; 1 when a check failed."""
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
        cfg.launch, timeout_s=min(cfg.launch.timeout_s, DOCTOR_TIMEOUT_S), max_restarts=0))
    env = DistEnv.from_environ()
    master = nodes.host if nodes is not None else env.master_addr
    run = RunFolder(cfg.output.run_dir)
    facts = node_facts(cfg, master, run.root)
    # node 0 reports: the one given --node-rank 0, or, where the rendezvous numbers the nodes, the endpoint's host
    node_zero = nodes is None or nodes.rank == 0 or (nodes.rank is None and is_address_of_this_host(nodes.host))
    reports_here = node_zero and (not launched_outside or env.global_rank == 0)
    try:
        run_ranks(doctor_worker, (config_mod.to_dict(cfg), facts, str(run.doctor)), cfg, world_size, launched_outside,
                  None, nodes)
    except (LaunchError, WorkerFailure, RuntimeError) as exc:
        findings = Findings(nodes=[facts], expected_nodes=nodes.count if nodes else max(1, world_size),
                            never_came=str(exc).splitlines()[0].replace("`dptrain train`", "`dptrain doctor`"),
                            device="cuda" if wants_cuda(cfg.launch.device) else "cpu",
                            ranks_per_node=world_size // (nodes.count if nodes else 1))
        checks = judge(findings)
        write_report(run.doctor, checks, findings)
        print(table(checks, f"{run.doctor} (this node's checks only)"))
        return 1
    if not reports_here:
        node = (nodes.rank if nodes.rank is not None else "numbered by the rendezvous") if nodes is not None else \
            env.global_rank // max(env.local_world_size, 1)
        print(f"dptrain doctor: node {node} ({facts['host']}) checked; node 0 prints the table and writes "
              f"{run.doctor}")
        return 0
    checks = read_checks(run.doctor)
    print(table(checks, str(run.doctor)))
    return 1 if failed(checks) else 0


def read_checks(path: Path) -> list[Check]:
    """The checks rank 0 wrote (read back within bounds: plain JSON, each field a string)."""
    try:
        data = read_json_object(path, 1 << 24)
    except (UnreadableFile, FileNotFoundError) as exc:
        raise LaunchError(f"the doctor's ranks ended without their report {path} ({exc}); see the lines above.") \
            from None
    return [Check(name=str(c["name"]), status=c["status"] if c["status"] in MARK else "fail", seen=str(c["seen"]),
                  advice=str(c.get("advice", ""))) for c in data.get("checks", [])]


def table(checks: list[Check], where: str) -> str:
    """The doctor's table: a line per check (status, check, what was seen), what to do under each that is not ok."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'':4}  {'check':<{width}}  seen", ""]
    for c in checks:
        lines.append(f"{MARK[c.status]:<4}  {c.name:<{width}}  {c.seen}")
        if c.status != "ok" and c.advice:
            lines.append(textwrap.indent(f"-> {c.advice}.", " " * (width + 8)))
    bad = failed(checks)
    warned = [c for c in checks if c.status == "warn"]
    lines += ["", f"dptrain doctor: {len(checks)} checks, {len(bad)} failed, {len(warned)} warned; {where}"]
    return "\n".join(lines)


def doctor_job(cfg: RunConfig, workdir: Path) -> tuple[RunConfig, slurm_job.Job, str]:
    """(the config the doctor's tasks read, its job, the job's script): the job of cfg's [slurm] table as `dptrain
    submit` from workdir would write it, each task running `dptrain doctor` instead of `dptrain train`, with its
    files in RUN_DIR/doctor-job/ (the run's own job.sbatch and job.toml stay as they are); no signal, no requeue."""
    run_dir = cfg.output.run_dir if cfg.output.run_dir.is_absolute() else workdir / cfg.output.run_dir
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(run_dir)),
                              slurm=dataclasses.replace(cfg.slurm, signal_lead_s=0, requeue=False))
    job = slurm_job.job_for(cfg, workdir)
    job = dataclasses.replace(job, run_dir=RunFolder(job.run_dir).doctor_job, name=f"{job.name}-doctor")
    command = dataclasses.replace(slurm_script.dptrain_command(cfg, job, "doctor", "dptrain doctor"),
                                  written_by="dptrain doctor --slurm")
    return cfg, job, slurm_script.render(cfg, job, command)


def run_doctor_job(cfg: RunConfig, dry_run: bool) -> int:
    """`dptrain doctor --slurm`: submit the doctor's job (doctor_job), wait for its end, print its output (node 0's
    table); 1 when a check failed, or the job ended without a table. dry_run: print the job's script only."""
    cfg, job, script = doctor_job(cfg, Path.cwd())
    partition.check_nodes_fit(cfg.slurm)
    if dry_run:
        print(script, end="")
        return 0
    queue.require_clients("dptrain doctor --slurm")
    RunFolder(job.run_dir).logs.mkdir(parents=True, exist_ok=True)
    job.config.write_text(config_mod.to_toml(cfg))
    job.script.write_text(script)
    report = RunFolder(cfg.output.run_dir).doctor
    report.unlink(missing_ok=True)  # an earlier doctor's table is not this job's
    job_id = queue.submit(job.script)
    print(f"dptrain doctor: submitted job {job_id} ({job.shape}, {job.mode}): {job.script}; waiting for its end "
          f"(scancel {job_id} stops it)", flush=True)
    ended: dict[str, str | None] = {}
    queue.wait_for([job_id], ended.__setitem__)
    for path in dict.fromkeys((job.output(job_id), job.errors(job_id))):
        if path.is_file() and (text := read_head(path, SHOWN_OUTPUT).strip()):
            print(text)
    if not report.is_file():
        raise LaunchError(f"the doctor's job {job_id} ended {ended.get(job_id) or ''} without node 0's table "
                          f"({report}); see its output above, in {job.output(job_id)}.".replace("  ", " "))
    return 1 if failed(read_checks(report)) else 0
