"""The sweep's plan and checks, without running anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptrain_bench import sweep as sweep_mod
from dptrain_bench.sweep import cap_workers, describe_plan, first_error, plan, run_sweep, sweep_from_options
from dptrain.errors import ConfigError

SYNTH = [("data.name", "synthetic"), ("train.epochs", "3")]


def make(tmp_path: Path, **kw) -> sweep_mod.Sweep:
    args = dict(config_path=None, pairs=[*SYNTH, ("output.dir", str(tmp_path / "b"))], workers="1,2",
                strategies="ddp,fsdp", repeats=2, warmup_epochs=None, engines="dptrain", run_timeout_s=60.0) | kw
    return sweep_from_options(**args)[0]


def test_plan_is_repeat_major_and_alternates_direction(tmp_path):
    points = plan(make(tmp_path))
    assert [p.name for p in points] == [
        "dptrain-ddp-w1-r1", "dptrain-fsdp-w1-r1", "dptrain-ddp-w2-r1", "dptrain-fsdp-w2-r1",
        "dptrain-fsdp-w2-r2", "dptrain-ddp-w2-r2", "dptrain-fsdp-w1-r2", "dptrain-ddp-w1-r2"]


def test_build_defaults_and_train_args(tmp_path):
    sweep = make(tmp_path)
    assert sweep.warmup_epochs == 1 and sweep.bench_dir == tmp_path / "b"
    assert sweep.train_args == ("--data.name", "synthetic", "--train.epochs", "3")
    assert make(tmp_path, pairs=[("data.name", "synthetic"), ("train.epochs", "1")]).warmup_epochs == 0


def test_several_engines_skip_the_strategies_they_do_not_run_in_one_line(tmp_path):
    sweep, notes = sweep_from_options(config_path=None, pairs=[*SYNTH, ("output.dir", str(tmp_path / "b"))],
                                      workers="1,2", strategies="ddp,zero1,ps", repeats=1, warmup_epochs=None,
                                      engines="dptrain,tutorial", run_timeout_s=60.0)
    assert notes == ["skipped the strategies these engines do not run: tutorial zero1, tutorial ps"]
    names = [p.name for p in plan(sweep)]
    assert "tutorial-ddp-w1-r1" in names and not [n for n in names if n.startswith(("tutorial-zero1", "tutorial-ps"))]
    assert len(names) == 8 and "dptrain-ps-w1-r1" in names  # dptrain runs all three; ps at 1 worker too
    assert describe_plan(sweep, plan(sweep)).startswith("8 points (2 engines x 3 strategies x workers 1,2 x 1 repeats, "
                                                        "4 skipped)")


def test_a_worker_count_the_strategy_refuses_is_skipped(tmp_path):
    sweep, notes = sweep_from_options(config_path=None, pairs=[*SYNTH, ("strategy.ps.dedicated_server", "true")],
                                      workers="1,2", strategies="ddp,ps", repeats=1, warmup_epochs=None,
                                      engines="dptrain", run_timeout_s=60.0)
    assert [p.name for p in plan(sweep)] == ["dptrain-ddp-w1-r1", "dptrain-ddp-w2-r1", "dptrain-ps-w2-r1"]
    assert notes == ["skipped the worker counts dptrain's strategy refuses: dptrain ps at 1 worker (strategy ps with "
                     "dedicated_server needs at least 2 processes (a server and a worker); start more workers.)"]


def test_default_workers_are_capped_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_mod, "worker_cap", lambda device: (2, "CPU cores"))
    sweep, notes = sweep_from_options(config_path=None, pairs=SYNTH, workers=None, strategies="ddp", repeats=1,
                                      warmup_epochs=None, engines="dptrain", run_timeout_s=60.0)
    assert sweep.workers == (1, 2)
    assert notes == ["dropped workers 4,8: this machine has 2 CPU cores (one worker each); "
                     "ask for them with --workers to run them oversubscribed"]
    assert cap_workers((1, 2), 8, "GPUs") == ((1, 2), None)


@pytest.mark.parametrize("kw, words", [
    (dict(engines="nope"), "--engines nope is unknown"),
    (dict(strategies="ddp,zz"), "strategy.name"),
    (dict(workers="1,x"), "--workers 1,x is not a comma-separated list"),
    (dict(workers="0,2"), "below 1"),
    (dict(workers="1,3"), "train.global_batch_size 128 is not divisible by 3 workers"),
    (dict(warmup_epochs=3), "--warmup-epochs 3 leaves no timed epoch"),
    (dict(pairs=[("strategy.name", "ddp")]), "--strategy.name is set by the sweep for each point; use --strategies"),
    (dict(pairs=[("launch.nproc_per_node", "2")]), "use --workers"),
    (dict(engines="dptrain,tutorial", strategies="zero1,ps"),
     "--engines tutorial runs strategies ddp, fsdp only, none of --strategies zero1,ps; add one of them"),
    (dict(strategies="ddp,single", workers="2"), "strategy single cannot run on 2 processes"),
    (dict(engines="tutorial", pairs=[*SYNTH, ("optim.schedule", "cosine")]), "no optim.schedule = cosine"),
])
def test_mistakes_are_one_sentence(tmp_path, kw, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("-", r"\-")):
        make(tmp_path, **kw)


def test_resume_runs_missing_points_only(tmp_path, monkeypatch, machine_probes):
    sweep = make(tmp_path, strategies="ddp")
    sweep_mod.adopt_probes(machine_probes, sweep.bench_dir)  # what the probes measure is not this test's
    for point in plan(sweep)[:3]:  # three finished points; the fourth never started
        run_dir = sweep.run_dir(point)
        run_dir.mkdir(parents=True)
        events = [{"event": "run_start"}] + ([{"event": "run_end"}] if point.name != "dptrain-ddp-w2-r1" else [])
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (sweep.run_dir(plan(sweep)[2]) / sweep_mod.ERROR_FILE).write_text("worker failed: exit at teardown\n")
    ran: list[str] = []
    monkeypatch.setattr(sweep_mod, "run_point", lambda s, p: ran.append(p.name) or None)
    assert run_sweep(sweep) == []
    # the half-done one, the one that ended but failed, and the missing one, in plan order
    assert ran == ["dptrain-ddp-w2-r1", "dptrain-ddp-w2-r2", "dptrain-ddp-w1-r2"]


def test_a_resume_with_other_train_options_is_refused(tmp_path, monkeypatch, machine_probes):
    monkeypatch.setattr(sweep_mod, "run_point", lambda s, p: None)
    first = make(tmp_path)
    sweep_mod.adopt_probes(machine_probes, first.bench_dir)
    run_sweep(first)
    with pytest.raises(ConfigError, match="holds a sweep with other train options"):
        run_sweep(make(tmp_path, pairs=[*SYNTH, ("optim.lr", "0.1"), ("output.dir", str(tmp_path / "b"))]))


def test_first_error_prefers_dptrains_own_line():
    out = "INFO start\ndptrain: error: strategy single cannot run on 2 processes.\nTraceback\nValueError: x\n"
    assert first_error(out, 2) == "dptrain: error: strategy single cannot run on 2 processes."
    assert first_error("INFO a\nTraceback (most recent call last):\nRuntimeError: boom\n", 1) == "RuntimeError: boom"
    assert first_error("", 9) == "exit status 9"
    torchrun = ("terminate called without an active exception\nTraceback (most recent call last):\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                "  traceback : Signal 15 (SIGTERM) received by PID 2\n  traceback : Signal 6 (SIGABRT) received by PID 1\n")
    assert first_error(torchrun, 1) == "worker failed: Signal 6 (SIGABRT) received by PID 1"
