"""What decides the GPU paths outside the strategies, on the CPU: the watch that names a lost peer on nccl, the host
syncs of a user Dataset's indices and of evaluation, and the refusal of more nccl workers than visible GPUs (and of
send/recv on gloo with CUDA tensors) before any worker starts. What only a GPU shows is in perf/gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dptrain import cli, config
from dptrain.data.loader import Batch, DatasetLoader, indices_on
from dptrain.distributed.env import DistEnv
from dptrain.distributed.failures import PULSE_DONE, PeerWatch, Phase, WorkerFailure, needs_peer_watch
from dptrain.errors import ConfigError
from dptrain.evaluate import evaluate
from dptrain.launch import local
from dptrain.prestart import check_gpus_for_workers

REPO = Path(__file__).resolve().parents[1]


def rank_env(rank: int, world: int, port: int = 0) -> DistEnv:
    return DistEnv(rank, rank, world, world, "127.0.0.1", port, "torchrun")


# Finding 5: on nccl a lost peer left the host waiting until NCCL's watchdog aborted it, unnamed.

class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watches(world: int, silence_s: float = 10.0, store: dist.Store | None = None) -> tuple[list[PeerWatch], Clock]:
    """One PeerWatch per rank on one store, each rank in phase 'step 12', each rank's first pulse given."""
    store = dist.HashStore() if store is None else store
    clock = Clock()
    ranks = []
    for rank in range(world):
        phase = Phase(rank)
        phase.name = "step 12"
        ranks.append(PeerWatch(store, rank_env(rank, world), phase, silence_s, end=lambda failure: None, clock=clock))
    for watch in ranks:
        watch.beat()
    return ranks, clock


def test_only_nccl_needs_the_watch():
    assert needs_peer_watch("nccl")
    assert not needs_peer_watch("gloo")  # its collectives raise in the call, and Phase names the silent ranks


def test_a_pulse_that_stops_for_the_silence_names_the_rank_for_every_other():
    (r0, r1, r2), clock = watches(3)
    for watch in (r0, r1, r2):
        assert watch.lost() is None  # the first reading
    clock.now = 9.0
    r0.beat()
    r2.beat()  # rank 1 beats no more
    assert r0.lost() is None and r1.lost() is None  # rank 0 saw rank 1's last pulse at 0: 9 s < 10 s
    clock.now = 10.5
    assert r0.lost() == (1, "no heartbeat from it on the world's store for 10 s")
    # Rank 2, which watches rank 0 (alive), learns it from the store, and so would rank 1 if it were only stuck.
    assert r2.lost() == r0.lost()
    failure = r2.failure(*r2.lost())
    assert isinstance(failure, WorkerFailure)
    assert str(failure) == ("rank 2 failed during step 12: rank 1 did not answer (dead or stuck): no heartbeat from it "
                            "on the world's store for 10 s")
    assert str(r1.failure(*r1.lost())) == ("rank 1 failed during step 12: the other ranks took it for lost (no heartbeat "
                                           "from it on the world's store for 10 s)")


def test_a_live_peer_is_never_taken_for_lost_however_long_it_lives():
    """Each new pulse starts the silence again: a peer that beats every second for 60 s of a 10 s silence limit, read
    twice a second, is never lost (a watch that kept the first pulse's time named it at 10.5 s)."""
    (r0, r1), clock = watches(2)
    for tick in range(1, 121):
        clock.now = tick / 2
        if tick % 2 == 0:
            r1.beat()
        assert r0.lost() is None, f"rank 1 taken for lost at {clock.now} s although it beat every second"
    clock.now += 10.5  # then it stops: named once its last pulse is older than the silence
    assert r0.lost() == (1, "no heartbeat from it on the world's store for 10 s")


