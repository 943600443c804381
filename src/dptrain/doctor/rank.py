"""What each rank of the doctor does, started as training starts its ranks: meet at the run's store (which the
rendezvous already reached), exchange each node's facts as JSON through it, check from every node what only the
nodes together can see (the names of the others, a connection to each, the run folder node 0 writes to), then, if
every pair connects, make the collectives' group for a short matmul on every rank and a ping-pong between every pair
of nodes. Rank 0 judges (checks.judge) and writes doctor.json.

Every wait has a bound (launch.timeout_s, which the doctor caps, for the store and its keys; CONNECT_S a
connection; GROUP_TIMEOUT_S a collective), so that the doctor ends with a verdict where a training run would hang.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dptrain import config as config_mod
from dptrain.distributed.env import DistEnv
from dptrain.distributed.store import join_store, pin_collective_interface, unpin_collective_interface
from dptrain.doctor.checks import Check, Findings, judge
from dptrain.doctor.facts import resolve
from dptrain.files import write_atomically
from dptrain.run_folder import RunFolder

log = logging.getLogger("dptrain")

CONNECT_S = 3.0  # for one connection between two nodes
GROUP_TIMEOUT_S = 20.0  # every collective of the speed checks
MATMUL_N, MATMUL_S = 512, 0.3  # a short float32 matmul on every rank at once: its rate, not a peak
PING_BYTES, PING_ROUNDS, SMALL_ROUNDS = 1 << 20, 3, 10


def node_of(env: DistEnv) -> int:
    """This rank's node: ranks are numbered node by node (dptrain's rendezvous, torchrun, srun's block layout)."""
    return env.global_rank // max(env.local_world_size, 1)


class Listener:
    """A TCP listener on the collectives' address of this node, which answers every connection with one byte: what
    the others' connections test. It listens only for the doctor's life, on that address only."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.sock.settimeout(0.2)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(b"k")
                except OSError:
                    pass

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        self.thread.join(timeout=1)


def connect(address: str, port: int) -> str | None:
    """None when a connection to address:port opened and answered within CONNECT_S, else why not."""
    try:
        with socket.create_connection((address, port), timeout=CONNECT_S) as conn:
            conn.settimeout(CONNECT_S)
            if conn.recv(1) != b"k":
                return "the connection opened but nothing answered"
    except (TimeoutError, socket.timeout):
        return f"no answer from {address}:{port} within {CONNECT_S:g} s"
    except OSError as exc:
        return f"{address}:{port}: {exc.strerror or exc}"
    return None


def wait_json(store: Any, key: str, what: str, timeout_s: float) -> Any:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError, and the timeouts of older torch versions
        raise RuntimeError(f"{what} did not arrive within {timeout_s:g} s") from exc
    return json.loads(store.get(key).decode())


def doctor_worker(cfg_tree: dict[str, Any], facts: dict[str, Any], report: str) -> None:
    """Entry point of every rank of `dptrain doctor`; rank 0 writes the findings' checks to `report`."""
    from dptrain.runtime import pick_device, set_cpu_threads

    cfg = config_mod.from_dict(cfg_tree)
    env = DistEnv.from_environ()
    threads = set_cpu_threads(env)
    device = pick_device(cfg.launch.device, env.local_rank)
    nodes = max(1, env.world_size // max(env.local_world_size, 1))
    node = node_of(env)
    findings = Findings(nodes=[facts], expected_nodes=nodes, device=device.type, ranks_per_node=env.local_world_size)
    if env.world_size == 1 and env.source == "none":
        findings.ranks = [{"rank": 0, "node": 0, "local_rank": 0, "device": str(device), "threads": threads}]
        findings.compute_tflops = {"0": matmul_tflops(device)}
        finish(cfg, findings, Path(report))
        return
    wait_s = cfg.launch.timeout_s
    store = join_store(env, wait_s)
    prefix = f"dptrain/doctor/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}rank/{env.global_rank}", json.dumps({"rank": env.global_rank, "node": node,
                                                              "local_rank": env.local_rank, "device": str(device),
                                                              "threads": threads}))
    listener, token = None, None
    try:
        if env.local_rank == 0:
            listener = Listener(facts["collective"].get("address") or "127.0.0.1")
            store.set(f"{prefix}facts/{node}", json.dumps(facts | {"listen": listener.endpoint}))
            if node == 0:
                token = write_token(RunFolder(cfg.output.run_dir))
                store.set(f"{prefix}token", json.dumps(token))
            everyone = [wait_json(store, f"{prefix}facts/{j}", f"node {j}'s facts", wait_s) for j in range(nodes)]
            seen = from_every_node(everyone, node, wait_json(store, f"{prefix}token", "node 0's file", wait_s))
            store.set(f"{prefix}seen/{node}", json.dumps(seen))
        everyone = [wait_json(store, f"{prefix}facts/{j}", f"node {j}'s facts", wait_s) for j in range(nodes)]
        seen_all = [wait_json(store, f"{prefix}seen/{j}", f"node {j}'s checks", wait_s) for j in range(nodes)]
        findings.nodes = [{k: v for k, v in f.items() if k != "listen"} for f in everyone]
        for j, seen in enumerate(seen_all):
            findings.names[str(j)] = seen["names"]
            findings.pairs |= seen["pairs"]
            findings.shared_folder[str(j)] = seen["shared_folder"]
        findings.ranks = [wait_json(store, f"{prefix}rank/{r}", f"rank {r}", wait_s) for r in range(env.world_size)]
        if any(why is not None for why in findings.pairs.values()):
            findings.group_problem = "skipped: a pair of nodes cannot connect"
        else:
            measure(env, device, store, findings)
        if env.global_rank == 0:
            finish(cfg, findings, Path(report))
    finally:
        if listener is not None:
            listener.close()
        if token is not None:
            Path(token["path"]).unlink(missing_ok=True)


