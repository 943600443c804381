"""`dptrain bench`'s command line: the subcommands sweep, tune, probe matmul and probe link each take their own
options; one of another subcommand is refused in one sentence naming it; the spellings of before the subcommands
(`bench --workers ...`, `bench --tune ...`) still work, with one line of note. Nothing is run here: the subcommands'
functions are replaced by ones that record what they were given (the sweep itself: test_sweep.py)."""

from __future__ import annotations

import logging

import pytest

from dptrain_bench import cli as bench_cli, link, peak
from dptrain_bench.link import LinkProbe, Timing, read_link
from dptrain_bench.peak import Probe
from dptrain.cli import main

COMMANDS = ("cmd_sweep", "cmd_tune", "cmd_probe_matmul", "cmd_probe_link")


@pytest.fixture
def given(monkeypatch) -> list[tuple[str, object, list]]:
    """(the subcommand's function, its options, its --section.option pairs) of every `dptrain bench` run from here."""
    calls: list[tuple[str, object, list]] = []
    for name in COMMANDS:
        monkeypatch.setattr(bench_cli, name, lambda args, pairs, name=name: calls.append((name, args, pairs)) or 0)
    return calls


def test_each_subcommand_parses_its_own_options(given):
    assert main(["bench", "sweep", "--workers", "1,2", "--strategies", "ddp", "--repeats", "2", "--slurm", "--nodes",
                 "2", "--dry-run", "--probes-from", "earlier", "--output.dir", "out", "--train.epochs", "1"]) == 0
    assert main(["bench", "tune", "--lossy", "--candidates", "2", "--link", "1gbit", "--slurm", "--nodes", "2",
                 "--config", "run.toml"]) == 0
    assert main(["bench", "probe", "matmul", "--workers", "1,2", "--dtype", "bfloat16", "--threads", "1"]) == 0
    assert main(["bench", "probe", "link", "--world", "2,4", "--sizes", "256", "--min-s", "0.01", "--record", "b"]) == 0
    (_, sweep, sweep_pairs), (_, tune, tune_pairs), (_, matmul, _), (_, link_args, _) = given
    assert [name for name, _, _ in given] == list(COMMANDS)
    assert (sweep.workers, sweep.strategies, sweep.repeats, sweep.nodes, sweep.dry_run, sweep.probes_from) == (
        "1,2", "ddp", 2, "2", True, "earlier")
    assert sweep_pairs == [("output.dir", "out"), ("train.epochs", "1")]
    assert (tune.lossy, tune.candidates, tune.link, tune.nodes, tune.config, tune_pairs) == (
        True, 2, "1gbit", "2", "run.toml", [])
    assert (matmul.workers, matmul.dtype, matmul.threads) == ("1,2", "bfloat16", 1)
    assert (link_args.world, link_args.sizes, link_args.min_s, link_args.record) == ("2,4", "256", 0.01, "b")


def test_tunes_old_option_names_are_aliases_of_its_new_ones(given):
    assert main(["bench", "tune", "--tune-lossy", "--tune-candidates", "5"]) == 0
    [(_, tune, _)] = given
    assert tune.lossy is True and tune.candidates == 5


