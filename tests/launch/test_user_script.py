"""`dptrain train -- my_train.py ...`: a training script of the user's own on local workers, started as torchrun starts
it, by dptrain's elastic agent (src/dptrain/launch/user_script.py). The tutorials' DDP script and their Lightning script
(tests/slurm/) train this way; a failed rank is restarted with the sentence that says which; the refusals are one
sentence each."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, start_cli
from tests.launch.test_local import _listening_addresses, _state, _tree

SCRIPTS = Path(__file__).parents[1] / "slurm"
# Each rank writes what torchrun would have given it, and rank 1 fails on its first attempt where a marker says so.
PROBE = """
import json, os, sys
rank = os.environ["RANK"]
if rank == "1" and os.path.exists("fail-once"):
    os.remove("fail-once")
    sys.exit("rank 1: the disk is full")
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
with open(f"rank{rank}.json", "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, args", [
    # the default run keeps it on the private cluster (tests/slurm/test_slurm_jobs.py) and the local launches below
    pytest.param("tutorial_ddp.py", ["--epochs", "2", "--model_dir", "saved"], marks=pytest.mark.nightly),
    ("tutorial_lightning.py", ["--gpus", "2", "--epochs", "2", "--model_dir", "saved"]),
], ids=["ddp", "lightning"])
def test_the_tutorials_scripts_train_on_two_local_workers_and_save_their_model(tmp_path, script, args):
    if script == "tutorial_lightning.py":
        pytest.importorskip("lightning")  # a dev dependency: `./scripts/setup.sh --dev` installs it
    shutil.copy(SCRIPTS / script, tmp_path)
    done = run_cli(["train", "--nproc-per-node", "2", "--", script, *args], tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = torch.load(tmp_path / "saved" / "model.pt")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {"1.weight": (10, 784), "1.bias": (10,)}
    assert [r["rank"] for r in json.loads((tmp_path / "saved" / "ranks.json").read_text())] == [0, 1]
    assert "Epoch 02" in done.stdout and "| world 2" in done.stdout  # rank 0's lines, on the console
    name = Path(script).stem
    assert f"dptrain: starting {script} {' '.join(args)} on 2 local worker(s), world size 2" in done.stderr
    assert (tmp_path / "runs" / name / "logs" / "launcher.log").is_file()  # the agent's log, in the run folder


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_rank_gets_torchruns_variables_a_free_port_its_cores_and_a_restart_that_names_the_failed_rank(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "fail-once").touch()
    done = run_cli(["train", "--nproc-per-node", "2", "--launch.max_restarts", "1", "--", "python", "probe.py",
                    "--lr", "0.1"], tmp_path, timeout=100, env={"OMP_NUM_THREADS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: the disk is full" in done.stderr  # the script's own words, on the console
    # rank 0, done with its part by then, may have ended at the same moment: the line says so where it had
    assert any(re.fullmatch(r"dptrain: rank 1 exited with code 1( \(rank 0 also stopped\))?; starting the workers again, "
                            r"attempt 2 of 2 \(--launch.max_restarts 1\)\.", line) for line in done.stderr.splitlines())
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))  # this machine's cores, shared by its two ranks
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"]) for s in seen] == [
        ("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"} and seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert {s["OMP_NUM_THREADS"] for s in seen} == {threads} and {tuple(s["argv"]) for s in seen} == {("--lr", "0.1")}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_a_launcher_already_the_script_replaces_dptrain_and_reads_its_variables(tmp_path):
    """As under torchrun's or srun's task: no agent of dptrain's, the script runs once with the launcher's rank."""
    (tmp_path / "probe.py").write_text(PROBE)
    torchruns = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999", "OMP_NUM_THREADS": "3"}
    done = run_cli(["train", "--", "probe.py"], tmp_path, timeout=50, env=torchruns)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert (seen["MASTER_PORT"], seen["OMP_NUM_THREADS"]) == ("29999", "3")
    assert not (tmp_path / "runs").exists()  # no agent, no agent's log


@pytest.mark.parametrize("args, error", [
    (["--"], "no training script after --; give the script and its arguments as torchrun takes them, e.g. dptrain "
             "train --nproc-per-node 2 -- my_train.py --epochs 5."),
    (["--", "train.py"], "the training script train.py is not a file in {tmp}, where each worker runs it; give its "
                         "path from there."),
    (["--train.epochs", "3", "--", "my_train.py"], "--train.epochs is an option of dptrain's own trainer, which this "
                                                   "launch does not run; give your script its own options after its "
                                                   "name (-- my_train.py --epochs 5)."),
    (["--", "--nproc_per_node", "2", "my_train.py"], "--nproc_per_node after -- is an option, not a training script; "
                                                     "put dptrain train's options before --, and the script and its "
                                                     "arguments after it, e.g. dptrain train --nproc-per-node 2 -- "
                                                     "my_train.py --epochs 5."),
    (["--output.dir", "taken", "--", "my_train.py"], "the run folder taken is a file; choose another --output.name "
                                                    "or --output.dir."),
])
def test_what_a_users_script_cannot_be_given_is_one_sentence(tmp_path, monkeypatch, capsys, args, error):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("raise SystemExit('never run')\n")
    (tmp_path / "taken").write_text("a file of the user's\n")
    code = main(["train", *args])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == "dptrain: error: " + error.format(tmp=tmp_path)
    assert not (tmp_path / "runs").exists() and (tmp_path / "taken").read_text() == "a file of the user's\n"


def test_a_dry_run_says_what_would_start_and_starts_nothing(tmp_path, monkeypatch, capsys):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("open('ran', 'w')\n")
    code = main(["train", "--dry-run", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                 "10.0.0.1", "--output.name", "mine", "--", "my_train.py", "--epochs", "5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.startswith("dptrain: would start my_train.py --epochs 5 on 2 local worker(s), world size 4, through "
                          "dptrain's elastic agent (2 nodes meeting at 10.0.0.1:29500)")
    assert err.rstrip().endswith(f"the agent's log: {Path('runs', 'mine', 'logs', 'launcher.log')}")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("words", [["-u", "my_train.py", "--epochs", "5"],
                                   ["python3", "-u", "my_train.py", "--epochs", "5"],
                                   ["-m", "my_train", "--epochs", "5"]])
def test_an_interpreters_words_after_the_double_dash_are_the_scripts_not_dptrains(tmp_path, monkeypatch, capsys, words):
    """python's -u (unbuffered: torchrun runs its workers so already), a named python, or -m and a module, as the
    tutorials' launch lines write them: what follows -- is the user's, never an option of dptrain's."""
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("open('ran', 'w')\n")
    code = main(["train", "--dry-run", "--nproc-per-node", "2", "--", *words])
    out, err = capsys.readouterr()
    assert code == 0, err
    shown = "-m my_train" if "-m" in words else "my_train.py"
    assert err.startswith(f"dptrain: would start {shown} --epochs 5 on 2 local worker(s), world size 2"), err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "runs").exists()


# Each rank says it has started, then waits for ever (the script of issue 42's kill -9).
HANG = """
import os, time
open(f"started-{os.environ['RANK']}", "w").close()
while True:
    time.sleep(1)
"""


def _wait_for(paths: list[Path], proc, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"never came: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_a_scripts_ranks_end_when_their_agent_is_killed_by_sigkill(tmp_path):
    """The ranks ran on for ever, re-parented to PID 1: torch's agent starts a program in a session of its own."""
    (tmp_path / "hang.py").write_text(HANG)
    proc = start_cli(["train", "--nproc-per-node", "2", "--", "hang.py"], tmp_path)
    ranks: list[int] = []
    try:
        _wait_for([tmp_path / "started-0", tmp_path / "started-1"], proc, 90)
        ranks = _tree(proc.pid)[1:]
        assert len(ranks) == 2, ranks  # the agent's two children are the ranks themselves (user_script_rank.py execs)
        os.kill(proc.pid, signal.SIGKILL)  # `dptrain train`, which is the agent, as kill -9 or the OOM killer ends it
        deadline = time.monotonic() + 10  # the kernel's SIGTERM comes at once; 10 s for a loaded machine
        while alive := [pid for pid in ranks if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]:
            assert time.monotonic() < deadline, f"ranks {alive} ran on without their agent"
            time.sleep(0.1)
    finally:
        proc.kill()
        for pid in ranks:  # leftovers where it failed: first, as they hold the pipes communicate() reads to their end
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


# Each rank joins the world through init_process_group's env:// (the store at MASTER_ADDR:MASTER_PORT) and all-reduces;
# rank 1 fails once after that (a restart must join a new round's store, not read the old one's keys); then each says
# it is in the world, in which round (the agent's restart count), and what the sum was, and waits for "go".
IN_THE_WORLD = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
if dist.get_rank() == 1 and os.path.exists("fail-once"):
    os.remove("fail-once")
    dist.destroy_process_group()  # else gloo's teardown at exit may abort (SIGABRT) before the exit code is given
    sys.exit("rank 1 fails once")
with open(f"joined-{dist.get_rank()}-{os.environ['TORCHELASTIC_RESTART_COUNT']}", "w") as f:
    f.write(str(total.item()))
while not os.path.exists("go"):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


# nightly: the default run keeps dptrain's own ranks on loopback only (tests/launch/test_local.py: the same agent's
# store and pinned sockets) and a script's restart naming its failed rank (above)
@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket tables of Linux's /proc")
def test_a_scripts_ranks_on_one_node_listen_on_loopback_only_and_a_restart_joins_afresh(tmp_path):
    """Rank 0's store listened on every interface (*:MASTER_PORT), against docs/security.md: the agent now serves
    the ranks a store of its own on loopback, a new one each round, and gloo's sockets are on loopback."""
    (tmp_path / "in_the_world.py").write_text(IN_THE_WORLD)
    (tmp_path / "fail-once").touch()
    proc = start_cli(["train", "--nproc-per-node", "2", "--launch.max_restarts", "1", "--", "in_the_world.py"],
                     tmp_path)
    try:
        _wait_for([tmp_path / "joined-0-1", tmp_path / "joined-1-1"], proc, 150)  # the second round
        seen = _listening_addresses(_tree(proc.pid))  # while every rank is in the world, its sockets open
    finally:
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "dptrain: rank 1 exited with code 1" in err and "starting the workers again, attempt 2 of 2" in err
    assert [(tmp_path / f"joined-{r}-1").read_text() for r in (0, 1)] == ["3.0", "3.0"]
    addresses = set().union(*seen.values())
    assert len(seen) >= 3, f"expected the agent and both ranks to listen, saw {seen}"  # stores, rendezvous, gloo
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), seen


# A script that joins a gloo world and all-reduces once a step; on rank 1 its loader blocks at step 3 where asked.
HANGS = """
import os, sys, time
import torch, torch.distributed as dist
import helper  # a module beside the script: sys.path[0] is the script's folder, as `python script.py` makes it

def load_batch(step):
    if step == 3 and os.environ["RANK"] == "1" and os.environ.get("BLOCK"):
        time.sleep(120)
    return torch.ones(4)

print("rank", os.environ["RANK"], "argv", sys.argv, "name", __name__, "helper", helper.NAME, flush=True)
dist.init_process_group("gloo")
for step in range(1, 6):
    dist.all_reduce(load_batch(step))
dist.destroy_process_group()
if os.environ.get("KILL_SELF") and os.environ["RANK"] == "1":
    os.kill(os.getpid(), 15)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def _hang_script(folder: Path) -> None:
    (folder / "hangs.py").write_text(HANGS)
    (folder / "helper.py").write_text("NAME = 'beside'\n")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_hangs_is_ended_naming_the_rank_and_its_python_line(tmp_path):
    """No hook inside the script: the watch thread of its rank (launch/user_script_rank.py) compares over the store."""
    _hang_script(tmp_path)
    done = run_cli(["train", "--nproc-per-node", "2", "--launch.timeout_s", "6", "--", "hangs.py", "--lr", "0.1"],
                   tmp_path, timeout=100, env={"BLOCK": "1"})
    for rank in (0, 1):  # run in the rank's process as `python -u hangs.py --lr 0.1` runs it
        assert f"rank {rank} argv ['hangs.py', '--lr', '0.1'] name __main__ helper beside" in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    line = HANGS.splitlines().index("        time.sleep(120)") + 1
    assert done.returncode == 1
    assert last.startswith(f"dptrain: error: rank 1 ({os.uname().nodename}) never entered all_reduce #3; rank 0 "
                           f"waited "), last
    assert f"; rank 1 was at hangs.py:{line} (in load_batch); its stack is on its output, above" in last, last


@pytest.mark.slow
@pytest.mark.nightly  # the default run keeps the argv, __main__ and sys.path of the hang's script above
@pytest.mark.timeout(120)
def test_a_script_run_in_the_ranks_process_keeps_its_argv_main_path_and_exit_code(tmp_path):
    _hang_script(tmp_path)
    done = run_cli(["train", "--nproc-per-node", "2", "--", "hangs.py", "--lr", "0.1"], tmp_path, timeout=100,
                   env={"EXIT_CODE": "3"})
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("dptrain: error: rank ")
    assert "exited with code 3" in done.stderr.strip().splitlines()[-1]
    for rank in (0, 1):
        assert f"rank {rank} argv ['hangs.py', '--lr', '0.1'] name __main__ helper beside" in done.stdout


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(120)
def test_a_script_run_in_the_ranks_process_still_dies_of_its_signal(tmp_path):
    _hang_script(tmp_path)
    done = run_cli(["train", "--nproc-per-node", "2", "--", "hangs.py"], tmp_path, timeout=100, env={"KILL_SELF": "1"})
    assert done.returncode == 1
    assert re.search(r"rank 1 was killed by SIGTERM \(pid \d+\)", done.stderr.strip().splitlines()[-1]), done.stderr
