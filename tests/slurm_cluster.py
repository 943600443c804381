"""A private, real SLURM 22.05 cluster on this one machine: munged, slurmctld and two slurmd (nodes n1, n2).

Everything lives in one state folder (config, munge key and socket, spool, logs, pid files) and every port is
a free one picked at start, so neither a system munged nor a user's own SLURM cluster is ever touched. Clients
reach it only through `SLURM_CONF` (see `SlurmCluster.env`).

The daemons run in the foreground under a small supervisor process (this file run as a script) that is a
child subreaper: slurmd double-forks its slurmstepd processes, and PID 1 on this kind of machine does not reap
orphans, so without a reaper every finished job step would stay behind as a zombie. Stopping kills the daemons
by the PIDs in their pid files (slurmctld, then both slurmd, then munged) and then the supervisor, which kills
whatever is left below it (job processes of jobs still running) and reaps it all.

    with SlurmCluster.start(tmp_path / "slurm") as cluster:
        job_id = cluster.sbatch(script)
        assert cluster.wait(job_id)["JobState"] == "COMPLETED"
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 8  # more than this machine has (SlurmdParameters=config_overrides): the launcher tests run their jobs side by side
# The credential lifetime is also how long a requeued job waits before it may start again. slurm 22.05 refuses
# anything below 5 (src/common/slurm_cred.c: "AuthInfo=cred_expire=%d invalid", falling back to 120).
CRED_EXPIRE_S = 5
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE")
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long

# binary -> the Debian package that has it
BINARIES = {
    "slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client", "sbatch": "slurm-client",
    "scontrol": "slurm-client", "squeue": "slurm-client", "scancel": "slurm-client",
    "munged": "munge", "munge": "munge", "unmunge": "munge", "mungekey": "munge",
}
# Inherited from an outer SLURM job, these would make our clients talk about that job instead of ours.
_FOREIGN_ENV = re.compile(r"^(SLURM_|SBATCH_|SALLOC_|SRUN_|SQUEUE_|SCONTROL_|SINFO_)")
_SUN_PATH_MAX = 107  # a UNIX socket path longer than this cannot be bound
# Written into every state folder start() makes or adopts: the only folders it ever empties are those that carry it.
MARKER = ".slurm-cluster"
_MARKER_TEXT = ("This folder holds a private SLURM cluster's state (tests/slurm_cluster.py, scripts/slurm-cluster): "
                "a new start in it empties it.\n")


class SlurmClusterError(RuntimeError):
    """The private cluster could not start (or stop); the message names the daemon and its log file."""


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def client_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any outer SLURM job's variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}, **extra}


# ---------------------------------------------------------------------------------------------- process helpers

def _pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _arguments(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def read_small_file(path: Path, limit: int) -> str | None:
    """The text of `path` if it is a regular file (not a link) of at most `limit` bytes, else None: a state folder
    `stop` is pointed at may be anyone's, its pid file a link to /dev/zero or a FIFO that would block a read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = file.read(limit + 1)
    return data.decode(errors="replace") if len(data) <= limit else None


def _read_pid(pid_file: Path, *arguments: str) -> int | None:
    """The PID in `pid_file` if that process runs and `arguments` stand whole, one after the other, in its command
    line (`-f <our slurm.conf>`), so that a stale or planted pid file never gets a reused PID (a system daemon, an
    editor of a file in the folder) killed."""
    try:
        pid = int((read_small_file(pid_file, 64) or "").split()[0])
    except (ValueError, IndexError):
        return None
    if not _pid_alive(pid):
        return None
    argv, wanted = _arguments(pid), list(arguments)
    return pid if any(argv[i:i + len(wanted)] == wanted for i in range(len(argv) - len(wanted) + 1)) else None


