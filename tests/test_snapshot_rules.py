"""What a resume may change, what it refuses, damaged and unreadable snapshots, which ones pruning keeps: in this
process (snapshots of one process, through a stand-in strategy), no rank processes."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from dptrain import snapshots, config
from dptrain.snapshots import Snapshotter
from dptrain.snapshots.layout import sha256_of
from dptrain.snapshots.saving import _prune as prune
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError, SnapshotError
from dptrain.strategies.state import Shards
from dptrain.train_state import TrainState
from tests.conftest import read_events

# Snapshots of one process: DCP says it assumes one process, which is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def cfg(*pairs: tuple[str, str]) -> config.RunConfig:
    return config.load(None, [("data.name", "synthetic"), *pairs])


def manifest_of(run: config.RunConfig, total_steps: int = 100) -> dict:
    return {"model": run.model.name, "strategy": run.strategy.name, "config_hash": snapshots.config_hash(run),
            "config": snapshots.computation_options(run), "schedule_steps": total_steps}


def test_paths_run_length_logging_and_device_may_change_the_math_may_not():
    base = snapshots.config_hash(cfg())
    for key, value in (("data.root", "/elsewhere"), ("train.epochs", "9"), ("train.max_steps", "7"), ("train.log_every", "3"),
                       ("train.eval_batch_size", "17"), ("launch.device", "cpu"), ("launch.nproc_per_node", "4"),
                       ("checkpoint.every_steps", "10"), ("output.name", "other"), ("output.weights_dir", "saved"),
                       ("output.weights_file", "net.pth"), ("output.rank_epoch_lines", "true")):
        assert snapshots.config_hash(cfg((key, value))) == base, key
    for key, value in (("optim.lr", "0.5"), ("train.global_batch_size", "64"), ("train.seed", "3"), ("train.bf16", "true"),
                       ("model.dropout", "false"), ("strategy.ddp.comm_hook", "fp16"), ("data.synthetic_train_size", "99")):
        assert snapshots.config_hash(cfg((key, value))) != base, key


def test_a_refused_resume_names_the_option_and_both_values(tmp_path):
    saved = manifest_of(cfg())
    with pytest.raises(ConfigError) as refused:
        snapshots.check_compatible(saved, cfg(("optim.lr", "0.5"), ("train.seed", "3")), tmp_path, 100)
    assert str(refused.value) == (f"snapshot {tmp_path} was written with optim.lr = 0.001 but this run has 0.5 (and train.seed); "
                                  f"use the snapshot's setting, or another --output.name to start afresh.")


def test_a_refused_resume_of_a_folder_given_as_output_dir_advises_another_folder_not_another_name(tmp_path):
    """output.dir overrides output.name: "another --output.name" could not start afresh (a tutorial user's
    --model_dir was read as the run folder and got that advice)."""
    saved = manifest_of(cfg(("output.dir", str(tmp_path))))
    with pytest.raises(ConfigError) as refused:
        snapshots.check_compatible(saved, cfg(("output.dir", str(tmp_path)), ("optim.lr", "0.5")), tmp_path, 100)
    assert str(refused.value).endswith("use the snapshot's setting, or another --output.dir to start afresh.")
    with pytest.raises(ConfigError) as refused:
        snapshots.check_compatible(manifest_of(cfg(("optim.schedule", "cosine"), ("output.dir", str(tmp_path)))),
                                    cfg(("optim.schedule", "cosine"), ("output.dir", str(tmp_path))), tmp_path, 50)
    assert str(refused.value).endswith("keep train.epochs and train.max_steps as they were, or use another --output.dir "
                                       "to start afresh.")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step-00000004").write_text("")
    with pytest.raises(SnapshotError) as refused:
        snapshots.choose(cfg(("output.dir", str(tmp_path))), is_main=True, world_size=1)
    assert str(refused.value).endswith("or use another --output.dir to start afresh.")


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_a_schedule_planned_for_the_run_length_refuses_another_length(tmp_path, schedule):
    run = cfg(("optim.schedule", schedule))
    snapshots.check_compatible(manifest_of(run, 100), run, tmp_path, 100)  # the same length resumes
    with pytest.raises(ConfigError, match=f"follows a {schedule} learning-rate schedule planned for 100 steps, but this run would last 150"):
        snapshots.check_compatible(manifest_of(run, 100), run, tmp_path, 150)
    constant = cfg()
    snapshots.check_compatible(manifest_of(constant, 100), constant, tmp_path, 150)  # a constant rate may run longer


@pytest.mark.parametrize("manifest", ["{}", '{"files": []}', "[1, 2]", '{"world_size": 2, "strategy": "ddp"}', "not json",
                                      "[" * 200_000], ids=["{}", "no files", "a list", "a part", "not json", "nested"])
def test_a_damaged_manifest_is_one_sentence(tmp_path, manifest):
    snapshot = tmp_path / "step-00000003"
    snapshot.mkdir()
    (snapshot / snapshots.MANIFEST).write_text(manifest)
    with pytest.raises(SnapshotError) as damaged:
        snapshots.verify(snapshot)
    assert str(damaged.value) == f"snapshot {snapshot} has a damaged manifest.json."
    with pytest.raises(SnapshotError, match="no snapshot in .* can be used .*has a damaged manifest.json"):
        snapshots.find_latest(tmp_path)  # refused, not crashed on, and not taken as "no snapshot: start afresh"


def test_a_nested_manifest_in_the_newest_snapshot_is_skipped_by_every_command_and_the_run_resumes_before_it(
        tmp_path, capsys, monkeypatch):
    """200 KB of brackets in the newest manifest.json: eval, verify and list printed a RecursionError's traceback,
    and a resume failed with the raw message instead of taking the intact snapshot before it."""
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    run = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "128", "--data.synthetic_test_size", "32",
           "--train.global_batch_size", "64", "--checkpoint.every_epochs", "1", "--output.name", "r"]
    assert main([*run, "--train.epochs", "2"]) == 0
    newest, older = Path("runs/r/checkpoints/step-00000004"), Path("runs/r/checkpoints/step-00000002")
    (newest / snapshots.MANIFEST).write_text("[" * 200_000)
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(newest)]) == 2
    assert capsys.readouterr().err == f"dptrain: error: snapshot {newest} has a damaged manifest.json.\n"
    assert main(["checkpoint", "list", "runs/r"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{newest}  (latest): snapshot {newest} has a damaged manifest.json.",
        f"{older}: ok: step 2, world size 1, strategy ddp"]
    assert main(["eval", "--checkpoint", "runs/r"]) == 0
    assert main([*run, "--train.epochs", "3"]) == 0  # resumed from step 2, step 4 written again
    assert [e["step"] for e in read_events(Path("runs/r"), "run_start")] == [0, 2]
    snapshots.verify(newest)


def test_a_manifest_listing_a_file_that_is_gone_is_incomplete(tmp_path):
    (tmp_path / snapshots.MANIFEST).write_text(json.dumps(
        {"world_size": 1, "strategy": "single", "model": "mnist-cnn", "config_hash": "x", "step": 3,
         "files": {"extra.pt": {"bytes": 1, "sha256": "0"}}}))
    with pytest.raises(SnapshotError, match="lacks extra.pt: it is incomplete"):
        snapshots.verify(tmp_path)


def test_the_options_kept_in_a_manifest_compare_equal_after_the_json_round_trip(tmp_path):
    shape = ("data.synthetic_shape", "[3, 8, 8]")  # a tuple, which the manifest's JSON holds as a list
    saved = json.loads(json.dumps(manifest_of(cfg(shape))))
    with pytest.raises(ConfigError) as refused:
        snapshots.check_compatible(saved, cfg(shape, ("optim.lr", "0.5")), tmp_path, 100)
    assert "was written with optim.lr = 0.001 but this run has 0.5; " in str(refused.value)  # and nothing else


def test_the_one_rule_of_when_a_snapshot_is_due():
    """10 steps per epoch, 25 in the run: every_steps 4 saves mid-epoch at 4 and 8, at 12 and 16, and 20 lands on an
    epoch's end, so it waits for the evaluation; every_epochs 2 saves after epoch 2's evaluation; the run's last step
    is left to the end of fit()."""
    from dptrain.snapshots import Snapshotter
    from dptrain.train_state import TrainState

    run = cfg(("checkpoint.every_steps", "4"), ("checkpoint.every_epochs", "2"))
    saver = Snapshotter(run, None, None, None, None, None, total_steps=25, steps_per_epoch=10)
    in_step, after_eval = [], []
    state = TrainState()
    for step in range(1, 26):
        state.step, state.epoch, state.batches_consumed = step, (step - 1) // 10, (step - 1) % 10 + 1
        if saver.due(state, after_evaluation=False):
            in_step.append(step)
        if state.batches_consumed == 10 and saver.due(state, after_evaluation=True):
            after_eval.append(step)
    assert in_step == [4, 8, 12, 16, 24]
    assert after_eval == [20]  # epoch 1 ends at 10 (not a multiple of 4, epoch 1 not even); epoch 2 at 20


class OneTensorStrategy:
    """What a Snapshotter asks of a strategy, with one tensor for DCP to write: snapshots in a second, no model."""

    def __init__(self) -> None:
        self.weight = torch.arange(4.0)

    def state_parts(self, optimizer) -> list:
        return [Shards("model", lambda: {"model": {"weight": self.weight}}, lambda shards: None)]

    def settle(self) -> None:
        """No update is ever owed here (Strategy.settle: a snapshot first finishes one)."""


class ConstantScheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 0}


def snapshotter(run_dir: Path, keep_last: int = 2, env: DistEnv | None = None) -> Snapshotter:
    """A Snapshotter of a run in run_dir, as a fresh process (a run, or its resume) makes it: it has verified nothing."""
    run = cfg(("output.dir", str(run_dir)), ("checkpoint.keep_last", str(keep_last)))
    return Snapshotter(run, env or DistEnv.single(), torch.device("cpu"), OneTensorStrategy(), None, ConstantScheduler(),
                       total_steps=100, steps_per_epoch=10)


def save_at(snapshots: Snapshotter, step: int) -> Path:
    state = TrainState()
    state.step, state.batches_consumed = step, step % 10
    return snapshots.save(state, wait=True)


def damage(snapshot: Path) -> None:
    """Flip a byte of the loop state: the manifest is intact, the sha256 no longer agrees."""
    extra = snapshot / snapshots.EXTRA
    data = bytearray(extra.read_bytes())
    data[len(data) // 2] ^= 0xFF
    extra.write_bytes(bytes(data))


def said(caplog) -> list[str]:
    """dptrain's warnings (DCP logs too, at DEBUG; and an earlier test's CLI may have set dptrain's level to INFO)."""
    return [r.getMessage() for r in caplog.records if r.name == "dptrain" and r.levelno >= logging.WARNING]


