"""Snapshots: exact resume at the same world size, crash while saving, corrupt and mismatched snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain import snapshots
from dptrain.faults import CRASH_BEFORE_RENAME, CRASH_EXIT_CODE, SIGNAL_AT
from dptrain.stopping import EXIT_STOPPED
from tests.conftest import FLOAT64_ENV, log_tail, read_events
from tests.ranks import run_cli_on_ranks, run_on_ranks

pytestmark = pytest.mark.slow

# 200 samples in global batches of 32: 7 steps per epoch, 14 in all; dropout on (RNG state matters).
RUN = ["--nproc-per-node", "2", "--data.name", "synthetic", "--data.synthetic_train_size", "200",
       "--data.synthetic_test_size", "50", "--train.global_batch_size", "32", "--train.epochs", "2",
       "--checkpoint.every_steps", "5", "--checkpoint.keep_last", "3"]


def train_on_two_ranks(*args: str) -> str:
    """`dptrain train ARGS` (a run, or the resume of one) on 2 rank processes of the pool as under torchrun (see
    run_cli_on_ranks): what it added to rank 0's log, once it ended with exit code 0."""
    run_dir = Path(args[args.index("--output.dir") + 1])
    log = run_dir / "logs" / "rank0.log"
    before = log.stat().st_size if log.exists() else 0
    [code] = run_cli_on_ranks(2, [["train", *args]], str(run_dir.parent))
    with log.open("rb") as f:
        f.seek(before)
        added = f.read().decode()
    assert code == 0, added[-3000:]
    return added


def weights_equal(a, b) -> bool:
    wa, wb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


STRATEGIES = ("ddp", "fsdp", "zero1", "ps", "ddp-deferred")
# strategy -> its options; ddp-deferred: each step's update applied in the next forward (deferred_update.py), whose
# snapshots (at 5, at the epoch's end, at the stop) must each hold whole updates only (gloo's all-reduce: on one host
# the option gives way to the shared-memory sum)
OPTIONS = {**{s: ["--strategy.name", s] for s in STRATEGIES},
           "ddp-deferred": ["--strategy.name", "ddp", "--strategy.ddp.update_in_next_forward", "true",
                            "--strategy.ddp.shared_memory", "false"]}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """name -> (run folder, exit code) of every plain run of this module, all made on first use on 2 rank
    processes of the pool (see run_cli_on_ranks), two runs at a time: per strategy the uninterrupted 2-epoch run
    ("ref/<s>"), and a run stopped by train.max_steps 9, 2 batches into epoch 2, then run again to the end
    ("stopped/<s>", two runs: the second in a second wave, after the first wave's runs)."""
    root = tmp_path_factory.mktemp("batch")
    made: dict[str, tuple] = {}

    def get(name: str):
        if not made:
            first, second = {}, {}  # name -> argv; each wave's runs are independent of each other
            for s in STRATEGIES:
                first[f"ref/{s}"] = ["train", *RUN, *OPTIONS[s], "--output.dir", str(root / "ref" / s)]
                stopped = ["train", *RUN, *OPTIONS[s], "--output.dir", str(root / "stopped" / s)]
                first[f"stopped/{s}/first"], second[f"stopped/{s}"] = [*stopped, "--train.max_steps", "9"], stopped
            asynchronous = ["--strategy.name", "ddp", "--checkpoint.async_save", "true", "--checkpoint.keep_last", "5"]
            first["async"] = ["train", *RUN, *asynchronous, "--output.dir", str(root / "async"), "--train.max_steps", "9"]
            second["from5"] = ["train", *RUN, "--strategy.name", "ddp", "--output.dir", str(root / "from5"),
                               "--train.resume", str(root / "async" / "checkpoints" / "step-00000005")]
            # a periodic snapshot (every 5 steps, mid-epoch) of a run whose updates wait for the next forward
            second["from10/ddp-deferred"] = ["train", *RUN, *OPTIONS["ddp-deferred"], "--output.dir",
                                             str(root / "from10" / "ddp-deferred"), "--train.resume",
                                             str(root / "ref" / "ddp-deferred" / "checkpoints" / "step-00000010")]
            for wave in (first, second):
                for name_, code in zip(wave, run_cli_on_ranks(2, list(wave.values()), str(root), side_by_side=True)):
                    made[name_] = (root / name_.removesuffix("/first"), code)
        run_dir, code = made[name]
        assert code == 0, f"the run {name} failed: " + log_tail(run_dir)
        return run_dir

    return get


