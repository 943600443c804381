"""dptrain bench tune: the candidates and those that make the same run, the model's pruning, the choice beyond the
spread of repeated runs, tuned.toml."""

from __future__ import annotations

import csv
import json

import pytest

from dptrain import config
from dptrain_bench import tune
from dptrain_bench.tune import Candidate, Tuner
from dptrain.cli import main
from tests.conftest import run_cli

TINY = [("data.name", "synthetic"), ("data.synthetic_train_size", "512"), ("data.synthetic_test_size", "64"),
        ("train.global_batch_size", "32")]


def tuner(tmp_path, speeds: dict[str, float | list[float | None]], keep: int = 3, max_ranks: int = 2) -> Tuner:
    """A Tuner of TINY on this machine as if it had max_ranks cores, over the named 1gbit link, whose trial runs take
    the images/s the test gives each candidate by name (a list: its 1st, 2nd, ... run's, the last one's after that;
    None: a failed run; 100 for a name not given)."""
    ran: list[tuple[str, str]] = []

    def run(_: Tuner, candidate: Candidate, label: str) -> float | None:
        ran.append((label, candidate.name))
        given = speeds.get(candidate.name, 100.0)
        if not isinstance(given, list):
            return given
        nth = sum(1 for _, name in ran if name == candidate.name) - 1
        return given[min(nth, len(given) - 1)]

    t = Tuner(cfg=config.load(None, TINY), config_path=None, user_pairs=list(TINY), tune_dir=tmp_path / "tune",
              nodes=1, max_ranks=max_ranks, slurm=False, link_name="1gbit", keep=keep, run=run,
              shares={1: 1.0, 2: 0.7}, own_cpu={})
    t.ran = ran  # type: ignore[attr-defined]  # what the test looks at
    return t


def runs_of(t: Tuner, name: str) -> list[str]:
    return [label for label, n in t.ran if n == name]  # type: ignore[attr-defined]  # set by tuner()


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


def test_over_several_nodes_ddp_is_also_a_candidate_with_its_update_in_the_next_forward():
    default = Candidate("ddp", 1)
    on_one = tune.candidates(default, max_ranks=2, nodes=1, global_batch=32, lossy=True)
    assert not any(c.update_in_next_forward for c in on_one)  # it would give way to the shared-memory sum
    over_two = tune.candidates(default, max_ranks=2, nodes=2, global_batch=32, lossy=False)
    assert {(c.strategy, c.ranks_per_node, c.comm_hook) for c in over_two if c.update_in_next_forward} == {
        ("ddp", 1, "allreduce"), ("ddp", 2, "allreduce")}
    lossy = tune.candidates(default, max_ranks=1, nodes=2, global_batch=32, lossy=True)
    assert {c.comm_hook for c in lossy if c.update_in_next_forward} == {"allreduce", *tune.LOSSY_HOOKS}
    # Issue 45: on a rank's only core the transfer left running takes the CPU the next forward needed
    two_cores = tune.candidates(default, max_ranks=2, nodes=2, global_batch=32, lossy=False, cores_per_node=2)
    assert {c.ranks_per_node for c in two_cores if c.update_in_next_forward} == {1}  # 2 ranks: a core each
    one_core = tune.candidates(default, max_ranks=1, nodes=2, global_batch=32, lossy=True, cores_per_node=1)
    assert not any(c.update_in_next_forward for c in one_core) and Candidate("ddp", 1) in one_core
    c = Candidate("ddp", 1, comm_hook="powersgd", update_in_next_forward=True)
    cfg = config.load(None, [*TINY, *c.pairs()])
    assert cfg.strategy.ddp.update_in_next_forward and tune.default_candidate(cfg, 1) == c
    assert c.name == "ddp-powersgd-next-forward-r1"
    assert c.plan(shared_memory=False).update_in_next_forward
    assert not Candidate("ddp", 2, update_in_next_forward=True).plan(shared_memory=True).update_in_next_forward


