"""The doctor's verdicts: what the nodes said and measured (facts.py, rank.py) -> one Check a line, ok / warn / fail,
what was seen on which node, and one sentence of what to do. Pure functions of plain data, so each verdict is
tested on the facts that make it.

A fail is what would stop or hang a run (a name that does not resolve, a port that cannot be reached, a run folder
one node does not see, another torch); a warn is what slows a run or may surprise (a straggler node or link, fewer
cores than threads, a different git revision).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal

Status = Literal["ok", "warn", "fail"]
STRAGGLER = 0.7  # a node or link below 70% of the median is named: 30% slower than the others
SOFTWARE_MUST_MATCH = ("python", "torch", "cuda", "nccl", "dptrain")
MIN_SHM_BYTES = 64 << 20  # the shared-memory sum's buffers for a small model, and the DataLoader workers' queues


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    status: Status
    seen: str
    """What was seen, naming the node(s) where it is."""
    advice: str = ""
    """One sentence of what to do (empty when ok)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Findings:
    """Everything the checks read; each field holds plain JSON data, node-indexed where it says so."""

    nodes: list[dict[str, Any]]
    """facts.node_facts of each node that came, by node index."""
    expected_nodes: int = 1
    never_came: str | None = None
    """The sentence of why the ranks did not all meet (a node that never came, a store not reached); the rest of
    the findings are then this node's alone."""
    names: dict[str, dict[str, Any]] = field(default_factory=dict)
    """node index -> {host name of another node -> {"addresses": [...], "problem": str | None}}."""
    pairs: dict[str, str | None] = field(default_factory=dict)
    """"i->j" -> None when node i opened a connection to node j's collective address, else why not."""
    shared_folder: dict[str, str | None] = field(default_factory=dict)
    """node index -> None when it read the file node 0 wrote into the run folder, else what it found."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Each rank: node, local_rank, device, threads."""
    compute_tflops: dict[str, float] = field(default_factory=dict)
    """node index -> TFLOPS of a short float32 matmul on each of its ranks at once, summed."""
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    """"i-j" -> {"bandwidth_bps": ..., "latency_s": ...} of a ping-pong between the two nodes."""
    group_problem: str | None = None
    """Why the process group could not be made (the speed checks then have nothing)."""
    device: str = "cpu"
    ranks_per_node: int = 1
    snapshot_bytes: int | None = None
    """What the run's kept snapshots take on disk, estimated from the model's size; None when unknown."""
    shared_memory_bytes: int | None = None
    """What the shared-memory gradient sum needs in /dev/shm on a node; None when the run does not use it."""


def host_of(findings: Findings, node: int | str) -> str:
    i = int(node)
    return f"node {i} ({findings.nodes[i]['host']})" if i < len(findings.nodes) else f"node {i}"


def judge(findings: Findings) -> list[Check]:
    """Every check, in the table's order. Where some nodes never came, only what this node saw of itself."""
    if findings.never_came is not None:
        alone = reaching(findings)
        return [alone[0], alone[1], alone[4], dataset(findings), disk(findings), shm(findings), *devices(findings)]
    return [*reaching(findings), software(findings), *files(findings), *devices(findings), *speed(findings)]


def reaching(f: Findings) -> list[Check]:
    checks = []
    if f.never_came is not None:
        checks.append(Check("ranks met", "fail", f.never_came,
                            "start the doctor on every node with the same --master-addr and --master-port, and check "
                            "that each node reaches that address and port (a firewall, another interface)"))
    else:
        checks.append(Check("ranks met", "ok", f"{len(f.ranks)} rank(s) on {len(f.nodes)} of {f.expected_nodes} "
                            f"node(s) met at the rendezvous and the store"))
    unresolved = [(i, n) for i, n in enumerate(f.nodes) if n.get("master_problem")]
    if unresolved:
        i, n = unresolved[0]
        checks.append(Check("master address resolves", "fail",
                            f"{host_of(f, i)} cannot resolve {n['master_addr']}: {n['master_problem']}",
                            "give --master-addr as an address, or add the name to that node's /etc/hosts or DNS"))
    else:
        master = f.nodes[0]["master_addr"] if f.nodes else "?"
        checks.append(Check("master address resolves", "ok", f"{master} on every node"))
    checks.append(names_resolve(f))
    checks.append(pairs_connect(f))
    checks.append(interfaces(f))
    return checks


