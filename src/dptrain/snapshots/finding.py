"""Which snapshot: every step-<N> entry of a run's checkpoints folder, newest first, with what is wrong where it is not
a verified snapshot; the one a resume takes (train.resume: auto, a folder, never), and the one a command is given."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from dptrain.config import RunConfig
from dptrain.errors import SnapshotError
from dptrain.run_folder import RunFolder
from dptrain.snapshots.layout import MANIFEST, PREFIX, verify

log = logging.getLogger("dptrain")

AFRESH = "another --output.name"
"""How a refusal ends where it does not know the run's options (OutputConfig.elsewhere says it where it does)."""


def entries(root: Path, elsewhere: str = AFRESH) -> list[tuple[Path, str | None]]:
    """Every step-* entry under root, newest first, with None for a snapshot folder, else the sentence refusing it
    (not_a_snapshot_folder)."""
    return [(path, not_a_snapshot_folder(path, elsewhere)) for path in sorted(root.glob(f"{PREFIX}*"), reverse=True)]


def not_a_snapshot_folder(path: Path, elsewhere: str = AFRESH) -> str | None:
    """None where the step-* entry `path` is a folder, as every snapshot dptrain writes is (renamed into place), or is
    not there; else one sentence saying what it is instead and what to do. A symbolic link, dangling or not, is refused as such: the
    run would fail to write that step's snapshot in its place ([Errno 20], after training up to it), and what a link
    points to is not the run's own folder, whose owner and mode are what make a snapshot safe to load."""
    if path.is_symlink():
        target = os.readlink(path)
        what = f"a symbolic link (to {target if target.isprintable() else repr(target)})"
    elif path.is_dir() or not path.exists():
        return None
    else:
        what = "a file" if path.is_file() else "a device, a pipe or a socket"
    return (f"{path} is {what}, not a snapshot folder: dptrain writes each snapshot as a folder of its own there; "
            f"remove it (or put the snapshot itself in its place), or use {elsewhere} to start afresh.")


def snapshot_folders(root: Path, elsewhere: str = AFRESH) -> list[Path]:
    """The snapshot folders under root, newest first; SnapshotError in one sentence for a step-* entry that is not a
    folder (not_a_snapshot_folder), found before a run trains rather than when it reaches that step."""
    found = entries(root, elsewhere)
    for _, refusal in found:
        if refusal is not None:
            raise SnapshotError(refusal)
    return [path for path, _ in found]


def _snapshot_statuses(root: Path, elsewhere: str = AFRESH) -> Iterator[tuple[Path, str]]:
    """Each step-* entry under root, newest first, with 'ok' or what is wrong with it, verified as it is reached."""
    for path, refusal in entries(root, elsewhere):
        if refusal is not None:
            yield path, refusal
            continue
        try:
            manifest = verify(path)
            yield path, f"ok: step {manifest['step']}, world size {manifest['world_size']}, strategy {manifest['strategy']}"
        except SnapshotError as exc:
            yield path, str(exc)


def list_snapshots(root: Path) -> list[tuple[Path, str]]:
    """Every snapshot folder under root, newest first, with 'ok' or what is wrong with it."""
    return list(_snapshot_statuses(root))


def rerun_ending(root: Path, resumes: str) -> str:
    """How a failure's sentence ends, after 'run the same command': `resumes` where a snapshot under root verifies,
    else that the run starts again from step 0 (a sentence must not promise a resume from nothing)."""
    return resumes if newest_verified(root) is not None else " (no snapshot was written yet: it starts again from step 0)."


def newest_verified(root: Path) -> Path | None:
    """The newest snapshot under root that verifies, the one the same command resumes from; None if there is none.
    The older ones are not read (verifying reads every byte)."""
    return next((path for path, status in _snapshot_statuses(root) if status.startswith("ok")), None)


def find_latest(root: Path, elsewhere: str = AFRESH) -> Path | None:
    """The newest snapshot that verifies; the newer ones skipped are named in one log line however many they are.
    None if there are none; SnapshotError if there are snapshots and none verifies (a resume from step 0 would throw
    their work away), or where a step-* entry is not a folder (snapshot_folders). elsewhere: the option that starts
    afresh, which a refusal ends with (OutputConfig.elsewhere)."""
    snapshot_folders(root, elsewhere)
    skipped = []
    for path, status in _snapshot_statuses(root, elsewhere):
        if status.startswith("ok"):
            if len(skipped) == 1:
                log.warning("skipping %s", skipped[0][1])
            elif skipped:
                log.warning("skipping %s; %s", span(skipped), first_reason(skipped))
            return path
        skipped.append((path, status))
    if skipped:
        why = skipped[0][1] if len(skipped) == 1 else f"{span(skipped)}; {first_reason(skipped)}"
        raise SnapshotError(f"no snapshot in {root} can be used ({why.rstrip('.')}); repair or remove the damaged ones, "
                            f"or use {elsewhere} to start afresh.")
    return None


def span(rows: list[tuple[Path, str]]) -> str:
    """Damaged snapshots, rows of (folder, what is wrong) newest first, in a few words however many there are."""
    if len(rows) == 1:
        return f"damaged snapshot {rows[0][0].name}"
    return f"{len(rows)} damaged snapshots, {rows[-1][0].name} to {rows[0][0].name}"


def first_reason(rows: list[tuple[Path, str]]) -> str:
    return rows[0][1] if len(rows) == 1 else f"the newest: {rows[0][1]}"


def choose(cfg: RunConfig, is_main: bool, world_size: int) -> Path | None:
    """The snapshot train.resume names: auto (the newest valid one in the run folder), a folder, or never (None).
    Whatever it names, the run's checkpoints folder, where it will write, is checked first (snapshot_folders)."""
    choice = cfg.train.resume
    # Rank 0 chooses for everyone: on a shared file system other ranks may not see the newest files yet.
    found: list[Any] = [None, None]
    if is_main:
        try:
            root = cfg.output.folder.checkpoints
            if choice == "auto":
                latest = find_latest(root, cfg.output.elsewhere)
                found[0] = str(latest) if latest is not None else None
            else:
                snapshot_folders(root, cfg.output.elsewhere)
        except SnapshotError as exc:
            found[1] = str(exc)
    if world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[1] is not None:
        raise SnapshotError(found[1])
    if choice not in ("auto", "never"):
        return Path(choice)
    return Path(found[0]) if found[0] is not None else None


def find_snapshot(path: Path) -> Path:
    """A snapshot folder as given, or the newest valid one of a run folder."""
    if (path / MANIFEST).exists():  # whatever it is: verify says what is wrong with it
        return path
    snapshots = RunFolder(path).checkpoints
    found = find_latest(snapshots) if snapshots.is_dir() else None
    if found is None:
        raise SnapshotError(f"{path} is neither a snapshot nor a run folder with a valid snapshot; "
                            f"give a folder that dptrain checkpoint list shows as ok.")
    return found
