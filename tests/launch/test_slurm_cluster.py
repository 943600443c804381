"""The private SLURM cluster's own helpers (tests/slurm_cluster.py); its jobs are tested through dptrain's in
test_slurm_jobs.py (tasks on both nodes, a shared node, a requeue, scancel --signal reaching every task), and
scripts/slurm-cluster's plain form (its lab form: test_lab_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.lab_cluster import LabCluster
from tests.slurm_cluster import SlurmCluster, parse_scontrol_record


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
