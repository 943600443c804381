"""TensorBoard: rank 0's event files continue across resumes with one point per step; `dptrain tensorboard` serves them."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dptrain.cli import main
from dptrain.metrics import epoch_line
from dptrain.metrics.tensorboard import TensorBoardSink, free_port, logdir_args
from tests.conftest import read_events, run_cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "100", "--data.synthetic_test_size", "30",
         "--strategy.name", "single", "--train.global_batch_size", "32", "--train.log_every", "1", "--train.epochs", "5"]


def read_board(tb_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tb_dir))
    board.Reload()
    return board


@pytest.mark.slow
def test_a_resumed_run_continues_the_curves_with_one_point_per_step(tmp_path, monkeypatch):
    """4 steps an epoch. A: steps 1-6. B resumes from A's step-4 snapshot (A's steps 5, 6 must go) to step 8.
    C resumes from B's end to step 10. Every step tag then has exactly one point per step."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "run"
    named = [*SMALL, "--output.name", "run"]
    assert main(["train", *named, "--train.max_steps", "6"]) == 0
    assert main(["train", *named, "--train.max_steps", "8", "--train.resume", str(run / "checkpoints" / "step-00000004")]) == 0
    assert main(["train", *named, "--train.max_steps", "10"]) == 0
    board = read_board(run / "tb")
    scalars = board.Tags()["scalars"]
    assert {"train/loss", "train/lr", "epoch/train_loss", "epoch/eval_acc", "epoch/samples_per_s", "epoch/epoch_time_s",
            "epoch/peak_mem_mb", "epoch/lr", "util/cpu_util_pct/rank0", "util/rss_max_mb/rank0"} <= set(scalars)
    for tag in ("train/loss", "train/lr"):
        assert [e.step for e in board.Scalars(tag)] == list(range(1, 11)), tag
    # Epoch events: epoch 1 at 4 (A), A's partial epoch 2 at 6 purged, epoch 2 at 8 (B), partial epoch 3 at 10 (C).
    assert [e.step for e in board.Scalars("epoch/train_loss")] == [4, 8, 10]
    # The curves hold what metrics.jsonl holds, at the same steps (B's and C's step events, A's up to step 4).
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_loss = {e["step"]: e["loss"] for e in jsonl if e["event"] == "step"}
    curve = board.Scalars("train/loss")
    assert [e.value for e in curve] == pytest.approx([last_loss[e.step] for e in curve], rel=1e-6)
    # The config and the environment as text, once per process at the step it started from; hparams at each end.
    texts = board.Tensors("config/text_summary")
    assert [t.step for t in texts] == [0, 4, 8]
    assert "global_batch_size = 32" in texts[0].tensor_proto.string_val[0].decode()
    assert "torch" in board.Tensors("environment/text_summary")[0].tensor_proto.string_val[0].decode()
    assert [e.step for e in board.Scalars("hparams/eval_acc")] == [8, 10]  # A's, at step 6, went with B's purge
    # Each epoch's line in the text tab, as the console prints it (the tutorials read their log there), one per step
    # as TensorBoard's server shows it (its accumulator, unlike read_board's, purges text too).
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    served = EventAccumulator(str(run / "tb"))
    served.Reload()
    lines = served.Tensors("epoch lines/text_summary")
    assert [t.step for t in lines] == [4, 8, 10]
    shown = [t.tensor_proto.string_val[0].decode() for t in lines]
    assert [line.split(" | ")[0] for line in shown] == ["Epoch 1/2", "Epoch 2/2", "Epoch 3/3"]
    epochs = [e for e in jsonl if e["event"] == "epoch"]
    assert shown[-1] == epoch_line(epochs[-1], 3)


def test_each_run_is_named_by_its_folder_even_alone(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "tb").mkdir(parents=True)
    (tmp_path / "x" / "a" / "tb").mkdir(parents=True)
    # alone too: a plain --logdir of its tb/ made TensorBoard list the run as "."
    assert logdir_args([tmp_path / "a"]) == ["--logdir_spec", f"a:{tmp_path}/a/tb"]
    flag, spec = logdir_args([tmp_path / "a", tmp_path / "b", tmp_path / "x" / "a"])
    assert flag == "--logdir_spec"
    assert spec == f"a:{tmp_path}/a/tb,b:{tmp_path}/b/tb,a-2:{tmp_path}/x/a/tb"