def test_a_rank_that_finished_is_never_taken_for_lost_and_its_watcher_watches_the_next():
    (r0, r1, r2), clock = watches(3)
    r0.lost()
    r1.stop(finished=True)  # rank 1 is done (rank 0 still writes the final weights, say)
    assert r1.store.add(r1._pulse_key(1), 0) >= PULSE_DONE
    clock.now = 100.0
    assert r0.lost() is None  # rank 0 now watches rank 2, first heard now
    r2.beat()
    clock.now = 105.0
    assert r0.lost() is None
    clock.now = 111.0  # rank 2's pulse has not moved since 100 (its last beat was read at 105 as new)
    r2.beat()
    assert r0.lost() is None
    clock.now = 200.0
    assert r0.lost() == (2, "no heartbeat from it on the world's store for 10 s")


def test_a_rank_whose_own_work_failed_tells_the_others_at_once():
    (r0, r1), clock = watches(2)
    r1.stop(finished=False)
    assert r0.lost() == (1, "it failed (its own line says why) and left the world")  # no silence to wait for
    r1.stop(finished=True)  # the rank's teardown calls it again: the first call counts
    assert r0.lost() == (1, "it failed (its own line says why) and left the world")


def test_the_first_rank_written_as_lost_stays():
    (r0, r1, r2), clock = watches(3)
    r2.stop(finished=False)
    clock.now = 50.0
    for watch in (r0, r1):
        assert watch.lost() == (2, "it failed (its own line says why) and left the world")


class GoneAfter:
    """A store that answers until told its host is gone, then fails as torch's TCPStore does."""

    def __init__(self) -> None:
        self.store, self.gone = dist.HashStore(), False

    def __getattr__(self, name: str):
        if self.gone:
            def fail(*args, **kwargs):
                raise RuntimeError("Connection reset by peer")
            return fail
        return getattr(self.store, name)


def test_a_store_that_stops_answering_names_rank_0_once_it_has_lasted_the_silence():
    """Its host, rank 0, is gone; at a run's end rank 0 may leave moments before a peer stops its watch: not at once."""
    store = GoneAfter()
    clock = Clock()
    phase = Phase(2)
    phase.name = "step 12"
    watch = PeerWatch(store, rank_env(2, 4), phase, 10.0, end=lambda failure: None, clock=clock)  # type: ignore[arg-type]
    assert watch.tick() is None
    store.gone = True
    clock.now = 1.0
    assert watch.tick() is None  # failing since 1 s
    clock.now = 10.5
    assert watch.tick() is None
    clock.now = 11.0
    assert watch.tick() == (0, "the world's store, which it hosts, no longer answers")
    store.gone = False  # answering again (and rank 3, the watched one, beating): the count starts over
    store.add("dptrain/pulse/0/3", 1)
    assert watch.tick() is None
    store.gone = True
    clock.now = 20.0
    assert watch.tick() is None
    host = PeerWatch(store, rank_env(0, 4), phase, 10.0, end=lambda failure: None, clock=clock)  # type: ignore[arg-type]
    for clock.now in (100.0, 200.0):
        assert host.tick() is None  # rank 0 hosts the store itself: a failure there names nobody


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dead", ["the watched rank", "the store's host"])
def test_the_watch_thread_ends_the_rank_naming_the_lost_peer(dead):
    """The thread as a worker runs it, on the real clock, with a short silence; `end` records what the rank would say."""
    store = GoneAfter()
    ended: list[WorkerFailure] = []
    done = threading.Event()

    def end(failure: WorkerFailure) -> None:
        ended.append(failure)
        done.set()

    phase = Phase(2)
    phase.name = "step 12"
    env = rank_env(2, 4)
    for rank in range(4):  # every rank's first pulse; ranks 0, 1, 3 then go silent (or the store goes away)
        store.add(f"dptrain/pulse/0/{rank}", 1)
    watch = PeerWatch(store, env, phase, 0.3, end=end)  # type: ignore[arg-type] - a stand-in store
    if dead == "the store's host":
        watch.start()
        store.gone = True
        expected = "rank 0 did not answer (dead or stuck): the world's store, which it hosts, no longer answers"
    else:
        watch.start()
        expected = "rank 3 did not answer (dead or stuck): no heartbeat from it on the world's store for 0.3 s"
    assert done.wait(20), "the watch never ended the rank"
    assert [str(f) for f in ended] == [f"rank 2 failed during step 12: {expected}"]
    watch.stop(finished=True)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_blocked_outside_python_is_ended_with_the_sentence_and_exit_code_1(tmp_path):
    """A process whose main thread never returns (as a host blocked in a CUDA sync behind an nccl collective) and whose
    peer, rank 1, never beats: its watch writes the launcher's error file and ends it with exit code 1."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = textwrap.dedent(f"""
        import time
        from dptrain.distributed.env import DistEnv
        from dptrain.distributed.failures import PeerWatch, Phase, own_client
        env = DistEnv(0, 0, 2, 2, "127.0.0.1", {server.port}, "torchrun")
        phase = Phase(0)
        with phase("step 3"):
            PeerWatch(own_client(env, 5), env, phase, 0.5).start()
            time.sleep(50)
    """)
    error_file = tmp_path / "error.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TORCHELASTIC_ERROR_FILE": str(error_file)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=55, cwd=REPO, env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.endswith("rank 0 failed during step 3: rank 1 did not answer (dead or stuck): no heartbeat from it on "
                            "the world's store for 0.5 s"), message


# Finding 6: a user Dataset's indices went to the GPU by torch.tensor(list, device=cuda), a copy that waits for it.

class Recorder(TorchDispatchMode):
    """Every copy to another device that the dispatcher sees: (the source, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, bool]] = []
        self.made_from_python = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and out.device != args[0].device:
            self.copies.append((args[0].clone(), bool(kwargs.get("non_blocking"))))
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.made_from_python += 1  # a tensor made from Python data: on CUDA, a copy from host memory
        return out


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 2, 2), float(i)), 1000 + i  # labels unlike any index


