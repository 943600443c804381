"""Fetch dataset files once per machine (once per cluster on a shared folder): an exclusive file lock, a temporary name, an md5 check, a rename.

No process group is needed: every process that wants the files calls fetch(); the first one to
take the lock downloads, the others block on the lock and then find the files in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import logging
import urllib.request
from pathlib import Path
from typing import Iterator

from dptrain.data.formats import open_data_file
from dptrain.errors import DataError
from dptrain.files import written_atomically

log = logging.getLogger(__name__)

CHUNK = 1 << 20
HTTP_TIMEOUT_S = 60


def md5sum(path: Path) -> str:
    """The md5 of a regular file; DataError in one sentence for a FIFO or a device there (never waited on)."""
    digest = hashlib.md5()
    with open_data_file(path) as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock held across processes, released if the holder dies. A POSIX record lock (lockf), the kind
    NFS serves across nodes (v4 itself, v3 through lockd), so on a folder every node mounts the download happens
    once per cluster; flock is emulated with it on Linux NFS clients, but kept node-local by `local_lock=flock`.
    Even where a lock only holds on one node, each file is renamed into place whole: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:  # lockf wants a file open for writing
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def fetch(dest: Path, files: list[tuple[str, str]], mirrors: list[str]) -> list[Path]:
    """Make every (filename, md5) of `files` present and verified in dest, trying mirrors in order."""
    dest.mkdir(parents=True, exist_ok=True)
    with file_lock(dest / ".download.lock"):
        return [_fetch_one(dest, name, md5, mirrors) for name, md5 in files]


def _fetch_one(dest: Path, name: str, md5: str, mirrors: list[str]) -> Path:
    target = dest / name
    if target.exists():
        if md5sum(target) == md5:
            return target
        log.warning("%s has the wrong md5; downloading it again", target)
    failures = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + name
        try:
            _download(url, target, md5)
            log.info("downloaded %s", url)
            return target
        except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError is an OSError, DataError a ValueError
            failures.append(f"{url}: {exc}")
    raise DataError(
        f"could not download {name} from any mirror ({'; '.join(failures)}); "
        f"check the network or --data.mirror, or place the file in {dest} yourself."
    )


def _download(url: str, target: Path, md5: str) -> None:
    """Stream to a temporary file beside target, check the md5, then rename: no half file is ever found."""
    # 0o666 less the umask, as any download: a shared data root needs the files readable by the group.
    with written_atomically(target, mode=0o666) as tmp:
        digest = hashlib.md5()
        with tmp.open("wb") as out, urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            for chunk in iter(lambda: response.read(CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise DataError(f"md5 {digest.hexdigest()} does not match the expected {md5}")
