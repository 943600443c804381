"""A lab cluster on this one machine: SLURM nodes on hosts of their own, joined by links of a chosen bandwidth.

Host k (1..N) is a network namespace with hostname `hostk`, address 10.214.<x>.k and one veth link into a bridge
in the machine's own namespace, which holds 10.214.<x>.254: slurmctld listens there, and client commands
(sbatch, scontrol) reach it from the machine as usual. Each host runs its own slurmd, so a job's processes run
inside their host's namespace, with its hostname, its hosts file (every host and the controller by name) and
only its link: gloo and torch's store go over the links. Each link is shaped both ways with a token bucket
(`tc qdisc ... tbf rate R`, on the host's end for what it sends and on the bridge's end for what it receives),
so each host's link is the bottleneck, as a switch port would be. This kernel has tbf but not netem: the links
have a bandwidth, no added delay or loss.

    with LabCluster.start(tmp_path / "lab", hosts=2, rate="1gbit") as lab:
        lab.network.run(1, ["python", "-c", "..."])   # a command on host1
        job_id = lab.sbatch(script)                   # SLURM jobs run on host1 and host2

    scripts/slurm-cluster start /tmp/lab --hosts 4 --rate 1gbit    # the same, for people

Everything of one lab carries the number <x> of its subnet, picked free on this machine at start (under a lock
file, since other test processes make labs at the same time): the bridge dptlab<x>, the hosts' namespaces
dptlab<x>h<k> with /etc/netns/dptlab<x>h<k>/hosts, the bridge's ends of the links dptlab<x>v<k>. The bridge's
alias names its owner, so a late second teardown never removes a newer lab that got the same number. A lab
cluster's supervisor (tests/slurm_cluster.py, this file run as a script) removes the network once its daemons
are gone, so a killed test process leaves nothing behind; stop() removes it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

if __package__ in (None, ""):  # run as the supervisor's script: the repository root, for tests.slurm_cluster
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_hosts import finish, kill_processes_in as _kill_processes_in  # noqa: E402
from tests.slurm_cluster import (SlurmCluster, SlurmClusterError, _which, check_state_folder,  # noqa: E402
                                 read_small_file, supervisor_main)

SUBNET_PREFIX = "10.214"  # 10.214.<x>.0/24; TwoHosts (tests/netns_hosts.py) uses 10.213 inside its namespaces
CONTROLLER_OCTET = 254
MAX_HOSTS = 250
HOST_INTERFACE = "eth0"  # the host's end of its link, inside its namespace
ETC_NETNS = Path("/etc/netns")  # <ns>/hosts: what `ip netns exec <ns>` (and LabNetwork.command) puts on /etc/hosts
NETNS_RUN_DIR = Path("/var/run/netns")  # where `ip netns add` names a namespace
NAME_PREFIX = "dptlab"
# Held while a lab picks its subnet number and claims it by creating its bridge: labs of other processes at once.
ALLOCATION_LOCK = Path(tempfile.gettempdir()) / "dptrain-lab-network.lock"
LAB_FILE = "lab.json"  # in a lab cluster's state folder: its network, for `stop` and the supervisor
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller: LabCluster.cpu_quota's groups
_QUOTAS = itertools.count()
TCP_RETRIES2 = 5  # a connection over a dead link fails in ~13 s, not ~15 min (see tests/netns_hosts.py)
# tbf's queue holds this much time of traffic at the rate: a switch port's buffer, not a bufferbloat of seconds
TBF_LATENCY = "10ms"

_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # tc's units: powers of 1000
_COUNTER = itertools.count()


def rate_bits_per_s(rate: str) -> float:
    """'1gbit' -> 1e9: a rate in tc's bit units (bit, kbit, mbit, gbit, tbit; 1kbit = 1000 bit)."""
    match = _RATE.fullmatch(rate.strip())
    if not match or float(match.group(1)) <= 0:
        raise SlurmClusterError(f"the rate {rate!r} is not one tc's tbf takes; write a number of bits per second "
                                f"with its unit, e.g. 100mbit or 1gbit")
    return float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]


