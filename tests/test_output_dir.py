"""A run directory that cannot be written: one sentence naming the path and the cause, and nothing left half-written.

The full and read-only disks are real: small tmpfs mounts (root only, as on the project's machines and CI).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dptrain.cli import main

RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
       "--train.epochs", "1", "--train.global_batch_size", "64", "--checkpoint.every_epochs", "0"]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only) -> a fresh tmpfs folder of that many bytes; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; this machine's tests run as root")
    mounts = []

    def mount(size: int, read_only: bool = False) -> Path:
        folder = tmp_path / f"mnt{len(mounts)}"
        folder.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_an_output_path_that_is_a_file_is_one_sentence(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("mine")
    assert main([*RUN, "--output.dir", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dptrain: error: the run directory {target} is a file; choose another --output.name or --output.dir."
    assert target.read_text() == "mine"
    assert main([*RUN, "--output.dir", str(target / "sub")]) == 2
    assert f"the run directory {target / 'sub'} cannot be made: {target} is a file" in capsys.readouterr().err


def test_a_read_only_folder_is_one_sentence(tmpfs, capsys):
    folder = tmpfs(1 << 20, read_only=True)
    assert main([*RUN, "--output.dir", str(folder / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dptrain: error: the run directory {folder / 'run'} cannot be written: {folder} is not writable for you; "
                   f"choose another --output.dir, or fix its permissions.")


@pytest.mark.parametrize("size_mb, what", [(3, "the final weights"), (10, "a snapshot")])
def test_a_full_disk_is_one_sentence_and_leaves_no_temporary_file(tmpfs, capsys, size_mb, what):
    """mnist-cnn's weights take 4.8 MB and a snapshot with Adam's state 14.5 MB: 3 MB fails the weights, 10 MB the snapshot."""
    folder = tmpfs(size_mb << 20)
    run_dir = folder / "run"
    assert main([*RUN, "--output.dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: rank 0 failed during "), err
    assert f"could not write {what}" in err[0] and "(No space left on device)" in err[0], err
    assert err[0].endswith("then run the same command to resume from the last snapshot.") or \
        err[0].endswith("then run the same command: it resumes from the last snapshot."), err
    leftovers = [p.name for p in run_dir.rglob("*") if ".tmp" in p.name]
    assert leftovers == []
    assert (run_dir / "metrics.jsonl").is_file()  # what was written before is kept
