from __future__ import annotations

import os
from unittest import mock

import pytest

from dptrain.distributed.env import DistEnv, Nodes, check_master_resolves
from dptrain.errors import ConfigError, LaunchError
from dptrain.slurm.env import expand_nodelist


def test_no_launcher_is_one_process():
    env = DistEnv.from_environ({})
    assert (env.global_rank, env.world_size, env.source, env.is_main) == (0, 1, "none", True)


def test_torchrun_variables():
    env = DistEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                "MASTER_ADDR": "node7", "MASTER_PORT": "29411"})
    assert env == DistEnv(5, 1, 8, 4, "node7", 29411, "torchrun")
    assert not env.is_main


def test_torchrun_wins_over_slurm_when_both_are_set():
    env = DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"})
    assert env.source == "torchrun" and env.global_rank == 1


def test_slurm_variables_take_the_master_from_the_node_list():
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    env = DistEnv.from_environ(slurm)
    assert (env.global_rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.master_addr == "gpu07" and env.source == "slurm"
    assert env.master_port == 20000 + 4242 % 20000
    # An explicit MASTER_ADDR/MASTER_PORT (from the sbatch script) wins.
    env = DistEnv.from_environ({**slurm, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 31000)


def test_the_sbatch_shell_itself_is_not_a_rank():
    assert DistEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"}).source == "none"


def test_bad_numbers_are_one_sentence():
    with pytest.raises(LaunchError, match="WORLD_SIZE='two' is not an integer"):
        DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[9-11]", ["a9", "a10", "a11"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_unresolvable_master_fails_fast():
    check_master_resolves("127.0.0.1")
    with pytest.raises(LaunchError, match="does not resolve"):
        check_master_resolves("no-such-host.invalid")


def test_from_environ_reads_os_environ():
    with mock.patch.dict("os.environ", {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}, clear=True):
        assert DistEnv.from_environ().global_rank == 2


@pytest.mark.parametrize("addr", ["0.0.0.0", "0", "::", "0:0::0"])
def test_a_wildcard_master_address_is_refused(addr):
    # A store bound there would listen on every interface of node 0, and the other nodes cannot reach "0.0.0.0".
    with pytest.raises(ConfigError, match=f"master address '{addr}' means every interface of a host"):  # an option's
        Nodes.from_options(2, 0, addr, None, None, {})
    with pytest.raises(ConfigError, match="means every interface of a host"):
        Nodes.from_options(2, 0, None, None, f"[{addr}]:29500", {})
    with pytest.raises(LaunchError, match="means every interface of a host"):  # MASTER_ADDR from torchrun or SLURM
        check_master_resolves(addr)


@pytest.mark.parametrize("user_sets_it", [False, True])
def test_a_world_in_the_calling_process_gives_the_collective_interface_back(monkeypatch, user_sets_it):
    # A one-rank run in the CLI's own process left GLOO_SOCKET_IFNAME=lo behind, and a later multi-host run of that
    # process bound loopback. Set while the world lives (torch reads it for every group); a user's own is kept.
    import torch

    from dptrain.distributed.store import loopback_interface
    from dptrain.distributed.world import destroy_process_group, init_process_group

    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    users = loopback_interface() if user_sets_it else None  # gloo must find it: an interface of this host
    if users is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", users)
    init_process_group(DistEnv.single(), torch.device("cpu"), 10)
    try:
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
        assert "NCCL_SOCKET_IFNAME" in os.environ
    finally:
        destroy_process_group()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == users and "NCCL_SOCKET_IFNAME" not in os.environ
