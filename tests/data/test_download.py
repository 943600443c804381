"""download.fetch and catalog downloads against a real HTTP server on 127.0.0.1 (no outside network)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from dptrain.config import DataConfig
from dptrain.data import catalog, download
from dptrain.data.catalog import DATASETS, load, locate
from dptrain.data.formats import read_cifar_batch
from dptrain.errors import DataError

from .datafiles import CIFAR_DIR, IDX_STEMS, write_cifar_archive, write_cifar_batch, write_idx_dataset

LOCK = ".download.lock"


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def serve(server, name: str, data: bytes) -> tuple[str, str]:
    (server.root / name).write_bytes(data)
    return name, md5(data)


def listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def test_md5sum_matches_hashlib_across_chunks(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, download.CHUNK * 2 + 12345, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert download.md5sum(path) == hashlib.md5(data).hexdigest()
    path.write_bytes(b"")
    assert download.md5sum(path) == "d41d8cd98f00b204e9800998ecf8427e"


def test_fetch_downloads_and_verifies(tmp_path, file_server):
    files = [serve(file_server, "a.bin", b"alpha" * 1000), serve(file_server, "b.gz", os.urandom(3000))]
    dest = tmp_path / "dest" / "nested"  # created by fetch
    paths = download.fetch(dest, files, [file_server.url])
    assert paths == [dest / "a.bin", dest / "b.gz"]
    for path, (name, digest) in zip(paths, files):
        assert path.read_bytes() == (file_server.root / name).read_bytes()
        assert download.md5sum(path) == digest
    assert listing(dest) == {"a.bin", "b.gz", LOCK}  # no temporary files left beside them
    assert file_server.count("a.bin") == 1 and file_server.count("b.gz") == 1


def test_fetch_wrong_md5_raises_and_leaves_nothing(tmp_path, file_server):
    name, _ = serve(file_server, "train-images-idx3-ubyte.gz", b"not the real file")
    expected = "0123456789abcdef0123456789abcdef"
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as info:
        download.fetch(dest, [(name, expected)], [file_server.url])
    message = str(info.value)
    assert "md5" in message and expected in message and md5(b"not the real file") in message
    assert file_server.url + name in message and str(dest) in message
    assert listing(dest) == {LOCK}  # neither the file nor a partial/temporary copy


def test_fetch_wrong_md5_on_first_mirror_falls_back(tmp_path, file_server):
    good = b"the right bytes"
    (file_server.root / "bad").mkdir()
    (file_server.root / "bad" / "f.bin").write_bytes(b"the wrong bytes")
    (file_server.root / "f.bin").write_bytes(good)
    dest = tmp_path / "dest"
    [path] = download.fetch(dest, [("f.bin", md5(good))], [file_server.url + "bad/", file_server.url])
    assert path.read_bytes() == good
    assert listing(dest) == {"f.bin", LOCK}


def test_fetch_404_mirror_falls_back_to_the_next(tmp_path, file_server):
    files = [serve(file_server, "x.bin", b"xyz" * 100)]
    dest = tmp_path / "dest"
    [path] = download.fetch(dest, files, [file_server.url + "missing", file_server.url])
    assert path.read_bytes() == b"xyz" * 100
    assert file_server.gets["/missing/x.bin"] == 1 and file_server.gets["/x.bin"] == 1
    assert listing(dest) == {"x.bin", LOCK}


def test_fetch_unreachable_mirror_falls_back(tmp_path, file_server):
    files = [serve(file_server, "y.bin", b"y")]
    [path] = download.fetch(tmp_path / "d", files, [closed_port_url(), file_server.url])
    assert path.read_bytes() == b"y"


def test_fetch_all_mirrors_fail_names_every_url(tmp_path, file_server):
    dead = closed_port_url()
    with pytest.raises(DataError) as info:
        download.fetch(tmp_path / "d", [("z.bin", "0" * 32)], [file_server.url + "nope/", dead])
    message = str(info.value)
    assert file_server.url + "nope/z.bin" in message and dead + "z.bin" in message
    assert "404" in message
    assert listing(tmp_path / "d") == {LOCK}


def test_fetch_skips_files_already_present(tmp_path, file_server):
    files = [serve(file_server, "a.bin", b"aaa"), serve(file_server, "b.bin", b"bbb")]
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a.bin").write_bytes(b"aaa")
    stamp = (dest / "a.bin").stat().st_mtime_ns
    paths = download.fetch(dest, files, [file_server.url])
    assert [p.read_bytes() for p in paths] == [b"aaa", b"bbb"]
    assert file_server.count("a.bin") == 0 and file_server.count("b.bin") == 1
    assert (dest / "a.bin").stat().st_mtime_ns == stamp
    download.fetch(dest, files, [file_server.url])  # everything present: no request at all
    assert file_server.total() == 1


def test_fetch_replaces_a_present_file_with_the_wrong_md5(tmp_path, file_server):
    files = [serve(file_server, "a.bin", b"correct")]
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a.bin").write_bytes(b"half a fi")
    [path] = download.fetch(dest, files, [file_server.url])
    assert path.read_bytes() == b"correct" and file_server.count("a.bin") == 1


# ---------------------------------------------------------------- two processes, one download

RACER = r"""
import json, os, sys, time
from pathlib import Path
from dptrain.data import download
dest, url, go, files = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
print("ready", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.002)
start = time.time()
print("fetching", flush=True)
paths = download.fetch(Path(dest), [tuple(f) for f in files], [url])
print(json.dumps({"start": start, "end": time.time(), "paths": [str(p) for p in paths]}), flush=True)
"""


@pytest.mark.slow
def test_two_processes_download_each_file_once(tmp_path, file_server, monkeypatch):
    """The two calls overlap by construction, not by timing: the server answers no GET until both processes are in
    fetch, so that one of them downloads while the other waits for it."""
    payloads = {"train-images.gz": os.urandom(200_000), "train-labels.gz": os.urandom(5_000)}
    files = [serve(file_server, name, data) for name, data in payloads.items()]
    both_in_fetch = threading.Event()
    # The server's delay of each GET (tests/data/conftest.py: time.sleep(delay_s)) becomes a wait for that moment.
    server_module = sys.modules[type(file_server).__module__]
    monkeypatch.setattr(server_module, "time", types.SimpleNamespace(sleep=lambda _: both_in_fetch.wait(60)))
    file_server.delay_s = 1.0  # any delay: each GET waits for that moment instead
    dest, go = tmp_path / "shared", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(dest), file_server.url, str(go), json.dumps(files)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:  # both imported dptrain and wait at the starting line
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)
        go.touch()
        for p in procs:
            assert p.stdout.readline().strip() == "fetching", p.communicate(timeout=60)
        both_in_fetch.set()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # The two calls overlapped (each started before the other finished), as the server's wait made them.
    assert max(r["start"] for r in results) < min(r["end"] for r in results)
    assert file_server.total() == len(payloads)  # one process downloaded; the other found the files whole
    for r in results:
        assert r["paths"] == [str(dest / name) for name in payloads]
    for name, data in payloads.items():
        assert (dest / name).read_bytes() == data
        assert download.md5sum(dest / name) == md5(data)
        assert file_server.count(name) == 1, dict(file_server.gets)
    assert listing(dest) == {*payloads, LOCK}


# ---------------------------------------------------------------- catalog: downloads for load()


def offline(spec):
    """The spec with its official mirrors removed, so that only the test server is ever asked."""
    return dataclasses.replace(spec, mirrors=())


def test_load_download_wrong_content_reports_md5(tmp_path, file_server, monkeypatch):
    monkeypatch.setitem(DATASETS, "mnist", offline(DATASETS["mnist"]))
    for name, _ in DATASETS["mnist"].downloads:
        (file_server.root / name).write_bytes(b"this is not MNIST")
    root = tmp_path / "data"
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(root), download=True, mirror=file_server.url))
    message = str(info.value)
    assert "md5" in message
    assert "f68b3c2dcbeaaa9fbdd348bbdeb94873" in message  # the official md5 of train-images-idx3-ubyte.gz
    assert file_server.url + "train-images-idx3-ubyte.gz" in message
    assert not any(root.glob("*ubyte*")) and not any(root.glob(".*ubyte*"))


def test_load_download_fetches_idx_files_from_mirror(tmp_path, file_server, monkeypatch):
    arrays = write_idx_dataset(file_server.root, 30, 12, gz=True, seed=4)
    downloads = tuple((f"{stem}.gz", download.md5sum(file_server.root / f"{stem}.gz")) for stem in IDX_STEMS)
    monkeypatch.setitem(DATASETS, "mnist", dataclasses.replace(offline(DATASETS["mnist"]), downloads=downloads))
    root = tmp_path / "data"
    cfg = DataConfig(name="mnist", root=str(root), download=True, mirror=file_server.url)
    spec, train, test = load(cfg)
    assert len(train) == 30 and len(test) == 12
    assert np.array_equal(train.images[:, 0].numpy(), arrays[0]) and test.labels.tolist() == arrays[3].tolist()
    assert locate(spec, root) == root
    assert file_server.total() == 4
    load(cfg)  # present now: found, not fetched again
    assert file_server.total() == 4


def test_load_without_download_never_contacts_the_mirror(tmp_path, file_server):
    with pytest.raises(DataError):
        load(DataConfig(name="mnist", root=str(tmp_path), download=False, mirror=file_server.url))
    assert file_server.total() == 0


# ---------------------------------------------------------------- CIFAR-10 archive


def test_extract_cifar_archive_then_locate(tmp_path):
    root = tmp_path / "data"
    archive = root / "cifar-10-python.tar.gz"
    train, test = write_cifar_archive(archive, 4, 6)
    with pytest.raises(DataError):
        locate(DATASETS["cifar10"], root)
    catalog._extract(archive, root)
    assert locate(DATASETS["cifar10"], root) == root / CIFAR_DIR
    _, train_split, test_split = load(DataConfig(name="cifar10", root=str(root)))
    assert len(train_split) == 20 and len(test_split) == 6
    assert np.array_equal(test_split.images.numpy(), test[0]) and test_split.labels.tolist() == test[1]


def test_catalog_fetch_downloads_and_unpacks_cifar_once(tmp_path, file_server):
    archive = file_server.root / "cifar-10-python.tar.gz"
    write_cifar_archive(archive, 3, 5)
    spec = dataclasses.replace(offline(DATASETS["cifar10"]), downloads=(("cifar-10-python.tar.gz", download.md5sum(archive)),))
    root = tmp_path / "data"
    assert catalog.fetch(spec, root, file_server.url) == root / CIFAR_DIR
    assert {p.name for p in (root / CIFAR_DIR).iterdir()} >= {*spec.required, "batches.meta"}
    # A second call finds archive and folder in place: no request, no second unpacking over the files.
    marker_images = np.full((2, 3, 32, 32), 7, np.uint8)
    write_cifar_batch(root / CIFAR_DIR / "data_batch_1", marker_images, [1, 2])
    assert catalog.fetch(spec, root, file_server.url) == root / CIFAR_DIR
    assert file_server.total() == 1
    images, labels = read_cifar_batch(root / CIFAR_DIR / "data_batch_1")
    assert labels.tolist() == [1, 2] and int(images.max()) == 7


def test_extract_damaged_archive_is_named(tmp_path):
    root = tmp_path / "data"
    archive = root / "cifar-10-python.tar.gz"
    write_cifar_archive(archive, 2, 2)
    archive.write_bytes(archive.read_bytes()[:300])
    with pytest.raises(DataError) as info:
        catalog._extract(archive, root)
    assert str(archive) in str(info.value)


def test_extract_refuses_members_outside_root(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    archive = root / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"owned"))
    with pytest.raises(DataError) as err:
        catalog._extract(archive, root)
    assert str(archive) in str(err.value)
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize("bad_mirror", ["mirror.invalid/mnist/", "not a url"])
def test_fetch_mirror_without_a_scheme_falls_back(tmp_path, file_server, bad_mirror):
    files = [serve(file_server, "a.bin", b"payload")]
    paths = download.fetch(tmp_path / "dest", files, [bad_mirror, file_server.url])
    assert paths[0].read_bytes() == b"payload"


def test_fetch_a_mirror_that_does_not_speak_http_falls_back(tmp_path, file_server):
    import threading

    garbage = socket.socket()
    garbage.bind(("127.0.0.1", 0))
    garbage.listen(1)

    def answer_garbage() -> None:
        conn, _ = garbage.accept()
        conn.recv(1024)
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        conn.close()

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    files = [serve(file_server, "a.bin", b"payload")]
    url = f"http://127.0.0.1:{garbage.getsockname()[1]}/"
    paths = download.fetch(tmp_path / "dest", files, [url, file_server.url])
    thread.join(timeout=10)
    garbage.close()
    assert paths[0].read_bytes() == b"payload"


def test_downloaded_files_follow_the_umask_not_0600(tmp_path, file_server):
    old = os.umask(0o022)
    try:
        path = download.fetch(tmp_path / "dest", [serve(file_server, "a.bin", b"x" * 10)], [file_server.url])[0]
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_fifo_in_place_of_a_file_to_download_is_one_sentence_not_a_hang(tmp_path):
    """The md5 of a file already there was read with a plain open: a FIFO in its place held the download for ever."""
    from .test_formats import returns_within

    target = tmp_path / "train-images-idx3-ubyte.gz"
    os.mkfifo(target)
    error = returns_within(lambda: download.fetch(tmp_path, [(target.name, "0" * 32)], ["http://127.0.0.1:9/"]))
    assert isinstance(error, DataError) and str(error) == (f"{target} is a FIFO, not a regular file; put the dataset's "
                                                           f"own file there, or give another --data.root.")
    assert target.is_fifo()  # left as it was
