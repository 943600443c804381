"""Where ranks come from: torchrun's or SLURM's environment variables (the latter through slurm.env, which names
them), read once into a DistEnv; the nodes of a run started without a scheduler (Nodes)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Literal, Mapping

from dptrain.errors import ConfigError, LaunchError
from dptrain.slurm.env import SLURM_VARS, expand_nodelist, in_srun_task, job_port, slurm_count, slurm_value


TORCHRUN_VARS = {
    "global_rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the world; `source` says who started it."""

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: Literal["torchrun", "slurm", "none"]

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    @classmethod
    def single(cls) -> "DistEnv":
        return cls(0, 0, 1, 1, "127.0.0.1", 0, "none")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        """torchrun's variables win over SLURM's (torchrun inside srun sets both); none: one process."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls._from_torchrun(env)
        if in_srun_task(env):  # not the batch shell, which has a rank too
            return cls._from_slurm(env)
        return cls.single()

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str]) -> "DistEnv":
        v = {key: env.get(var) for key, var in TORCHRUN_VARS.items()}
        world_size = _int(v["world_size"], "WORLD_SIZE")
        return cls(
            global_rank=_int(v["global_rank"], "RANK"),
            local_rank=_int(v["local_rank"] or "0", "LOCAL_RANK"),
            world_size=world_size,
            local_world_size=_int(v["local_world_size"] or str(world_size), "LOCAL_WORLD_SIZE"),
            master_addr=v["master_addr"] or "127.0.0.1",
            master_port=_int(v["master_port"] or "29500", "MASTER_PORT"),
            source="torchrun",
        )

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str]) -> "DistEnv":
        v = {what: slurm_value(what, env) for what in SLURM_VARS}
        world_size = _int(v["world_size"], SLURM_VARS["world_size"])
        nodes = expand_nodelist(v["node_list"] or socket.gethostname())
        master = env.get("MASTER_ADDR") or nodes[0]
        port = env.get("MASTER_PORT") or str(job_port(v["job_id"]))
        local_world = v["local_world_size"] or str(-(-world_size // len(nodes)))
        return cls(
            global_rank=_int(v["global_rank"], SLURM_VARS["global_rank"]),
            local_rank=_int(v["local_rank"] or "0", SLURM_VARS["local_rank"]),
            world_size=world_size,
            local_world_size=_int(local_world.split("(")[0], SLURM_VARS["local_world_size"]),
            master_addr=master,
            master_port=_int(port, "MASTER_PORT"),
            source="slurm",
        )


def _int(value: str | None, name: str) -> int:
    try:
        return int(value)  # type: ignore[arg-type]  # None raises TypeError, handled below
    except (TypeError, ValueError):
        raise LaunchError(f"environment variable {name}={value!r} is not an integer; fix the launcher's environment.") from None


def check_master_resolves(addr: str) -> None:
    """Fail fast: c10d retries an unresolvable master silently until the job's time limit. A wildcard (0.0.0.0, ::)
    resolves, but is no host's address: the others cannot reach it, and rank 0 or node 0 would listen on every
    interface for the store that has no authentication."""
    try:
        resolved = socket.getaddrinfo(addr, None)
    except socket.gaierror:
        raise LaunchError(
            f"master address {addr!r} does not resolve on {socket.gethostname()}; "
            "set MASTER_ADDR to the first node's IP address or add it to /etc/hosts."
        ) from None
    if any(ipaddress.ip_address(sockaddr[0].partition("%")[0]).is_unspecified for *_, sockaddr in resolved):
        raise LaunchError(f"master address {addr!r} means every interface of a host, not an address the other hosts can "
                          f"reach; give the first node's IP address or host name.")


DEFAULT_MASTER_PORT = 29500  # the tutorials' and torchrun's; a multi-node run's every node must name the same one


@dataclass(frozen=True)
class Nodes:
    """A run over several nodes without a scheduler (or with one elastic agent per node under srun): how many
    nodes, this one's index, and where node 0 hosts the agents' rendezvous (torchrun's options, same meaning)."""

    count: int  # the most nodes (--nnodes N, or MAX of MIN:MAX)
    rank: int | None  # --node-rank; None: the rendezvous numbers the nodes, node 0 the one at the endpoint's host
    host: str
    port: int
    min_count: int | None = None  # the fewest nodes the run goes on with (MIN of --nnodes MIN:MAX); None: count

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def fewest(self) -> int:
        return self.count if self.min_count is None else self.min_count

    @property
    def elastic(self) -> bool:
        """Whether the run may go on with fewer nodes than it started with (--nnodes MIN:MAX, MIN < MAX)."""
        return self.fewest < self.count

    @property
    def spelled(self) -> str:
        """--nnodes as given: N, or MIN:MAX."""
        return f"{self.fewest}:{self.count}" if self.elastic else str(self.count)

    @classmethod
    def from_options(cls, nnodes: int | str | None, node_rank: int | None, master_addr: str | None,
                     master_port: int | None, rdzv_endpoint: str | None,
                     environ: Mapping[str, str] | None = None) -> "Nodes | None":
        """The options of `dptrain train` checked together; None for a run on this node alone; ConfigError (an option
        error, exit 2, as argparse's own) for a bad one. nnodes: N, or MIN:MAX (torchrun's elastic form: the run starts
        with up to MAX nodes and goes on with MIN or more). Without --node-rank (and outside srun) the rank is None:
        the rendezvous numbers the nodes, as torchrun's c10d rendezvous does (launch.rendezvous)."""
        env = os.environ if environ is None else environ
        spelled = nnodes
        fewest, nnodes = node_range(nnodes)
        given = [name for name, value in (("--node-rank", node_rank), ("--master-addr", master_addr),
                                          ("--master-port", master_port), ("--rdzv-endpoint", rdzv_endpoint)) if value is not None]
        if nnodes is None:
            if given:
                raise ConfigError(f"{given[0]} is for a run over several nodes; give --nnodes too (the number of nodes).")
            return None
        if nnodes < 1:
            raise ConfigError(f"--nnodes {nnodes} must be 1 or more.")
        if "RANK" in env and "WORLD_SIZE" in env:
            raise ConfigError("--nnodes starts this node's workers, but a launcher (torchrun) already started this process "
                              "as a rank; drop --nnodes, or run dptrain without torchrun.")
        if rdzv_endpoint is not None and (master_addr is not None or master_port is not None):
            raise ConfigError("give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both.")
        if rdzv_endpoint is not None:
            host, sep, port_text = rdzv_endpoint.rpartition(":")
            if not sep or not host or not port_text.isdigit():
                raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT; write it as node1:29500.")
            master_addr, master_port = host.strip("[]"), int(port_text)
        if node_rank is None:
            node_rank = slurm_count("node_rank", env)  # one agent per node under srun: the task's node (else None)
        if nnodes == 1 and master_addr is None:
            return None  # this node alone: the local launch, on loopback
        if nnodes == 1:
            node_rank = 0 if node_rank is None else node_rank
        if node_rank is not None and not 0 <= node_rank < nnodes:
            raise ConfigError(f"--node-rank {node_rank} is outside 0 to {nnodes - 1} (--nnodes {spelled}).")
        if master_addr is None:
            raise ConfigError(f"--master-addr is needed with --nnodes {spelled}: the address of node 0, which every node "
                              f"can reach (or --rdzv-endpoint HOST:PORT).")
        port = DEFAULT_MASTER_PORT if master_port is None else master_port
        if not 0 < port < 65536:
            raise ConfigError(f"--master-port {port} is not a TCP port; pick one from 1024 to 65535.")
        try:
            check_master_resolves(master_addr)
        except LaunchError as exc:  # here the address is an option's value: an option error, as the others
            raise ConfigError(str(exc)) from None
        return cls(nnodes, node_rank, master_addr, port, min_count=fewest if fewest != nnodes else None)


def node_range(nnodes: int | str | None) -> tuple[int | None, int | None]:
    """--nnodes as (fewest, most): N is (N, N), MIN:MAX is (MIN, MAX); ConfigError (exit 2) for anything else."""
    if nnodes is None or isinstance(nnodes, int):
        return nnodes, nnodes
    low, sep, high = nnodes.partition(":")
    if not (low.strip().isdigit() and (not sep or high.strip().isdigit())):
        raise ConfigError(f"--nnodes {nnodes!r} is not a node count; write N (e.g. 2) or MIN:MAX (e.g. 1:4, a run that "
                          f"goes on with fewer nodes after losing one).")
    fewest, most = int(low), int(high if sep else low)
    if fewest < 1 or most < fewest:
        raise ConfigError(f"--nnodes {nnodes} needs 1 <= MIN <= MAX; write e.g. 1:4.")
    return fewest, most
