"""`dptrain submit --rehearse` without a cluster: the twins' options, the percentiles, the refusals."""

from __future__ import annotations


import pytest

from dptrain import config
from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.rehearsal import FAIL, OK, Table, percentiles, twin_overrides
from dptrain.slurm.job import job_for


JOB = [("slurm.nodes", "2"), ("slurm.requeue", "true"), ("slurm.signal_lead_s", "90")]


@pytest.fixture
def job(tmp_path):
    cfg = config.load(None, [*JOB, ("output.dir", str(tmp_path / "runs" / "job"))])
    return cfg, job_for(cfg, tmp_path)


def test_each_twin_is_the_job_with_a_short_run_in_a_folder_of_its_own(job, tmp_path):
    cfg, the_job = job
    twins = {name: config.load(None, [*JOB, *twin_overrides(cfg, the_job, name, 200, 4, True)])
             for name in ("preempted", "sigterm", "uninterrupted")}
    assert {n: t.output.run_dir for n, t in twins.items()} == {
        n: tmp_path / "runs" / "job" / "rehearsal" / n for n in twins}
    assert [(t.slurm.requeue, t.slurm.signal_lead_s, t.slurm.time) for t in twins.values()] == [
        (True, 90, "12"), (False, 0, "1"), (False, 90, "12")]  # the lead's minutes and 10 more; SLURM's smallest limit
    assert [t.train.max_steps for t in twins.values()] == [200, 10**9, 200]  # sigterm: until its time limit
    assert {t.checkpoint.keep_last for t in twins.values()} == {7}  # every signal's snapshot kept


def test_too_few_steps_for_the_drills_is_refused_in_one_sentence(job):
    cfg, the_job = job
    with pytest.raises(ConfigError) as refused:
        twin_overrides(cfg, the_job, "preempted", 5, 4, True)
    assert str(refused.value) == ("--rehearse-steps 5 leaves no room for 4 drills and the stop after step 2; give at "
                                  "least 8 steps, or fewer --rehearse-drills.")


def test_p95_is_the_nearest_rank_so_with_20_values_or_fewer_the_largest():
    assert percentiles([float(v) for v in range(1, 21)]) == (10.5, 19.0)
    assert percentiles([0.4, 0.1, 0.2]) == (0.2, 0.4)
    assert percentiles([3.0]) == (3.0, 3.0)


def test_a_table_fails_when_a_row_does_and_draws_as_markdown():
    table = Table()
    table.add("signal reaches every rank: SIGUSR1", OK, "5 of 5 | all")
    assert not table.failed
    table.add("requeued, resumed from that snapshot", FAIL, "never started")
    assert table.failed
    assert table.markdown().splitlines()[2] == "| signal reaches every rank: SIGUSR1 | ok | 5 of 5 / all |"


def test_then_submit_needs_rehearse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--then-submit", "--data.name", "synthetic"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dptrain: error: --then-submit submits the job after its rehearsal, so it needs --rehearse; without it, "
        "dptrain submit submits the job at once.")
