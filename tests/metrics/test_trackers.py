"""output.trackers: MLflow and Weights & Biases beside TensorBoard, read back for real: MLflow's store with MLflow's own
client, W&B's offline run folder record by record (its protobuf records, with no network). Rank 0 only, the same
events as metrics.jsonl, and a tracker that fails or is slow never stops or holds up training."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import struct
import threading
import zlib
from pathlib import Path

import pytest

from dptrain.config import load as load_config
from dptrain.errors import ConfigError
from dptrain.metrics.trackers import TrackerSink, metrics_of
from tests.conftest import read_events

# ---------------------------------------------------------------- the sink, with trackers of the test's own


class Recorder:
    """A tracker that records its calls; `gate`, where given, holds every log() until it is set."""

    def __init__(self, gate: threading.Event | None = None, fail_at: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.gate, self.fail_at = gate, fail_at
        self.held = threading.Event()  # set once log() waits at the gate

    def _call(self, name: str, *args) -> None:
        if name == self.fail_at:
            raise RuntimeError("the store is gone\nsecond line")
        self.calls.append((name, *args))

    def start(self, params):
        self._call("start", params)

    def log(self, metrics, step):
        if self.gate is not None:
            self.held.set()
            assert self.gate.wait(60)
        self._call("log", metrics, step)

    def artifact(self, path):
        self._call("artifact", path)

    def finish(self, status):
        self._call("finish", status)


EVENTS = [{"event": "run_start", "time": 1.0, "world_size": 2, "step": 0},
          {"event": "step", "time": 2.0, "epoch": 1, "step": 2, "loss": 2.3, "lr": 0.001},
          {"event": "epoch", "time": 3.0, "epoch": 1, "step": 4, "train_loss": 2.2, "train_samples": 128,
           "comm_bytes_per_step": [10, 12], "eval_loss": None},
          {"event": "run_end", "time": 4.0, "step": 4}]


def test_the_events_reach_a_tracker_as_metrics_jsonl_has_them(tmp_path):
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"weights")
    tracker = Recorder()
    sink = TrackerSink("recorder", tracker, {"optim": {"lr": 0.001, "betas": [0.9, 0.999]}}, weights)
    for event in EVENTS:
        sink.write(event)
    sink.close()
    assert tracker.calls == [
        ("start", {"optim.lr": 0.001, "optim.betas": "[0.9, 0.999]"}),
        ("log", {"step/loss": 2.3, "step/lr": 0.001, "step/epoch": 1.0}, 2),
        ("log", {"epoch/train_loss": 2.2, "epoch/train_samples": 128.0, "epoch/comm_bytes_per_step/rank0": 10.0,
                 "epoch/comm_bytes_per_step/rank1": 12.0}, 4),
        ("artifact", weights), ("finish", "finished")]


def test_a_run_that_ends_without_run_end_is_a_failed_one_and_a_stopped_one_is_stopped(tmp_path):
    failed, stopped = Recorder(), Recorder()
    for tracker, events in ((failed, EVENTS[:2]), (stopped, [*EVENTS[:2], {"event": "stopped", "step": 2}])):
        sink = TrackerSink("recorder", tracker, {}, tmp_path / "none.pt")
        for event in events:
            sink.write(event)
        sink.close()
    assert failed.calls[-1] == ("finish", "failed") and stopped.calls[-1] == ("finish", "stopped")


def test_training_never_waits_for_a_tracker():
    """write() returns while the tracker's thread is held inside log(); the calls then run in order."""
    gate = threading.Event()
    tracker = Recorder(gate=gate)
    sink = TrackerSink("slow", tracker, {}, Path("none.pt"))
    for event in EVENTS[:3]:
        sink.write(event)  # would wait for ever if it ran the tracker's log() itself
    assert tracker.held.wait(60)  # the tracker's thread is inside the first log(), held there
    assert [call[0] for call in tracker.calls] == ["start"]
    gate.set()
    sink.close()
    assert [call[0] for call in tracker.calls] == ["start", "log", "log", "finish"]


