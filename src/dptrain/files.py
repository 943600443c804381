"""Files written atomically: a reader (a resume, eval, a user's script) finds the old file or the new one,
never half of one, whatever kills the writer."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

from dptrain.errors import ConfigError


@contextlib.contextmanager
def written_atomically(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """Yields a temporary path beside path for the block to write; then flushes it to the disk and renames it over
    path. On any failure the temporary file is removed and path is left as it was.

    mode: the new file's permissions, less the umask (0o644: never writable by group or others, even under umask 002;
    eval refuses a config.toml others could change). The temporary name holds this process's id, so that writers on
    several nodes of a shared folder do not meet. The cost: one fsync of the file and one of its folder.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a writer of this pid that was killed
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    """path's text replaced atomically (written_atomically), never written through a link planted there."""
    with written_atomically(path) as tmp:
        tmp.write_text(text)


def fsync_dir(folder: Path) -> None:
    """A rename is durable only once its folder is flushed."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(path: Path, option: str, ours: Callable[[list[str]], bool], what: str) -> None:
    """A CSV that a command writes (eval's --predictions, predict's --output) may replace an earlier file of its own
    only, never another file (a run's config.toml, say): ours(the first line's cells) says whether it is one.
    ConfigError in one sentence otherwise; nothing is written here."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give a file name, for example {path / 'predictions.csv'}.")
    if path.exists():
        with path.open(errors="replace") as f:
            first = f.readline().rstrip("\r\n").split(",")
        if not ours(first):
            raise ConfigError(f"{option} {path} exists and is not {what}; choose another path.")
