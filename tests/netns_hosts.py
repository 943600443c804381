"""Two real "hosts" on this machine for multi-node tests: two network namespaces joined by a veth pair.

    with TwoHosts() as hosts:
        server = hosts.popen(0, [sys.executable, "-c", "..."])   # runs in node1 (hostname node1)
        client = hosts.popen(1, [sys.executable, "-c", "..."])   # runs in node2, reaches node1 by name
        hosts.cut_link()                                         # the cable pulled out

Each host has its own network stack (loopback + one veth end), its own UTS hostname (node1, node2) for the
processes started through `popen`, and a hosts file (`ip netns exec` bind-mounts /etc/netns/<ns>/hosts on
/etc/hosts) mapping node1/node2 to their addresses, so `socket.gethostname()` resolves to the host's own
address: what torch's c10d rendezvous and gloo rely on to pick who hosts the store and which interface to use.
`net.ipv4.tcp_retries2=5` inside each namespace makes a TCP connection over a cut link fail in ~13 s instead
of ~15 min. Needs root, `ip netns` and `unshare` (see `TwoHosts.unavailable_reason`). Everything (processes,
namespaces, the veth pair, /etc/netns/<ns>) is removed on exit, also when the body raised.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

ETC_NETNS = Path("/etc/netns")
_COUNTER = itertools.count()


def _run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def kill_processes_in(ns: str, timeout: float = 10) -> None:
    """SIGKILL whatever still runs in network namespace `ns`, waiting up to `timeout` s for it to go."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """A process started in its own session, to its end; killed with its session, and TimeoutExpired raised, past
    `timeout`."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class TwoHosts:
    """Two network namespaces `dpt<pid>n<k>a`/`...b` as hosts node1/node2 on 10.<x>.<y>.1/24 and .2/24."""

    names = ["node1", "node2"]

    def __init__(self, tcp_retries2: int = 5) -> None:
        pid, k = os.getpid(), next(_COUNTER)
        self.tcp_retries2 = tcp_retries2
        self.namespaces = [f"dpt{pid}n{k}a", f"dpt{pid}n{k}b"]
        # interface names live inside the namespaces only, but keep them short (15 chars at most) and unique
        self.interfaces = [f"v{pid % 10**7}{k % 100}a", f"v{pid % 10**7}{k % 100}b"]
        # the namespaces' stacks are separate from the root one, so any subnet would do; one unlikely to be
        # routed anywhere on this machine keeps a mistake (a process left in the root namespace) visible
        subnet = f"10.213.{pid % 250 + 1}"
        self.addresses = [f"{subnet}.1", f"{subnet}.2"]
        self._procs: list[subprocess.Popen] = []
        self._entered = False

    # --- availability ---------------------------------------------------------------------------------------

    @staticmethod
    def unavailable_reason() -> str | None:
        """One line saying why two hosts cannot be made here (not root, no `ip netns`, no `unshare`), else None."""
        if os.geteuid() != 0:
            return "network namespaces need root (euid is not 0)"
        for tool in ("ip", "unshare", "hostname", "sh"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed"
        probe = f"dptprobe{os.getpid()}n{next(_COUNTER)}"
        try:
            done = _run("ip", "netns", "add", probe, check=False)
            if done.returncode != 0:
                return f"`ip netns add` fails: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
            done = _run("ip", "netns", "exec", probe, "unshare", "--uts", "sh", "-c", "hostname probe && hostname",
                        check=False)
            if done.returncode != 0 or done.stdout.strip() != "probe":
                return f"`unshare --uts` + `hostname` inside `ip netns exec` fails: {done.stderr.strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`ip netns` cannot be used: {exc}"
        finally:
            _run("ip", "netns", "del", probe, check=False)
            shutil.rmtree(ETC_NETNS / probe, ignore_errors=True)
        return None

    # --- setup / teardown -----------------------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        self._entered = True
        try:
            self._create()
        except BaseException:
            self._destroy()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._destroy()

    def _create(self) -> None:
        self._destroy()  # names left by an earlier process that had this pid
        a, b = self.namespaces
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
        # both ends are created straight inside their namespaces: the root namespace never sees them
        _run("ip", "link", "add", self.interfaces[0], "netns", a, "type", "veth",
             "peer", "name", self.interfaces[1], "netns", b)
        hosts = "".join(f"{addr} {name}\n" for addr, name in zip(self.addresses, self.names))
        for ns, iface, addr in zip(self.namespaces, self.interfaces, self.addresses):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _run("ip", "-n", ns, "link", "set", iface, "up")
            # per-namespace sysctl (net.ipv4.* of the namespace the writer is in)
            _run("ip", "netns", "exec", ns, "sh", "-c",
                 f"echo {self.tcp_retries2} > /proc/sys/net/ipv4/tcp_retries2")
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{hosts}")

    def _destroy(self) -> None:
        for proc in self._procs:  # whole process groups: a launcher's workers too
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        existing = _run("ip", "netns", "list", check=False).stdout.split()
        for ns in self.namespaces:
            if ns in existing:
                self._kill_namespace_pids(ns)
                _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        try:
            ETC_NETNS.rmdir()  # only when empty: other sessions' namespaces keep theirs
        except OSError:
            pass

    @staticmethod
    def _kill_namespace_pids(ns: str) -> None:
        """Kill whatever still runs in `ns` (started outside `popen` too), waiting up to 10 s for it to go."""
        kill_processes_in(ns)

    # --- use ------------------------------------------------------------------------------------------------

    def popen(self, index: int, argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE, text: bool = True,
              **kwargs: Any) -> subprocess.Popen:
        """Start argv in host `index` (0 -> node1, 1 -> node2) with that hostname, in its own process group.

        `env` is added to this process's environment (PYTHONPATH etc. pass through); `cwd` is the command's
        working directory. The Popen's pid is argv's own process (`ip netns exec`, `unshare` and `sh` exec).
        """
        if not self._entered:
            raise RuntimeError("TwoHosts.popen outside its `with` block")
        full_env = {**os.environ, **(env or {})}
        wrapped = ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts",
                   "sh", "-c", 'hostname "$0" && exec "$@"', self.names[index], *map(str, argv)]
        proc = subprocess.Popen(wrapped, env=full_env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: list[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        """popen + communicate under `timeout` (killed and raised past it)."""
        return finish(self.popen(index, argv, **kwargs), timeout)

    def cut_link(self) -> None:
        """Take both veth ends down: traffic between the hosts stops, as if the cable were pulled out."""
        for ns, iface in zip(self.namespaces, self.interfaces):
            _run("ip", "-n", ns, "link", "set", iface, "down")

    def restore_link(self) -> None:
        """Bring both veth ends back up (addresses and the subnet route come back with them)."""
        for ns, iface in zip(self.namespaces, self.interfaces):
            _run("ip", "-n", ns, "link", "set", iface, "up")
