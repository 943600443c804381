"""Fixtures of the launcher tests."""

from __future__ import annotations

import pytest

from tests.slurm_cluster import SlurmCluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """One private SLURM cluster (tests/slurm_cluster.py) for the whole session; skipped, with the reason, where
    this machine cannot run one."""
    reason = SlurmCluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
