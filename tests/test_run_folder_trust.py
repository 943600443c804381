"""What eval and predict read from a run folder besides the snapshot, its config.toml, gets the snapshot's checks.

The configuration names the data eval scores and the model (even code to import): a group member who could edit it
changed the accuracy eval reported (0.7388 -> 0.9188, exit 0) before it was checked.
"""

from __future__ import annotations

import os

import pytest

from dptrain.cli import main

RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "16",
       "--train.epochs", "1", "--train.global_batch_size", "32"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished one-worker run, written under umask 002 (which grants the group write permission)."""
    folder = tmp_path_factory.mktemp("trust") / "run"
    old = os.umask(0o002)
    try:
        assert main([*RUN, "--output.dir", str(folder)]) == 0
    finally:
        os.umask(old)
    return folder


@pytest.mark.slow
def test_a_config_written_under_umask_002_is_closed_to_the_group_and_eval_reads_it(run_dir, capsys):
    assert (run_dir / "config.toml").stat().st_mode & 0o022 == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run_dir)]) == 0
    assert "eval_acc=" in capsys.readouterr().out


@pytest.mark.slow
def test_a_config_others_may_write_is_refused_before_it_is_read(run_dir, capsys):
    config = run_dir / "config.toml"
    original = config.read_text()
    config.chmod(0o664)
    try:
        for command in (["eval", "--checkpoint", str(run_dir)],
                        ["predict", "--checkpoint", str(run_dir), "--input", str(run_dir / "none.npy"),
                         "--output", str(run_dir / "p.csv")]):
            capsys.readouterr()
            assert main(command) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"dptrain: error: the run's configuration {config} is a file which others may write to "
                           f"(mode -rw-rw-r--); if you trust it, run 'chmod go-w {config}', else do not use it."]
    finally:
        config.chmod(0o644)
    assert config.read_text() == original and not (run_dir / "p.csv").exists()


def test_a_config_of_another_user_or_a_link_is_refused(run_dir, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root; this machine's tests run as root")
    config = run_dir / "config.toml"
    moved = tmp_path / "config.toml"
    config.rename(moved)
    try:
        config.symlink_to(moved)
        assert main(["eval", "--checkpoint", str(run_dir)]) == 2
        assert capsys.readouterr().err.strip() == (f"dptrain: error: the run's configuration {config} is a symbolic "
                                                   f"link, not a plain file; it is not read.")
        config.unlink()
        moved.rename(config)
        os.chown(config, 65534, 65534)
        assert main(["eval", "--checkpoint", str(run_dir)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"dptrain: error: the run's configuration {config} is owned by user id 65534, not by you (0); a file written "
            f"by someone else could change what is loaded or run code, so it is not read.")
    finally:
        if config.is_symlink():
            config.unlink()
        if moved.exists():
            moved.rename(config)
        os.chown(config, 0, 0)


@pytest.mark.slow
def test_a_run_named_as_an_older_dptrain_allowed_is_still_read(tmp_path, capsys):
    # output.name takes no spaces now; eval and predict of a run written before must not be refused for it.
    run = tmp_path / "old"
    assert main([*RUN, "--output.dir", str(run)]) == 0
    config = run / "config.toml"
    head, output, rest = config.read_text().partition("[output]\n")
    assert output and rest.startswith("name = ")
    config.write_text(head + output + 'name = "my run"\n' + rest.split("\n", 1)[1])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0, capsys.readouterr().err
    assert "eval_acc=" in capsys.readouterr().out


# ---- a FIFO in place of a file of the run: named as one, never taken for a missing file, never waited on -------------

def with_fifo(path):
    """path (a file) moved aside, a real FIFO in its place; the file back on leaving."""
    import contextlib

    @contextlib.contextmanager
    def swapped():
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        os.mkfifo(path)
        try:
            yield
        finally:
            path.unlink()
            aside.rename(path)

    return swapped()


@pytest.mark.parametrize("name, command, says", [
    ("metrics.jsonl", ["card", "{run}"], "dptrain: error: {path} is a FIFO, not a regular file; delete it, or give another folder."),
    ("metrics.jsonl", [*RUN, "--output.dir", "{run}"],
     "dptrain: error: {path} is a FIFO where the run keeps its file; move it away, or choose another --output.dir."),
    ("config.toml", ["eval", "--checkpoint", "{run}"],
     "dptrain: error: the run's configuration {path} is a FIFO, not a plain file; it is not read."),
    ("checkpoints/step-00000002/manifest.json", ["checkpoint", "verify", "{run}/checkpoints/step-00000002"],
     "dptrain: error: snapshot {run}/checkpoints/step-00000002 holds {path}, which is a FIFO, not a plain file; a "
     "snapshot holds plain files only, so it is not read."),
], ids=["card", "train", "eval", "verify"])
@pytest.mark.timeout(60)  # in this process: a command that opened the FIFO would wait there for ever
def test_a_fifo_in_place_of_a_file_of_the_run_is_said_to_be_one(run_dir, name, command, says, capsys):
    """metrics.jsonl, config.toml and manifest.json as FIFOs were reported as missing (`has no metrics.jsonl`, `is
    missing`, `has no manifest.json: it is incomplete`), and a run into the folder waited for ever at metrics.jsonl."""
    path = run_dir / name
    capsys.readouterr()
    with with_fifo(path):
        code = main([word.format(run=run_dir) for word in command])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [says.format(run=run_dir, path=path)]
