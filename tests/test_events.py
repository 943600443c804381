"""metrics.jsonl's schema (dptrain.events): the keys dptrain has always written, every event a run writes validated
against it, and the readers reading only fields the schema has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptrain import events
from dptrain.cli import main
from dptrain.events import EPOCH_EVENT, EVENT, SCHEMAS, STEP_EVENT, TIME, schema_problem
from dptrain.faults import SIGNAL_AT
from dptrain.metrics import tensorboard
from dptrain.reporting import run_record
from dptrain.stopping import EXIT_STOPPED
from tests.conftest import plan_runs

# metrics.jsonl's keys after "event" and "time", in the order dptrain writes them, as its readers (the lab's collect,
# the run card, TensorBoard, scripts that parse the [METRIC] line) have always read them: spelled out here, not taken
# from the schema, so that a field renamed or moved in the schema fails this test.
WRITTEN = {
    "run_start": ["world_size", "strategy", "model", "data", "global_batch_size", "total_steps", "device", "step",
                  "slurm_restarts", "agent_restarts", "slurm_job_id"],
    "step": ["epoch", "step", "loss", "lr", "straggler_rank", "straggler_host", "straggler_phase", "straggler_slower_pct"],
    "epoch": ["epoch", "step", "train_loss", "train_acc", "train_samples", "epoch_time_s", "samples_per_s",
              "model_flops_per_sample", "achieved_tflops", "peak_mem_mb", "lr", "skipped_steps", "mem_params_bytes",
              "mem_grads_bytes",
              "mem_optim_bytes", "comm_bytes_per_step", "comm_ms_per_step", "comm_exposed_ms_per_step",
              "own_compute_ms_per_step", "own_compute_cpu_ms_per_step", "data_wait_ms_per_step", "link_probe_ms",
              "link_probe_s", "straggler_rank",
              "straggler_host", "straggler_phase", "straggler_slower_pct", "cpu_util_pct",
              "rss_max_mb", "gpu_util_mean_pct", "gpu_util_max_pct", "gpu_mem_used_max_mb", "gpu_power_mean_w",
              "gpu_power_max_w", "eval_loss", "eval_acc", "eval_count", "eval_time_s"],
    "run_end": ["step"],
    "stopped": ["step", "message"],
    "signal": ["step", "signal", "received_at", "snapshot_at", "drill"],
    "requeue": ["step", "job_id"],
    "requeue_failed": ["step", "job_id", "reason"],
    "hang": ["step", "message", "ranks", "waited_s", "collective", "doing", "line"],
    "eval": ["snapshot", "step", "world_size", "eval_loss", "eval_acc", "eval_count", "eval_time_s"],
}
SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "100", "--data.synthetic_test_size", "30",
         "--train.global_batch_size", "32", "--train.log_every", "1", "--train.epochs", "2"]
plan_runs({"events/ddp": (["train", *SMALL, "--strategy.name", "ddp", "--launch.timeout_s", "60"], (2,))})


def test_the_schema_names_the_keys_dptrain_has_always_written():
    assert {name: list(schema.fields) for name, schema in SCHEMAS.items()} == WRITTEN
    assert EPOCH_EVENT.required == ("epoch", "step", "train_loss", "train_acc", "train_samples", "epoch_time_s",
                                    "samples_per_s", "peak_mem_mb", "lr", "mem_params_bytes", "mem_grads_bytes",
                                    "mem_optim_bytes", "comm_bytes_per_step")


def test_a_record_with_a_field_missing_unknown_or_out_of_order_is_not_an_event_dptrain_writes():
    step = {EVENT: "step", TIME: 1.5, "epoch": 1, "step": 3, "loss": 0.5, "lr": 0.001}
    assert schema_problem(step) is None
    assert schema_problem({**step, "loss_avg": 0.4}) == "step: unknown ['loss_avg'], missing []"
    assert schema_problem({k: v for k, v in step.items() if k != "lr"}) == "step: unknown [], missing ['lr']"
    swapped = {EVENT: "step", TIME: 1.5, "step": 3, "epoch": 1, "loss": 0.5, "lr": 0.001}
    assert schema_problem(swapped) == "step: fields ['step', 'epoch', 'loss', 'lr'] out of the order ['epoch', 'step', 'loss', 'lr']"
    assert schema_problem({TIME: 1.5, **step}) == "it does not start with event, time = 'step'"
    assert schema_problem({EVENT: "steps", TIME: 1.5}) == "no event is named 'steps'"
    # The optional fields may be left out (run_start outside SLURM and the agent) and follow any order among them
    start = {EVENT: "run_start", TIME: 1.0, **{k: 1 for k in WRITTEN["run_start"][:8]}}
    assert schema_problem(start) is None
    assert schema_problem({**start, "agent_restarts": 0, "slurm_restarts": 1, "slurm_job_id": "7"}) is None
    assert schema_problem({EVENT: "eval", **{k: 1 for k in WRITTEN["eval"]}}) is None  # dptrain eval's: no time


def test_the_readers_read_only_fields_of_the_events_they_read():
    epoch, step = set(EPOCH_EVENT.fields), set(STEP_EVENT.fields)
    assert set(tensorboard.STEP_SCALARS) <= step
    assert set(tensorboard.EPOCH_SCALARS) | set(tensorboard.FINAL_METRICS) <= epoch
    assert set(run_record.EPOCH_NUMBERS) | set(run_record.RANK_FIELDS) <= epoch
    assert set(events.EPOCH_MEASURES) <= epoch
    assert set(events.PER_RANK) <= epoch


def assert_written_by_the_schema(path: Path) -> list[dict]:
    """Every line of metrics.jsonl an event of the schema, each loop-written one (step, epoch) with its keys in the
    schema's order exactly (the [METRIC] line prints them in that order)."""
    written = [json.loads(line) for line in path.read_text().splitlines()]
    for event in written:
        assert schema_problem(event) is None, (schema_problem(event), event)
        if event[EVENT] in (STEP_EVENT.name, EPOCH_EVENT.name):
            fields = SCHEMAS[event[EVENT]].fields
            assert list(event) == [EVENT, TIME, *(f for f in fields if f in event)], event
    return written


@pytest.mark.slow
def test_every_event_of_a_stopped_and_resumed_run_is_one_of_the_schema(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    args = ["train", *SMALL, "--strategy.name", "single", "--output.dir", str(run_dir)]
    monkeypatch.setenv(SIGNAL_AT, "0:2:SIGUSR1:self")
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == EXIT_STOPPED
    monkeypatch.delenv(SIGNAL_AT)
    assert main(args) == 0
    written = assert_written_by_the_schema(run_dir / "metrics.jsonl")
    assert [e[EVENT] for e in written] == ["run_start", "step", "step", "signal", "stopped", "run_start", "step", "step", "epoch",
                                           "step", "step", "step", "step", "epoch", "run_end"]


@pytest.mark.slow
def test_every_event_of_a_two_rank_ddp_run_is_one_of_the_schema(planned_run):
    """Two ranks add the per-rank communication times (DDP's sampled step) to the epoch events."""
    written = assert_written_by_the_schema(planned_run("events/ddp", 2) / "metrics.jsonl")
    assert [e[EVENT] for e in written].count("epoch") == 2
    assert {"comm_bytes_per_step", "cpu_util_pct"} <= set(written[-2])