def check_shape(hosts: int, rate: str | None) -> None:
    """Refuse, in one sentence, a number of hosts or a rate a lab cannot have, before anything is made."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise SlurmClusterError(f"a lab cluster has 1 to {MAX_HOSTS} hosts, not {hosts}; choose --hosts in that range")
    if rate is not None:
        rate_bits_per_s(rate)


def _tbf(rate: str) -> list[str]:
    """tbf's arguments for `rate`: a bucket of 1 ms at the rate (at least 32 KiB, which a 64 KiB GSO packet split
    by tbf still fits in), so a link's throughput is its rate, not the timer's granularity."""
    burst = max(32 * 1024, int(rate_bits_per_s(rate) / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", TBF_LATENCY]


def _ip(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    """An ip/tc command (found in /usr/sbin too); raises SlurmClusterError with its message where check fails."""
    done = subprocess.run([_which(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise SlurmClusterError(f"`{' '.join(argv)}` failed ({done.returncode}): {said}")
    return done


def _namespaces() -> list[str]:
    # `ip netns list` prints "name (id: 3)" for a namespace that has an id
    return [line.split()[0] for line in _ip("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    return [link["ifname"] for link in json.loads(_ip("ip", "-j", "link", "show").stdout or "[]")]


@dataclass(frozen=True)
class LabNetwork:
    """Hosts host1..hostN in namespaces, each with one shaped link into a bridge. Make one with `create`."""

    subnet: int  # <x> of 10.214.<x>.0/24, and of every name
    hosts: int
    rate: str | None  # tc's rate of every link, each way; None: unshaped
    owner: str  # the bridge's alias: who may remove this network

    # ------------------------------------------------------------------ names and addresses

    @property
    def bridge(self) -> str:
        return f"{NAME_PREFIX}{self.subnet}"

    def namespace(self, host: int) -> str:
        return f"{NAME_PREFIX}{self.subnet}h{host}"

    def bridge_end(self, host: int) -> str:
        """The bridge's end of host `host`'s link, in the machine's namespace (15 characters at most)."""
        return f"{NAME_PREFIX}{self.subnet}v{host}"

    @staticmethod
    def hostname(host: int) -> str:
        return f"host{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.{host}"

    @property
    def controller_address(self) -> str:
        """The bridge's address in the machine's own namespace: where slurmctld (and any server of the machine's)
        is reached from every host."""
        return f"{SUBNET_PREFIX}.{self.subnet}.{CONTROLLER_OCTET}"

    @property
    def host_numbers(self) -> range:
        return range(1, self.hosts + 1)

    # ------------------------------------------------------------------ availability

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def unavailable_reason() -> str | None:
        """One line saying why this machine cannot make a lab network (not root, a tool missing, no bridge, veth,
        tbf or namespace), else None. Probes with a bridge, a namespace and a shaped veth of its own."""
        if os.geteuid() != 0:
            return "a lab network needs root (euid is not 0) for namespaces, a bridge and tc"
        for tool in ("ip", "tc", "nsenter", "unshare", "mount", "hostname", "sh"):
            if _which(tool) is None:
                return f"a lab network needs `{tool}`: apt-get install --no-install-recommends iproute2 util-linux"
        probe = f"dptlp{os.getpid() % 10**7}"
        steps = [("ip", "link", "add", f"{probe}b", "type", "bridge"),
                 ("ip", "netns", "add", probe),
                 ("ip", "link", "add", f"{probe}v", "type", "veth", "peer", "name", HOST_INTERFACE, "netns", probe),
                 ("ip", "link", "set", f"{probe}v", "master", f"{probe}b", "up"),
                 ("tc", "qdisc", "add", "dev", f"{probe}v", "root", *_tbf("1gbit")),
                 ("nsenter", f"--net={NETNS_RUN_DIR / probe}", "unshare", "--mount", "--uts", "sh", "-c",
                  "mount --bind /etc/hosts /etc/hosts && hostname probe")]
        try:
            for step in steps:
                done = _ip(*step, check=False)
                if done.returncode != 0:
                    return f"`{' '.join(step[:5])} ...` fails here: {(done.stderr or done.stdout).strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"a lab network cannot be made here: {exc}"
        finally:
            for cleanup in (("ip", "link", "del", f"{probe}v"), ("ip", "netns", "del", probe),
                            ("ip", "link", "del", f"{probe}b")):
                _ip(*cleanup, check=False)
        return None

    # ------------------------------------------------------------------ create and destroy

    @classmethod
    def create(cls, hosts: int, rate: str | None = None, owner: str | None = None,
               controller_name: str | None = None) -> LabNetwork:
        """A new network of `hosts` hosts, each link shaped to `rate` each way (None: unshaped). `owner` marks the
        bridge (default: this process and a counter); `controller_name` is written into every host's hosts file
        for the bridge's address (default: this machine's short host name, which slurmctld goes by)."""
        check_shape(hosts, rate)
        owner = owner or f"dptrain lab of pid {os.getpid()} #{next(_COUNTER)}"
        network = cls._claim(hosts, rate, owner)
        try:
            network._build(controller_name or socket.gethostname().split(".")[0])
        except BaseException:
            network.destroy()
            raise
        return network

    @classmethod
    def _claim(cls, hosts: int, rate: str | None, owner: str) -> LabNetwork:
        """Pick a subnet number no lab uses (no bridge, no namespace of that number) and claim it by creating
        the bridge, under the lock file so that two processes never claim the same one."""
        with open(ALLOCATION_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            numbered = re.compile(rf"{NAME_PREFIX}(\d+)(?:[hv]\d+)?$")
            taken = {int(m.group(1)) for name in [*_links(), *_namespaces()] if (m := numbered.match(name))}
            start = os.getpid() % 250  # spread: labs of different processes rarely probe the same numbers
            free = [x for x in (1 + (start + i) % 250 for i in range(250)) if x not in taken]
            if not free:
                raise SlurmClusterError(f"all 250 lab subnets {SUBNET_PREFIX}.1-250.0/24 are in use; stop a lab "
                                        f"cluster (scripts/slurm-cluster stop DIR) or remove stale dptlab* links")
            network = cls(free[0], hosts, rate, owner)
            _ip("ip", "link", "add", network.bridge, "type", "bridge")
            _ip("ip", "link", "set", network.bridge, "alias", owner)
        return network

    def _build(self, controller_name: str) -> None:
        _ip("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _ip("ip", "link", "set", self.bridge, "up")
        hosts_file = "".join([
            "127.0.0.1 localhost\n::1 localhost ip6-localhost\n",
            f"{self.controller_address} {controller_name}\n",
            *(f"{self.address(k)} {self.hostname(k)}\n" for k in self.host_numbers)])
        for k in self.host_numbers:
            ns, end = self.namespace(k), self.bridge_end(k)
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", end, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", ns)
            _ip("ip", "link", "set", end, "master", self.bridge, "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", HOST_INTERFACE)
            _ip("ip", "-n", ns, "link", "set", HOST_INTERFACE, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            # a per-namespace sysctl: written from inside the namespace
            _ip("ip", "netns", "exec", ns, "sh", "-c", f"echo {TCP_RETRIES2} > /proc/sys/net/ipv4/tcp_retries2")
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts_file)  # `ip netns exec` bind-mounts it on /etc/hosts
        if self.rate is not None:
            self.shape(self.rate)

    def owns_bridge(self) -> bool:
        """Whether the bridge of this number exists and is this network's (its alias names our owner): False
        once ours is removed, also where another lab has claimed the number since."""
        try:
            return Path(f"/sys/class/net/{self.bridge}/ifalias").read_text().strip() == self.owner
        except OSError:
            return False

    def destroy(self) -> None:
        """Remove everything of this network: processes left in its namespaces, links, namespaces, hosts files,
        bridge (last: while it exists no other lab claims the number). Safe to call again: a no-op once the
        bridge is gone, even where another lab has claimed the number since."""
        if not self.owns_bridge():
            return
        existing_namespaces, existing_links = set(_namespaces()), set(_links())
        for k in self.host_numbers:
            ns = self.namespace(k)
            if ns in existing_namespaces:
                _kill_processes_in(ns)
            if self.bridge_end(k) in existing_links:  # its peer inside the namespace goes with it
                _ip("ip", "link", "del", self.bridge_end(k), check=False)
            if ns in existing_namespaces:
                _ip("ip", "netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        _ip("ip", "link", "del", self.bridge, check=False)
        try:
            ETC_NETNS.rmdir()  # only when empty: other labs' and TwoHosts' namespaces keep theirs
        except OSError:
            pass

    def __enter__(self) -> LabNetwork:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.destroy()

    # ------------------------------------------------------------------ use

    def shape(self, rate: str | None, hosts: Iterable[int] | None = None) -> None:
        """Every link (or those of `hosts`) shaped to `rate` both ways from now on (None: unshaped, as fast as this
        machine copies)."""
        for k in self.host_numbers if hosts is None else hosts:
            for prefix, device in ((["-n", self.namespace(k)], HOST_INTERFACE), ([], self.bridge_end(k))):
                if rate is None:
                    _ip("tc", *prefix, "qdisc", "del", "dev", device, "root", check=False)  # none there: fine
                else:
                    _ip("tc", *prefix, "qdisc", "replace", "dev", device, "root", *_tbf(rate))

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv as a command line that runs it on host `host` (1..hosts): in its network namespace, under its
        hostname, with its hosts file on /etc/hosts (in a mount namespace of its own). Not `ip netns exec`: that
        also mounts a fresh /sys without the machine's cgroup hierarchies, and slurmd 22.05 then refuses to start
        ("No filesystem mounted on /sys/fs/cgroup"). nsenter, unshare and sh each exec the next, so the process
        started is argv's own."""
        if host not in self.host_numbers:
            raise SlurmClusterError(f"there is no host {host} in this lab; choose one of its hosts 1 to {self.hosts}")
        return [_which("nsenter") or "nsenter", f"--net={NETNS_RUN_DIR / self.namespace(host)}",
                "unshare", "--mount", "--uts", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
                self.hostname(host), str(ETC_NETNS / self.namespace(host) / "hosts"), *map(str, argv)]

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start argv on host `host`, in a session of its own; `env` is added to this process's environment."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(host, argv), env={**os.environ, **(env or {})}, **kwargs)

    def run(self, host: int, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """argv on host `host` to its end (text output captured); killed, with its session, past `timeout`."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return finish(self.popen(host, argv, env=env, text=True, **kwargs), timeout)

    def bytes_sent(self, host: int) -> int:
        """Bytes host `host` has sent over its link since the network was made (its interface's counter)."""
        links = json.loads(_ip("ip", "-n", self.namespace(host), "-j", "-s", "link", "show", "dev",
                               HOST_INTERFACE).stdout)
        return int(links[0]["stats64"]["tx"]["bytes"])

    # ------------------------------------------------------------------ saved in a state folder

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> LabNetwork | None:
        """The network `save` wrote to `path`, or None where the file is missing or is not one `save` writes (its
        numbers name links, namespaces and /etc/netns folders that destroy() removes)."""
        try:
            network = cls(**json.loads(read_small_file(path, 4096) or ""))
        except (ValueError, TypeError):
            return None
        well_typed = (type(network.subnet) is int and type(network.hosts) is int and isinstance(network.owner, str)
                      and (network.rate is None or isinstance(network.rate, str)))
        try:
            if well_typed and 1 <= network.subnet <= 250:
                check_shape(network.hosts, network.rate)
                return network
        except SlurmClusterError:
            pass
        return None


# ---------------------------------------------------------------------------------------------- the cluster

class LabCluster(SlurmCluster):
    """A private SLURM cluster whose nodes host1..hostN are the hosts of a LabNetwork (see the module's text).
    Start it with `LabCluster.start(folder, hosts=2, rate="1gbit")`; `network` runs commands on a host."""

    def __init__(self, state_dir: Path, hosts: int | None = None, rate: str | None = None):
        """The cluster of `state_dir` as its lab.json describes it; `hosts` and `rate`: the one start() makes."""
        super().__init__(state_dir)
        self.network = None if hosts is not None else self._saved_network()
        self.hosts = hosts if hosts is not None else (self.network.hosts if self.network else 0)
        self.rate = rate if hosts is not None else (self.network.rate if self.network else None)

    @property
    def nodes(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(LabNetwork.hostname(k) for k in range(1, self.hosts + 1))

    @property
    def network_owner(self) -> str:
        """The alias of this folder's bridge: a lab.json copied from another lab's folder names another owner."""
        return f"dptrain lab cluster {self.state_dir}"

    def _saved_network(self) -> LabNetwork | None:
        """The network this folder's lab.json describes, if this folder made it (None otherwise: not ours to stop)."""
        network = LabNetwork.load(self.state_dir / LAB_FILE)
        return network if network is not None and network.owner == self.network_owner else None

    @staticmethod
    def is_lab_folder(state_dir: Path) -> bool:
        """Whether `state_dir` holds a lab cluster's state (running or not)."""
        return (Path(state_dir) / LAB_FILE).is_file()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return SlurmCluster.unavailable_reason() or LabNetwork.unavailable_reason()

    @classmethod
    def start(cls, state_dir: Path, *, hosts: int = 2, rate: str | None = None, detached: bool = False,
              timeout: float = 60) -> LabCluster:
        """Start a fresh lab cluster of `hosts` hosts, links shaped to `rate` (None: unshaped), in `state_dir`
        (a new path, an empty folder, or a folder a previous start made, emptied first), returning once
        `srun -N<hosts>` has run on every host. `detached`: as SlurmCluster.start (stop a detached one with
        `LabCluster.stop_folder`)."""
        check_shape(hosts, rate)
        check_state_folder(state_dir)  # the path as given: resolved, a link would be its target
        reason = cls.unavailable_reason()
        if reason:
            raise SlurmClusterError(reason)
        cluster = cls(state_dir, hosts, rate)
        cluster._prepare()  # refuses a folder whose cluster still runs: outside the `try` that would stop it
        try:
            cluster._start_supervisor(detached)
            cluster._wait_ready(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        """Stop the daemons and jobs (SlurmCluster.stop), then remove the network (the supervisor did, unless
        it was killed)."""
        super().stop()
        if self.network is not None:
            self.network.destroy()

    @contextlib.contextmanager
    def cpu_quota(self, host: int, cores: float) -> Iterator[Path]:
        """Host `host` held to `cores` CPUs' worth of time while inside: its slurmd goes into a cgroup of its own
        whose CPU quota is that (cgroup v1's cpu controller, cpu.cfs_quota_us over a 100 ms period), and the
        processes of its jobs, slurmd's children, are born there. A host slowed as a neighbour's job or a
        throttled node slows one; on leaving, every process still there goes back to the root group. Yields the
        group's folder (cpu.stat counts the periods it was held back)."""
        if not CPU_CGROUPS.is_dir() or not 0 < cores <= 64:
            raise SlurmClusterError(f"a CPU quota needs cgroup v1's cpu controller at {CPU_CGROUPS} and 0 < cores "
                                    f"<= 64 (got {cores})")
        slurmd = self._daemon_pids().get(f"slurmd-{LabNetwork.hostname(host)}")
        if slurmd is None:
            raise SlurmClusterError(f"host{host}'s slurmd is not running")
        group = CPU_CGROUPS / f"{NAME_PREFIX}-{os.getpid()}-host{host}-{next(_QUOTAS)}"
        group.mkdir()
        try:
            period = int((group / "cpu.cfs_period_us").read_text())
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * period))))
            (group / "cgroup.procs").write_text(str(slurmd))
            yield group
        finally:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (CPU_CGROUPS / "cgroup.procs").write_text(pid)
                except ProcessLookupError:  # ended meanwhile
                    pass
            group.rmdir()

    def describe(self) -> str:
        """One line for people: the hosts, their addresses, their links, the controller's address."""
        net = self.network
        links = f"links of {net.rate} each way" if net.rate else "unshaped links"
        return (f"hosts host1..host{net.hosts} at {net.address(1)}-{net.hosts} ({links}; namespaces "
                f"{net.namespace(1)}..{net.hosts}), slurmctld at {net.controller_address}")

    # ------------------------------------------------------------------ SlurmCluster's hooks

    def _prepare(self) -> None:
        """As SlurmCluster's, with the network made between the folder and slurm.conf; a network left by a
        killed supervisor of this folder is removed first (the bridge's alias keeps another lab's safe)."""
        check_state_folder(self.state_dir)  # a lab.json in a folder no start made is not read
        stale = self._saved_network()
        if stale is not None and self.supervisor_pid() is None and not self._daemon_pids():
            stale.destroy()
        try:
            super()._prepare()
        except BaseException:
            if self.network is not None:
                self.network.destroy()
            raise

    def _prepare_network(self) -> None:
        self.network = LabNetwork.create(self.hosts, self.rate, owner=self.network_owner)
        self.network.save(self.state_dir / LAB_FILE)

    def _controller_addr(self) -> str:
        return self.network.controller_address

    def _node_addr(self, node: str) -> tuple[str, str]:
        return node, self.network.address(self._host_number(node))

    def _slurmd_argv(self, node: str) -> list[str]:
        return self.network.command(self._host_number(node), super()._slurmd_argv(node))

    def _after_supervised(self) -> None:
        if self.network is not None:
            self.network.destroy()

    @staticmethod
    def _host_number(node: str) -> int:
        return int(node.removeprefix("host"))


if __name__ == "__main__":  # the supervisor, as SlurmCluster._start_supervisor runs it for a LabCluster
    sys.exit(supervisor_main(LabCluster))