def test_a_candidates_options_make_its_configuration():
    c = Candidate("zero1", 2, bucket_mb=4.0)
    cfg = config.load(None, [*TINY, *c.pairs()])
    assert (cfg.strategy.name, cfg.launch.nproc_per_node, cfg.strategy.ddp.bucket_mb) == ("zero1", 2, 4.0)
    assert tune.default_candidate(cfg, 2) == c


def test_over_several_nodes_diloco_is_also_a_candidate_with_its_exchange_behind_a_quarter_of_its_period():
    default = Candidate("ddp", 1)
    over_two = tune.candidates(default, max_ranks=1, nodes=2, global_batch=32, lossy=True)
    assert {(c.period, c.overlap_steps) for c in over_two if c.strategy == "diloco"} == {
        *((h, 0) for h in tune.PERIODS), *((h, h // 4) for h in tune.PERIODS)}
    assert not any(c.overlap_steps for c in over_two if c.strategy != "diloco")
    on_one = tune.candidates(default, max_ranks=2, nodes=1, global_batch=32, lossy=True)
    assert not any(c.overlap_steps for c in on_one)
    c = Candidate("diloco", 1, period=32, overlap_steps=8)
    cfg = config.load(None, [*TINY, *c.pairs()])
    assert (cfg.strategy.diloco.period, cfg.strategy.diloco.overlap_steps) == (32, 8)
    assert tune.default_candidate(cfg, 1) == c and c.name == "diloco-h32-behind8-r1"
    assert c.plan(shared_memory=False).overlap_steps == 8
    assert tune.changed(c, Candidate("diloco", 1, period=32)) == ["overlap_steps"]
    # the model credits streaming nothing on a one-core rank: a trial of its own measures it
    assert (tune.lossy_kind(c), tune.lossy_kind(Candidate("diloco", 1, period=32))) == ("diloco-behind", "diloco")


def test_the_model_ranks_more_ranks_first_where_they_compute_faster_and_the_link_is_free():
    work = tune.workload(config.load(None, TINY), compute_s_per_sample=1e-3)
    from dptrain_bench.scaling_model import Link

    free = Link("free", 0.0, 1e15, "no cost")
    ranked = tune.rank_by_model([Candidate("ddp", 1), Candidate("ddp", 2)], work.__class__(**{
        **work.__dict__, "rank_share": {1: 1.0, 2: 0.9}}), free, 1, None, overlap=0.5)
    assert [c.ranks_per_node for c, _ in ranked] == [2, 1]  # 2 x 0.9 of a rank's rate beats 1 x 1.0


def test_tune_tries_the_models_best_picks_the_fastest_and_writes_a_config_that_trains(tmp_path):
    t = tuner(tmp_path, speeds={"zero1-r2": 900.0, "ddp-r1": 500.0})
    tuned = tune.tune(t)
    tried = [name for label, name in t.ran if label == "trial"]
    assert tried[0] == "ddp-r1" or ("compute", "ddp-r1") in t.ran  # the default, measured once
    assert len([n for n in tried if n != "ddp-r1"]) <= 3  # the model's 3 best besides it, no more
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


def test_a_trial_winner_slower_when_run_again_leaves_the_default(tmp_path):
    fast_once = {c.name: [1000.0, 100.0] for c in tune.candidates(Candidate("ddp", 1), 2, 1, 32, False)}
    t = tuner(tmp_path, speeds={**fast_once, "ddp-r1": [100.0, 500.0]})
    tuned = tune.tune(t)
    assert runs_of(t, "ddp-r1") == ["compute", "repeat2"]
    table = rows(t)
    again = [n for n, r in table.items() if n != "ddp-r1" and len(r["runs"].split()) == 2]
    assert len(again) == tune.CONTENDERS  # the two best trials ran again, once: slower than yours, they stopped there
    chosen = [n for n, r in table.items() if r["chosen"] == "True"]
    assert chosen == ["ddp-r1"]
    assert config.load(tuned).strategy.name == "ddp" and config.load(tuned).launch.nproc_per_node == 1
    assert "so your configuration is kept" in (t.tune_dir / "tune.md").read_text()


def test_at_one_rank_every_bucket_cap_and_comm_hook_is_the_same_run_as_plain_ddp_and_single():
    gradients = 4.8e6  # the tutorials' CNN: more than any first bucket
    plain = tune.same_run(Candidate("ddp", 1), 1, gradients)
    for strategy in ("ddp", "single"):
        for hook in ("allreduce", *tune.LOSSY_HOOKS):
            for bucket in (None, *tune.BUCKETS_MB, 0.25):
                assert tune.same_run(Candidate(strategy, 1, hook, bucket), 1, gradients) == plain
    zero1 = {tune.same_run(Candidate("zero1", 1, hook, bucket), 1, gradients)
             for hook in ("allreduce", *tune.LOSSY_HOOKS) for bucket in (None, *tune.BUCKETS_MB)}
    assert len(zero1) == 1 and plain not in zero1  # its own optimizer wrapper still runs at one rank
    assert tune.same_run(Candidate("fsdp", 1), 1, gradients) != plain


def test_over_more_than_one_rank_every_bucket_cap_and_hook_is_its_own_run_unless_the_gradients_fit_one_bucket():
    options = [(hook, bucket) for hook in ("allreduce", *tune.LOSSY_HOOKS) for bucket in (None, *tune.BUCKETS_MB)]
    for nodes, ranks in ((1, 2), (2, 1)):  # a world of 2, on one node or over two
        for strategy in ("ddp", "zero1"):
            made = {tune.same_run(Candidate(strategy, ranks, h, b), nodes, 4.8e6) for h, b in options}
            assert len(made) == len(options)
    small = 0.5 * 2**20  # within every first bucket of 1 MiB and more: one bucket whatever the cap, but not 0.25 MiB
    made = {tune.same_run(Candidate("ddp", 2, h, b), 1, small) for h, b in options}
    assert len(made) == 1 + len(tune.LOSSY_HOOKS)  # the hooks still differ
    assert tune.same_run(Candidate("ddp", 2, bucket_mb=0.25), 1, small) != tune.same_run(Candidate("ddp", 2), 1, small)


def test_the_default_stands_for_every_candidate_that_makes_its_run():
    user = Candidate("ddp", 1, bucket_mb=4.0)
    found = tune.candidates(user, max_ranks=2, nodes=1, global_batch=32, lossy=True)
    same = tune.distinct(found, nodes=1, gradient_bytes=4.8e6)
    assert list(same)[0] == user
    assert {c.name for c in same[user]} == {"ddp-r1", "ddp-bucket1mb-r1", "ddp-fp16-r1", "ddp-bf16-r1",
                                            "ddp-powersgd-r1"}
    # zero1's one-rank run too stands as the candidate with the user's cap, tried first: chosen, it keeps that cap
    assert [c for c in same if c.ranks_per_node == 1] == [user, Candidate("zero1", 1, bucket_mb=4.0), Candidate("fsdp", 1)]
    assert sum(len(others) for others in same.values()) + len(same) == len(found)  # each candidate kept once
    assert all(not others for c, others in same.items() if c.ranks_per_node == 2)


def test_a_candidate_wins_only_when_each_of_its_runs_beats_each_of_the_defaults():
    user, other, third = Candidate("ddp", 1), Candidate("ddp", 2), Candidate("zero1", 2)
    overlapping = {user: [1865.0, 1990.0, 1720.0], other: [2058.0, 1950.0, 1800.0]}  # faster on average, not each time
    chosen, reason = tune.choose(user, overlapping)
    assert chosen == user
    assert "1,800-2,058 images/s over 3 runs" in reason and "1,720-1,990 images/s over 3 runs" in reason
    assert reason.endswith("so your configuration is kept")
    clear = {user: [1865.0, 1900.0, 1880.0], other: [2058.0, 2040.0, 2070.0], third: [1950.0, 1940.0, 1960.0]}
    chosen, reason = tune.choose(user, clear)
    assert chosen == other and "each of its 3 runs faster than each of yours" in reason
    assert "2,040-2,070 images/s over 3 runs, against 1,865-1,900 images/s over 3 runs" in reason
    too_few = {user: [1865.0, 1900.0], other: [2058.0, 2070.0]}
    assert tune.choose(user, too_few)[0] == user  # ahead in 2 runs each: not enough to tell them apart
    failed = {user: [1865.0, 1900.0, None], other: [2058.0, 2040.0, 2070.0]}
    chosen, reason = tune.choose(user, failed)
    assert chosen == user and "a run of your configuration failed" in reason
    one_failed = {user: [1865.0, 1900.0, 1880.0], other: [2058.0, None, 2070.0]}
    assert tune.choose(user, one_failed)[0] == user
    nothing_faster = {user: [1865.0], other: [1800.0], third: []}
    chosen, reason = tune.choose(user, nothing_faster)
    assert chosen == user and "no candidate's trial was faster than your configuration" in reason


def test_the_contenders_are_the_fastest_few_ahead_of_the_default():
    user = Candidate("ddp", 1)
    others = [Candidate("ddp", 2, bucket_mb=b) for b in (None, 1.0, 4.0)]
    runs = {user: [1000.0], others[0]: [1100.0], others[1]: [1300.0], others[2]: [1200.0],
            Candidate("fsdp", 2): [990.0]}
    # the fastest two, and beside them the one that keeps the user's cap (DDP's own), ahead too
    assert tune.contenders(user, runs) == [others[1], others[2]][:tune.CONTENDERS] + [others[0]]
    assert tune.contenders(user, {user: [1000.0], others[0]: [1100.0, 990.0]}) == []  # one run no faster: out
    assert tune.contenders(user, {user: [1000.0], others[0]: [None]}) == []


def test_tune_tries_one_of_the_candidates_that_make_the_same_run_and_keeps_your_bucket(tmp_path):
    # the issue: at one rank, ddp-bucket4mb-r1 measured 2,058 once against your ddp-r1's 1,865
    t = tuner(tmp_path, speeds={"ddp-r1": 1865.0, "ddp-bucket4mb-r1": 2058.0, "ddp-bucket1mb-r1": 2000.0},
              max_ranks=1)
    tuned = tune.tune(t)
    table = rows(t)
    assert [n for n, r in table.items() if r["chosen"] == "True"] == ["ddp-r1"]
    assert config.load(tuned).strategy.ddp.bucket_mb is None  # nothing presented as a finding
    ran = {name for _, name in t.ran}  # type: ignore[attr-defined]  # set by tuner()
    assert "ddp-bucket4mb-r1" not in ran and "ddp-bucket1mb-r1" not in ran
    assert set(table["ddp-r1"]["same_run"].split()) == {"ddp-bucket1mb-r1", "ddp-bucket4mb-r1"}
    assert tuned.read_text().startswith("# dptrain bench tune kept your configuration (ddp-r1)")
    assert "ddp-r1 (the same run: ddp-bucket1mb-r1, ddp-bucket4mb-r1)" in (t.tune_dir / "tune.md").read_text()


def test_a_trial_winner_within_the_spread_of_repeated_runs_leaves_the_default_and_tune_md_shows_each_run(tmp_path):
    # faster in its trial and again in its second run, slower than one of yours in its third
    t = tuner(tmp_path, speeds={"ddp-r1": [1865.0, 1900.0, 1880.0], "zero1-r1": [2058.0, 1950.0, 1850.0]})
    tuned = tune.tune(t)
    table = rows(t)
    assert [n for n, r in table.items() if r["chosen"] == "True"] == ["ddp-r1"]
    assert runs_of(t, "ddp-r1") == ["compute", "repeat2", "repeat3"]
    assert runs_of(t, "zero1-r1") == ["trial", "repeat2", "repeat3"]
    assert [float(r) for r in table["zero1-r1"]["runs"].split()] == [2058.0, 1950.0, 1850.0]
    assert config.load(tuned).strategy.name == "ddp"
    text = (t.tune_dir / "tune.md").read_text()
    assert "| 2,058; 1,950; 1,850 | 1,850-2,058 |" in text
    assert "| 1,865; 1,900; 1,880 | 1,865-1,900 |  | default, chosen | chosen (your configuration) |" in text
    assert "no candidate beat your configuration by more than the spread of their runs" in text


def test_a_candidate_ahead_in_every_run_is_chosen_with_its_spread(tmp_path):
    t = tuner(tmp_path, speeds={"ddp-r1": [500.0, 520.0, 510.0], "ddp-r2": [900.0, 880.0, 910.0]})
    tuned = tune.tune(t)
    table = rows(t)
    assert [n for n, r in table.items() if r["chosen"] == "True"] == ["ddp-r2"]
    assert len(table["ddp-r2"]["runs"].split()) == len(table["ddp-r1"]["runs"].split()) == tune.REPEATS
    assert len(t.ran) <= 1 + 1 + t.keep + (tune.REPEATS - 1) * (1 + tune.CONTENDERS)  # type: ignore[attr-defined]
    assert config.load(tuned).launch.nproc_per_node == 2
    assert tuned.read_text().startswith("# dptrain bench tune chose ddp-r2")
    assert "880-910 images/s over 3 runs, against 500-520 images/s over 3 runs" in (t.tune_dir / "tune.md").read_text()


def test_tune_options_are_checked_in_one_sentence(tmp_path, capsys):
    for argv, sentence in [
        (["tune", "--workers", "2"], "--workers is an option of `dptrain bench sweep` and `dptrain bench probe "
                                     "matmul`, not of `dptrain bench tune`"),
        (["--tune", "--workers", "2"], "--workers is an option of `dptrain bench sweep` and `dptrain bench probe "
                                       "matmul`, not of `dptrain bench tune`"),  # the spelling of before
        (["tune", "--link", "5gbit"], "--link '5gbit' is no link the model knows"),
        (["sweep", "--link", "1gbit"], "--link is an option of `dptrain bench tune`, not of `dptrain bench sweep`"),
        (["tune", "--nodes", "2"], "--nodes of bench tune is the SLURM nodes to tune for; add --slurm"),
        (["tune", "--candidates", "0"], "--candidates 0 tries nothing but your own configuration"),
    ]:
        code = main(["bench", *argv, "--output.dir", str(tmp_path / "t")])  # refused before anything runs
        err = capsys.readouterr().err
        errors = [line for line in err.strip().splitlines() if line.startswith("dptrain: error:")]
        assert code == 2 and sentence in err and len(errors) == 1, (argv, err)  # the old spelling's note besides
    assert not (tmp_path / "t").exists()


@pytest.mark.slow  # the default run's one real tune (issue 43 keeps a real tune in it): about 20 s
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
    folded = {name for row in table for name in row["same_run"].split()}
    assert "ddp-bucket4mb-r1" in folded  # at one rank, the same run as ddp-r1: not tried apart
    tried = [run.name for run in (tmp_path / "tune" / "runs").iterdir()]
    assert not [name for name in tried if name.endswith(tuple(f"-{same}" for same in folded))], tried
    default, chosen = [next(row for row in table if row[mark] == "True") for mark in ("default", "chosen")]
    if chosen is not default:  # each of its runs faster than each of the default's
        assert len(chosen["runs"].split()) == tune.REPEATS
        assert float(chosen["min_images_per_s"]) > float(default["max_images_per_s"])
    train = run_cli(["train", "--config", str(tmp_path / "tune" / "tuned.toml"), "--train.max_steps", "2",
                     "--output.dir", str(tmp_path / "run")], tmp_path, timeout=200)
    assert train.returncode == 0, train.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["event"] == "run_end"


def test_the_workload_counts_in_the_parameters_own_element_size():
    """fp16, bf16 and PowerSGD's bytes are counted in elements of the parameters' size: a float64 model's are 8 bytes
    (the workload said 4 whatever the model)."""
    import torch

    from dptrain_bench.tune import workload

    cfg = config.load(None, [("data.name", "synthetic")])
    assert workload(cfg, 1e-3).element_size == 4
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert workload(cfg, 1e-3).element_size == 8
    finally:
        torch.set_default_dtype(default)


def test_of_two_winners_within_each_others_spread_the_one_that_keeps_your_bucket_is_chosen():
    """Issue 42: ddp-r2 and ddp-bucket1mb-r2 both beat the user's ddp-r1 in every run, but overlap each other; tune
    took the faster on average and wrote the incidental bucket_mb = 1.0 into tuned.toml."""
    user, keeps, bucket1 = Candidate("ddp", 1), Candidate("ddp", 2), Candidate("ddp", 2, bucket_mb=1.0)
    overlapping = {user: [1000.0, 1020.0, 1010.0], keeps: [1500.0, 1580.0, 1530.0], bucket1: [1520.0, 1600.0, 1550.0]}
    chosen, reason = tune.choose(user, overlapping)
    assert chosen == keeps, reason
    assert reason == ("ddp-r2 ran 1.52x your configuration, each of its 3 runs faster than each of yours (1,500-1,580 "
                      "images/s over 3 runs, against 1,000-1,020 images/s over 3 runs); ddp-bucket1mb-r2 was faster "
                      "on average but not beyond the spread of their runs (1,520-1,600 images/s over 3 runs), so its "
                      "bucket_mb = 1.0 is not taken")
    beyond = {**overlapping, bucket1: [1700.0, 1720.0, 1710.0]}  # its slowest faster than the other's fastest
    assert tune.choose(user, beyond)[0] == bucket1
    # A cap of the user's own is kept the same way, and every rank count has a candidate with it.
    mine = Candidate("ddp", 1, bucket_mb=2.0)
    assert Candidate("ddp", 2, bucket_mb=2.0) in tune.candidates(mine, 2, 1, 64, lossy=False)
    keeps = Candidate("ddp", 2, bucket_mb=2.0)
    assert tune.choose(mine, {mine: [1000.0] * 3, keeps: [1500.0, 1580.0, 1530.0], bucket1: [1520.0, 1600.0, 1550.0]}
                       )[0] == keeps



def accuracy_tuner(tmp_path, speeds: dict[str, float], accuracy: dict[str, float], budget: float | None = 0.5) -> Tuner:
    """tuner() with an accuracy budget, whose accuracy probes end at the accuracy the test gives each candidate by name
    (exact ddp's, REFERENCE, 0.9; a name not given: 0.9), on 10,000 test images."""
    t = tuner(tmp_path, speeds)
    probed: list[str] = []

    def probe(_: Tuner, candidate: Candidate) -> tune.Accuracy:
        probed.append(candidate.name)
        return tune.Accuracy(acc=accuracy.get(candidate.name, 0.9), loss=0.3, count=10_000)

    t.accuracy_budget, t.accuracy_steps, t.run_accuracy, t.lossy = budget, 100, probe, budget is not None
    t.probed = probed  # type: ignore[attr-defined]  # what the test looks at
    return t


def test_a_lossy_candidate_is_chosen_only_within_the_accuracy_budget_the_longest_period_first(tmp_path):
    """local SGD at period 64 is the fastest but loses 2 points in its probe: it gives way to period 16, tried and
    probed then, which loses 0.1 and is chosen; PowerSGD, fast too, loses 0.8 of a budget of 0.5."""
    speeds = {"ddp-r1": 500.0, "local_sgd-h64-r2": 950.0, "local_sgd-h16-r2": 900.0, "ddp-powersgd-r2": 920.0}
    t = accuracy_tuner(tmp_path, speeds, {"local_sgd-h64-r2": 0.88, "local_sgd-h16-r2": 0.899,
                                          "ddp-powersgd-r2": 0.892})
    tuned = tune.tune(t)
    table = rows(t)
    assert [n for n, r in table.items() if r["chosen"] == "True"] == ["local_sgd-h16-r2"]
    cfg = config.load(tuned)
    assert (cfg.strategy.name, cfg.strategy.local_sgd.period, cfg.launch.nproc_per_node) == ("local_sgd", 16, 2)
    assert t.probed[0] == "ddp-r1" and {"local_sgd-h64-r2", "local_sgd-h16-r2", "ddp-powersgd-r2"} <= set(t.probed)
    assert "local_sgd-h4-r2" not in t.probed  # period 16 kept within the budget: no shorter one tried
    assert float(table["local_sgd-h64-r2"]["accuracy_gap_points"]) == pytest.approx(2.0)
    assert table["local_sgd-h64-r2"]["why"] == "out of the accuracy budget (+2.00 points from ddp's, budget 0.5)"
    assert table["ddp-powersgd-r2"]["why"].startswith("out of the accuracy budget (+0.80 points")
    # its parameters averaged once in 16 steps: a sixteenth of ddp's gradients a step, on 2 ranks
    assert int(table["local_sgd-h16-r2"]["bytes_per_step"]) * 16 == pytest.approx(
        int(table["ddp-r2"]["bytes_per_step"]), rel=1e-5)
    text = (t.tune_dir / "tune.md").read_text()
    assert "| bytes a step |" in text and "Accuracy budget: 0.5 points" in text
    assert "exact ddp's accuracy after 100 steps: 0.9000" in text.lower()


def test_without_an_accuracy_budget_tune_keeps_to_exact_candidates(tmp_path, capsys):
    t = tuner(tmp_path, speeds={"ddp-r1": 500.0, "ddp-powersgd-r2": 5000.0, "local_sgd-h64-r2": 5000.0})
    tune.tune(t)
    assert all(r["comm_hook"] == "allreduce" and r["strategy"] not in tune.PERIODIC for r in rows(t).values())
    assert "Without --accuracy-budget only candidates that compute what ddp computes" in (
        t.tune_dir / "tune.md").read_text()
    code = main(["bench", "tune", "--lossy", "--output.dir", str(tmp_path / "t")])
    assert code == 2 and ("--lossy candidates round or delay the gradients and are chosen only within an accuracy "
                          "budget; add --accuracy-budget POINTS (0.5, say), or drop --lossy.") in capsys.readouterr().err


def test_where_one_test_image_is_more_than_half_the_budget_the_loss_decides():
    reference = tune.Accuracy(acc=0.9, loss=0.30, count=10_000)
    assert tune.gap_of(reference, tune.Accuracy(0.896, 0.5, 10_000), 0.5)[1:] == (True, "accuracy")
    assert tune.gap_of(reference, tune.Accuracy(0.894, 0.3, 10_000), 0.5)[1:] == (False, "accuracy")
    few = tune.Accuracy(acc=0.9, loss=0.30, count=64)  # one image: 1.6 points
    assert tune.gap_of(few, tune.Accuracy(0.875, 0.3014, 64), 0.5)[1:] == (True, "loss")  # within 0.5% of the loss
    assert tune.gap_of(few, tune.Accuracy(0.9, 0.302, 64), 0.5)[1:] == (False, "loss")
