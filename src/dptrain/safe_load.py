"""Reading files that other people may have written, without running code from them.

A snapshot on a shared folder is input from others. Python's pickle calls whatever a file names,
so every file a snapshot holds is read through an allow-list:
- `.pt` files with `torch.load(weights_only=True)`: tensors and plain containers only;
- DCP's `.metadata` through `MetadataUnpickler`, which admits DCP's own metadata classes and
  nothing else (DCP itself would `pickle.load` it);
- DCP's non-tensor entries (optimizer hyper-parameters) through `SafeLoadPlanner`, with
  `weights_only=True` (DCP's default planner loads them with weights_only=False).
`check_private` refuses a folder that another user could have planted files in.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from dptrain.errors import UnsafeFileError
from dptrain.read_back import special_kind


def check_private(folder: Path, what: str) -> None:
    """Refuse `folder` (and everything in it) if it is not ours or if group or others may write to it."""
    for path in [folder, *sorted(folder.rglob("*"))]:
        problem = _not_private(path, plain=path != folder)
        if problem is not None:
            advice = {"link": "a snapshot holds plain files only, so it is not read.",
                      "owner": "a file written by someone else could run code on load, so it is not read.",
                      "mode": f"if you trust it, run 'chmod -R go-w {folder}', else do not use it."}[problem[0]]
            raise UnsafeFileError(f"{what} {folder} holds {path}, {problem[1]}; {advice}")


def check_private_file(path: Path, what: str) -> None:
    """Refuse the file `path` if it is not a plain file of ours or if group or others may write to it: a snapshot's
    rule, for a file that decides what a command loads (a run's config.toml names the data, and may name code)."""
    problem = _not_private(path, plain=True)
    if problem is not None:
        kind, wrong = problem
        sentence = {"link": f"{what} {path} is {wrong.removeprefix('which is ')}; it is not read.",
                    "owner": f"{what} {path} is {wrong}; a file written by someone else could change what is loaded or "
                             f"run code, so it is not read.",
                    "mode": f"{what} {path} is a file {wrong}; if you trust it, run 'chmod go-w {path}', else do not "
                            f"use it."}[kind]
        raise UnsafeFileError(sentence)


def _not_private(path: Path, plain: bool) -> tuple[str, str] | None:
    """('link' | 'owner' | 'mode', what is wrong with path), or None if it is a folder or plain file of ours alone."""
    info = path.lstat()
    me = os.geteuid()
    if plain and not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else special_kind(info.st_mode)
        return "link", f"which is {kind}, not a plain file"
    if info.st_uid != me:
        return "owner", f"owned by user id {info.st_uid}, not by you ({me})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "mode", f"which others may write to (mode {stat.filemode(info.st_mode)})"
    return None


def make_private(folder: Path) -> None:
    """Drop group and other write permission from folder and its contents (a umask of 002 grants it)."""
    for path in [folder, *folder.rglob("*")]:
        mode = path.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            path.chmod(stat.S_IMODE(mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def load_tensors(path: Path, mmap: bool = False) -> Any:
    """A `.pt` file of tensors and plain containers; anything else is refused, in one sentence.

    mmap: map the tensors' bytes instead of reading them (to check a large file without holding it)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeFileError(f"{path} holds something other than tensors and plain values ({_named(exc)}), which could "
                              f"run code on load; it is not read.") from None
    except Exception as exc:  # truncated or garbled: RuntimeError from the zip reader, EOFError, ...
        raise UnsafeFileError(f"{path} is not a readable tensor file ({type(exc).__name__}); it is damaged.") from None


def _named(exc: BaseException) -> str:
    """What torch's refusal names ('it names posix.system'), without its paragraph of advice."""
    found = re.search(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)", str(exc))
    return f"it names {found.group(1)}" if found else "it is not plain data"


def _dcp_classes() -> dict[tuple[str, str], Any]:
    """DCP's metadata classes, the torch types they refer to, and plain containers: nothing that runs code."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_meta

    allowed: dict[tuple[str, str], Any] = {}
    for module in (dcp_meta,):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                allowed[(module.__name__, name)] = value
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # maps a name to a torch.layout
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            allowed[("torch", name)] = value
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and refuses any other class or function."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if MetadataUnpickler._allowed is None:
            MetadataUnpickler._allowed = _dcp_classes()
        try:
            return MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


def read_metadata(folder: Path) -> Any:
    """DCP's Metadata of a snapshot folder, read through the allow-list."""
    path = folder / ".metadata"
    try:
        metadata = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeFileError(f"{path} names {str(exc).removeprefix('refusing to load ')}, which is not part of a "
                              f"snapshot's metadata and could run code on load; it is not read.") from None
    except Exception as exc:  # truncated or garbled: EOFError, ValueError, ...
        raise UnsafeFileError(f"{path} is not readable snapshot metadata ({type(exc).__name__}); it is damaged.") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeFileError(f"{path} is not snapshot metadata; it is damaged.")
    return metadata


def data_files(metadata: Any) -> set[str]:
    """The shard files a snapshot's metadata refers to, as paths relative to its folder."""
    return {str(info.relative_path) for info in metadata.storage_data.values()}


def check_plain_entries(folder: Path, metadata: Any) -> None:
    """Every non-tensor entry of the DCP shards (optimizer hyper-parameters) holds plain values only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(fqn)]
        if getattr(info, "transform_descriptors", None):  # compressed entries: never written by dptrain
            raise UnsafeFileError(f"{folder} holds the entry {fqn} in a transformed form that dptrain does not write; it is not read.")
        with (folder / str(info.relative_path)).open("rb") as f:
            f.seek(info.offset)
            raw = io.BytesIO(f.read(info.length))
        try:
            torch.load(raw, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeFileError(f"{folder} holds the entry {fqn} with something other than plain values ({_named(exc)}), "
                                  f"which could run code on load; it is not read.") from None
        except Exception as exc:
            raise UnsafeFileError(f"{folder} holds an unreadable entry {fqn} ({type(exc).__name__}); it is damaged.") from None


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002 - DCP's signature varies by version
        metadata = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor entries loaded as plain values only; entries named by keep_missing that
    the snapshot lacks are left as they are (kept), not asked of it."""

    keep_missing: str | None = None

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.kept: list[str] = []
        if self.keep_missing and metadata is not None:
            for key in [k for k in self.state_dict if self.keep_missing in k and k not in metadata.state_dict_metadata]:
                del self.state_dict[key]  # never planned: its value in the state given stays
                self.kept.append(key)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses (2.6 to 2.13)

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeFileError(f"the snapshot entry {read_item.dest_index.fqn} holds something other than plain values "
                                  f"({_named(exc)}), which could run code on load; it is not read.") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict[str, Any], folder: Path, keep_missing: str | None = None) -> list[str]:
    """torch.distributed.checkpoint.load into `state`, in place, through the allow-lists. keep_missing: entries whose
    name holds it (".param_groups.": an optimizer's hyper-parameters) that the snapshot lacks keep their value in
    `state` instead of failing the load; the names of those kept."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    planner = SafeLoadPlanner()
    planner.keep_missing = keep_missing
    try:
        load(state, storage_reader=SafeReader(str(folder)), planner=planner)
        return sorted(planner.kept)
    except CheckpointException as exc:  # DCP wraps each rank's failure; ours says what was refused
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, UnsafeFileError):
                raise UnsafeFileError(f"{folder}: {inner}") from None
        raise
