"""What a resume may change, what it refuses, and damaged manifests: pure functions, no processes."""

from __future__ import annotations

import json

import pytest

from dptrain import checkpoint, config
from dptrain.checkpoint import SnapshotError
from dptrain.config import ConfigError


def cfg(*pairs: tuple[str, str]) -> config.RunConfig:
    return config.load(None, [("data.name", "synthetic"), *pairs])


def manifest_of(run: config.RunConfig, total_steps: int = 100) -> dict:
    return {"model": run.model.name, "strategy": run.strategy.name, "config_hash": checkpoint.config_hash(run),
            "config": checkpoint.computation_options(run), "schedule_steps": total_steps}


def test_paths_run_length_logging_and_device_may_change_the_math_may_not():
    base = checkpoint.config_hash(cfg())
    for key, value in (("data.root", "/elsewhere"), ("train.epochs", "9"), ("train.max_steps", "7"), ("train.log_every", "3"),
                       ("train.eval_batch_size", "17"), ("launch.device", "cpu"), ("launch.nproc_per_node", "4"),
                       ("checkpoint.every_steps", "10"), ("output.name", "other")):
        assert checkpoint.config_hash(cfg((key, value))) == base, key
    for key, value in (("optim.lr", "0.5"), ("train.global_batch_size", "64"), ("train.seed", "3"), ("train.bf16", "true"),
                       ("model.dropout", "false"), ("strategy.comm_hook", "fp16"), ("data.synthetic_train_size", "99")):
        assert checkpoint.config_hash(cfg((key, value))) != base, key


def test_a_refused_resume_names_the_option_and_both_values(tmp_path):
    saved = manifest_of(cfg())
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_compatible(saved, cfg(("optim.lr", "0.5"), ("train.seed", "3")), tmp_path, 100)
    assert str(refused.value) == (f"snapshot {tmp_path} was written with optim.lr = 0.001 but this run has 0.5 (and train.seed); "
                                  f"use the snapshot's setting, or another --output.name to start afresh.")


@pytest.mark.parametrize("schedule", ["cosine", "onecycle"])
def test_a_schedule_planned_for_the_run_length_refuses_another_length(tmp_path, schedule):
    run = cfg(("optim.schedule", schedule))
    checkpoint.check_compatible(manifest_of(run, 100), run, tmp_path, 100)  # the same length resumes
    with pytest.raises(ConfigError, match=f"follows a {schedule} learning-rate schedule planned for 100 steps, but this run would last 150"):
        checkpoint.check_compatible(manifest_of(run, 100), run, tmp_path, 150)
    constant = cfg()
    checkpoint.check_compatible(manifest_of(constant, 100), constant, tmp_path, 150)  # a constant rate may run longer


@pytest.mark.parametrize("manifest", ["{}", '{"files": []}', "[1, 2]", '{"world_size": 2, "strategy": "ddp"}', "not json"])
def test_a_damaged_manifest_is_one_sentence(tmp_path, manifest):
    snapshot = tmp_path / "step-00000003"
    snapshot.mkdir()
    (snapshot / checkpoint.MANIFEST).write_text(manifest)
    with pytest.raises(SnapshotError) as damaged:
        checkpoint.verify(snapshot)
    assert str(damaged.value) == f"snapshot {snapshot} has a damaged manifest.json."
    with pytest.raises(SnapshotError, match="no snapshot in .* can be used .*has a damaged manifest.json"):
        checkpoint.find_latest(tmp_path)  # refused, not crashed on, and not taken as "no snapshot: start afresh"


def test_a_manifest_listing_a_file_that_is_gone_is_incomplete(tmp_path):
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(
        {"world_size": 1, "strategy": "single", "model": "mnist-cnn", "config_hash": "x", "step": 3,
         "files": {"extra.pt": {"bytes": 1, "sha256": "0"}}}))
    with pytest.raises(SnapshotError, match="lacks extra.pt: it is incomplete"):
        checkpoint.verify(tmp_path)


def test_the_options_kept_in_a_manifest_compare_equal_after_the_json_round_trip(tmp_path):
    shape = ("data.synthetic_shape", "[3, 8, 8]")  # a tuple, which the manifest's JSON holds as a list
    saved = json.loads(json.dumps(manifest_of(cfg(shape))))
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_compatible(saved, cfg(shape, ("optim.lr", "0.5")), tmp_path, 100)
    assert "was written with optim.lr = 0.001 but this run has 0.5; " in str(refused.value)  # and nothing else


def test_pruning_deletes_only_this_runs_older_snapshots(tmp_path):
    def snapshot(step: int, manifest: str | None) -> None:
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        if manifest is not None:
            (folder / checkpoint.MANIFEST).write_text(manifest)

    snapshot(1, json.dumps({"config_hash": "ours"}))
    snapshot(2, None)  # damaged: a crash left it without a manifest
    snapshot(3, json.dumps({"config_hash": "someone else's"}))
    snapshot(4, "not json")
    snapshot(5, json.dumps({"config_hash": "ours"}))
    snapshot(6, json.dumps({"config_hash": "ours"}))
    checkpoint._prune(tmp_path, keep_last=2, config_hash_="ours")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{s:08d}" for s in (2, 3, 4, 5, 6)]


def test_the_one_rule_of_when_a_snapshot_is_due():
    """10 steps per epoch, 25 in the run: every_steps 4 saves mid-epoch at 4 and 8, at 12 and 16, and 20 lands on an
    epoch's end, so it waits for the evaluation; every_epochs 2 saves after epoch 2's evaluation; the run's last step
    is left to the end of fit()."""
    from dptrain.checkpoint import Snapshotter
    from dptrain.train_state import TrainState

    run = cfg(("checkpoint.every_steps", "4"), ("checkpoint.every_epochs", "2"))
    snapshots = Snapshotter(run, None, None, None, None, None, total_steps=25, steps_per_epoch=10)
    in_step, after_eval = [], []
    state = TrainState()
    for step in range(1, 26):
        state.step, state.epoch, state.batches_consumed = step, (step - 1) // 10, (step - 1) % 10 + 1
        if snapshots.due(state, after_evaluation=False):
            in_step.append(step)
        if state.batches_consumed == 10 and snapshots.due(state, after_evaluation=True):
            after_eval.append(step)
    assert in_step == [4, 8, 12, 16, 24]
    assert after_eval == [20]  # epoch 1 ends at 10 (not a multiple of 4, epoch 1 not even); epoch 2 at 20