@pytest.fixture(scope="module")
def uninterrupted(batch):
    """strategy -> the run folder of the uninterrupted 2-epoch run."""
    return lambda strategy: batch(f"ref/{strategy}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_run_stopped_mid_epoch_resumes_bit_identical(batch, uninterrupted, strategy):
    reference = uninterrupted(strategy)
    batch(f"stopped/{strategy}/first")  # stopped 2 batches into epoch 2
    run_dir = batch(f"stopped/{strategy}")
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "resumed from" in log and "step-00000009 at step 9 (epoch 2, 2 batches into it)" in log
    assert weights_equal(run_dir, reference)
    # Snapshots at 5, 7 (epoch end), 9 (the stop), then 10 and 14 (the end): keep_last 3 keeps the newest three.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [f"step-{s:08d}" for s in (9, 10, 14)]
    # The resumed epoch's metrics cover all of its samples, as if never stopped.
    assert read_events(run_dir, "epoch")[-1]["train_loss"] == read_events(reference, "epoch")[-1]["train_loss"]


def test_a_periodic_snapshot_of_updates_left_for_the_next_forward_holds_whole_steps(batch, uninterrupted):
    """strategy.ddp.update_in_next_forward: step 10's update is still owed when its snapshot is due mid-epoch; the
    snapshot must hold it applied (settled), or the run resumed from it never applies it."""
    run_dir = batch("from10/ddp-deferred")
    assert "step-00000010 at step 10 (epoch 2, 3 batches into it)" in (run_dir / "logs" / "rank0.log").read_text()
    assert weights_equal(run_dir, uninterrupted("ddp-deferred"))


def test_asynchronous_snapshots_are_whole_and_resume_bit_identical(batch, uninterrupted, capsys):
    from dptrain.cli import main

    run_dir = batch("async")
    assert main(["checkpoint", "list", str(run_dir)]) == 0
    listing = capsys.readouterr().out
    for step in (5, 7, 9):  # every 5 steps, the epoch's end, the stop: each committed whole
        assert f"step-{step:08d}{'  (latest)' if step == 9 else ''}: ok: step {step}" in listing
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    # Step 5's snapshot was written in the background while steps 6 and 7 ran: it must hold step 5.
    other = batch("from5")
    assert "step-00000005 at step 5" in (other / "logs" / "rank0.log").read_text()
    assert weights_equal(other, uninterrupted("ddp"))


def test_a_crash_between_shards_and_rename_leaves_the_previous_snapshot(cli, tmp_path, uninterrupted, capsys):
    """The crash goes through the launcher (which names the exit code); the listing runs in this process, the
    resume on the pool's rank processes."""
    from dptrain.cli import main

    strategy, reference = "ddp", uninterrupted("ddp")  # the file-level protocol does not depend on the strategy
    run_dir = tmp_path / "crash"
    args = [*RUN, "--strategy.name", strategy, "--output.dir", str(run_dir)]
    crashed = cli("train", *args, env={CRASH_BEFORE_RENAME: "step-00000010"})
    assert crashed.returncode != 0 and f"exited with code {CRASH_EXIT_CODE}" in crashed.stderr
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / ".tmp-step-00000010").is_dir()  # the shards were written, never renamed
    assert (checkpoints / "latest").read_text().strip() == "step-00000007"
    assert main(["checkpoint", "list", str(run_dir)]) == 0
    listing = capsys.readouterr().out
    assert "step-00000007  (latest): ok: step 7" in listing and "step-00000010" not in listing
    assert "step-00000007 at step 7" in train_on_two_ranks(*args)
    assert weights_equal(run_dir, reference)


