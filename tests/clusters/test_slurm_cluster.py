"""The private SLURM cluster's own helpers (tests/slurm_cluster.py); its jobs are tested through dptrain's in
test_slurm_jobs.py (tasks on both nodes, a shared node, a requeue, scancel --signal reaching every task), and
scripts/slurm-cluster's plain form (its lab form: test_lab_cluster.py), which empties only a folder it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.lab_cluster import LAB_FILE, LabCluster, LabNetwork
from tests.slurm_cluster import MARKER, SlurmCluster, _make_state_folder, parse_scontrol_record, read_small_file

SCRIPT = [sys.executable, str(REPO / "scripts" / "slurm-cluster")]


def test_parse_scontrol_record_keeps_values_with_equals_signs_and_spaces():
    line = ("JobId=7 JobName=x JobState=PENDING Reason=BeginTime Dependency=(null) TRES=cpu=2,node=1 Comment=a b c "
            "Restarts=1")
    record = parse_scontrol_record(line)
    assert record["TRES"] == "cpu=2,node=1"
    assert record["Comment"] == "a b c"
    assert record["Restarts"] == "1"


@pytest.mark.slow
def test_the_script_starts_and_stops_the_plain_two_node_cluster_as_before(tmp_path):
    """`scripts/slurm-cluster start DIR` without the lab options: nodes n1, n2 of this machine, the export line alone
    on stdout (what `eval "$(scripts/slurm-cluster start DIR)"` relies on), no lab network."""
    reason = SlurmCluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    state = tmp_path / "plain"
    script = [sys.executable, str(REPO / "scripts" / "slurm-cluster")]
    started = subprocess.run([*script, "start", str(state)], capture_output=True, text=True, timeout=90)
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout == f"export SLURM_CONF={state / 'slurm.conf'}\n"
        assert "# nodes n1, n2 in partition debug" in started.stderr
        nodes = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], capture_output=True, text=True,
                               env={**os.environ, "SLURM_CONF": str(state / "slurm.conf")}, timeout=30)
        assert nodes.stdout.split() == ["n1", "idle", "n2", "idle"], nodes.stderr
        assert not LabCluster.is_lab_folder(state)
    finally:
        stopped = subprocess.run([*script, "stop", str(state)], capture_output=True, text=True, timeout=90)
    assert stopped.returncode == 0 and f"stopped the cluster in {state}" in stopped.stderr, stopped.stderr
    assert SlurmCluster(state).supervisor_pid() is None


# ------------------------------------------------------------------ only a folder a start made is ever emptied

def _tree(root: Path) -> dict[str, tuple]:
    """Every entry below `root`, links not followed: a file's bytes, a link's target, a folder's mode."""
    found = {}
    for folder, dirs, files in os.walk(root):  # a link to a folder is listed in dirs, never entered
        for name in dirs + files:
            path = Path(folder) / name
            kind = ("link", os.readlink(path)) if path.is_symlink() else (
                ("dir", path.stat().st_mode) if path.is_dir() else ("file", path.read_bytes()))
            found[str(path.relative_to(root))] = kind
    return found


def _thesis(folder: Path) -> Path:
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "thesis.tex").write_text("precious\n")
    return folder


def _foreign_folder(tmp_path: Path) -> Path:
    return _thesis(tmp_path / "x")


def _link_to_a_clusters_folder(tmp_path: Path) -> Path:
    """A link to a folder that does carry the marker: refused for being a link, its target left as it is."""
    target = _thesis(tmp_path / "cluster")
    (target / MARKER).write_text("made by an earlier start\n")
    (tmp_path / "link").symlink_to(target)
    return tmp_path / "link"


def _link_to_a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("precious\n")
    (tmp_path / "link").symlink_to(tmp_path / "notes.txt")
    return tmp_path / "link"


def _dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return tmp_path / "link"


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "thesis.tex").write_text("precious\n")
    return tmp_path / "thesis.tex"


def _below_a_file(tmp_path: Path) -> Path:
    return _a_file(tmp_path) / "cluster"


FOREIGN = ("is not empty and no cluster was started in it before (it has no .slurm-cluster file), so start will not "
           "empty it; choose a new or empty folder")
LINK = ("is a symbolic link, and start never empties what a link points at; give the cluster a new or empty folder of "
        "its own")


@pytest.mark.parametrize("make, options, refusal", [
    (_foreign_folder, [], FOREIGN),
    (_foreign_folder, ["--hosts", "2"], FOREIGN),
    (_link_to_a_clusters_folder, [], LINK),
    (_link_to_a_file, [], LINK),
    (_dangling_link, [], LINK),
    (_a_file, [], "is a file, not a folder; give the cluster a new or empty folder"),
    (_below_a_file, [], "cannot hold a cluster (Not a directory); choose a new or empty folder"),
], ids=["foreign-folder", "foreign-folder-lab", "link-to-a-clusters-folder", "link-to-a-file", "dangling-link", "file",
        "below-a-file"])
def test_start_refuses_a_path_it_must_not_empty_in_one_line_and_leaves_everything_as_it_was(tmp_path, make, options,
                                                                                             refusal):
    """`start` on a folder it did not make (issue: `start x` deleted x/src/thesis.tex), a link (it emptied the
    target) or a file (a NotADirectoryError traceback): one sentence, exit 1, nothing made, changed or started."""
    state = make(tmp_path)
    before = _tree(tmp_path)
    done = subprocess.run([*SCRIPT, "start", str(state), *options], capture_output=True, text=True, timeout=90)
    if done.returncode == 0:  # a start that wrongly went ahead: its daemons must not outlive the test
        subprocess.run([*SCRIPT, "stop", str(state)], capture_output=True, timeout=90)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"slurm-cluster: {state} {refusal}\n")
    assert _tree(tmp_path) == before