def test_a_missing_run_dir_or_one_without_tb_is_one_sentence(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["tensorboard", str(tmp_path / "nope")]) == 2
    assert main(["tensorboard", str(tmp_path / "empty")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"dptrain: error: the run folder {tmp_path / 'nope'} does not exist; give a run folder, runs/<name> or an --output.dir.",
                     f"dptrain: error: {tmp_path / 'empty'} has no tb/ folder: no run with TensorBoard files has been "
                     f"written there yet."]


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_the_tensorboard_command_serves_the_runs_on_loopback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.max_steps", "3", "--output.name", "run"]) == 0
    assert main(["train", *SMALL, "--train.max_steps", "2", "--output.name", "other"]) == 0
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "tensorboard", "runs/run", "runs/other", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, tags = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            tags = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
            if tags and {"run/.", "other/."} <= set(tags):  # logdir_spec names each run name/<folder under it>
                break
            time.sleep(0.5)
        assert tags and {"run/.", "other/."} <= set(tags), (tags, proc.poll())
        assert "train/loss" in tags["run/."] and "epoch/eval_acc" in tags["other/."]
        points = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=run/.&tag=train/loss")
        assert [step for _, step, _ in points] == [1, 2, 3]
    finally:
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert f"at http://127.0.0.1:{port}/" in out
    assert f"ssh -N -L {port}:127.0.0.1:{port} " in out
    assert "TensorBoard stopped" in out


def test_a_port_that_is_no_port_or_is_taken_and_a_file_given_as_run_dir_are_one_sentence(tmp_path, capsys):
    # Each was a 31- to 38-line traceback (TensorBoard's bind, socket's OverflowError), and a file "did not exist".
    (tmp_path / "runs" / "run" / "tb").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("not a run\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv in ([str(tmp_path / "runs" / "run"), "--port", "99999"], [str(tmp_path / "runs" / "run"), "--port", "-1"],
                     [str(tmp_path / "runs" / "run"), "--port", str(port)], [str(tmp_path / "notes.txt")]):
            assert main(["tensorboard", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "dptrain: error: --port 99999 is not a TCP port; pick one from 1024 to 65535, or leave --port out for a free one.",
        "dptrain: error: --port -1 is not a TCP port; pick one from 1024 to 65535, or leave --port out for a free one.",
        f"dptrain: error: port {port} on 127.0.0.1 is taken by another program; choose another --port, or leave it out "
        f"for a free one.",
        f"dptrain: error: {tmp_path / 'notes.txt'} is a file, not a run folder; give a run folder, runs/<name> or an --output.dir.",
    ]


@pytest.fixture
def full_tmpfs(tmp_path):
    """full_tmpfs(at) -> the folder `at`, now a fresh 1 MiB tmpfs (unmounted afterwards), for fill() to fill.
    Mounted as in tests/test_output_dir.py: root only, as this project's tests run."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; this machine's tests run as root")
    mounts = []

    def mount(at: Path) -> Path:
        at.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(at)], check=True)
        mounts.append(at)
        return at

    yield mount
    for folder in reversed(mounts):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Fill the disk of folder to its last byte (whatever this machine's page size)."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    (folder / "filler").write_bytes(b"\0" * free)
    assert os.statvfs(folder).f_bavail == 0


def tensorboard_warning(tb_dir: Path, step: int) -> str:
    return (f"TensorBoard files cannot be written to {tb_dir} at step {step} (No space left on device); the run goes "
            f"on without them: metrics.jsonl keeps every point.")


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.nightly)])
def test_a_full_disk_under_tb_is_one_warning_line_and_the_run_goes_on(full_tmpfs, tmp_path, workers):
    """It was 98 lines: the writer thread's traceback ("Exception in thread"), then the same OSError raised from
    SummaryWriter's constructor, and the run failed. TensorBoard's files are a copy of metrics.jsonl's points, so
    the run goes on without them (tensorboard.py's docstring)."""
    run_dir = tmp_path / "run"
    fill(full_tmpfs(run_dir / "tb"))
    result = run_cli(["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256",
                      "--data.synthetic_test_size", "64", "--train.epochs", "1", "--train.global_batch_size", "64",
                      "--output.dir", str(run_dir), "--nproc-per-node", str(workers)], tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "Traceback" not in said and "Exception in thread" not in said, said
    warnings = [line for line in said.splitlines() if "TensorBoard" in line]
    assert len(warnings) == 1 and warnings[0].endswith(" WARNING " + tensorboard_warning(run_dir / "tb", 0)), said
    assert read_events(run_dir, "run_end")  # metrics.jsonl has the whole run


def test_a_disk_that_fills_during_the_run_is_one_warning_line_and_no_thread_traceback(full_tmpfs, tmp_path, caplog,
                                                                                      monkeypatch):
    """The writer's thread meets the full disk: it printed its traceback ("Exception in thread"), and the writer
    raised the same OSError at the sink's next call, out of the training loop. Now: one warning, then nothing more
    is written (and nothing else said); the thread's exception reaches no hook."""
    seen_by_hook = []
    monkeypatch.setattr(threading, "excepthook", seen_by_hook.append)  # the hook Python would print with
    tb_dir = full_tmpfs(tmp_path / "tb")
    sink = TensorBoardSink(tb_dir, 0, {"train": {"epochs": 1}}, "epochs = 1", {"torch": "2"}, 1)
    fill(tb_dir)  # the event file's last page still has room: the write that needs a new page fails
    epoch = {"event": "epoch", "epoch": 1, "train_loss": 0.5, "train_acc": 0.9, "eval_loss": 0.6, "eval_acc": 0.8,
             "lr": 0.1, "epoch_time_s": 1.0, "samples_per_s": 100.0}
    with caplog.at_level(logging.WARNING, logger="dptrain"):
        for step in range(1, 1001):  # ~300 bytes each: past any page size long before the last
            sink.write({**epoch, "step": step})  # flushed: a failure shows at its own step
            if caplog.records:
                break
        failed_at = step
        for step in range(failed_at + 1, failed_at + 5):
            sink.write({**epoch, "step": step})
        sink.write({"event": "run_end", "step": step})
        sink.close()
    assert [r.getMessage() for r in caplog.records] == [tensorboard_warning(tb_dir, failed_at)]
    assert seen_by_hook == []