def test_corrupt_and_mismatched_snapshots_are_one_sentence_and_lose_nothing(tmp_path, capsys):
    """The run and its resume run on the pool's 2 rank processes (as under torchrun); the refusals in this process
    (the refusals made in a worker with one worker, a resume at another world size, which checks the options first)."""
    from dptrain.cli import main

    def refused(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().err.strip()

    strategy = "ddp"
    run_dir = tmp_path / "bad"
    args = [*RUN, "--strategy.name", strategy, "--output.dir", str(run_dir)]
    train_on_two_ranks(*args, "--train.max_steps", "12")  # snapshots at 5, 7, 10, 12
    newest = run_dir / "checkpoints" / "step-00000012"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert refused("checkpoint", "verify", str(newest)) == (
        2, f"dptrain: error: snapshot {newest} has a damaged {shard.name} (size or sha256 differs from the manifest).")
    resumed = train_on_two_ranks(*args)
    assert f"skipping snapshot {newest} has a damaged {shard.name}" in resumed
    assert "step-00000010 at step 10" in resumed
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    saved_config = (run_dir / "config.toml").read_text()
    how_to = "use the snapshot's setting, or another --output.dir to start afresh."  # the folder was given
    one_worker = [*args, "--nproc-per-node", "1"]
    code, err = refused("train", *one_worker, "--model.name", "tests.user_code:TinyNet")
    assert code == 1 and len(err.splitlines()) == 1
    assert err.startswith("dptrain: error: rank ") and " failed during resume: snapshot " in err
    assert err.endswith(f"was written with model mnist-cnn but this run has tests.user_code:TinyNet; {how_to}")
    code, err = refused("train", *one_worker, "--optim.lr", "0.01")
    assert code == 1 and err.endswith(f"was written with optim.lr = 0.001 but this run has 0.01; {how_to}")
    assert refused("train", *args, "--train.resume", "never") == (  # refused before any worker starts
        2, f"dptrain: error: {run_dir} holds snapshots of an earlier run and train.resume is never; "
           f"choose another --output.dir, or delete {run_dir / 'checkpoints'} to start afresh there.")
    assert refused("train", *args, "--train.resume", str(tmp_path / "nowhere")) == (
        2, f"dptrain: error: snapshot {tmp_path / 'nowhere'} does not exist; give a snapshot folder that dptrain "
           f"checkpoint list shows as ok.")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing deleted
    assert (run_dir / "config.toml").read_text() == saved_config  # nor overwritten by the refused runs


# Resharding: fp32, no dropout, SGD; 200 samples in global batches of 24 (divisible by 2, 3 and 4):
# 9 steps per epoch, 18 in all; the uninterrupted run also leaves a snapshot at step 11, mid-epoch 2.
RESHARD = ["--data.name", "synthetic", "--data.synthetic_train_size", "200", "--data.synthetic_test_size", "50",
           "--model.dropout", "false", "--train.global_batch_size", "24", "--train.epochs", "2", "--train.log_every", "1",
           "--optim.name", "sgd", "--optim.lr", "0.01", "--train.channels_last", "false", "--checkpoint.every_steps", "11"]


def step_losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir, "step")}


# The default run keeps a world that grows (2 to 3) for each of DCP's two kinds of state (whole tensors, shards); the
# nightly tier adds the worlds that shrink (4 ranks to 2) and the other strategies.
RESHARDS = [pytest.param("ddp", 4, 2, marks=pytest.mark.nightly), ("ddp", 2, 3),
            pytest.param("fsdp", 4, 2, marks=pytest.mark.nightly), ("fsdp", 2, 3),
            pytest.param("zero1", 4, 2, marks=pytest.mark.nightly), pytest.param("ps", 2, 3, marks=pytest.mark.nightly)]


def runs_by_world(runs: dict[str, tuple[int, list[str]]], root) -> dict[str, int]:
    """name -> (world size, options): each world size's runs on the pool's rank processes, into root/name (the runs
    are independent of each other: side by side, see run_cli_on_ranks).

    Returns each run's exit code: a run that fails fails its own test, not its neighbours'.
    """
    codes = {}
    for world in sorted({w for w, _ in runs.values()}):
        names = [n for n, (w, _) in runs.items() if w == world]
        argvs = [["train", *runs[n][1], "--output.dir", str(root / n)] for n in names]
        codes.update(zip(names, run_cli_on_ranks(world, argvs, str(root), side_by_side=True)))
    return codes


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, request):
    """The uninterrupted runs at the first world size, then each resumed from its step 11 at the second: for the
    cases of RESHARDS this session selected."""
    root = tmp_path_factory.mktemp("reshard")
    cases = {tuple(item.callspec.params[k] for k in ("strategy", "before", "after")) for item in request.session.items
             if getattr(item, "originalname", None) == "test_a_snapshot_resumes_at_another_world_size"}
    codes = runs_by_world({f"{s}-{b}": (b, [*RESHARD, "--strategy.name", s]) for s, b, _ in cases}, root)
    codes |= runs_by_world({f"{s}-{b}-{a}": (a, [*RESHARD, "--strategy.name", s, "--train.resume",
                                                 str(root / f"{s}-{b}" / "checkpoints" / "step-00000011")])
                            for s, b, a in cases}, root)
    return root, codes