def test_a_folder_an_earlier_start_made_is_emptied_without_following_a_link_in_it(tmp_path):
    """The second start in a folder empties it but for its marker; a link inside goes, what it points at stays."""
    outside = _thesis(tmp_path / "outside")
    state = tmp_path / "state"
    _make_state_folder(state)
    (state / "log").mkdir()
    (state / "log" / "slurmctld.log").write_text("an earlier cluster's log\n")
    (state / "log" / "to-a-file").symlink_to(outside / "src" / "thesis.tex")
    (state / "to-a-folder").symlink_to(outside)
    (state / "dangling").symlink_to(tmp_path / "nowhere")
    kept = _tree(outside)
    _make_state_folder(state)
    assert os.listdir(state) == [MARKER]
    assert _tree(outside) == kept


def test_an_empty_folder_is_adopted_as_it_is_and_marked(tmp_path):
    """An empty folder (pytest's own, as the test fixtures give) is kept, not replaced, and marked as a start's."""
    state = tmp_path / "empty"
    state.mkdir()
    inode = state.stat().st_ino
    _make_state_folder(state)
    assert (state.stat().st_ino, os.listdir(state)) == (inode, [MARKER])


def test_stop_on_a_folder_no_start_made_kills_nothing_and_deletes_nothing(tmp_path):
    """Pid files in a foreign folder naming a process whose command line only mentions a file of that folder (an
    editor, say): `stop` leaves that process running and the folder as it was."""
    folder = _thesis(tmp_path / "x")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                  str(folder / "src" / "thesis.tex")])
    try:
        (folder / "run").mkdir()
        for daemon in ("supervisor", "munged", "slurmctld", "slurmd-n1", "slurmd-n2"):
            (folder / "run" / f"{daemon}.pid").write_text(f"{bystander.pid}\n")
        before = _tree(tmp_path)
        done = subprocess.run([*SCRIPT, "stop", str(folder)], capture_output=True, text=True, timeout=90)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", f"no cluster was running from {folder}\n")
        assert bystander.poll() is None
        assert _tree(tmp_path) == before
    finally:
        bystander.kill()
        bystander.wait()


def test_a_lab_json_names_only_the_network_its_own_folder_made(tmp_path):
    """`stop` removes the network a folder's lab.json names: never another folder's (a copied lab.json), never one
    whose names could carry a path (they name the /etc/netns folders that are removed)."""
    folder = tmp_path / "lab"
    folder.mkdir()
    ours = LabNetwork(subnet=7, hosts=2, rate="1gbit", owner=LabCluster(folder, hosts=2).network_owner)
    ours.save(folder / LAB_FILE)
    assert LabCluster(folder).network == ours
    LabNetwork(7, 2, "1gbit", owner=f"dptrain lab cluster {tmp_path / 'other'}").save(folder / LAB_FILE)
    assert LabCluster(folder).network is None
    for planted in ({"subnet": "7/../../../tmp/x"}, {"hosts": "2"}, {"hosts": 0}, {"rate": 5}, {"rate": "fast"},
                    {"subnet": 251}, {"subnet": True}, {"owner": None}):
        (folder / LAB_FILE).write_text(json.dumps({**asdict(ours), **planted}))
        assert LabNetwork.load(folder / LAB_FILE) is None, planted


def test_files_read_from_a_state_folder_are_small_regular_files_or_nothing(tmp_path):
    """A pid file or lab.json of a folder `stop` is pointed at may be a link to /dev/zero or a FIFO, whose read would
    never end: such a file reads as nothing."""
    (tmp_path / "pid").write_text("123\n")
    (tmp_path / "big").write_text("1" * 65)
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    assert read_small_file(tmp_path / "pid", 64) == "123\n"
    assert [read_small_file(tmp_path / name, 64) for name in ("big", "zero", "fifo", "missing")] == [None] * 4


@pytest.mark.slow
def test_a_second_start_over_an_earlier_clusters_folder_works_and_follows_no_link(tmp_path):
    """start, stop, then start again in the same folder, a link to a folder of someone's planted in it: the second
    cluster starts, the link is gone, its target is as it was."""
    reason = SlurmCluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    state, outside = tmp_path / "cluster", _thesis(tmp_path / "outside")
    kept = _tree(outside)
    first = _start_and_stop(state)
    assert first.returncode == 0, first.stderr
    (state / "log" / "outside").symlink_to(outside)
    second = _start_and_stop(state)
    assert (second.returncode, second.stdout) == (0, f"export SLURM_CONF={state / 'slurm.conf'}\n"), second.stderr
    assert (state / MARKER).is_file() and not os.path.lexists(state / "log" / "outside")
    assert _tree(outside) == kept


def _start_and_stop(state: Path) -> subprocess.CompletedProcess:
    """`start` in `state`, then `stop`, asserting that the stop succeeded; returns the start's outcome."""
    try:
        return subprocess.run([*SCRIPT, "start", str(state)], capture_output=True, text=True, timeout=90)
    finally:
        stopped = subprocess.run([*SCRIPT, "stop", str(state)], capture_output=True, text=True, timeout=90)
        assert stopped.returncode == 0, stopped.stderr
