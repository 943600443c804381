"""StatePart: one named stateful part of a snapshot, saying how it is stored and which files it writes.

A strategy lists its parts (Strategy.state_parts); the Snapshotter saves and loads every part alike, in this order:
save() on every rank (the files of the part's own), then one DCP write of every part's shards(); on load, one DCP
load into every part's shards(), then load() on every rank. Three kinds here, by where the state lives:
  Shards     the tensors as each rank holds them, through DCP; reshardable to another world size.
  WholeFile  one file written by rank 0 (a state DCP cannot see into); loads at any world size.
  OwnFolder  the files an engine writes itself into a subfolder (DeepSpeed); resumes at the same world size only.
and a strategy's own where none fits (PowerSGD's memory: one file per rank, strategies/powersgd.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SaveFile = Callable[[Any, Path], None]
"""Writes plain data (tensors, dicts, numbers) to a file of the snapshot."""
LoadFile = Callable[[Path], Any]
"""Reads such a file back, through safe_load's allow-lists."""

WHOLE_OPTIMIZER = "optimizer.pt"  # for strategies whose optimizer DCP cannot shard (zero1, ps)


class StatePart:
    """The defaults: no shards, no files of its own, nothing to do on save or load."""

    name: str
    storage: str
    """How the part is stored, in words (a manifest records it beside the part's files)."""
    same_world_only = False
    """True when the part cannot be resharded: a snapshot holding it resumes at the world size it was written at."""
    without_it: str | None = None
    """For a part that snapshots written before dptrain kept it lack: what a resume from such a snapshot does without
    it, in words (logged); None: a snapshot without the part's files is damaged."""

    def files(self, world_size: int) -> set[str]:
        """The files of the part's own that load() reads, relative to a snapshot written by world_size ranks (DCP's
        files are DCP's to name)."""
        return set()

    def resumes_on(self, written: int, world_size: int) -> str | None:
        """None if the part's state in a snapshot of `written` ranks can go on at world_size; else why not and on how
        many it can, in words that follow 'snapshot PATH' (the Snapshotter ends the sentence)."""
        return None

    def shards(self) -> dict[str, Any]:
        """What DCP writes and loads in place: top-level keys of the snapshot's DCP state, each rank its own."""
        return {}

    def save(self, folder: Path, save_file: SaveFile) -> None:
        """Write the part's own files into the snapshot folder (every rank calls it; it may be a collective)."""

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        """Restore the part from a verified snapshot folder written by world_size ranks, after DCP has loaded `shards`
        (every rank)."""


@dataclass
class Shards(StatePart):
    """State written by DCP as each rank holds it: `state()` gives top-level keys to state dicts, `restore` takes them
    back once DCP has loaded into them."""

    name: str
    state: Callable[[], dict[str, Any]]
    restore: Callable[[dict[str, Any]], None]
    storage = "DCP shards"

    def shards(self) -> dict[str, Any]:
        return self.state()

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        self.restore(shards)


@dataclass
class WholeFile(StatePart):
    """A whole state in one file: `state()` gives it on rank 0 and None elsewhere (it may be a collective)."""

    name: str
    file: str
    state: Callable[[], dict[str, Any] | None]
    restore: Callable[[dict[str, Any]], None]
    storage = "one file by rank 0"

    def files(self, world_size: int) -> set[str]:
        return {self.file}

    def save(self, folder: Path, save_file: SaveFile) -> None:
        whole = self.state()
        if whole is not None:
            save_file(whole, folder / self.file)

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        self.restore(load_file(folder / self.file))


@dataclass
class OwnFolder(StatePart):
    """Files an engine writes and reads itself (every rank, into the snapshot); `own_files` names those it reads."""

    name: str
    write: Callable[[Path], None]
    read: Callable[[Path], None]
    own_files: Callable[[], set[str]]
    storage = "the strategy's own folder"
    same_world_only = True

    def files(self, world_size: int) -> set[str]:
        return self.own_files()  # at world_size only: same_world_only

    def save(self, folder: Path, save_file: SaveFile) -> None:
        self.write(folder)

    def load(self, folder: Path, shards: dict[str, Any], load_file: LoadFile, world_size: int) -> None:
        self.read(folder)