def write_token(run: RunFolder) -> dict[str, str]:
    """A file with random content in the run folder, which every node must read back the same."""
    run.root.mkdir(parents=True, exist_ok=True)
    content = secrets.token_hex(16)
    path = run.root / f".doctor-{content[:8]}"
    path.write_text(content)
    return {"path": str(path.resolve()), "content": content}


def from_every_node(everyone: list[dict[str, Any]], node: int, token: dict[str, str]) -> dict[str, Any]:
    """What this node sees of the others: their names resolved, a connection to each, node 0's file."""
    names, pairs = {}, {}
    for j, other in enumerate(everyone):
        if j == node:
            continue
        addresses, problem = resolve(other["host"])
        names[other["host"]] = {"addresses": addresses, "problem": problem}
        host, port = other["listen"]
        pairs[f"{node}->{j}"] = connect(host, port)
    try:
        read = Path(token["path"]).read_text()
        shared = None if read == token["content"] else f"reads other content at {token['path']}"
    except OSError as exc:
        shared = f"cannot read {token['path']} ({exc.strerror or exc}): it sees another folder there"
    return {"names": names, "pairs": pairs, "shared_folder": shared}


def matmul_tflops(device: Any) -> float:
    """This rank's rate on float32 matmuls of MATMUL_N for about MATMUL_S seconds, in TFLOPS."""
    import torch

    a = torch.randn(MATMUL_N, MATMUL_N, device=device)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < MATMUL_S:
        a @ b
        calls += 1
        if device.type == "cuda" and calls % 50 == 0:
            sync()
    sync()
    return 2 * MATMUL_N**3 * calls / (time.perf_counter() - start) / 1e12