def test_a_batchs_indices_reach_the_device_by_a_copy_that_does_not_wait():
    """On the meta device (standing in for CUDA, where the old torch.tensor(indices, device=...) made no copy that a
    dispatch mode sees): each batch's indices leave host memory by a non-blocking copy."""
    loader = DatasetLoader(Samples(), torch.device("meta"), global_batch=4, rank=0, world_size=1, seed=3, shuffle=True,
                           num_workers=0)
    expected = [indices for indices in loader.sampler]
    with Recorder() as recorder:
        batches = list(loader.epoch_batches(0))
    assert len(batches) == len(expected) == 3 and all(b.indices.device.type == "meta" for b in batches)
    index_copies = [(src.tolist(), blocking) for src, blocking in recorder.copies if src.dtype == torch.long]
    for indices in expected:
        assert (indices, True) in index_copies


def test_indices_on_the_cpu_are_the_indices():
    assert torch.equal(indices_on([4, 1, 7], torch.device("cpu")), torch.tensor([4, 1, 7]))


# Finding 10: evaluation made a tensor of each batch's sample count on the device: a host-to-device copy per batch.

class Batches:
    """A loader of fixed batches, made before the recording starts."""

    def __init__(self, count: int) -> None:
        gen = torch.Generator().manual_seed(count)
        self.batches = [Batch(torch.randn(3, 4, generator=gen), torch.tensor([0, 1, 1]), 3 * count, torch.arange(3))
                        for _ in range(count)]

    def __len__(self) -> int:
        return len(self.batches)

    def epoch_batches(self, epoch: int, start_batch: int = 0):
        return iter(self.batches)


def made_from_python_in_evaluation(batches: int) -> tuple[int, dict]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = Batches(batches)
    with Recorder() as recorder:
        result = evaluate(model, loader, lambda: torch.autocast("cpu", enabled=False), lambda t: t)
    return recorder.made_from_python, result


