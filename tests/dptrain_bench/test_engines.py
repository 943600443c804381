"""The other engines of `dptrain bench` (lightning, deepspeed): their refusals, without running anything, and one real
point each (gloo on CPU, 2 workers, tiny synthetic data) whose row lands in results.csv."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dptrain import config as config_mod
from dptrain_bench import deepspeed_engine, engines, lightning_engine
from dptrain_bench.sweep import first_error, sweep_from_options
from dptrain.errors import ConfigError
from tests.dptrain_bench.test_sweep import TINY, read_rows, run_bench

SYNTH = [("data.name", "synthetic"), ("train.epochs", "2")]


def make(tmp_path: Path, **kw) -> None:
    args = dict(config_path=None, pairs=[*SYNTH, ("output.dir", str(tmp_path / "b"))], workers="1,2",
                strategies="ddp", repeats=1, warmup_epochs=None, engines="dptrain", run_timeout_s=60.0) | kw
    sweep_from_options(**args)


@pytest.mark.parametrize("engine, module", [("lightning", lightning_engine), ("deepspeed", deepspeed_engine)])
def test_a_missing_package_is_one_sentence_before_anything_runs(tmp_path, monkeypatch, engine, module):
    monkeypatch.setitem(sys.modules, module.PACKAGE, None)  # `import PACKAGE` fails, as where it is not installed
    with pytest.raises(ConfigError) as caught:
        module.check(config_mod.load(None, SYNTH))
    assert str(caught.value) == (f"--engines {engine} needs the {engine} package, which is not installed here; "
                                 f"pip install 'dptrain[{engine}]', or drop {engine} from --engines.")
    with pytest.raises(ConfigError, match=f"needs the {engine} package"):
        make(tmp_path, engines=f"dptrain,{engine}")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("kw, words", [
    (dict(engines="lightning", strategies="ddp,zero1"), "--engines lightning runs strategies ddp, fsdp only, not zero1"),
    (dict(engines="deepspeed", strategies="ddp,ps"), "--engines deepspeed runs strategies ddp, zero1, fsdp only, not ps"),
    (dict(engines="deepspeed", pairs=[*SYNTH, ("train.grad_clip", "1.0")]),
     "--engines deepspeed runs the plain loop, which has no train.grad_clip = 1.0"),
])
def test_what_a_peer_cannot_run_is_one_sentence(tmp_path, kw, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        make(tmp_path, **kw)


def test_issue_12s_sweep_runs_every_engine_on_its_own_strategies(tmp_path):
    from dptrain_bench.sweep import plan

    sweep, notes = sweep_from_options(config_path=None, pairs=[*SYNTH, ("output.dir", str(tmp_path / "b"))],
                                      workers="1,2", strategies="ddp,fsdp,zero1,ps", repeats=1, warmup_epochs=None,
                                      engines="dptrain,tutorial,lightning,deepspeed", run_timeout_s=60.0)
    assert notes == ["skipped the strategies these engines do not run: tutorial zero1, tutorial ps, lightning zero1, "
                     "lightning ps, deepspeed ps"]
    runs = {(p.engine, p.strategy) for p in plan(sweep)}
    assert runs == {("dptrain", "ddp"), ("dptrain", "fsdp"), ("dptrain", "zero1"), ("dptrain", "ps"),
                    ("tutorial", "ddp"), ("tutorial", "fsdp"), ("lightning", "ddp"), ("lightning", "fsdp"),
                    ("deepspeed", "ddp"), ("deepspeed", "zero1"), ("deepspeed", "fsdp")}
    assert len(plan(sweep)) == 2 * len(runs) and not (tmp_path / "b").exists()  # planned, nothing run


def test_an_option_the_plain_loop_lacks_is_still_refused_in_a_sweep_of_several_engines(tmp_path):
    with pytest.raises(ConfigError, match="--engines tutorial runs the plain loop, which has no train.bf16 = True"):
        make(tmp_path, engines="dptrain,tutorial,lightning", strategies="ddp,zero1", pairs=[*SYNTH, ("train.bf16", "true")])


def test_strategies_map_onto_zero_stages():
    cfg = config_mod.load(None, [*SYNTH, ("train.global_batch_size", "64"), ("strategy.name", "fsdp")])
    ds = deepspeed_engine.ds_config(cfg, 4)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 16, 1)
    assert ds["zero_optimization"] == {"stage": 3}
    assert deepspeed_engine.STAGES == {"ddp": 0, "zero1": 1, "fsdp": 3}


def test_eval_batches_count_every_sample_once_and_alike_on_every_rank():
    import torch

    images, labels = torch.arange(65).view(65, 1, 1, 1), torch.arange(65)
    shards = [engines.eval_batches(images, labels, 16, rank, 2) for rank in range(2)]
    assert [len(s) for s in shards] == [3, 3]  # a sharded model's forward is a collective: as many on every rank
    assert [len(y) for _, y in shards[1]] == [16, 16, 0]
    seen = sorted(v for s in shards for _, y in s for v in y.tolist())
    assert seen == list(range(65))


def test_a_failed_peer_is_named_by_its_workers_exception():
    out = ("[rank0]: Traceback (most recent call last):\n[rank0]: TypeError: 'NoneType' object is not subscriptable\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
           "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert first_error(out, 1) == "TypeError: 'NoneType' object is not subscriptable"


def run_one(tmp_path: Path, engine: str, strategy: str, *extra: str, probes: Path | None = None) -> dict[str, str]:
    """One point of `engine`'s `strategy` on 2 workers (probes: a folder of this machine's probes to take)."""
    taken = ["--probes-from", str(probes)] if probes is not None else []
    assert run_bench(tmp_path, "--workers", "2", "--strategies", strategy, "--engines", engine,
                     "--output.dir", "out", *TINY, *extra, *taken) == 0
    [row] = read_rows(tmp_path / "out" / "results.csv")
    assert (row["engine"], row["strategy"], row["workers"], row["status"], row["global_batch_size"],
            row["epochs_timed"]) == (engine, strategy, "2", "ok", "32", "1")
    assert float(row["epoch_time_s"]) > 0 and float(row["images_per_s"]) > 0 and float(row["peak_mem_mb"]) > 0
    assert 0 <= float(row["eval_acc"]) <= 1 and 0 < float(row["eval_loss"]) < 10 and float(row["cpu_util_pct"]) > 0
    return row


def events(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "runs" / name / "metrics.jsonl").open()]


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lightning_point_writes_a_row(tmp_path, machine_probes):
    run_one(tmp_path, "lightning", "ddp", probes=machine_probes)
    run = events(tmp_path, "lightning-ddp-w2-r1")
    assert [e["event"] for e in run] == ["run_start", "epoch", "epoch", "run_end"]
    assert [e["step"] for e in run[1:]] == [8, 16, 16]  # 256 samples / 32 a step, per epoch
    assert run[1]["train_samples"] == 256 and run[1]["eval_count"] == 64 and len(run[1]["rss_max_mb"]) == 2
    env = json.loads((tmp_path / "out" / "runs" / "lightning-ddp-w2-r1" / "env.json").read_text())
    assert env["engine"] == "lightning" and env["lightning"].startswith("2.") and env["launched_by"] == "torchrun"
    assert not list((tmp_path / "out" / "runs" / "lightning-ddp-w2-r1").rglob("*.ckpt"))  # no checkpointing


@pytest.mark.nightly  # the default run keeps DeepSpeed's strategy (tests/strategies/test_deepspeed.py)
@pytest.mark.slow
@pytest.mark.timeout(180)  # 15 s here; DeepSpeed's first run on a machine compiles its CPU comm op (75 s), then cached
def test_deepspeed_zero3_point_writes_a_row(tmp_path, machine_probes):
    # 65 test samples in batches of 16: rank 1's last batch is empty, and ZeRO-3 still gathers with rank 0
    run_one(tmp_path, "deepspeed", "fsdp", "--data.synthetic_test_size", "65", "--train.eval_batch_size", "16",
            probes=machine_probes)
    run = events(tmp_path, "deepspeed-fsdp-w2-r1")
    assert run[0]["zero_stage"] == 3 and [e["event"] for e in run] == ["run_start", "epoch", "epoch", "run_end"]
    assert run[1]["train_samples"] == 256 and run[1]["eval_count"] == 65
