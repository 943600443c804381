"""files.written_atomically: the old file or the new one, never half of one, and no temporary file left behind."""

from __future__ import annotations

import os

import pytest

from dptrain.files import written_atomically


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "model.pt"
    path.write_text("old")
    with pytest.raises(RuntimeError), written_atomically(path) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_whole_write_replaces_the_file_closed_to_group_and_others_whatever_the_umask(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("old")
    old = os.umask(0o002)
    try:
        with written_atomically(path) as tmp:
            tmp.write_text("new")
    finally:
        os.umask(old)
    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_temporary_file_left_by_a_killed_writer_of_this_pid_is_written_over(tmp_path):
    path = tmp_path / "latest"
    (tmp_path / f".latest.{os.getpid()}.tmp").write_text("stale")
    with written_atomically(path) as tmp:
        tmp.write_text("step-00000004\n")
    assert path.read_text() == "step-00000004\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