def test_evaluation_makes_no_tensor_from_host_data_per_batch():
    few, result_few = made_from_python_in_evaluation(2)
    many, result_many = made_from_python_in_evaluation(6)
    assert few == many
    assert (result_few["eval_count"], result_many["eval_count"]) == (6, 18)
    assert 0 <= result_many["eval_acc"] <= 1 and result_many["eval_loss"] > 0


# Finding 9: CUDA_VISIBLE_DEVICES=0 and 2 nccl workers all took cuda:0, and NCCL refused them once started.

@pytest.mark.parametrize("backend", ["auto", "nccl"])  # auto is nccl on GPUs
def test_more_nccl_workers_than_visible_gpus_are_refused(monkeypatch, backend):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as error:
        check_gpus_for_workers(backend, 2, 1)
    assert str(error.value) == ("2 workers on this node would share the 1 GPU (CUDA_VISIBLE_DEVICES=0) it shows, and "
                                "nccl needs a GPU of its own for each; start at most 1 (--nproc-per-node 1), make more "
                                "GPUs visible, or use --launch.backend gloo.")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match=r"^3 workers on this node would share the 2 GPUs it shows, "):
        check_gpus_for_workers(backend, 3, 2)


def test_as_many_nccl_workers_as_gpus_or_gloo_ranks_sharing_one_run():
    check_gpus_for_workers("nccl", 2, 2)
    check_gpus_for_workers("auto", 1, 8)
    check_gpus_for_workers("gloo", 4, 1)  # gloo's ranks may share a GPU (the GPU check runs them so)


@pytest.fixture
def pretend_gpus(monkeypatch):
    """This process sees `count` CUDA GPUs (nothing of CUDA is touched before a worker would start)."""
    def pretend(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    return pretend


def test_the_refusal_comes_before_the_agent_starts_a_worker(monkeypatch, pretend_gpus):
    pretend_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    started = []
    monkeypatch.setattr(local, "launch_local", lambda *args, **kwargs: started.append(args))
    cfg = config.load(None, [("launch.nproc_per_node", "2")])
    with pytest.raises(ConfigError, match=r"^2 workers on this node would share the 1 GPU \(CUDA_VISIBLE_DEVICES=0\)"):
        local.run_ranks(print, (), cfg, 2, launched_outside=False)
    assert started == []
    local.run_ranks(print, (), config.load(None, [("launch.nproc_per_node", "2"), ("launch.backend", "gloo")]), 2, False)
    assert len(started) == 1  # gloo's ranks share the GPU


SYNTHETIC = ["--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64"]


@pytest.mark.parametrize("args, sentence", [
    (["--nproc-per-node", "2"], "dptrain: error: 2 workers on this node would share the 1 GPU (CUDA_VISIBLE_DEVICES=0) it"),
    (["--nproc-per-node", "2", "--launch.backend", "gloo", "--strategy.ddp.comm_hook", "ring"],
     "dptrain: error: strategy ddp with comm_hook ring cannot run on GPUs with launch.backend gloo, "),
    (["--nproc-per-node", "2", "--launch.backend", "gloo", "--strategy.name", "ps"],
     "dptrain: error: strategy ps cannot run on GPUs with launch.backend gloo, "),
])
def test_dptrain_train_refuses_in_one_sentence_with_exit_code_2(monkeypatch, pretend_gpus, tmp_path, capsys, args,
                                                               sentence):
    pretend_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: pytest.fail("a worker would start"))
    assert cli.main(["train", *SYNTHETIC, "--output.dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(sentence) and err.count("\n") == 1, err


# Finding 2, through the CLI's own resolution of the world: auto with 4 GPUs.

@pytest.mark.parametrize("name, world", [("dp", 1), ("single", 1), ("ddp", 4), ("fsdp", 4)])
def test_the_world_of_auto_on_4_gpus(pretend_gpus, name, world):
    pretend_gpus(4)
    assert local.world_size_here(config.load(None, [("strategy.name", name)])) == (world, False)