def measure(env: DistEnv, device: Any, store: Any, findings: Findings) -> None:
    """The speed checks in the collectives' group: every rank's matmul at once, then a ping-pong between the first
    ranks of every pair of nodes, one pair at a time; a group that cannot be made is said, not raised."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        pin_collective_interface(env.master_addr)
        dist.init_process_group(backend, store=dist.PrefixStore("dptrain/doctor/group", store), rank=env.global_rank,
                                world_size=env.world_size, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - any reason the group cannot be made is a finding
        unpin_collective_interface()
        findings.group_problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return
    try:
        dist.barrier()
        rate = torch.tensor([matmul_tflops(device)], dtype=torch.float64, device=device)
        rates = [torch.zeros_like(rate) for _ in range(env.world_size)]
        dist.all_gather(rates, rate)
        per_node: dict[str, float] = {}
        for r, value in enumerate(rates):
            key = str(r // env.local_world_size)
            per_node[key] = per_node.get(key, 0.0) + float(value.item())
        findings.compute_tflops = per_node
        nodes = env.world_size // env.local_world_size
        for a in range(nodes):
            for b in range(a + 1, nodes):
                measured = ping_pong(env, device, a * env.local_world_size, b * env.local_world_size)
                if measured is not None:
                    findings.links[f"{a}-{b}"] = measured
                dist.barrier()
    finally:
        dist.destroy_process_group()
        unpin_collective_interface()


def ping_pong(env: DistEnv, device: Any, first: int, second: int) -> dict[str, float] | None:
    """Latency (half the best round trip of 8 bytes) and bandwidth (the best of PING_ROUNDS round trips of
    PING_BYTES) between two ranks; on the first of them, else None."""
    import torch
    import torch.distributed as dist

    if env.global_rank not in (first, second):
        return None
    other = second if env.global_rank == first else first
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def round_trip(tensor: Any) -> float:
        sync()
        start = time.perf_counter()
        if env.global_rank == first:
            dist.send(tensor, other)
            dist.recv(tensor, other)
        else:
            dist.recv(tensor, other)
            dist.send(tensor, other)
        sync()
        return time.perf_counter() - start

    small = torch.zeros(2, dtype=torch.float32, device=device)
    big = torch.zeros(PING_BYTES // 4, dtype=torch.float32, device=device)
    latency = min(round_trip(small) for _ in range(SMALL_ROUNDS)) / 2
    best = min(round_trip(big) for _ in range(PING_ROUNDS))
    if env.global_rank != first:
        return None
    return {"latency_s": latency, "bandwidth_bps": 2 * PING_BYTES / max(best - 2 * latency, 1e-9)}


def finish(cfg: Any, findings: Findings, report: Path) -> None:
    """Rank 0: the estimates the checks compare with, the verdicts, and doctor.json."""
    findings.snapshot_bytes, findings.shared_memory_bytes = estimates(cfg, findings)
    write_report(report, judge(findings), findings)


def write_report(path: Path, checks: list[Check], findings: Findings) -> None:
    """doctor.json, written atomically: the checks and what they were judged on (where the ranks never all met, this
    node's facts alone, and no ranks, links or rates)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"checks": [c.to_dict() for c in checks], "nodes": findings.nodes,
                                  "ranks": findings.ranks, "links": findings.links,
                                  "compute_tflops": findings.compute_tflops}, indent=2) + "\n")


def estimates(cfg: Any, findings: Findings) -> tuple[int | None, int | None]:
    """(bytes of the snapshots the run keeps, bytes the shared-memory gradient sum takes in /dev/shm), from the
    model's parameter count; (None, None) when the model cannot be built here."""
    try:
        from dptrain.data import describe
        from dptrain.models import build_model

        info = describe(cfg.data)
        params = sum(p.numel() * p.element_size() for p in build_model(cfg.model, info.image_shape, info.num_classes)
                     .parameters())
    except Exception as exc:  # noqa: BLE001 - an estimate, never a reason to fail the doctor
        log.debug("no size estimate: %s", exc)
        return None, None
    optimizer_copies = 2 if cfg.optim.name.lower().startswith("adam") else 1
    snapshot = params * (1 + optimizer_copies) * (cfg.checkpoint.keep_last + 1)
    uses_shm = findings.device == "cpu" and findings.ranks_per_node > 1
    return snapshot, (2 * params * findings.ranks_per_node if uses_shm else None)
