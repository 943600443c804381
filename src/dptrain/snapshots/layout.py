"""What a snapshot holds and how it is checked: its folder's layout (step-<N>/, latest, manifest.json, extra.pt, a
file per rank), the options a manifest records (those a resume must keep), and verify(): every file against the
manifest, plain data only, a resume's compatibility with the run."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from dptrain import config as config_mod, read_back
from dptrain.config import RunConfig
from dptrain.errors import ConfigError, SnapshotError, UnsafeFileError
from dptrain.run_folder import SNAPSHOT_LATEST, SNAPSHOT_MANIFEST, SNAPSHOT_PREFIX
from dptrain.safe_load import check_plain_entries, check_private, data_files, load_tensors, read_metadata
from dptrain.strategies.registry import STRATEGIES


PREFIX, LATEST, MANIFEST = SNAPSHOT_PREFIX, SNAPSHOT_LATEST, SNAPSHOT_MANIFEST  # the run folder's names
EXTRA = "extra.pt"  # the loop's TrainState and the scheduler
# Schedules whose shape depends on the run's length: a resume must keep the length they were planned for.
LENGTH_BOUND_SCHEDULES = ("cosine", "onecycle")
# A manifest holds about 300 bytes per rank (its rank file and shard, each with size and sha256) and a few kB of
# options: 1 MiB is the manifest of some 3,000 ranks. A larger one is damaged, or not ours, and is not read whole.
MANIFEST_MAX_BYTES = 1 << 20


def computation_options(cfg: RunConfig) -> dict[str, Any]:
    """Every option that changes the computation, as dotted names: what a resume must keep (config.fixed_at_resume;
    each other option's field says it may change)."""
    options = {**config_mod.fixed_at_resume(cfg), **STRATEGIES[cfg.strategy.name].computation_options(cfg)}
    return json.loads(json.dumps(options, default=str))  # as the manifest holds them: tuples become lists


def config_hash(cfg: RunConfig) -> str:
    """Hash of computation_options(cfg)."""
    return _hash(computation_options(cfg))


def _hash(options: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recorded_options(manifest: dict[str, Any]) -> dict[str, Any]:
    """The options a manifest records, under today's names (a snapshot of before the strategy tables says
    strategy.comm_hook for strategy.ddp.comm_hook); an option added since it was written (optim.betas) at its
    default, which is what that snapshot computed with."""
    recorded = {config_mod.current_name(name): value for name, value in manifest.get("config", {}).items()}
    return {**_defaults_of_options(), **recorded}


def _defaults_of_options() -> dict[str, Any]:
    """Every option a resume must keep, at its default (the config files left out, whose absence is their default)."""
    return {name: value for name, value in computation_options(RunConfig()).items() if "(" not in name}


def recorded_hash(manifest: dict[str, Any]) -> str:
    """The manifest's config_hash, as config_hash() computes it today: from its options where it records them."""
    return _hash(recorded_options(manifest)) if "config" in manifest else manifest["config_hash"]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The well-formed manifest of snapshot folder `path`, read up to MANIFEST_MAX_BYTES from a regular file
    (read_back's bounded read: a FIFO there is refused, not waited on); SnapshotError in one sentence where it is
    damaged (brackets nested thousands deep too: a RecursionError in Python's parser), OSError if it cannot be read."""
    try:
        text = read_back.read_bytes(path / MANIFEST, MANIFEST_MAX_BYTES)
    except read_back.UnreadableFile as exc:
        if exc.problem.startswith("is larger"):
            raise SnapshotError(f"snapshot {path} has a {MANIFEST} of more than {MANIFEST_MAX_BYTES >> 20} MiB, far more "
                                f"than any manifest holds; it is damaged.") from None
        raise SnapshotError(f"snapshot {path} has a {MANIFEST} that {exc.problem}; it is damaged.") from None
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        well_formed = (all(key in manifest for key in ("world_size", "strategy", "model", "config_hash", "step"))
                       and isinstance(files, dict) and isinstance(manifest["step"], int) and isinstance(manifest["world_size"], int)
                       and all(isinstance(m, dict) and "bytes" in m and "sha256" in m for m in files.values())
                       and _parts_well_formed(manifest.get("parts", {})))
    except (ValueError, KeyError, TypeError, RecursionError):  # ValueError: not JSON, or not UTF-8
        well_formed = False
    if not well_formed:
        raise SnapshotError(f"snapshot {path} has a damaged {MANIFEST}.")
    return manifest


def _parts_well_formed(parts: Any) -> bool:
    """A manifest's "parts": part name -> {"storage": words, "files": [file names]}."""
    return isinstance(parts, dict) and all(
        isinstance(p, dict) and isinstance(p.get("files"), list) and all(isinstance(f, str) for f in p["files"])
        for p in parts.values())


def _required_files(manifest: dict[str, Any], metadata: Any) -> set[str]:
    """Every file the loader will read: DCP's metadata and the shards it names, the loop state, each rank's file, and
    the files of each of the strategy's state parts, as the manifest records them (Snapshotter.load checks the
    strategy's own list too: a manifest written before the parts were recorded has none)."""
    required = {".metadata", EXTRA, *(f"rank{r}.pt" for r in range(manifest["world_size"]))}
    for part in manifest.get("parts", {}).values():
        required |= set(part["files"])
    if metadata is not None:
        required |= data_files(metadata)
    return required


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a verified snapshot that is safe to load; SnapshotError naming the first thing wrong.

    Safe: the folder is the user's own and nobody else may write to it. Whole: the manifest lists exactly
    the files the folder holds, those include every file the loader reads, each has its recorded size and
    sha256, and the step agrees with the folder's name and with the loop state inside. A file that cannot be read
    (permissions, an I/O error) is named in one sentence too.
    """
    try:
        return _verify(path)
    except OSError as exc:
        raise SnapshotError(f"cannot read {exc.filename or path} of snapshot {path} ({exc.strerror or exc}); "
                            f"make it readable for you, or use another snapshot.") from None


def _verify(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SnapshotError(f"snapshot {path} does not exist; give a snapshot folder that dptrain checkpoint list shows as ok.")
    if not path.is_dir():
        raise SnapshotError(f"snapshot {path} is a file, not a snapshot folder; give a snapshot folder that "
                            f"dptrain checkpoint list shows as ok.")
    if not (path / MANIFEST).exists():  # a FIFO there is no missing manifest: read_manifest says what it is
        raise SnapshotError(f"snapshot {path} has no {MANIFEST}: it is incomplete.")
    try:
        check_private(path, "snapshot")
        manifest = read_manifest(path)
        listed = set(manifest["files"])
        present = {str(p.relative_to(path)) for p in path.rglob("*") if p.exists() and not p.is_dir()} - {MANIFEST}
        for name in sorted(listed - present):
            raise SnapshotError(f"snapshot {path} lacks {name}: it is incomplete.")
        for name in sorted(present - listed):
            raise SnapshotError(f"snapshot {path} holds {name}, which its manifest does not list; it was changed after it was written.")
        for name, meta in sorted(manifest["files"].items()):
            file = path / name
            kind = read_back.special_kind(file.stat().st_mode)
            if kind is not None:  # hashing a FIFO would wait for ever, a device never end
                raise SnapshotError(f"snapshot {path} has a {name} that is {kind}, not a regular file; it is damaged.")
            if file.stat().st_size != meta["bytes"] or sha256_of(file) != meta["sha256"]:
                raise SnapshotError(f"snapshot {path} has a damaged {name} (size or sha256 differs from the manifest).")
        with reading(manifest, path, "DCP metadata (.metadata)"):
            metadata = read_metadata(path) if ".metadata" in listed else None
        for name in sorted(_required_files(manifest, metadata) - listed):
            raise SnapshotError(f"snapshot {path} has a manifest that does not list {name}, which a resume reads; it is damaged.")
        # Plain data only, in every file and entry, even those this command will not read (eval reads only the model).
        loaded = {}
        for name in sorted(n for n in listed if n.endswith(".pt")):
            with reading(manifest, path, name):
                loaded[name] = load_tensors(path / name, mmap=True)
        with reading(manifest, path, "DCP entries"):
            check_plain_entries(path, metadata)
        named_step = path.name.removeprefix(PREFIX)
        loop_step = loaded[EXTRA]["loop"]["step"]
        if loop_step != manifest["step"]:
            raise SnapshotError(f"snapshot {path} says step {manifest['step']} in its manifest but holds the state of step "
                                f"{loop_step}; it is damaged.")
        if path.name.startswith(PREFIX) and named_step.isdigit() and int(named_step) != manifest["step"]:
            # a resume picks the newest snapshot by its folder's name: a renamed one would be taken for another step
            raise SnapshotError(f"snapshot {path} is named for step {int(named_step)} but its manifest says step "
                                f"{manifest['step']}; it was renamed or is damaged: use another snapshot.")
    except UnsafeFileError as exc:
        raise SnapshotError(str(exc)) from None
    except (KeyError, TypeError) as exc:
        raise SnapshotError(f"snapshot {path} holds a loop state without {exc}; it is damaged.") from None
    return manifest


def torch_release(version: str) -> str:
    """A torch version's release, without its build: 2.6.0+cu124 and 2.6.0 are one release."""
    return version.split("+")[0]


def written_elsewhere(manifest: dict[str, Any]) -> str | None:
    """The torch version that wrote the snapshot where it is another release than this one's; None where it is the same
    (or the manifest does not say)."""
    theirs = manifest.get("torch")
    if not isinstance(theirs, str) or torch_release(theirs) == torch_release(torch.__version__):
        return None
    return theirs


def across_versions(manifest: dict[str, Any], path: Path, part: str, why: str) -> SnapshotError:
    """The one sentence for a part of a snapshot written by another torch that does not read the same here."""
    theirs = manifest.get("torch")
    return SnapshotError(f"snapshot {path} was written by torch {theirs}, and torch {torch.__version__} cannot load its "
                         f"{part} as written ({why}); load it with torch {theirs} (dptrain checkpoint verify "
                         f"--python names each part an interpreter reads), or export its weights there and start afresh.")


@contextlib.contextmanager
def reading(manifest: dict[str, Any], path: Path, part: str) -> Iterator[None]:
    """Reading `part` of a snapshot: where another torch wrote it, whatever fails says so in one sentence naming both
    versions and the part (across_versions); with the same torch, failures are left as they are."""
    try:
        yield
    except (SnapshotError, ConfigError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's own words: DCP's CheckpointException (a BaseException), an UnpicklingError
        if written_elsewhere(manifest) is None:
            raise
        inner = next(iter(getattr(exc, "failures", {}).values()), None)  # DCP's: rank -> (exception, traceback)
        exc = (inner[0] if isinstance(inner, tuple) else inner) or exc
        words = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise across_versions(manifest, path, part, f"{type(exc).__name__}: {words}") from None


def optimizer_record(optimizer: Any) -> dict[str, Any]:
    """What a loader needs to judge an optimizer's state: its class, the keys of its per-parameter state, and of its
    parameter groups (the optimizer inside a wrapper such as ZeroRedundancyOptimizer's)."""
    inner = getattr(optimizer, "optim", optimizer)
    state = getattr(inner, "state", {})
    groups = getattr(inner, "param_groups", [])
    return {"class": type(inner).__name__, "state_keys": sorted({str(k) for st in state.values() for k in st}),
            "group_keys": sorted({str(k) for g in groups for k in g if k != "params"})}


def dcp_record() -> dict[str, Any]:
    """DCP's format as this torch writes it (the version its FileSystemWriter stamps, where it has one)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    return {"format": "FileSystemWriter", "version": getattr(dcp_fs, "CURRENT_DCP_VERSION", None)}


def check_optimizer_keys(manifest: dict[str, Any], path: Path, optimizer: Any) -> None:
    """After a resume's load: the optimizer's state keeps the keys the snapshot recorded, or, written by another torch,
    one sentence naming both versions and the keys (an optimizer refactor between releases renames them)."""
    recorded = (manifest.get("optimizer") or {}).get("state_keys")
    now = optimizer_record(optimizer)
    if not recorded or not now["state_keys"] or recorded == now["state_keys"] or written_elsewhere(manifest) is None:
        return
    raise across_versions(manifest, path, f"optimizer state ({now['class']})",
                          f"it holds {', '.join(recorded)}; this torch's keeps {', '.join(now['state_keys'])}")


def check_compatible(manifest: dict[str, Any], cfg: RunConfig, path: Path, total_steps: int) -> None:
    """ConfigError naming the first option this run changed that a resume must keep."""
    how_to = f"use the snapshot's setting, or {cfg.output.elsewhere} to start afresh"
    for key, ours in (("model", cfg.model.name), ("strategy", cfg.strategy.name)):
        if manifest[key] != ours:
            raise ConfigError(f"snapshot {path} was written with {key} {manifest[key]} but this run has {ours}; {how_to}.")
    if recorded_hash(manifest) != config_hash(cfg):
        theirs, ours = recorded_options(manifest), computation_options(cfg)
        changed = [name for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]
        if changed:
            name = changed[0]
            more = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
            raise ConfigError(f"snapshot {path} was written with {name} = {theirs.get(name)!r} but this run has "
                              f"{ours.get(name)!r}{more}; {how_to}.")
        raise ConfigError(f"snapshot {path} was written with another configuration (only run length, logging, paths and "
                          f"the device may change); {how_to}.")
    planned = manifest.get("schedule_steps", total_steps)
    if cfg.optim.schedule in LENGTH_BOUND_SCHEDULES and planned != total_steps:
        raise ConfigError(f"snapshot {path} follows a {cfg.optim.schedule} learning-rate schedule planned for {planned} steps, "
                          f"but this run would last {total_steps}; keep train.epochs and train.max_steps as they were, "
                          f"or use {cfg.output.elsewhere} to start afresh.")
