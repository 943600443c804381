"""A run folder that cannot be written: one sentence naming the path and the cause, and nothing left half-written.

The full and read-only disks are real: small tmpfs mounts (root only, as on the project's machines and CI).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from dptrain import snapshots
from dptrain.cli import main
from dptrain.metrics import JsonlSink
from tests.conftest import run_cli

RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "64",
       "--train.epochs", "1", "--train.global_batch_size", "64", "--checkpoint.every_epochs", "0"]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only, at) -> a fresh tmpfs folder of that many bytes (at a given folder); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; this machine's tests run as root")
    mounts = []

    def mount(size: int, read_only: bool = False, at: Path | None = None) -> Path:
        folder = at or tmp_path / f"mnt{len(mounts)}"
        folder.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
        mounts.append(folder)
        return folder

    yield mount
    for folder in reversed(mounts):  # a mount inside another first
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_an_output_path_that_is_a_file_is_one_sentence(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("mine")
    assert main([*RUN, "--output.dir", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dptrain: error: the run folder {target} is a file; choose another --output.name or --output.dir."
    assert target.read_text() == "mine"
    assert main([*RUN, "--output.dir", str(target / "sub")]) == 2
    assert f"the run folder {target / 'sub'} cannot be made: {target} is a file" in capsys.readouterr().err


def test_a_read_only_folder_is_one_sentence(tmpfs, capsys):
    folder = tmpfs(1 << 20, read_only=True)
    assert main([*RUN, "--output.dir", str(folder / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dptrain: error: the run folder {folder / 'run'} cannot be written: {folder} is not writable for you; "
                   f"choose another --output.dir, or fix its permissions.")


@pytest.mark.parametrize("part", ["checkpoints", "logs", "tb"])
def test_a_read_only_folder_inside_the_run_directory_is_refused_before_the_run_starts(tmpfs, tmp_path, capsys, part):
    # Found at the first snapshot, a read-only checkpoints/ cost the steps before it, and its sentence came with 15
    # lines of C++ frames from the other rank; logs/ and tb/ hid the run's details or its TensorBoard files.
    run_dir = tmp_path / "run"
    folder = tmpfs(1 << 20, read_only=True, at=run_dir / part)
    assert main([*RUN, "--output.dir", str(run_dir), "--nproc-per-node", "2"]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: {folder} is not writable for you, and the run writes "
                                               f"there; fix its permissions, or choose another --output.dir.")
    assert sorted(p.name for p in run_dir.iterdir()) == [part]  # nothing written


def test_a_file_where_the_run_keeps_a_folder_is_refused_before_the_run_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("mine")
    assert main([*RUN, "--output.dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: {run_dir / 'checkpoints'} is a file where the run keeps "
                                               f"its folder; move it away, or choose another --output.dir.")
    assert (run_dir / "checkpoints").read_text() == "mine"


# When the snapshots come: none before the end (then the final weights, then the final snapshot), or one every 2
# of the epoch's 4 steps (the snapshots of steps 2 and 4, then the final weights).
SNAPSHOTS = {"at the end": [], "every 2 steps": ["--checkpoint.every_steps", "2"]}
ONE_SENTENCE = re.compile(r"dptrain: error: rank (?P<rank>\d+) failed during [^:]+: "
                          r"could not write (?P<what>the final weights|a snapshot) "
                          r"(to|into) \S+ \(No space left on device\); free space or fix permissions there, "
                          r"then run the same command(?P<rerun>.*)")
RESUMES = {"the final weights": ": it resumes from the last snapshot.", "a snapshot": " to resume from the last snapshot."}
STARTS_AGAIN = " (no snapshot was written yet: it starts again from step 0)."


def pages(path: Path) -> int:
    """Bytes a file or folder takes on a tmpfs: each file's size rounded up to whole pages (folders take none)."""
    page = os.sysconf("SC_PAGESIZE")
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(-(-f.stat().st_size // page) * page for f in files)


@pytest.fixture(scope="module")
def ample_run(tmp_path_factory):
    """ample_run(argv) -> the run folder of `dptrain ARGV`, finished on an ample disk (once per module)."""
    made: dict[tuple[str, ...], Path] = {}

    def get(argv: list[str]) -> Path:
        if tuple(argv) not in made:
            root = tmp_path_factory.mktemp("ample")
            result = run_cli([*argv, "--output.dir", str(root / "run")], root)
            assert result.returncode == 0, result.stderr
            made[tuple(argv)] = root / "run"
        return made[tuple(argv)]

    return get


def fill(folder: Path) -> None:
    """Fill the disk of folder to its last byte."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    (folder / "filler").write_bytes(b"\0" * free)
    assert os.statvfs(folder).f_bavail == 0


# Every write on 1 worker; on 2, one case of each sentence (the run resumes: the final weights after two snapshots;
# it starts again: the first snapshot), which is what a second worker adds (its failure heard as the same one sentence)
@pytest.mark.slow
@pytest.mark.parametrize("what, saving, workers", [
    # the default run: a snapshot at the end (it starts again); the nightly tier every write (the final weights after
    # snapshots: it resumes)
    pytest.param("the final weights", "at the end", 1, marks=pytest.mark.nightly),
    pytest.param("the final weights", "every 2 steps", 1, marks=pytest.mark.nightly),
    ("a snapshot", "at the end", 1), pytest.param("a snapshot", "every 2 steps", 1, marks=pytest.mark.nightly),
    pytest.param("the final weights", "every 2 steps", 2, marks=pytest.mark.nightly),
    pytest.param("a snapshot", "at the end", 2, marks=pytest.mark.nightly)])
@pytest.mark.timeout(300)
def test_a_full_disk_is_one_sentence_and_leaves_no_temporary_file(tmpfs, tmp_path, ample_run, what, saving, workers):
    """The disk fills at the write named, whatever this machine's file sizes: a first run on an ample disk measures
    them, then a tmpfs holds everything written before that write and half of it. The rank logs are on a disk full
    from the start: a log line that cannot be written is dropped without a word (each printed logging's traceback)."""
    run = [*RUN, *SNAPSHOTS[saving], "--nproc-per-node", str(workers), "--launch.timeout_s", "60"]
    ample = ample_run(run)
    steps = sorted((ample / "checkpoints").glob(f"{snapshots.PREFIX}*"))
    weights = pages(ample / "model.pt")
    small = pages(ample) - weights - sum(map(pages, steps))  # config, metrics, logs, TensorBoard
    if saving == "at the end":
        written, failing = (0, weights) if what == "the final weights" else (weights, pages(steps[0]))
    elif what == "a snapshot":  # step 4's
        written, failing = pages(steps[0]), pages(steps[1])
    else:
        written, failing = sum(map(pages, steps)), weights
    margin = 64 * os.sysconf("SC_PAGESIZE")  # for what differs between the runs (the path in config.toml, times)
    assert failing // 2 > margin
    run_dir = tmpfs(small + margin + written + failing // 2) / "run"
    fill(tmpfs(1, at=run_dir / "logs"))

    result = run_cli([*run, "--output.dir", str(run_dir)], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Logging error" not in result.stderr + result.stdout and "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and (match := ONE_SENTENCE.fullmatch(lines[0])), result.stderr
    assert match["what"] == what, lines
    # rank 0 alone writes the final weights; every rank writes its part of a snapshot, and the first to fail is named
    assert int(match["rank"]) in ({0} if what == "the final weights" else set(range(workers))), lines
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob(f"{snapshots.PREFIX}*"))
    assert len(kept) == {"at the end": 0, "every 2 steps": 2 if what == "the final weights" else 1}[saving]
    assert match["rerun"] == (RESUMES[what] if kept else STARTS_AGAIN), lines
    for name in kept:  # what was written before is whole
        snapshots.verify(run_dir / "checkpoints" / name)
    assert [p.name for p in run_dir.rglob("*") if ".tmp" in p.name] == []
    assert (run_dir / "metrics.jsonl").read_text().endswith("\n")  # kept, in whole lines


@pytest.mark.slow
def test_a_disk_full_from_the_start_is_one_sentence_and_keeps_the_run_files(tmpfs, tmp_path):
    """config.toml, rewritten by every run of the folder, is replaced atomically (it was a 23-line OSError)."""
    run_dir = tmpfs(1) / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("# an earlier run's\n")
    fill(run_dir)
    result = run_cli([*RUN, "--output.dir", str(run_dir)], tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (f"dptrain: error: rank 0 failed during writing config.toml and env.json: could not "
                                     f"write {run_dir / 'config.toml'} (No space left on device); free space or fix "
                                     f"permissions there, then run the same command.")
    assert (run_dir / "config.toml").read_text() == "# an earlier run's\n"
    assert [p.name for p in run_dir.rglob("*") if ".tmp" in p.name] == []


@pytest.mark.slow
def test_metrics_that_cannot_be_written_are_one_sentence(tmpfs, tmp_path):
    """metrics.jsonl on a full disk (a link into a full tmpfs): it printed a 36-line chain of OSErrors."""
    full = tmpfs(1)
    fill(full)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to(full / "metrics.jsonl")
    result = run_cli([*RUN, "--output.dir", str(run_dir)], tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (f"dptrain: error: could not write the metrics to {run_dir / 'metrics.jsonl'} (No space "
                                     f"left on device); free space or fix permissions there, then run the same command.")


@pytest.mark.parametrize("text, kept", [("", ""), ('{"a": 1}\n', '{"a": 1}\n'), ('{"a": 1}\n{"b"', '{"a": 1}\n'),
                                        ('{"b"', ""), ("x" * 5000 + "\n" + "y" * 9000, "x" * 5000 + "\n")])
def test_a_metrics_line_cut_short_by_a_full_disk_goes_before_the_next_is_appended(tmp_path, text, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    sink = JsonlSink(path)
    sink.write({"event": "run_start"})
    sink.close()
    assert path.read_text() == kept + '{"event": "run_start"}\n'


ADOPTED = ("dptrain: error: the run folder {folder} holds files but no run of dptrain's (none of config.toml, "
           "metrics.jsonl, logs/, checkpoints/, ...); choose a new or empty folder, or an earlier run's, with another "
           "--output.dir or --output.name.")


@pytest.mark.parametrize("command", [
    ["train", "--dry-run", "--data.name", "synthetic"],
    ["train", "--data.name", "synthetic"],
    ["config", "--data.name", "synthetic"],
    ["doctor", "--data.name", "synthetic"],
    ["submit", "--dry-run", "--data.name", "synthetic"],
    ["train", "--", "script.py"],
    ["submit", "--dry-run", "--", "script.py"],
], ids=["dry run", "train", "config", "doctor", "submit", "train a script", "submit a script"])
def test_a_folder_of_other_files_is_not_adopted_as_a_run_folder(tmp_path, monkeypatch, capsys, command):
    """`--output.dir /etc -- script.py` made /etc/logs/launcher.log, and the dry run said it would write config.toml
    into /etc: a folder that holds files but none of a run's is refused before anything is written there (each command
    in this process: the refusal comes before any worker or job)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    (tmp_path / "script.py").write_text("open('ran', 'w')\n")
    monkeypatch.chdir(tmp_path)
    at = command.index("--") if "--" in command else len(command)
    code = main([*command[:at], "--output.dir", str(project), *command[at:]])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.strip().splitlines()[-1] == ADOPTED.format(folder=project)
    assert not (tmp_path / "ran").exists() and sorted(p.name for p in project.iterdir()) == ["notes.txt"]


def test_an_empty_folder_and_an_earlier_runs_folder_are_taken(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--dry-run", *RUN[1:], "--output.dir", str(empty)]) == 0
    scripts = tmp_path / "scripts_run"  # what a script's launch leaves: its logs only
    (scripts / "logs").mkdir(parents=True)
    (scripts / "logs" / "launcher.log").write_text("")
    assert main(["train", "--dry-run", *RUN[1:], "--output.dir", str(scripts)]) == 0
    doctored = tmp_path / "doctored"  # what `dptrain doctor` leaves
    doctored.mkdir()
    (doctored / "doctor.json").write_text("{}")
    assert main(["train", "--dry-run", *RUN[1:], "--output.dir", str(doctored)]) == 0
