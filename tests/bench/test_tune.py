"""dptrain bench --tune: the candidates, the model's pruning, the choice and its verification, tuned.toml."""

from __future__ import annotations

import csv
import json

import pytest

from dptrain import config
from dptrain.bench import tune
from dptrain.bench.tune import Candidate, Tuner
from dptrain.cli import main
from tests.conftest import run_cli

TINY = [("data.name", "synthetic"), ("data.synthetic_train_size", "512"), ("data.synthetic_test_size", "64"),
        ("train.global_batch_size", "32")]


def tuner(tmp_path, speeds: dict[str, float], verify: dict[str, float] | None = None, keep: int = 3) -> Tuner:
    """A Tuner of TINY on this machine as if it had 2 cores, over the named 1gbit link, whose probe runs take
    the images/s the test gives each candidate by name (verify: those of the verification runs)."""
    ran: list[tuple[str, str]] = []

    def run(_: Tuner, candidate: Candidate, label: str) -> float | None:
        ran.append((label, candidate.name))
        table = verify if label == "verify" and verify is not None else speeds
        return table.get(candidate.name, 100.0)

    t = Tuner(cfg=config.load(None, TINY), config_path=None, user_pairs=list(TINY), tune_dir=tmp_path / "tune",
              nodes=1, max_ranks=2, slurm=False, link_name="1gbit", keep=keep, run=run, shares={1: 1.0, 2: 0.7})
    t.ran = ran  # type: ignore[attr-defined]  # what the test looks at
    return t


def rows(t: Tuner) -> dict[str, dict]:
    with (t.tune_dir / "tune.csv").open() as f:
        return {row["candidate"]: row for row in csv.DictReader(f)}


def test_candidates_keep_the_global_batch_and_only_split_it_evenly():
    default = Candidate("ddp", 1)
    found = tune.candidates(default, max_ranks=4, nodes=3, global_batch=24, lossy=False)
    assert found[0] == default
    assert {c.ranks_per_node for c in found} == {1, 2, 4}  # 3 nodes x 1, 2, 4 ranks all split 24
    assert not any(c.comm_hook != "allreduce" for c in found)  # lossy hooks only when allowed
    assert {c.bucket_mb for c in found if c.strategy == "ddp"} == {None, 1.0, 4.0}
    assert not any(c.bucket_mb for c in found if c.strategy == "fsdp")
    odd = tune.candidates(default, max_ranks=4, nodes=3, global_batch=30, lossy=True)
    assert {c.ranks_per_node for c in odd} == {1, 2}  # 3 x 4 = 12 does not split 30
    assert {c.comm_hook for c in odd} == {"allreduce", "fp16", "bf16", "powersgd"}


def test_a_candidates_options_make_its_configuration():
    c = Candidate("zero1", 2, bucket_mb=4.0)
    cfg = config.load(None, [*TINY, *c.pairs()])
    assert (cfg.strategy.name, cfg.launch.nproc_per_node, cfg.strategy.ddp.bucket_mb) == ("zero1", 2, 4.0)
    assert tune.default_candidate(cfg, 2) == c


def test_the_model_ranks_more_ranks_first_where_they_compute_faster_and_the_link_is_free():
    work = tune.workload(config.load(None, TINY), compute_s_per_sample=1e-3)
    from dptrain.bench.model import Link

    free = Link("free", 0.0, 1e15, "no cost")
    ranked = tune.rank_by_model([Candidate("ddp", 1), Candidate("ddp", 2)], work.__class__(**{
        **work.__dict__, "rank_share": {1: 1.0, 2: 0.9}}), free, 1, None, overlap=0.5)
    assert [c.ranks_per_node for c, _ in ranked] == [2, 1]  # 2 x 0.9 of a rank's rate beats 1 x 1.0


def test_tune_probes_the_models_best_picks_the_fastest_and_writes_a_config_that_trains(tmp_path):
    t = tuner(tmp_path, speeds={"zero1-r2": 900.0, "ddp-r1": 500.0})
    tuned = tune.tune(t)
    probed = [name for label, name in t.ran if label == "probe"]
    assert probed[0] == "ddp-r1" or ("compute", "ddp-r1") in t.ran  # the default, measured once
    assert len([n for n in probed if n != "ddp-r1"]) <= 3  # the model's 3 best besides it, no more
    table = rows(t)
    assert all(row["predicted_images_per_s"] for row in table.values())  # every candidate predicted
    measured = {n: float(r["measured_images_per_s"]) for n, r in table.items() if r["measured_images_per_s"]}
    chosen = [n for n, r in table.items() if r["chosen"] == "True"]
    assert chosen == [max(measured, key=measured.get)]
    assert "zero1-r2" not in measured or chosen == ["zero1-r2"]
    cfg = config.load(tuned)  # tuned.toml loads as a --config
    assert (cfg.strategy.name, cfg.launch.nproc_per_node) == (table[chosen[0]]["strategy"],
                                                              int(table[chosen[0]]["ranks_per_node"]))
    assert "Chosen:" in (t.tune_dir / "tune.md").read_text()


def test_a_probe_winner_slower_in_the_verification_run_leaves_the_default(tmp_path):
    everyone_fast = {c.name: 1000.0 for c in tune.candidates(Candidate("ddp", 1), 2, 1, 32, False)}
    t = tuner(tmp_path, speeds={**everyone_fast, "ddp-r1": 100.0}, verify={"ddp-r1": 500.0})
    tuned = tune.tune(t)
    assert ("verify", "ddp-r1") in t.ran
    chosen = [n for n, r in rows(t).items() if r["chosen"] == "True"]
    assert chosen == ["ddp-r1"]
    assert config.load(tuned).strategy.name == "ddp" and config.load(tuned).launch.nproc_per_node == 1
    assert "so your configuration is kept" in (t.tune_dir / "tune.md").read_text()


def test_tune_options_are_checked_in_one_sentence(tmp_path, capsys):
    for argv, sentence in [
        (["--tune", "--workers", "2"], "--workers is an option of a sweep, not of --tune"),
        (["--tune", "--link", "5gbit"], "--link '5gbit' is no link the model knows"),
        (["--link", "1gbit"], "--link is an option of --tune; add --tune, or drop it."),
        (["--tune", "--nodes", "2"], "--nodes with --tune is the SLURM nodes to tune for; add --slurm"),
        (["--tune", "--tune-candidates", "0"], "--tune-candidates 0 probes nothing but your own configuration"),
    ]:
        code = main(["bench", *argv, "--output.dir", str(tmp_path / "t")])  # refused before anything runs
        err = capsys.readouterr().err
        assert code == 2 and sentence in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_tune_for_real_on_tiny_data_writes_its_table_and_a_config_that_trains(tmp_path):
    tiny = [arg for key, value in TINY for arg in (f"--{key}", value)]
    done = run_cli(["bench", "--tune", "--tune-candidates", "1", "--link", "1gbit", *tiny,
                    "--output.dir", str(tmp_path / "tune")], tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = tmp_path / "tune" / "tune.csv"
    with tuned.open() as f:
        table = list(csv.DictReader(f))
    measured = [row for row in table if row["measured_images_per_s"]]
    assert len(measured) >= 2 and all(float(row["measured_images_per_s"]) > 0 for row in measured)
    assert sum(row["chosen"] == "True" for row in table) == 1
    train = run_cli(["train", "--config", str(tmp_path / "tune" / "tuned.toml"), "--train.max_steps", "2",
                     "--output.dir", str(tmp_path / "run")], tmp_path, timeout=200)
    assert train.returncode == 0, train.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["event"] == "run_end"