def _terminate(pids: list[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM `pids`, wait until they are gone, SIGKILL whatever is left after `grace_s`."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(map(_pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in filter(_pid_alive, pids):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while any(map(_pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


# ---------------------------------------------------------------------------------------------- the state folder

def _is_marked(folder: Path) -> bool:
    """Whether `folder` carries MARKER as a regular file (a link named so does not count): a start made it."""
    try:
        return stat.S_ISREG(os.lstat(Path(folder) / MARKER).st_mode)
    except OSError:
        return False


def check_state_folder(state_dir: Path) -> None:
    """Refuse, in one sentence and before anything is made, a state folder that start() must not empty: a symbolic
    link (to anything), a path that is no folder, a folder with something in it but no MARKER (no start made it).
    A new path, an empty folder (adopted) and a folder a previous start made (emptied) are fine."""
    path = Path(state_dir)
    try:
        mode = os.lstat(path).st_mode
        entries = os.listdir(path) if stat.S_ISDIR(mode) else []
    except FileNotFoundError:
        return  # made by _prepare
    except OSError as error:  # a file where a parent folder should be, a folder this user may not read
        raise SlurmClusterError(f"{path} cannot hold a cluster ({error.strerror}); choose a new or empty "
                                f"folder") from None
    if stat.S_ISLNK(mode):
        raise SlurmClusterError(f"{path} is a symbolic link, and start never empties what a link points at; give the "
                                f"cluster a new or empty folder of its own")
    if not stat.S_ISDIR(mode):
        raise SlurmClusterError(f"{path} is a file, not a folder; give the cluster a new or empty folder")
    if entries and not _is_marked(path):
        raise SlurmClusterError(f"{path} is not empty and no cluster was started in it before (it has no {MARKER} "
                                f"file), so start will not empty it; choose a new or empty folder")


def _make_state_folder(state_dir: Path) -> None:
    """`state_dir` as check_state_folder allows it, marked as ours and emptied but for MARKER. Nothing is followed:
    a link inside it is removed, never what it points at (shutil.rmtree works below folders it opened itself)."""
    check_state_folder(state_dir)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        if not _is_marked(state_dir):
            (state_dir / MARKER).write_text(_MARKER_TEXT)
        with os.scandir(state_dir) as entries:
            for entry in entries:
                if entry.name == MARKER:
                    continue  # kept throughout: a start cut short leaves a folder still known as ours
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
    except OSError as error:
        raise SlurmClusterError(f"could not make {state_dir} a fresh cluster folder ({error.strerror or error}: "
                                f"{error.filename or state_dir}); choose another folder") from None


# ---------------------------------------------------------------------------------------------- the cluster

class SlurmCluster:
    """A private SLURM cluster whose whole state is one folder. Start it with `SlurmCluster.start(folder)`.

    A subclass changes where the nodes live (tests/lab_cluster.py: one network namespace per node) through
    `nodes`, `_controller_addr`, `_node_addr`, `_slurmd_argv`, `_prepare_network` and `_after_supervised`."""

    nodes: tuple[str, ...] = NODES

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir).resolve()
        self.conf_path = self.state_dir / "slurm.conf"
        self.munge_socket = self.state_dir / "munge" / "munge.sock"
        self.log_dir = self.state_dir / "log"
        self.run_dir = self.state_dir / "run"
        self._supervisor: subprocess.Popen | None = None  # set where this process started it (and so must reap it)

    # ------------------------------------------------------------------ client side

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs in its environment to talk to this cluster (and to no other)."""
        return {"SLURM_CONF": str(self.conf_path)}

    def run(self, *argv: str, timeout: float = 30, check: bool = False, cwd: Path | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """A client command (`sbatch`, `squeue`, `scontrol`, `scancel`, `srun`, ...) against this cluster."""
        return subprocess.run(list(argv), env=client_env(self.env), cwd=cwd, input=input, capture_output=True,
                              text=True, timeout=timeout, check=check)

    def sbatch(self, script: Path, *extra_args: str) -> int:
        """Submit `script` (run from its folder, so slurm-<id>.out lands next to it); returns the job id."""
        script = Path(script).resolve()
        done = self.run("sbatch", "--parsable", *extra_args, str(script), cwd=script.parent)
        if done.returncode != 0:
            raise SlurmClusterError(f"sbatch {' '.join(extra_args)} {script} failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, ExitCode, Restarts, NodeList, BatchHost, Reason, ...)."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id))
        if done.returncode != 0 or not done.stdout.strip():
            raise SlurmClusterError(f"scontrol does not know job {job_id}: {done.stderr.strip()}")
        return parse_scontrol_record(done.stdout.strip().splitlines()[0])

    def wait(self, job_id: int, states: tuple[str, ...] = TERMINAL_STATES, timeout: float = 120) -> dict[str, str]:
        """Poll job `job_id` every 0.2 s until its JobState is one of `states`; returns its record."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            if record.get("JobState") in states:
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {record.get('JobState')} (Reason={record.get('Reason')}) "
                                   f"after {timeout:.0f} s, waiting for {'/'.join(states)}")
            time.sleep(0.2)

    def wait_running(self, job_id: int, timeout: float = 60) -> dict[str, str]:
        """Wait until job `job_id` runs; fails at once if it ends first."""
        record = self.wait(job_id, ("RUNNING", *TERMINAL_STATES), timeout)
        if record["JobState"] != "RUNNING":
            raise SlurmClusterError(f"job {job_id} ended {record['JobState']} before it was seen running")
        return record

    # ------------------------------------------------------------------ start and stop

    @staticmethod
    def unavailable_reason() -> str | None:
        """One line saying why this machine cannot run the cluster, or None when it can."""
        if platform.system() != "Linux":
            return f"a private SLURM cluster needs Linux, not {platform.system()}"
        if os.geteuid() != 0:
            return "a private SLURM cluster needs root (slurmd runs jobs for any user)"
        missing = [name for name in BINARIES if _which(name) is None]
        if missing:
            packages = " ".join(dict.fromkeys(BINARIES[name] for name in missing))
            return (f"SLURM/munge programs missing ({', '.join(missing)}): "
                    f"apt-get install --no-install-recommends {packages}")
        return None

    @classmethod
    def start(cls, state_dir: Path, *, detached: bool = False, timeout: float = 60) -> SlurmCluster:
        """Start a fresh cluster in `state_dir` and return once a real `srun -N2 -n2 true` has run. `state_dir`: a
        new path, an empty folder, or a folder a previous start made (emptied first); anything else is refused (see
        check_state_folder). `detached`: the daemons outlive this process (stop with `stop_folder`); otherwise
        they also stop when the thread that called this ends (PR_SET_PDEATHSIG), e.g. if pytest is killed."""
        check_state_folder(state_dir)  # the path as given: resolved, a link would be its target
        reason = cls.unavailable_reason()
        if reason:
            raise SlurmClusterError(reason)
        cluster = cls(state_dir)
        cluster._prepare()
        cluster._start_supervisor(detached)
        try:
            cluster._wait_ready(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @classmethod
    def stop_folder(cls, state_dir: Path) -> bool:
        """Stop the cluster whose state is `state_dir` (started by another process). False: none was running."""
        cluster = cls(state_dir)
        was_running = cluster.supervisor_pid() is not None or bool(cluster._daemon_pids())
        cluster.stop()
        return was_running

    def supervisor_pid(self) -> int | None:
        return _read_pid(self.run_dir / "supervisor.pid", "supervise", str(self.state_dir))

    def stop(self) -> None:
        """Stop slurmctld, both slurmd, munged by the PIDs in their pid files, then the supervisor, which kills
        what is left of running jobs and reaps everything. Nothing of this cluster runs afterwards."""
        pids = self._daemon_pids()
        if "slurmctld" in pids:
            # A job that just ended still has messages in flight between its nodes and slurmctld; stopped then,
            # a slurmd (or slurmctld) waits seconds on a peer that is gone.
            self._no_job_completing(timeout=3)
        for group in self._stop_order():
            _terminate([pids[name] for name in group if name in pids])
        supervisor = self.supervisor_pid()
        if supervisor is not None:
            _terminate([supervisor], grace_s=15)
        if self._supervisor is not None:
            try:
                self._supervisor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._supervisor.kill()
                self._supervisor.wait()
            self._supervisor = None

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _stop_order(self) -> tuple[tuple[str, ...], ...]:
        """slurmctld first: stopped after its nodes, it spends ~3 s on a message to a slurmd that is gone. munged
        last: the others need it until they are done."""
        return ("slurmctld",), tuple(f"slurmd-{node}" for node in self.nodes), ("munged",)

    def _daemon_pids(self) -> dict[str, int]:
        """daemon name -> PID, from the pid files, for those of ours that still run (their command lines name
        our munge socket or slurm.conf)."""
        munged, slurm = (f"--socket={self.munge_socket}",), ("-f", str(self.conf_path))
        files = {"munged": (self.run_dir / "munged.pid", munged), "slurmctld": (self.run_dir / "slurmctld.pid", slurm),
                 **{f"slurmd-{node}": (self.run_dir / f"slurmd-{node}.pid", slurm) for node in self.nodes}}
        pids = {name: _read_pid(path, *arguments) for name, (path, arguments) in files.items()}
        return {name: pid for name, pid in pids.items() if pid is not None}

    def _prepare(self) -> None:
        """A fresh state folder: config, munge key, empty state/spool/log dirs."""
        check_state_folder(self.state_dir)  # before the pid files of a folder that may be anyone's are read
        if self.supervisor_pid() is not None or self._daemon_pids():
            raise SlurmClusterError(f"a cluster still runs from {self.state_dir}; stop it first")
        if len(str(self.munge_socket)) > _SUN_PATH_MAX:
            raise SlurmClusterError(f"state folder path too long for munge's socket ({self.munge_socket})")
        _make_state_folder(self.state_dir)  # saved state would let nodes look idle before their slurmd registered
        for folder in (self.munge_socket.parent, self.log_dir, self.run_dir, self.state_dir / "ctld",
                       *(self.state_dir / "spool" / node for node in self.nodes)):
            folder.mkdir(parents=True, mode=0o755)
        os.chmod(self.state_dir, 0o755)  # munged refuses a socket folder that others may write to
        key = self.munge_socket.parent / "munge.key"
        with open(key, "wb") as out:
            out.write(os.urandom(128))
        os.chmod(key, 0o400)  # owned by root, who runs munged; munged refuses a key others can read
        (self.state_dir / "plugstack.conf").write_text("")  # no SPANK plugins from the system's config
        self._prepare_network()
        self.conf_path.write_text(self._slurm_conf())

    def _prepare_network(self) -> None:
        """Where the nodes' addresses must exist before slurm.conf names them; here they are all 127.0.0.1."""

    def _controller_addr(self) -> str:
        """The address slurmctld is reached at, by clients and by every slurmd."""
        return "127.0.0.1"

    def _node_addr(self, node: str) -> tuple[str, str]:
        """(NodeHostname, NodeAddr) of `node`: every node of this cluster is this machine."""
        return socket.gethostname().split(".")[0], "127.0.0.1"

    def _slurmd_argv(self, node: str) -> list[str]:
        """How the supervisor starts `node`'s slurmd (in the foreground, so that it stays its child)."""
        return [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)]

    def _after_supervised(self) -> None:
        """Run by the supervisor once every daemon and job process below it is gone."""

    def _slurm_conf(self) -> str:
        host = socket.gethostname().split(".")[0]  # slurmctld compares it with its own short host name
        s = self.state_dir
        nodes = "\n".join(f"NodeName={node} NodeHostname={hostname} NodeAddr={address} Port={_free_port()} "
                          f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
                          for node in self.nodes for hostname, address in [self._node_addr(node)])
        return f"""\
# A private test cluster written by tests/slurm_cluster.py; every path is under {s}.
ClusterName=dptrain-private
SlurmctldHost={host}({self._controller_addr()})
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may run again; 5 is the least slurm accepts.
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool/%n
SlurmctldPidFile={s}/run/slurmctld.pid
SlurmdPidFile={s}/run/slurmd-%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={s}/plugstack.conf
MailProg=/bin/true
# no cgroups, no systemd on this kind of machine
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# Full scheduling passes every second (defaults: 60 s and 30 s): a requeued job becomes eligible on a timer, not
# on an event. A submitted batch job still waits for slurmctld's one-second background tick (0-1 s); an srun or
# salloc allocation starts at once. sched/builtin was no faster.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
# finished jobs stay visible to `scontrol show job` (there is no sacct without accounting)
MinJobAge=300
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""

    def _start_supervisor(self, detached: bool) -> None:
        """The supervisor runs in its own session, so a terminal's Ctrl-C reaches it only through stop()."""
        with open(self.log_dir / "supervisor.log", "ab") as log:
            # this class's own module as a script, so that the supervisor rebuilds the same kind of cluster
            script = Path(sys.modules[type(self).__module__].__file__).resolve()
            argv = [sys.executable, str(script), "supervise", str(self.state_dir)]
            if not detached:
                argv += ["--parent", str(os.getpid())]
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True, env=client_env(self.env))
        if not detached:
            self._supervisor = process

    def _wait_ready(self, timeout: float) -> None:
        """Until a real 2-node step runs, failing at once, naming the daemon, when one of them exits. Each stage
        is polled cheaply first: an srun sent before both nodes registered would wait for the next backfill pass."""
        deadline = time.monotonic() + timeout
        stages = [("munged answering munge -n", self._munge_answers),
                  ("slurmctld answering scontrol ping", self._slurmctld_answers),
                  ("both slurmd registered", self._nodes_idle),
                  ("srun -N2 -n2 true succeeding", lambda: self._srun_probe(deadline))]
        for what, ready in stages:
            while not ready():
                self._raise_if_a_daemon_exited()
                if time.monotonic() > deadline:
                    raise SlurmClusterError(
                        f"the private SLURM cluster in {self.state_dir} was not ready after {timeout:.0f} s "
                        f"(waiting for {what}); see {self.log_dir / 'slurmctld.log'}: "
                        f"{_tail(self.log_dir / 'slurmctld.log')}")
                time.sleep(0.02)

    def _slurmctld_answers(self) -> bool:
        # `scontrol ping` gives up at once; other client commands retry a refused connection for ~9 s
        return "is UP" in self.run("scontrol", "ping", timeout=10).stdout

    def _nodes_idle(self) -> bool:
        """Every node IDLE with no flag: the state folder starts empty, so that means their slurmd registered."""
        nodes = self.run("scontrol", "show", "node", "-o", timeout=10)
        states = [parse_scontrol_record(line).get("State") for line in nodes.stdout.splitlines()]
        return nodes.returncode == 0 and states == ["IDLE"] * len(self.nodes)

    def _srun_probe(self, deadline: float) -> bool:
        try:
            count = len(self.nodes)
            probe = self.run("srun", f"-N{count}", f"-n{count}", "true", timeout=max(1.0, min(15.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            return False
        return probe.returncode == 0 and self._no_job_completing()

    def _no_job_completing(self, timeout: float = 5) -> bool:
        """Wait (up to `timeout`) until no job is still COMPLETING, i.e. every node reported its end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                jobs = self.run("scontrol", "show", "job", "-o", timeout=max(0.5, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
            if jobs.returncode == 0 and "JobState=COMPLETING" not in jobs.stdout:
                return True
            time.sleep(0.02)
        return False

    def _munge_answers(self) -> bool:
        socket_arg = f"--socket={self.munge_socket}"
        try:
            token = subprocess.run(["munge", "-n", socket_arg], capture_output=True, timeout=5)
            decoded = subprocess.run(["unmunge", socket_arg], input=token.stdout, capture_output=True, timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return token.returncode == 0 and decoded.returncode == 0

    def _raise_if_a_daemon_exited(self) -> None:
        exits = self.run_dir / "exited"
        if not exits.exists():
            if self._supervisor is not None and self._supervisor.poll() is not None:
                raise SlurmClusterError(f"the cluster's supervisor exited ({self._supervisor.returncode}); "
                                        f"see {self.log_dir / 'supervisor.log'}: "
                                        f"{_tail(self.log_dir / 'supervisor.log')}")
            return
        name, status = exits.read_text().splitlines()[0].split()
        log, stderr = self.log_dir / f"{name}.log", self.log_dir / f"{name}.stderr"
        # slurmd/slurmctld write what goes wrong before they read slurm.conf (and so their log file's name) to stderr
        early = f" (stderr: {_tail(stderr, 2)})" if stderr.exists() and not log.exists() else ""
        raise SlurmClusterError(f"{name} exited ({status}) while the private SLURM cluster started; "
                                f"see {log}: {_tail(log)}{early}")


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line -> {key: value}. Values may contain '=' (TRES=cpu=2,node=1) and spaces
    (a Reason), so a key is a word followed by '=' at the start of the line or after whitespace."""
    matches = list(_SCONTROL_KEY.finditer(line))
    return {m.group(1): line[m.end():(matches[i + 1].start() if i + 1 < len(matches) else len(line))].strip()
            for i, m in enumerate(matches)}


# ---------------------------------------------------------------------------------------------- the supervisor

class _StopRequested(Exception):
    pass


def _supervise(cluster: SlurmCluster, parent: int | None) -> int:
    """Start munged, slurmctld and each node's slurmd in the foreground as our children, reap every process that
    ends below us (as a subreaper, the orphaned slurmstepds too), and on SIGTERM stop them all."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def stop_requested(signum, frame):
        raise _StopRequested

    signal.signal(signal.SIGTERM, stop_requested)
    signal.signal(signal.SIGINT, stop_requested)
    signal.signal(signal.SIGHUP, stop_requested)
    if parent is not None:  # a test run's cluster stops with the test process, even if that is killed
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            return 0
    (cluster.run_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")

    env = client_env(cluster.env)
    conf = str(cluster.conf_path)
    daemons: dict[int, str] = {}  # PID -> name of those still running
    # Kept referenced: subprocess reaps a dropped Popen's child itself (on the next Popen), and then our
    # waitpid(-1) would never see that daemon exit.
    launched: list[subprocess.Popen] = []
    try:
        def launch(name: str, argv: list[str], log_name: str) -> None:
            with open(cluster.log_dir / log_name, "ab") as log:
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
            launched.append(process)
            daemons[process.pid] = name

        munge_dir = cluster.munge_socket.parent
        # In the foreground munged logs to stderr, hence its log file is our redirect. --force: munged refuses a
        # socket under a folder that not everyone may enter (pytest's temporary folders are 0700); only root, who
        # may enter it, talks to this munged.
        launch("munged", [_which("munged"), "--foreground", "--force", f"--socket={cluster.munge_socket}",
                          f"--key-file={munge_dir / 'munge.key'}", f"--pid-file={cluster.run_dir / 'munged.pid'}",
                          f"--seed-file={munge_dir / 'munged.seed'}", f"--log-file={cluster.log_dir / 'munged.log'}",
                          "--num-threads=2"], "munged.log")
        deadline = time.monotonic() + 10
        while not cluster.munge_socket.exists() and time.monotonic() < deadline:
            _reap_once(daemons, cluster)
            time.sleep(0.01)
        if "munged" in daemons.values():  # else the starter reports munged's exit
            launch("slurmctld", [_which("slurmctld"), "-D", "-f", conf], "slurmctld.stderr")
        # slurmd registers with slurmctld at once, and if slurmctld does not answer yet, retries only a second
        # later: starting slurmd once slurmctld answers makes the cluster ready in ~0.2 s instead of ~1.2 s.
        deadline = time.monotonic() + 30
        while "slurmctld" in daemons.values() and time.monotonic() < deadline:
            if cluster._slurmctld_answers():
                break
            _reap_once(daemons, cluster)
            time.sleep(0.01)
        if "slurmctld" in daemons.values():
            for node in cluster.nodes:
                launch(f"slurmd-{node}", cluster._slurmd_argv(node), f"slurmd-{node}.stderr")
        while True:
            pid, status = os.waitpid(-1, 0)
            _record_exit(daemons, cluster, pid, status)
    except _StopRequested:
        pass
    except ChildProcessError:  # every child is gone
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop_supervised(daemons, cluster._stop_order())
        cluster._after_supervised()
    return 0


def _reap_once(daemons: dict[int, str], cluster: SlurmCluster) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _record_exit(daemons, cluster, pid, status)


def _record_exit(daemons: dict[int, str], cluster: SlurmCluster, pid: int, status: int) -> None:
    """Every daemon's exit is written down; the starter names the first one in its error message."""
    name = daemons.pop(pid, None)
    if name is not None:
        code = os.waitstatus_to_exitcode(status)
        described = f"status={code}" if code >= 0 else f"signal={-code}"
        with open(cluster.run_dir / "exited", "a") as out:
            out.write(f"{name} {described}\n")


def _stop_supervised(daemons: dict[int, str], stop_order: tuple[tuple[str, ...], ...]) -> None:
    """In the supervisor: the daemons in order (by their known PIDs), then every other process still below us
    (a running job's processes), reaping all of them."""
    by_name = {name: pid for pid, name in daemons.items()}
    for group in stop_order:
        _terminate([by_name[name] for name in group if name in by_name])
    for _ in range(20):
        left = _descendants(os.getpid())
        for pid in left:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.02)
    # still not empty: an unkillable (D-state) process; give up rather than hang the caller


def supervisor_main(cluster_class: type[SlurmCluster]) -> int:
    """`python THIS_FILE supervise STATE_DIR [--parent PID]`: the supervisor of a cluster of that class."""
    import argparse

    parser = argparse.ArgumentParser(description=f"The supervisor of a {cluster_class.__name__} (see its docstring).")
    parser.add_argument("command", choices=["supervise"])
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--parent", type=int, help="stop the cluster when this process (the starter) ends")
    args = parser.parse_args()
    return _supervise(cluster_class(args.state_dir), args.parent)


if __name__ == "__main__":  # the supervisor, as SlurmCluster._start_supervisor runs it
    sys.exit(supervisor_main(SlurmCluster))