def steps_kept(run_dir: Path) -> dict[int, str]:
    return {int(path.name.removeprefix("step-")): status.split(":")[0] if status.startswith("ok") else "damaged"
            for path, status in snapshots.list_snapshots(run_dir / "checkpoints")}


def resumed_from_2_past_a_damaged_4(tmp_path):
    """(snapshot 4, damaged after it was written; a Snapshotter resumed from snapshot 2, the whole one before it)."""
    save_at(snapshotter(tmp_path), 2)
    damaged = save_at(snapshotter(tmp_path), 4)
    damage(damaged)
    resumed = snapshotter(tmp_path)
    resumed.last_step = 2
    return damaged, resumed


def test_a_damaged_snapshot_does_not_take_the_place_of_a_whole_one(tmp_path, caplog):
    """keep_last 2, snapshots 2 and 4, then 4 damaged: a resume from 2 that saves 6 keeps 2 and 6, the two verified ones.
    (Pruning counted every snapshot with this run's manifest: it deleted 2 and kept the damaged 4, one to fall back on.)"""
    damaged, resumed = resumed_from_2_past_a_damaged_4(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dptrain"):
        save_at(resumed, 6)
    assert steps_kept(tmp_path) == {6: "ok", 2: "ok"}  # 4, damaged and older than a verified one, deleted
    assert said(caplog) == [f"deleted damaged snapshot step-00000004, older than a verified one; snapshot {damaged} has a "
                            f"damaged extra.pt (size or sha256 differs from the manifest)."]


def test_a_damaged_snapshot_at_a_step_the_run_saves_again_is_written_again(tmp_path, caplog):
    """A resume from 2 past a damaged 4 writes 4 again (it kept the damaged folder, as if whole, for ever)."""
    damaged, resumed = resumed_from_2_past_a_damaged_4(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dptrain"):
        assert save_at(resumed, 4) == damaged
    assert steps_kept(tmp_path) == {4: "ok", 2: "ok"}
    assert said(caplog) == [
        f"writing step-00000004 again, in place of the damaged one (snapshot {damaged} has a damaged extra.pt "
        f"(size or sha256 differs from the manifest))"]
    assert not list((tmp_path / "checkpoints").glob(".*-step-*"))  # neither the new folder's nor the old one's


def test_a_whole_snapshot_at_a_step_the_run_saves_again_is_kept(tmp_path):
    """A resume is bit-identical: a verified snapshot of a step the run reaches again is not written twice."""
    kept = save_at(snapshotter(tmp_path), 4)
    before = kept.stat().st_ino
    save_at(snapshotter(tmp_path), 4)
    assert kept.stat().st_ino == before


def test_pruning_keeps_the_newest_whole_snapshots_of_this_run_only(tmp_path, caplog):
    """Which folders pruning deletes, with verify() stood in for (damage: step -> what is wrong)."""
    def snapshot(step: int, config_hash: str | None = "ours") -> Path:
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir(mode=0o755)
        if config_hash is not None:
            (folder / snapshots.MANIFEST).write_text(json.dumps(
                {"world_size": 1, "strategy": "ddp", "model": "mnist-cnn", "config_hash": config_hash, "step": step, "files": {}}))
        return folder

    for step in (1, 2, 4, 5, 7, 9):
        snapshot(step)
    snapshot(3, config_hash=None)  # a crash left it without a manifest: damaged
    snapshot(6, config_hash="someone else's")  # another configuration's: left alone, whole or not
    snapshot(8).chmod(0o775)  # others may write to it: verify() refuses it, and pruning leaves it alone
    damaged = {9: "damaged 9", 5: "damaged 5", 3: "incomplete 3"}
    with caplog.at_level(logging.WARNING, logger="dptrain"):
        prune(tmp_path, keep_last=3, config_hash_="ours",
                          damage=lambda path: damaged.get(int(path.name.removeprefix("step-"))))
    # 9: newer than every whole one (the run may write it again); 7, 4 and 2: the three newest verified ones; 5 and 3:
    # damaged and older than a verified one; 1: past the three newest verified ones.
    assert sorted(int(p.name.removeprefix("step-")) for p in tmp_path.iterdir()) == [2, 4, 6, 7, 8, 9]
    assert said(caplog) == ["deleted 2 damaged snapshots, step-00000003 to step-00000005, older than a verified one; "
                            "the newest: damaged 5"]


@pytest.mark.slow
def test_thousands_of_damaged_snapshots_are_one_log_line(tmp_path, caplog):
    """3,000 damaged snapshots newer than the one whole one printed 3,000 lines when a resume looked for it."""
    root = tmp_path / "checkpoints"
    whole = save_at(snapshotter(tmp_path, keep_last=1), 1)
    for step in range(2, 3002):
        (root / f"step-{step:08d}").mkdir()  # no manifest: incomplete
    with caplog.at_level(logging.INFO, logger="dptrain"):
        assert snapshots.find_latest(root) == whole
    assert said(caplog) == [f"skipping 3000 damaged snapshots, step-00000002 to step-00003001; the newest: snapshot "
                            f"{root / 'step-00003001'} has no manifest.json: it is incomplete."]
    shutil.rmtree(whole)
    caplog.clear()
    with pytest.raises(SnapshotError) as refused:
        snapshots.find_latest(root)
    assert str(refused.value) == (f"no snapshot in {root} can be used (3000 damaged snapshots, step-00000002 to "
                                  f"step-00003001; the newest: snapshot {root / 'step-00003001'} has no manifest.json: it "
                                  f"is incomplete); repair or remove the damaged ones, or use another --output.name to "
                                  f"start afresh.")
    assert said(caplog) == []


def test_a_snapshot_that_does_not_exist_is_one_sentence_with_exit_code_2(tmp_path, capsys):
    from dptrain.cli import main

    missing = tmp_path / "nowhere"
    assert main(["checkpoint", "verify", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: snapshot {missing} does not exist; give a snapshot "
                                               f"folder that dptrain checkpoint list shows as ok.")


def test_a_manifest_over_1_mib_is_refused_unread(tmp_path):
    (tmp_path / snapshots.MANIFEST).write_text(json.dumps({"padding": "x" * (1 << 20)}))
    with pytest.raises(SnapshotError) as refused:
        snapshots.verify(tmp_path)
    assert str(refused.value) == (f"snapshot {tmp_path} has a manifest.json of more than 1 MiB, far more than any "
                                  f"manifest holds; it is damaged.")


def verify_as_a_user(snapshot: Path) -> str:
    """What verify(snapshot) says to a user whom file permissions apply to: root reads every file, so as root the
    check runs in a forked child as user nobody, on a snapshot that nobody owns (verify refuses another's)."""
    if os.geteuid() != 0:
        try:
            snapshots.verify(snapshot)
            return "ok"
        except SnapshotError as exc:
            return str(exc)
    try:
        nobody = pwd.getpwnam("nobody")
        uid, gid = nobody.pw_uid, nobody.pw_gid
    except KeyError:  # no such entry: the id it has by convention
        uid = gid = 65534
    for path in [snapshot, *snapshot.rglob("*")]:
        os.chown(path, uid, gid)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: leave only through os._exit, never back into pytest
        try:
            os.setgid(gid)
            os.setuid(uid)
            try:
                snapshots.verify(snapshot)
                said = "ok"
            except SnapshotError as exc:
                said = str(exc)
            except BaseException as exc:  # noqa: BLE001 - the parent's assertion shows it
                said = f"{type(exc).__name__}: {exc}"
            os.write(write_end, said.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as said:
        answer = said.read().decode()
    os.waitpid(child, 0)
    return answer


def test_a_snapshot_file_that_cannot_be_read_is_one_sentence():
    """It was a 23-line PermissionError traceback. A folder outside pytest's, which is root's alone (mode 700)."""
    folder = Path(tempfile.mkdtemp(prefix="dptrain-unreadable-"))
    try:
        folder.chmod(0o755)  # nobody may look inside
        snapshot = folder / "step-00000003"
        snapshot.mkdir(mode=0o755)
        extra = snapshot / snapshots.EXTRA
        extra.write_bytes(b"loop state")
        (snapshot / snapshots.MANIFEST).write_text(json.dumps(
            {"world_size": 1, "strategy": "ddp", "model": "mnist-cnn", "config_hash": "x", "step": 3,
             "files": {snapshots.EXTRA: {"bytes": extra.stat().st_size, "sha256": sha256_of(extra)}}}))
        extra.chmod(0)
        assert verify_as_a_user(snapshot) == (f"cannot read {extra} of snapshot {snapshot} (Permission denied); "
                                              f"make it readable for you, or use another snapshot.")
    finally:
        shutil.rmtree(folder)


def planted(root: Path, kind: str, elsewhere: Path) -> Path:
    """A checkpoints/step-00000005 entry that dptrain never writes: a dangling link, a link to a verified snapshot (of
    another run, in elsewhere) or a file."""
    root.mkdir(parents=True, exist_ok=True)
    entry = root / "step-00000005"
    if kind == "dangling link":
        entry.symlink_to("/nonexistent")
    elif kind == "link to a snapshot":
        entry.symlink_to(save_at(snapshotter(elsewhere), 5))
    else:
        entry.write_text("not a snapshot\n")
    return entry


WHAT = {"dangling link": "a symbolic link (to /nonexistent)", "link to a snapshot": "a symbolic link (to {})",
        "file": "a file"}


@pytest.mark.parametrize("kind", list(WHAT))
@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_step_entry_that_is_no_folder_is_refused_as_the_run_starts(tmp_path, kind, resume):
    """A dangling checkpoints/step-* link: the run trained to that step, then failed with a raw [Errno 20] at the
    snapshot's rename, once per restart. Now the run is refused before it trains, whatever train.resume says."""
    root = tmp_path / "run" / "checkpoints"
    save_at(snapshotter(tmp_path / "run"), 2)  # a verified snapshot older than the entry: auto would resume from it
    entry = planted(root, kind, tmp_path / "other")
    target = os.readlink(entry) if entry.is_symlink() else None
    sentence = (f"{entry} is {WHAT[kind].format(target)}, not a snapshot folder: dptrain writes each snapshot as a "
                f"folder of its own there; remove it (or put the snapshot itself in its place), or use another "
                f"--output.name to start afresh.")
    run = cfg(("output.dir", str(tmp_path / "run")), ("train.resume", resume))
    with pytest.raises(SnapshotError) as refused:
        snapshots.choose(run, is_main=True, world_size=1)
    # the run was given its folder: another name would not move it
    assert str(refused.value) == sentence.replace("another --output.name", "another --output.dir")
    with pytest.raises(SnapshotError, match="is a symbolic link|is a file"):
        snapshots.find_latest(root)  # eval --checkpoint RUN and train --dry-run look there
    assert dict(snapshots.list_snapshots(root))[entry] == sentence  # checkpoint list shows it with the others
    prune(root, keep_last=1, config_hash_=snapshots.config_hash(run), damage=lambda path: None)
    assert entry.is_symlink() or entry.is_file()  # never deleted, nor what it points to
    assert target is None or Path(target).exists() or kind == "dangling link"


def test_a_link_planted_while_the_run_trains_is_one_sentence_at_its_step(tmp_path):
    saver = snapshotter(tmp_path / "run")
    entry = planted(tmp_path / "run" / "checkpoints", "dangling link", tmp_path)
    with pytest.raises(SnapshotError) as refused:
        save_at(saver, 5)
    assert str(refused.value).startswith(f"{entry} is a symbolic link (to /nonexistent), not a snapshot folder")
    assert entry.is_symlink() and not list(entry.parent.glob(".*-step-*"))  # no temporary folder left behind


def test_a_run_with_a_dangling_step_link_is_refused_before_its_first_step(tmp_path, monkeypatch, capsys):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    entry = planted(tmp_path / "runs" / "x" / "checkpoints", "dangling link", tmp_path)
    code = main(["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size",
                 "16", "--train.global_batch_size", "16", "--train.epochs", "1", "--checkpoint.every_steps", "2",
                 "--output.name", "x"])
    err = capsys.readouterr().err
    assert code == 1
    [line] = [line for line in err.splitlines() if line.startswith("dptrain: error:")]
    assert line == (f"dptrain: error: rank 0 failed during resume: {entry.relative_to(tmp_path)} is a symbolic link (to "
                    f"/nonexistent), not a snapshot folder: dptrain writes each snapshot as a folder of its own there; "
                    f"remove it (or put the snapshot itself in its place), or use another --output.name to start afresh.")
    assert "Traceback" not in err and "Errno" not in err
    metrics = tmp_path / "runs" / "x" / "metrics.jsonl"
    assert not metrics.exists() or not read_events(metrics.parent, "step")  # refused before its first step