@pytest.mark.parametrize(("strategy", "before", "after"), RESHARDS)
def test_a_snapshot_resumes_at_another_world_size(resharded, strategy, before, after):
    root, codes = resharded
    reference, resumed_dir = root / f"{strategy}-{before}", root / f"{strategy}-{before}-{after}"
    for run_dir in (reference, resumed_dir):
        assert codes[run_dir.name] == 0, f"{run_dir.name} failed: " + log_tail(run_dir)
    snapshot = reference / "checkpoints" / "step-00000011"
    assert f"resharding snapshot {snapshot} from world size {before} to {after}" in (resumed_dir / "logs" / "rank0.log").read_text()
    expected, got = step_losses(reference), step_losses(resumed_dir)
    assert sorted(got) == list(range(12, 19))  # the same global batches, from the same position on
    # Another world size sums each loss and gradient in another order: fp32 rounding only (u = 2^-24). A loss sums
    # 24 positive terms (23u per side) and SGD on NCHW carries each step's rounding forward without amplifying it
    # (at most 3u per step measured; see test_train_distributed.py), over 18 steps: (2 * 23 + 18 * 3) u = 6e-6 < 1e-5.
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # Epoch 2's metrics add the partial sums written by the old ranks to the new ranks' own.
    last, last_ref = read_events(resumed_dir, "epoch")[-1], read_events(reference, "epoch")[-1]
    assert last["train_samples"] == last_ref["train_samples"] == 200
    assert last["train_loss"] == pytest.approx(last_ref["train_loss"], rel=1e-5)
    assert last["eval_loss"] == pytest.approx(last_ref["eval_loss"], rel=1e-5)


# kill -9 of rank 1 right after a step. ddp, killed after step 12 (mid-epoch 2: resumes from 10); in the nightly tier
# one run killed three times: after step 3 (before any snapshot: the restart begins afresh), 7 (the epoch's last step,
# before the epoch-end snapshot: resumes from step 5) and 12. fsdp (nightly) after step 9 (resumes from the
# epoch-end snapshot of step 7). After each kill the survivor's failed collective waits for the dead rank
# in the roll call (min(5 s, launch.timeout_s / 4)) before the agent restarts the group: launch.timeout_s 10
# keeps that wait short and still bounds the rendezvous and every collective of these short runs.
@pytest.mark.parametrize(("strategy", "steps"), [("ddp", (12,)), pytest.param("ddp", (3, 7, 12), marks=pytest.mark.nightly),
                                                 pytest.param("fsdp", (9,), marks=pytest.mark.nightly)])
