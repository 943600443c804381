"""The private SLURM cluster's own helpers (tests/slurm_cluster.py); its jobs are tested through dptrain's in
test_slurm_jobs.py (tasks on both nodes, a shared node, a requeue, scancel --signal reaching every task)."""

from __future__ import annotations

from tests.slurm_cluster import parse_scontrol_record


def test_parse_scontrol_record_keeps_values_with_equals_signs_and_spaces():
    line = ("JobId=7 JobName=x JobState=PENDING Reason=BeginTime Dependency=(null) TRES=cpu=2,node=1 Comment=a b c "
            "Restarts=1")
    record = parse_scontrol_record(line)
    assert record["TRES"] == "cpu=2,node=1"
    assert record["Comment"] == "a b c"
    assert record["Restarts"] == "1"
