"""`dptrain doctor`: on each node, its own facts first (facts.py); then the ranks started as training starts them
(rank.py), within the doctor's bound; then, on node 0, the table of checks printed and doctor.json written into the
run folder. A node that never comes, or a master no node reaches, still ends in a table: this node's own checks and
the launcher's sentence, within the rendezvous's bound.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

from dptrain import config as config_mod
from dptrain.config import RunConfig
from dptrain.distributed.env import DistEnv, Nodes
from dptrain.distributed.failures import WorkerFailure
from dptrain.doctor.checks import Check, Findings, failed, judge
from dptrain.doctor.facts import node_facts
from dptrain.doctor.rank import doctor_worker
from dptrain.errors import LaunchError
from dptrain.files import written_whole
from dptrain.launch.local import run_ranks
from dptrain.read_back import UnreadableFile, read_json_object
from dptrain.run_folder import RunFolder
from dptrain.runtime import wants_cuda

DOCTOR_TIMEOUT_S = 30.0  # the rendezvous and the store: a node that has not come by then is named, not waited for
MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


def run_doctor(cfg: RunConfig, world_size: int, launched_outside: bool, nodes: Nodes | None) -> int:
    """Check the world this configuration would train in; print the table on node 0; 1 when a check failed."""
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
        cfg.launch, timeout_s=min(cfg.launch.timeout_s, DOCTOR_TIMEOUT_S), max_restarts=0))
    env = DistEnv.from_environ()
    master = nodes.host if nodes is not None else env.master_addr
    run = RunFolder(cfg.output.run_dir)
    facts = node_facts(cfg, master, run.root)
    reports_here = (nodes is None or nodes.rank == 0) and (not launched_outside or env.global_rank == 0)
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
        node = nodes.rank if nodes is not None else env.global_rank // max(env.local_world_size, 1)
        print(f"dptrain doctor: node {node} ({facts['host']}) checked; node 0 prints the table and writes "
              f"{run.doctor}")
        return 0
    checks = read_checks(run.doctor)
    print(table(checks, str(run.doctor)))
    return 1 if failed(checks) else 0


def write_report(path: Path, checks: list[Check], findings: Findings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path) as tmp:
        tmp.write_text(json.dumps({"checks": [c.to_dict() for c in checks], "nodes": findings.nodes,
                                   "ranks": findings.ranks}, indent=2) + "\n")


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