def test_a_worker_killed_by_sigkill_is_restarted_and_ends_bit_identical(cli, tmp_path, uninterrupted, strategy, steps):
    run_dir = tmp_path / "killed"
    markers = [tmp_path / f"killed-after-{step}" for step in steps]
    kills = ",".join(f"1:{step}:SIGKILL:self:{marker}" for step, marker in zip(steps, markers))
    result = cli("train", *RUN, "--strategy.name", strategy, "--output.dir", str(run_dir),
                 "--launch.max_restarts", str(len(steps)), "--launch.timeout_s", "10", env={SIGNAL_AT: kills}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(marker.exists() for marker in markers)  # every kill happened
    assert len(read_events(run_dir, "run_start")) == 1 + len(steps)  # the first start and a restart per kill
    # Snapshots come every 5 steps and at epoch ends (step 7); each kill comes before its step's own.
    resumed_from = [max((s for s in (5, 7, 10) if s < step), default=0) for step in steps]
    expected = [f"step-{s:08d} at step {s}" for s in resumed_from if s]  # a kill before any snapshot starts afresh
    resumes = [line for line in result.stdout.splitlines() if "resumed from" in line]
    assert len(resumes) == len(expected) and all(e in line for e, line in zip(expected, resumes)), resumes
    assert weights_equal(run_dir, uninterrupted(strategy))


def test_sigterm_to_the_launcher_saves_at_the_next_step_and_exits_with_the_documented_code(cli, tmp_path, uninterrupted):
    run_dir = tmp_path / "preempted"
    args = [*RUN, "--strategy.name", "ddp", "--output.dir", str(run_dir), "--checkpoint.every_steps", "0"]
    stopped = cli("train", *args, env={SIGNAL_AT: "0:3:SIGTERM:parent"})  # as SLURM or a scheduler would
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    assert "stopped by SIGTERM" in stopped.stderr
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved_at = int(latest.removeprefix("step-"))
    assert 3 <= saved_at <= 5 and saved_at < 7  # the next step boundary or the one after, mid-epoch 1
    assert read_events(run_dir, "stopped")[0]["step"] == saved_at
    assert not (run_dir / "model.pt").exists()
    assert f"at step {saved_at}" in train_on_two_ranks(*args)  # the resume, on the pool's rank processes
    assert weights_equal(run_dir, uninterrupted("ddp"))


def test_sigusr1_to_one_worker_stops_every_rank_at_the_same_step(cli, tmp_path, uninterrupted):
    run_dir = tmp_path / "usr1"
    args = [*RUN, "--strategy.name", "ddp", "--output.dir", str(run_dir), "--checkpoint.every_steps", "0"]
    stopped = cli("train", *args, env={SIGNAL_AT: "1:6:SIGUSR1:self"})  # rank 1 only, as a stray signal would
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    # Rank 1 learns of it after step 6, rank 0 from the exchange read at step 7: both stop after step 7,
    # the epoch's last step, before the epoch's evaluation.
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000007"
    assert "stopped by SIGUSR1 after step 7" in (run_dir / "logs" / "rank1.log").read_text() + stopped.stderr
    assert read_events(run_dir, "epoch") == []
    train_on_two_ranks(*args)  # the resume, on the pool's rank processes
    assert weights_equal(run_dir, uninterrupted("ddp"))
    # The resume owes epoch 1 its event, once, with the same numbers as the run never stopped.
    got, expected = read_events(run_dir, "epoch"), read_events(uninterrupted("ddp"), "epoch")
    assert [e["epoch"] for e in got] == [1, 2]
    for key in ("train_loss", "train_acc", "train_samples", "eval_loss", "eval_count"):
        assert [e[key] for e in got] == [e[key] for e in expected], key


def _snapshot_into_the_folder_of(rank: int, world_size: int, folders: list[str], output_dirs: list[str]) -> list[str]:
    """Rank `rank` starts a Snapshotter with --output.dir output_dirs[rank], in folders[rank] as its working folder,
    then saves a snapshot of step 5: what each of the two said."""
    import os

    from dptrain.distributed.env import DistEnv
    from tests.test_snapshot_rules import save_at, snapshotter

    os.chdir(folders[rank])  # the pool puts it back after the job
    env = DistEnv(rank, rank, world_size, world_size, "127.0.0.1", 0, "torchrun")
    saver = snapshotter(Path(output_dirs[rank]), env=env)
    said = []
    for step in (saver.start, lambda: save_at(saver, 5)):
        try:
            step()
            said.append("done")
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank said
            said.append(str(exc))
    return said


@pytest.mark.timeout(60)
def test_a_run_folder_that_every_node_does_not_share_is_one_sentence_on_every_rank(tmp_path):
    """Nodes that each have a folder of their own at the run's path (a relative --output.dir, from working folders of
    their own, plays it on one machine): rank 1 failed at the first snapshot, after every step before it, with torch's
    'Parent directory ... does not exist' and a traceback, while rank 0 waited for it in DCP's collectives."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    folders = [str(node0), str(node1)]

    def unseen(folder: Path) -> str:
        return (f"snapshots need one folder that every node shares: rank 1 does not see {folder}, which rank 0 made; "
                f"put --output.dir on a file system that every node mounts.")

    def elsewhere(folder: str) -> str:
        return (f"snapshots need one folder that every node shares, but rank 1 writes into {node1 / 'run' / folder} and "
                f"rank 0 into {node0 / 'run' / folder}; give every node the same --output.dir, on a file system that all "
                f"of them mount.")

    # Found as the run starts (before its first step), and again at a snapshot (it was found there only).
    probe, tmp = Path("checkpoints") / ".seen-by-every-rank", Path("checkpoints") / ".tmp-step-00000005"
    said = run_on_ranks(_snapshot_into_the_folder_of, 2, folders, ["run", "run"], timeout=30)
    assert said == [[unseen("run" / probe), unseen("run" / tmp)]] * 2
    assert sorted(p.name for p in (node0 / "run" / "checkpoints").iterdir()) == []  # rank 0 took its folders away
    # A folder at another path on each node (--output.dir /scratch/$HOSTNAME/run): each rank would write its shards there.
    said = run_on_ranks(_snapshot_into_the_folder_of, 2, folders, [str(node0 / "run"), str(node1 / "run")], timeout=30)
    assert said == [[elsewhere(probe), elsewhere(tmp)]] * 2
    # One path that every rank sees: one snapshot, whole.
    said = run_on_ranks(_snapshot_into_the_folder_of, 2, folders, [str(node0 / "run")] * 2, timeout=30)
    assert said == [["done", "done"]] * 2
    assert snapshots.verify(node0 / "run" / "checkpoints" / "step-00000005")["world_size"] == 2


# Every comm hook, in float64 (the hooks' own math aside: fp16 and bf16 round to their format and back), killed by
# SIGKILL: 200 samples in global batches of 24 (divisible by 2 and 3), 9 steps per epoch, 18 in all, snapshots at 5, 9
# (the epoch's end), 10 and 15; rank 1 killed after step 12, so the restart resumes from step 10, mid-epoch 2. PowerSGD
# has compressed since step 3 by then: its error feedback and factors are the snapshot's (strategies/powersgd.py), and
# its first step after the restart runs in DDP's first layout of the buckets (one here), its second in the rebuilt one.
HOOKED_RUN = ["--data.name", "synthetic", "--data.synthetic_train_size", "200", "--data.synthetic_test_size", "50",
              "--train.global_batch_size", "24", "--train.epochs", "2", "--model.dropout", "false",
              "--checkpoint.every_steps", "5", "--checkpoint.keep_last", "5", "--train.log_every", "1",
              "--strategy.name", "ddp"]
HOOKS = {"allreduce": ["--strategy.ddp.comm_hook", "allreduce", "--strategy.ddp.shared_memory", "false"],  # gloo's
         **{hook: ["--strategy.ddp.comm_hook", hook] for hook in ("fp16", "bf16", "powersgd", "ring")},
         "powersgd-deferred": ["--strategy.ddp.comm_hook", "powersgd", "--strategy.ddp.update_in_next_forward", "true"]}


# Every hook is killed in the nightly tier. The default run kills DDP's all-reduce (the ddp case above) and resumes
# PowerSGD's snapshot, which holds its state, on 3 ranks (test_powersgd_resumes_on_another_world_size_...).
NIGHTLY_KILLS = ("allreduce", "fp16", "bf16", "ring", "powersgd", "powersgd-deferred")
KILLED_HOOKS = [pytest.param(hook, marks=pytest.mark.nightly) if hook in NIGHTLY_KILLS else hook for hook in HOOKS]


@pytest.fixture(scope="module")
def hooked(tmp_path_factory, request):
    """hook -> the run folder of its uninterrupted run, made side by side on 2 float64 rank processes of the pool
    for PowerSGD and the hooks this session kills; "powersgd-on-3": PowerSGD's run resumed from its step 10 on 3."""
    root = tmp_path_factory.mktemp("hooked")
    killed = {item.callspec.params["hook"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_a_run_killed_by_sigkill_resumes_bit_identical_with_every_comm_hook"}
    hooks = [hook for hook in HOOKS if hook in killed or hook == "powersgd"]
    codes = dict(zip(hooks, run_cli_on_ranks(2, [["train", *HOOKED_RUN, *HOOKS[hook], "--output.dir", str(root / hook)]
                                                 for hook in hooks], str(root), env=FLOAT64_ENV, side_by_side=True)))
    on_3 = ["train", *HOOKED_RUN, *HOOKS["powersgd"], "--output.dir", str(root / "powersgd-on-3"), "--train.resume",
            str(root / "powersgd" / "checkpoints" / "step-00000010")]
    if codes["powersgd"] == 0:
        [codes["powersgd-on-3"]] = run_cli_on_ranks(3, [on_3], str(root), env=FLOAT64_ENV)

    def get(name: str):
        assert codes.get(name) == 0, f"the run {name} failed: " + log_tail(root / name)
        return root / name

    return get


@pytest.mark.parametrize("hook", KILLED_HOOKS)
def test_a_run_killed_by_sigkill_resumes_bit_identical_with_every_comm_hook(cli, tmp_path, hooked, hook):
    run_dir, marker = tmp_path / "killed", tmp_path / "killed-after-12"
    result = cli("train", "--nproc-per-node", "2", *HOOKED_RUN, *HOOKS[hook], "--output.dir", str(run_dir),
                 "--launch.max_restarts", "1", "--launch.timeout_s", "10",
                 env={**FLOAT64_ENV, SIGNAL_AT: f"1:12:SIGKILL:self:{marker}"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.exists() and len(read_events(run_dir, "run_start")) == 2  # killed once, restarted once
    assert "resumed from" in result.stdout and "step-00000010 at step 10" in result.stdout
    reference = hooked(hook)
    assert torch.load(reference / "model.pt")["fc1.weight"].dtype == torch.float64  # the float64 mode took
    assert weights_equal(run_dir, reference)


def test_powersgd_resumes_on_another_world_size_from_the_mean_error_feedback(hooked):
    """2 -> 3 processes: each goes on from the mean of the 2 ranks' error feedback, which is what the steps after
    depend on; float64, so what is left is another order of sums (and PowerSGD's orthogonalisation of it)."""
    reference, resumed = hooked("powersgd"), hooked("powersgd-on-3")
    log = (resumed / "logs" / "rank0.log").read_text()
    assert "resharding snapshot" in log and "PowerSGD goes on from the mean of the error feedback of 2 processes" in log
    expected, got = step_losses(reference), step_losses(resumed)
    assert sorted(got) == list(range(11, 19))
    for step, loss in got.items():  # logged in float32 (train.py): 64 roundings of 2^-24 at most, as in float64 runs
        assert loss == pytest.approx(expected[step], rel=64 * 2.0**-24), step
    weights, reference_weights = torch.load(resumed / "model.pt"), torch.load(reference / "model.pt")
    diffs = {name: ((weights[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in reference_weights.items()}
    print("largest difference of the weights, relative to each tensor's largest:", max(diffs.values()))
    assert max(diffs.values()) <= 1e-10, diffs


def test_a_powersgd_snapshot_of_several_processes_is_refused_on_one_in_one_sentence(hooked, tmp_path, capsys):
    from dptrain.cli import main

    snapshot = hooked("powersgd") / "checkpoints" / "step-00000010"
    code = main(["train", "--nproc-per-node", "1", *HOOKED_RUN, *HOOKS["powersgd"], "--output.dir",
                 str(tmp_path / "one"), "--train.resume", str(snapshot)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.endswith(f"failed during resume: snapshot {snapshot} holds PowerSGD's error feedback of 2 processes, "
                        f"which one process cannot go on from (it sends no gradients, so it runs no hook); resume on 2 "
                        f"processes or more, or use another --output.dir to start afresh."), err


def test_a_powersgd_snapshot_written_before_its_state_was_kept_resumes_saying_so(hooked, tmp_path):
    """Such a snapshot lacks the part (its manifest names no powersgd files): not damaged, resumed as it was then."""
    import json
    import shutil

    old = tmp_path / "before" / "step-00000010"
    shutil.copytree(hooked("powersgd") / "checkpoints" / "step-00000010", old)
    manifest = json.loads((old / "manifest.json").read_text())
    for name in [n for n in manifest["files"] if n.startswith("powersgd-")]:
        (old / name).unlink()
        del manifest["files"][name]
    del manifest["parts"]["powersgd"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    run_dir = tmp_path / "resumed"
    [code] = run_cli_on_ranks(2, [["train", *HOOKED_RUN, *HOOKS["powersgd"], "--output.dir", str(run_dir),
                                   "--train.resume", str(old)]], str(tmp_path), env=FLOAT64_ENV)
    assert code == 0, log_tail(run_dir)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert (f"snapshot {old} was written before dptrain kept the powersgd state in snapshots: PowerSGD starts afresh "
            f"(two plain all-reduces, then new factors and no error feedback), so the run does not go on exactly as it "
            f"would have") in log
    assert f"resumed from {old} at step 10" in log
