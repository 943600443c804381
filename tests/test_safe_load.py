"""Attacks on a snapshot: a pickle planted in any file it holds never runs, with or without a re-hashed manifest.

Every attack is tried through both commands that load a snapshot, `dptrain train` (resume) and `dptrain eval`,
in this process. The planted pickle would create a marker file; the tests check that it never exists and that
the refusal is one sentence naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch

from dptrain import snapshots
from dptrain.cli import main
from dptrain.errors import SnapshotError

RUN = ["--data.name", "synthetic", "--data.synthetic_train_size", "128", "--data.synthetic_test_size", "32",
       "--train.global_batch_size", "32", "--train.epochs", "1", "--train.max_steps", "2"]


class Planted:
    """Unpickling calls os.system: what an attacker would put in a shared folder."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (os.system, (f"touch {self.marker}",))


def rehash(snapshot: Path) -> None:
    """What an attacker who can write the folder does: make the manifest agree with the planted files."""
    manifest = json.loads((snapshot / snapshots.MANIFEST).read_text())
    manifest["files"] = {str(p.relative_to(snapshot)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(snapshot.rglob("*")) if p.is_file() and p.name != snapshots.MANIFEST}
    (snapshot / snapshots.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """A real one-process snapshot per strategy kind: single (optimizer in DCP) and zero1 (optimizer.pt)."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for strategy in ("single", "zero1"):
        run_dir = root / strategy
        assert main(["train", *RUN, "--strategy.name", strategy, "--output.dir", str(run_dir)]) == 0
        out[strategy] = snapshots.find_latest(run_dir / "checkpoints")
    return out


def copy_run(snapshot: Path, tmp_path: Path) -> Path:
    """A copy of the snapshot's run folder (eval reads the run's config.toml beside its checkpoints)."""
    run_dir = tmp_path / "run"
    shutil.copytree(snapshot.parent.parent, run_dir)
    return run_dir / "checkpoints" / snapshot.name


def plant_pt(name: str):
    def plant(snapshot: Path, marker: Path) -> None:
        torch.save({"loop": Planted(marker), "rng": Planted(marker), "state": Planted(marker)}, snapshot / name)
    return plant


def plant_metadata(snapshot: Path, marker: Path) -> None:
    (snapshot / ".metadata").write_bytes(pickle.dumps(Planted(marker)))


def plant_dcp_entry(snapshot: Path, marker: Path) -> None:
    """A DCP shard whose non-tensor entry (the optimizer's learning rate) is the planted pickle."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = snapshot.parent / "whole.pt"
    dcp_to_torch_save(str(snapshot), str(whole))  # our own file, written by the fixture's run
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    state["optim"]["param_groups"][0]["lr"] = Planted(marker)
    for old in list(snapshot.glob("*.distcp")) + [snapshot / ".metadata"]:
        old.unlink()
    dcp.save(state, checkpoint_id=str(snapshot), no_dist=True)


ATTACKS = {  # (base snapshot, file, how to plant)
    "extra.pt": ("single", plant_pt("extra.pt")),
    "rank0.pt": ("single", plant_pt("rank0.pt")),
    "optimizer.pt": ("zero1", plant_pt("optimizer.pt")),
    ".metadata": ("single", plant_metadata),
    "a DCP entry": ("single", plant_dcp_entry),
}


@pytest.mark.slow
@pytest.mark.parametrize("rehashed", [True, False], ids=["manifest re-hashed", "manifest as written"])
@pytest.mark.parametrize("target", list(ATTACKS))
def test_a_planted_pickle_never_runs(written, tmp_path, capsys, target, rehashed):
    base, plant = ATTACKS[target]
    snapshot = copy_run(written[base], tmp_path)
    marker = tmp_path / "pwned"
    plant(snapshot, marker)
    if rehashed:
        rehash(snapshot)
    resumed = main(["train", *RUN, "--strategy.name", base, "--output.dir", str(tmp_path / "resumed"),
                    "--train.max_steps", "3", "--train.resume", str(snapshot)])
    resume_err = capsys.readouterr().err.strip().splitlines()
    evaluated = main(["eval", "--checkpoint", str(snapshot)])
    eval_err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists(), "the planted pickle ran"
    assert resumed != 0 and evaluated != 0
    for err in (resume_err, eval_err):
        assert len(err) == 1 and err[0].startswith("dptrain: error: "), err
        if rehashed:
            assert "could run code on load" in err[0] and "it is not read" in err[0], err
        else:
            assert "size or sha256 differs from the manifest" in err[0] or "which its manifest does not list" in err[0], err


def test_an_emptied_manifest_is_refused(written, tmp_path):
    snapshot = copy_run(written["single"], tmp_path)
    manifest = json.loads((snapshot / snapshots.MANIFEST).read_text())
    (snapshot / snapshots.MANIFEST).write_text(json.dumps({**manifest, "files": {}}))
    with pytest.raises(SnapshotError, match=r"lacks|does not list .metadata, which a resume reads|which its manifest does not list"):
        snapshots.verify(snapshot)


@pytest.mark.parametrize("gone", ["rank0.pt", ".metadata"])
def test_a_manifest_without_a_file_the_loader_reads_is_refused(written, tmp_path, gone):
    snapshot = copy_run(written["single"], tmp_path)
    (snapshot / gone).unlink()
    rehash(snapshot)
    with pytest.raises(SnapshotError, match=f"does not list {gone}, which a resume reads"):
        snapshots.verify(snapshot)


def test_a_file_the_manifest_does_not_list_is_refused(written, tmp_path):
    snapshot = copy_run(written["single"], tmp_path)
    (snapshot / "rank7.pt").write_bytes(b"")
    with pytest.raises(SnapshotError, match="holds rank7.pt, which its manifest does not list"):
        snapshots.verify(snapshot)


def test_the_manifests_step_must_agree_with_the_snapshots_state(written, tmp_path):
    """The folder is renamed along with the manifest, as one who moves a snapshot to another step would: only the loop
    state inside still says the true step (a folder left under its old name is refused earlier, by its name)."""
    snapshot = copy_run(written["single"], tmp_path)
    manifest = json.loads((snapshot / snapshots.MANIFEST).read_text())
    (snapshot / snapshots.MANIFEST).write_text(json.dumps({**manifest, "step": manifest["step"] + 1}))
    moved = snapshot.rename(snapshot.with_name(f"{snapshots.PREFIX}{manifest['step'] + 1:08d}"))
    with pytest.raises(SnapshotError, match=f"says step {manifest['step'] + 1} in its manifest but holds the state of step {manifest['step']}"):
        snapshots.verify(moved)


def test_the_folders_name_must_agree_with_the_manifests_step(written, tmp_path):
    """Manifest and loop state agree; only the folder's name, by which resume picks the newest snapshot, is another
    step."""
    snapshot = copy_run(written["single"], tmp_path)
    step = json.loads((snapshot / snapshots.MANIFEST).read_text())["step"]
    snapshots.verify(snapshot)  # whole under its own name
    moved = snapshot.rename(snapshot.with_name(f"{snapshots.PREFIX}{step + 1:08d}"))
    with pytest.raises(SnapshotError, match=f"is named for step {step + 1} but its manifest says step {step}; it was "
                                            f"renamed or is damaged"):
        snapshots.verify(moved)


def test_a_folder_others_may_write_to_is_refused(written, tmp_path):
    snapshot = copy_run(written["single"], tmp_path)
    extra = snapshot / "extra.pt"
    extra.chmod(extra.stat().st_mode | stat.S_IWGRP)
    with pytest.raises(SnapshotError, match=rf"holds {extra}, which others may write to \(mode -rw-rw-r--\); if you trust it, run 'chmod -R go-w"):
        snapshots.verify(snapshot)
    extra.chmod(0o644)
    snapshots.verify(snapshot)  # whole again


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_owned_by_someone_else_is_refused(written, tmp_path):
    snapshot = copy_run(written["single"], tmp_path)
    os.chown(snapshot / "rank0.pt", 65534, 65534)  # nobody
    with pytest.raises(SnapshotError, match=r"owned by user id 65534, not by you \(0\); a file written by someone else could run code"):
        snapshots.verify(snapshot)


def test_snapshots_are_written_without_group_write_even_under_umask_002(tmp_path):
    old = os.umask(0o002)
    try:
        assert main(["train", *RUN, "--strategy.name", "single", "--output.dir", str(tmp_path / "run")]) == 0
    finally:
        os.umask(old)
    snapshot = snapshots.find_latest(tmp_path / "run" / "checkpoints")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [snapshot, *snapshot.iterdir()]}
    assert all(not mode & 0o022 for mode in modes.values()), modes


def test_a_link_inside_a_snapshot_is_refused(written, tmp_path):
    """A link to /dev/zero listed with 0 bytes would make the sha256 check read forever."""
    snapshot = copy_run(written["single"], tmp_path)
    (snapshot / "zeros").symlink_to("/dev/zero")
    with pytest.raises(SnapshotError, match="holds .*zeros, which is a symbolic link, not a plain file"):
        snapshots.verify(snapshot)