def names_resolve(f: Findings) -> Check:
    """Every node resolves every other node's host name, to an address that node holds: gloo and nccl exchange
    host names or addresses, and a node that resolves another to nothing (or to a loopback address) hangs there."""
    problems = []
    for i, seen in sorted(f.names.items(), key=lambda kv: int(kv[0])):
        for host, answer in seen.items():
            owner = next((j for j, n in enumerate(f.nodes) if n["host"] == host), None)
            held = set() if owner is None else {a for addrs in f.nodes[owner]["interfaces"].values() for a in addrs}
            if answer.get("problem"):
                problems.append(f"{host_of(f, i)} cannot resolve {host}: {answer['problem']}")
            elif held and not set(answer["addresses"]) & held:
                problems.append(f"{host_of(f, i)} resolves {host} to {', '.join(answer['addresses'])}, which "
                                f"{host} does not hold")
    if problems:
        return Check("host names resolve", "fail", "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""),
                     "make every node's /etc/hosts or DNS give each node's name the address the others reach it at")
    return Check("host names resolve", "ok", "every node resolves every other node's name to an address it holds"
                 if len(f.nodes) > 1 else "one node")


def pairs_connect(f: Findings) -> Check:
    failed = [(pair, why) for pair, why in sorted(f.pairs.items()) if why is not None]
    if failed:
        shown = "; ".join(f"{host_of(f, p.split('->')[0])} cannot open a connection to "
                          f"{host_of(f, p.split('->')[1])} ({why})" for p, why in failed[:3])
        return Check("nodes reach each other", "fail", shown + (" ..." if len(failed) > 3 else ""),
                     "open the ports between the nodes on the interface the collectives use (a firewall), or set "
                     "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to an interface the nodes share")
    if len(f.nodes) < 2:
        return Check("nodes reach each other", "ok", "one node")
    return Check("nodes reach each other", "ok", f"every pair of the {len(f.nodes)} nodes, on the collectives' address")


def interfaces(f: Findings) -> Check:
    """The interface each node's collectives use, and the interface variables: set on some nodes only, or naming an
    interface a node lacks, a run binds the wrong network or none."""
    problems, shown = [], []
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        values = {i: n["interface_variables"].get(variable) for i, n in enumerate(f.nodes)}
        given = {v for v in values.values() if v}
        if given and len(set(values.values())) > 1:
            problems.append(f"{variable} differs: " + ", ".join(f"{host_of(f, i)} {v or 'unset'}"
                                                               for i, v in values.items()))
        for i, value in values.items():
            if value and not names_an_interface(variable, value, f.nodes[i]["interfaces"]):
                problems.append(f"{variable}={value} on {host_of(f, i)}, which has no such interface "
                                f"(it has {', '.join(sorted(f.nodes[i]['interfaces']))})")
    for i, n in enumerate(f.nodes):
        chosen = n["collective"]
        shown.append(f"{host_of(f, i)}: {chosen.get('interface') or '?'} {chosen.get('address') or ''}".rstrip())
    if problems:
        return Check("network interface", "fail", "; ".join(problems[:3]),
                     "set the same GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) on every node, naming an "
                     "interface each node has, or unset them and let dptrain pick the route to the master")
    return Check("network interface", "ok", "; ".join(shown))


def names_an_interface(variable: str, value: str, interfaces: Iterable[str]) -> bool:
    """Whether the variable's value picks an interface of this node: GLOO_SOCKET_IFNAME names interfaces exactly
    (comma-separated); NCCL_SOCKET_IFNAME takes prefixes, `=name` for an exact one, and `^...` to exclude (which
    always leaves nccl a choice, so it is not judged here)."""
    names = list(interfaces)
    if value.startswith("^"):
        return True
    exact = variable == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    wanted = [part for part in value.lstrip("=").split(",") if part]
    return bool(wanted) and all(any(n == w if exact else n.startswith(w) for n in names) for w in wanted)


def software(f: Findings) -> Check:
    differ, revision = [], []
    for key in SOFTWARE_MUST_MATCH:
        values = {i: n["software"].get(key) for i, n in enumerate(f.nodes)}
        if len(set(values.values())) > 1:
            differ.append(f"{key}: " + ", ".join(f"{host_of(f, i)} {v}" for i, v in values.items()))
    revisions = {i: n["software"].get("git") for i, n in enumerate(f.nodes)}
    if len(set(revisions.values())) > 1:
        revision.append("git revision: " + ", ".join(f"{host_of(f, i)} {(v or 'none')[:10]}"
                                                     for i, v in revisions.items()))
    first = f.nodes[0]["software"] if f.nodes else {}
    summary = ", ".join(f"{k} {first.get(k)}" for k in SOFTWARE_MUST_MATCH if first.get(k))
    if differ:
        return Check("same software", "fail", "; ".join(differ),
                     "install the same Python, torch (CUDA, nccl) and dptrain on every node, e.g. one shared venv")
    if revision:
        return Check("same software", "warn", "; ".join(revision),
                     "run the same dptrain checkout on every node (a shared folder, or the same git revision)")
    return Check("same software", "ok", summary + (" on every node" if len(f.nodes) > 1 else ""))