def test_a_failing_tracker_is_one_warning_line_and_the_rest_goes_on(caplog):
    tracker = Recorder(fail_at="start")
    sink = TrackerSink("broken", tracker, {}, Path("none.pt"))
    with caplog.at_level(logging.WARNING, logger="dptrain"):
        for event in EVENTS:
            sink.write(event)
        sink.close()
    assert tracker.calls == []  # nothing after the failure
    [record] = [r for r in caplog.records if r.name == "dptrain"]
    assert record.getMessage() == ("tracker broken failed at step 0 (RuntimeError: the store is gone); the run goes on "
                                   "without it: metrics.jsonl keeps every event")


def test_metrics_leave_out_the_step_and_nulls():
    assert metrics_of({"event": "step", "time": 1.0, "epoch": 1, "step": 3, "loss": None, "lr": 0.1}) == \
        {"step/epoch": 1.0, "step/lr": 0.1}


# ---------------------------------------------------------------- the options, checked before any worker starts


def test_trackers_are_named_from_the_registry_and_given_as_a_list():
    assert load_config(None, [("output.trackers", "mlflow,wandb")]).output.trackers == ("mlflow", "wandb")
    with pytest.raises(ConfigError, match="output.trackers"):
        load_config(None, [("output.trackers", "neptune")])


def test_a_tracker_that_is_not_installed_is_one_sentence(monkeypatch):
    import importlib.util

    from dptrain.prestart import check_trackers

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    with pytest.raises(ConfigError) as caught:
        check_trackers(load_config(None, [("output.trackers", "wandb")]))
    assert str(caught.value) == ("output.trackers wandb needs wandb, which is not installed here; run pip install "
                                 "'dptrain[wandb]', or leave wandb out of output.trackers.")


# ---------------------------------------------------------------- for real: a 2-rank run, read back