@pytest.mark.parametrize("argv, sentence", [
    (["tune", "--workers", "2"], "--workers is an option of `dptrain bench sweep` and `dptrain bench probe matmul`, "
                                 "not of `dptrain bench tune`"),
    (["sweep", "--link", "1gbit"], "--link is an option of `dptrain bench tune`, not of `dptrain bench sweep`"),
    (["sweep", "--candidates=2"], "--candidates is an option of `dptrain bench tune`, not of `dptrain bench sweep`"),
    (["tune", "--probes-from", "earlier"], "--probes-from is an option of `dptrain bench sweep`, not of"),
    (["probe", "link", "--workers", "2"], "--workers is an option of `dptrain bench sweep` and `dptrain bench probe "
                                          "matmul`, not of `dptrain bench probe link`"),
    (["probe", "matmul", "--config", "run.toml"], "--config is an option of `dptrain bench sweep`, `dptrain bench "
                                                  "tune` and `dptrain bench probe hooks`, not of `dptrain bench probe "
                                                  "matmul`"),
    (["--link", "1gbit"], "--link is an option of `dptrain bench tune`, not of `dptrain bench sweep`"),  # old spelling
    (["sweep", "--tune"], "--tune is the subcommand `dptrain bench tune` now; run that instead of `dptrain bench sweep`"),
])
def test_an_option_of_another_subcommand_is_refused_in_one_sentence(argv, sentence, given, capsys, tmp_path):
    assert main(["bench", *argv, "--output.dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1, err
    assert given == [] and not (tmp_path / "out").exists()


def test_the_spellings_of_before_the_subcommands_still_work_with_one_note(given, caplog):
    caplog.set_level(logging.INFO, logger="dptrain")
    assert main(["bench", "--workers", "1,2", "--strategies", "ddp", "--output.dir", "out"]) == 0
    notes = [r.getMessage() for r in caplog.records if "note" in r.getMessage()]
    assert notes == ["bench: note: `dptrain bench ...` without a subcommand is `dptrain bench sweep ...` now; read as "
                     "that"]
    caplog.clear()
    assert main(["bench", "--tune", "--tune-candidates", "1", "--link", "1gbit", "--output.dir", "t"]) == 0
    notes = [r.getMessage() for r in caplog.records if "note" in r.getMessage()]
    assert notes == ["bench: note: `dptrain bench --tune ...` is `dptrain bench tune ...` now; read as that"]
    (sweep_name, sweep, sweep_pairs), (tune_name, tune, tune_pairs) = given
    assert (sweep_name, sweep.workers, sweep.strategies, sweep_pairs) == ("cmd_sweep", "1,2", "ddp",
                                                                           [("output.dir", "out")])
    assert (tune_name, tune.candidates, tune.link, tune_pairs) == ("cmd_tune", 1, "1gbit", [("output.dir", "t")])
    caplog.clear()
    assert main(["bench", "sweep", "--workers", "1"]) == 0  # the new spelling: no note
    assert not [r for r in caplog.records if "note" in r.getMessage()]


def test_bench_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: dptrain bench")
    for line in ("sweep     measure scaling", "tune      find how to run one configuration fastest",
                 "probe     the matmul, link or hook probe alone"):
        assert line in out
    with pytest.raises(SystemExit):
        main(["bench", "probe", "--help"])
    out = capsys.readouterr().out
    assert "matmul" in out and "link" in out and "hooks" in out


def test_the_job_options_need_slurm_in_sweep_and_tune(capsys):
    for argv, each in ((["sweep", "--partition", "gpu"], "point"), (["tune", "--partition", "gpu"], "trial")):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err
        assert f"--partition is a job option; add --slurm to run every {each} as a SLURM job, or drop it." in err


def test_probe_matmul_prints_the_probes_of_a_fresh_python(monkeypatch, capsys):
    asked = []

    def measure(workers, device, dtype, threads=None):
        asked.append((workers, device, dtype, threads))
        return {w: Probe(device=device, dtype=dtype, workers=w, threads=1, tflops_by_size={512: 0.1 * w}) for w in workers}

    monkeypatch.setattr(peak, "measure", measure)
    assert main(["bench", "probe", "matmul", "--workers", "2,1", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert asked == [((1, 2), "cpu", "bfloat16", None)]
    assert "1 process (cpu, bfloat16, 1 thread each): peak 0.1 TFLOPS together" in out
    assert "2 processes (cpu, bfloat16, 1 thread each): peak 0.2 TFLOPS" in out


def test_probe_link_records_what_it_measured(monkeypatch, capsys, tmp_path):
    def measure(worlds, device, sizes=None, min_s=link.MIN_S):
        timings = [Timing(c, w, s, 1e-4 + s / 1e9) for w in worlds for c in link.COLLECTIVES for s in (1 << 10, 1 << 20)]
        return {w: LinkProbe(backend="gloo", device=device, world=w, hosts=1,
                             timings=[t for t in timings if t.world == w]) for w in worlds}

    monkeypatch.setattr(link, "measure", measure)
    assert main(["bench", "probe", "link", "--world", "2", "--record", str(tmp_path)]) == 0
    assert "2 processes on 1 host, gloo (cpu): latency" in capsys.readouterr().out
    recorded = read_link(tmp_path)
    assert recorded is not None and list(recorded.probes) == [(1, 2)]
    assert main(["bench", "probe", "link", "--world", "1"]) == 2
    assert "--world 1: a link needs two processes or more" in capsys.readouterr().err