def files(f: Findings) -> list[Check]:
    return [shared_folder(f), dataset(f), disk(f), shm(f)]


def shared_folder(f: Findings) -> Check:
    if len(f.nodes) < 2:
        return Check("run folder shared", "ok", "one node")
    blind = [(i, why) for i, why in sorted(f.shared_folder.items(), key=lambda kv: int(kv[0])) if why is not None]
    if blind:
        return Check("run folder shared", "fail", "; ".join(f"{host_of(f, i)} {why}" for i, why in blind[:3]),
                     "put the run folder (--output.dir) on a file system every node mounts at the same path")
    return Check("run folder shared", "ok", "a file node 0 wrote there was read by every node")


def dataset(f: Findings) -> Check:
    kinds = {i: n["dataset"]["kind"] for i, n in enumerate(f.nodes)}
    if all(k == "none" for k in kinds.values()):
        return Check("dataset on every node", "ok", f"no files to check ({f.nodes[0]['dataset']['why']})"
                     if f.nodes else "no node")
    missing = [i for i, k in kinds.items() if k == "missing"]
    if missing:
        downloads = all(f.nodes[i]["dataset"].get("download") for i in missing)
        status: Status = "warn" if downloads else "fail"
        return Check("dataset on every node", status,
                     "; ".join(f"{host_of(f, i)}: {f.nodes[i]['dataset']['why']}" for i in missing[:3]),
                     "the run downloads it on those nodes (--data.download true)" if downloads else
                     "copy the dataset to every node under --data.root (or a shared folder), or give --data.download "
                     "true")
    refused = [i for i, k in kinds.items() if k == "refused"]
    if refused:  # a FIFO, a device, a damaged file: the run stops at it on that node
        return Check("dataset on every node", "fail",
                     "; ".join(f"{host_of(f, i)}: {f.nodes[i]['dataset']['why']}" for i in refused[:3]),
                     "put the dataset's own files there (regular files, whole), or give another --data.root")
    reference = f.nodes[0]["dataset"]["files"]
    differ = []
    for i, n in enumerate(f.nodes[1:], 1):
        theirs = n["dataset"]["files"]
        for name in sorted(set(reference) | set(theirs)):
            if reference.get(name) != theirs.get(name):
                mine, other = reference.get(name), theirs.get(name)
                what = ("missing" if other is None else f"{other['bytes']} bytes" if mine is None or
                        mine["bytes"] != other["bytes"] else "other bytes at its start")
                differ.append(f"{host_of(f, i)}'s {name} is {what} (node 0: "
                              f"{'missing' if mine is None else str(mine['bytes']) + ' bytes'})")
    if differ:
        return Check("dataset on every node", "fail", "; ".join(differ[:3]),
                     "give every node the same copy of the dataset (copy it again, or use a shared folder)")
    total = sum(v["bytes"] for v in reference.values())
    return Check("dataset on every node", "ok", f"{len(reference)} files, {total / 1e6:.1f} MB, equal on every node"
                 if len(f.nodes) > 1 else f"{len(reference)} files, {total / 1e6:.1f} MB")


def disk(f: Findings) -> Check:
    free = {i: n["disk"]["run_folder_free_bytes"] for i, n in enumerate(f.nodes)}
    if not free:
        return Check("free disk", "ok", "no node")
    least = min(free, key=lambda i: free[i])
    where = f.nodes[least]["disk"]["run_folder_checked_at"]
    seen = f"{free[least] / 2**30:.1f} GiB free at {where} on {host_of(f, least)}"
    if f.snapshot_bytes is not None and free[least] < f.snapshot_bytes:
        return Check("free disk", "fail", f"{seen}; the kept snapshots take about {f.snapshot_bytes / 2**30:.2f} GiB",
                     "free space there, keep fewer snapshots (--checkpoint.keep_last), or choose another --output.dir")
    needs = f" for about {f.snapshot_bytes / 2**20:.0f} MiB of snapshots" if f.snapshot_bytes is not None else ""
    return Check("free disk", "ok", seen + needs)


def shm(f: Findings) -> Check:
    sizes = {i: n["disk"].get("shm_bytes") for i, n in enumerate(f.nodes)}
    needed = max(f.shared_memory_bytes or 0, MIN_SHM_BYTES)
    small = [i for i, size in sizes.items() if size is not None and size < needed]
    if small:
        return Check("/dev/shm", "fail" if f.shared_memory_bytes else "warn",
                     "; ".join(f"{host_of(f, i)} has {sizes[i] / 2**20:.0f} MiB" for i in small[:3])
                     + f", under the {needed / 2**20:.0f} MiB the run needs there",
                     "give /dev/shm more room (docker --shm-size, a larger tmpfs), or run one rank per node")
    shown = min((s for s in sizes.values() if s is not None), default=None)
    return Check("/dev/shm", "ok", "no /dev/shm" if shown is None else f"{shown / 2**20:.0f} MiB at least")


