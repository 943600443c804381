"""Run by another interpreter (`dptrain checkpoint verify --python PATH`): load each part of a snapshot as that
interpreter's torch reads it, and print one JSON line: {"torch": its version, "parts": [[part, "ok" or "failed",
detail], ...]}.

    PATH/bin/python probe.py SNAPSHOT

It imports torch and the standard library only, never dptrain, which that interpreter need not have. The dptrain that
runs it has verified the snapshot first (every file against the manifest, plain data only, through its allow-lists),
so the files are loaded here as torch loads them: .pt files with weights_only=True, DCP's shards with DCP's reader.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable


def _attempt(parts: list[list[str]], name: str, load: Callable[[], str]) -> None:
    try:
        parts.append([name, "ok", load()])
    except Exception as exc:  # what this torch makes of the part, in one line
        parts.append([name, "failed", f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"])


def _count(value: Any) -> int:
    import torch

    if torch.is_tensor(value):
        return 1
    if isinstance(value, dict):
        return sum(_count(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count(v) for v in value)
    return 0


def probe(folder: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    parts: list[list[str]] = []
    found: dict[str, Any] = {}
    if (folder / ".metadata").is_file():
        def metadata() -> str:
            found["metadata"] = FileSystemReader(str(folder)).read_metadata()
            return f"{len(found['metadata'].state_dict_metadata)} entries"

        _attempt(parts, ".metadata", metadata)
    if "metadata" in found:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        # DCP's own single-process load into an empty state (what its dcp_to_torch_save does, from torch 2.2 on);
        # the public load() fills a copy of the state, not the one given
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict[str, Any] = {}

        def shards() -> str:
            with warnings.catch_warnings():  # "loading in a single process": what this is
                warnings.simplefilter("ignore")
                _load_state_dict(state, storage_reader=FileSystemReader(str(folder)),
                                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            return ", ".join(f"{key}: {_count(value)} tensors" for key, value in sorted(state.items()))

        _attempt(parts, "DCP shards", shards)
    for path in sorted(p for p in folder.rglob("*.pt") if p.is_file()):
        _attempt(parts, str(path.relative_to(folder)),
                 lambda path=path: f"{_count(torch.load(path, map_location='cpu', weights_only=True))} tensors")
    return {"torch": torch.__version__, "parts": parts}


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))))