RUN = ["--nproc-per-node", "2", "--data.name", "synthetic", "--data.synthetic_train_size", "128",
       "--data.synthetic_test_size", "32", "--train.global_batch_size", "32", "--train.epochs", "2",
       "--train.log_every", "2", "--output.trackers", "mlflow,wandb"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    """The run folder of a 2-rank run that sends itself to an MLflow store and an offline W&B run in the folder: 2
    epochs, then the same command with a third, which resumes from the end of the second."""
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("tracked")
    home = {name: str(root / "wandb-home") for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR")}
    env = {**home, "WANDB_SILENT": "true"}
    for epochs in ("2", "3"):
        result = run_cli(["train", *RUN, "--train.epochs", epochs, "--output.dir", str(root / "run")], root,
                         timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "tracker" not in result.stdout + result.stderr  # no warning line of a failing tracker
    assert len(read_events(root / "run", "run_start")) == 2  # resumed once
    return root / "run"


@pytest.mark.slow
def test_mlflows_store_in_the_run_folder_holds_the_run_as_mlflows_client_reads_it(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tracked / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dptrain")
    [run] = client.search_runs([experiment.experiment_id])  # one run: rank 0's alone, gone on with by the resume
    assert run.info.run_id == (tracked / "mlflow" / "run_id").read_text().strip()
    assert (run.info.status, run.info.run_name) == ("FINISHED", "run")
    params = run.data.params
    assert (params["train.global_batch_size"], params["strategy.name"], params["output.trackers"]) == \
        ("32", "ddp", '["mlflow", "wandb"]')
    epochs = read_events(tracked, "epoch")
    history = client.get_metric_history(run.info.run_id, "epoch/train_loss")
    assert [(m.step, m.value) for m in history] == [(e["step"], e["train_loss"]) for e in epochs] and len(epochs) == 3
    losses = client.get_metric_history(run.info.run_id, "step/loss")
    assert [(m.step, m.value) for m in losses] == [(e["step"], e["loss"]) for e in read_events(tracked, "step")]
    [artifact] = client.list_artifacts(run.info.run_id)
    assert artifact.path == "model.pt"
    copy = Path(client.download_artifacts(run.info.run_id, "model.pt", str(tracked.parent)))
    assert copy.read_bytes() == (tracked / "model.pt").read_bytes()


def wandb_records(path: Path) -> list:
    """Every record of W&B's transaction log (run-<id>.wandb): LevelDB's log format under W&B's own 7-byte header
    (":W&B", magic 0xBEE1, version 0), each block of 32 KiB holding records of a 7-byte header (crc32, length, type:
    1 full, 2 first, 3 middle, 4 last), parsed as W&B's protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # the rest of a block too short for a header is padding
            offset += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0 and length == 0:
            break
        payload = data[offset + 7:offset + 7 + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
        offset += 7 + length
    return records


@pytest.mark.slow
def test_the_offline_wandb_run_folder_holds_the_run(tracked):
    # one W&B run, rank 0's alone: offline, each process group writes a folder of it, which `wandb sync` joins
    folders = sorted((tracked / "wandb").glob("offline-run-*"))
    run_id = (tracked / "wandb" / "dptrain-run-id").read_text().strip()
    assert len(folders) == 2 and all(folder.name.endswith(f"-{run_id}") for folder in folders)
    records = [*wandb_records(folders[0] / f"run-{run_id}.wandb"), *wandb_records(folders[1] / f"run-{run_id}.wandb")]
    by_kind: dict[str, list] = {}
    for record in records:
        by_kind.setdefault(record.WhichOneof("record_type"), []).append(record)
    run = by_kind["run"][0]
    assert [(r.run.run_id, r.run.display_name, r.run.project) for r in by_kind["run"]] == [(run_id, "run", "dptrain")] * 2
    config = {item.key: json.loads(item.value_json) for item in run.run.config.update}
    assert (config["train.global_batch_size"], config["strategy.name"]) == (32, "ddp")
    rows = [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            for record in by_kind["history"]]
    logged = {row["_step"]: row for row in rows}
    for epoch in read_events(tracked, "epoch"):
        assert logged[epoch["step"]]["epoch/train_loss"] == epoch["train_loss"]
    for step in read_events(tracked, "step"):
        assert logged[step["step"]]["step/loss"] == step["loss"]
    artifact = by_kind["artifact"][-1].artifact  # the second process group's final weights: the run's
    assert (artifact.type, artifact.name) == ("model", "run-weights")
    [entry] = artifact.manifest.contents
    weights = (tracked / "model.pt").read_bytes()
    assert entry.path == "model.pt" and entry.digest == base64.b64encode(hashlib.md5(weights).digest()).decode()


@pytest.mark.slow
def test_a_tracking_uri_given_takes_mlflows_run_there(tmp_path):
    """output.mlflow_uri: the store is that one (a database elsewhere here), not the run folder's."""
    from mlflow.tracking import MlflowClient

    from dptrain.metrics.trackers.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    cfg = load_config(None, [("output.dir", str(tmp_path / "run")), ("output.trackers", "mlflow"),
                             ("output.mlflow_uri", uri)])
    sink = TrackerSink("mlflow", MlflowTracker(cfg), {"optim": {"lr": 0.001}}, tmp_path / "run" / "model.pt")
    for event in EVENTS:
        sink.write(event)
    sink.close()
    assert not (tmp_path / "run" / "mlflow" / "mlflow.db").exists()
    [run] = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("dptrain").experiment_id])
    assert run.info.run_id == (tmp_path / "run" / "mlflow" / "run_id").read_text().strip()
    assert (run.info.status, run.data.params, run.data.metrics["epoch/train_loss"]) == ("FINISHED", {"optim.lr": "0.001"}, 2.2)