def devices(f: Findings) -> list[Check]:
    checks = []
    if f.device == "cuda":
        short = [(i, n["devices"]["gpus"]) for i, n in enumerate(f.nodes) if n["devices"]["gpus"] < f.ranks_per_node]
        if short:
            checks.append(Check("GPUs per node", "fail", "; ".join(f"{host_of(f, i)} sees {g} GPU(s) for "
                                                                   f"{f.ranks_per_node} ranks" for i, g in short),
                                "start as many ranks per node as its GPUs (--nproc-per-node), or check "
                                "CUDA_VISIBLE_DEVICES"))
        else:
            shared = [r for r in f.ranks if sum(1 for o in f.ranks if o["node"] == r["node"]
                                                 and o["device"] == r["device"]) > 1]
            checks.append(Check("GPUs per node", "fail" if shared else "ok",
                                f"rank {shared[0]['rank']} shares {shared[0]['device']} on "
                                f"{host_of(f, shared[0]['node'])}"
                                if shared else f"{f.ranks_per_node} rank(s) a node, each on its own GPU",
                                "check CUDA_VISIBLE_DEVICES: each rank must see its own GPU" if shared else ""))
    crowded = []
    for i, n in enumerate(f.nodes):
        threads = sum(r["threads"] for r in f.ranks if r["node"] == i)
        if threads > n["devices"]["cores"]:
            crowded.append(f"{host_of(f, i)}: {threads} threads over its ranks on {n['devices']['cores']} cores")
    if crowded:
        checks.append(Check("CPU threads", "warn", "; ".join(crowded[:3]),
                            "start fewer ranks per node (--nproc-per-node), or unset OMP_NUM_THREADS and let dptrain "
                            "split the cores"))
    else:
        checks.append(Check("CPU threads", "ok", ", ".join(f"{host_of(f, i)}: {n['devices']['cores']} cores"
                                                          for i, n in enumerate(f.nodes[:4]))
                            + (" ..." if len(f.nodes) > 4 else "")))
    return checks


def stragglers(values: dict[str, float]) -> tuple[float, list[str]]:
    """(the median, the keys whose value is below STRAGGLER x the median)."""
    median = statistics.median(values.values())
    return median, [k for k, v in values.items() if v < STRAGGLER * median]


def node_link_speeds(links: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each node's link: the best bandwidth of the pairs it is in (a pair is as slow as its slower end)."""
    best: dict[str, float] = {}
    for pair, measured in links.items():
        for node in pair.split("-"):
            best[node] = max(best.get(node, 0.0), measured["bandwidth_bps"])
    return best


def speed(f: Findings) -> list[Check]:
    if f.group_problem is not None:
        return [Check("speed", "fail", f"the collectives' group could not be made: {f.group_problem}",
                      "fix the reaching checks above first")]
    checks = []
    if f.compute_tflops:
        median, slow = stragglers(f.compute_tflops) if len(f.compute_tflops) > 2 else (
            statistics.median(f.compute_tflops.values()), [])
        if slow:
            checks.append(Check("compute speed", "warn", "; ".join(
                f"{host_of(f, i)} {f.compute_tflops[i]:.3g} TFLOPS" for i in slow) + f" (median {median:.3g})",
                "that node is slower than the others and every step waits for it: check its load, clocks and "
                "threads, or leave it out"))
        else:
            checks.append(Check("compute speed", "ok", ", ".join(f"{host_of(f, i)} {t:.3g} TFLOPS" for i, t in
                                                                sorted(f.compute_tflops.items())[:4])))
    if f.links:
        per_node = node_link_speeds(f.links)
        shown = ", ".join(f"{pair} {m['bandwidth_bps'] * 8 / 1e9:.3g} Gbit/s {m['latency_s'] * 1e6:.0f} us"
                          for pair, m in sorted(f.links.items())[:4])
        median, slow = stragglers(per_node) if len(per_node) > 2 else (0.0, [])
        if slow:
            checks.append(Check("link speed", "warn", "; ".join(
                f"{host_of(f, i)}'s link {per_node[i] * 8 / 1e9:.3g} Gbit/s" for i in slow)
                + f" (median {median * 8 / 1e9:.3g} Gbit/s)",
                "that node's link is slower than the others' and every all-reduce waits for it: check its cable, "
                "port speed and interface, or leave it out"))
        else:
            checks.append(Check("link speed", "ok", shown))
    return checks


def failed(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]
