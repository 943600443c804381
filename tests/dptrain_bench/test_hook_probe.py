"""The hook probe: what the compressing hooks, local SGD's averaging and DiLoCo's outer step cost a rank's CPU,
measured on the run's model (hooks.json), and read back by the report and tune within bounds."""

from __future__ import annotations

import json
import logging

import pytest

from dptrain_bench import hook_probe
from dptrain_bench.hook_probe import HookProbe

WANTED = HookProbe(model="mnist-cnn", image_shape=(1, 28, 28), num_classes=10, batch=16, threads=1, powersgd_rank=4,
                   cpu_s={})


def test_hooks_json_round_trips_and_a_planted_one_is_left_out_saying_why(tmp_path, caplog):
    probe = HookProbe(**{**WANTED.__dict__, "cpu_s": {"powersgd": 0.01, "local_sgd": 0.001}})
    assert HookProbe.from_dict(json.loads(json.dumps(probe.to_dict()))) == probe
    assert hook_probe.read_hooks(tmp_path) is None  # none there
    (tmp_path / "hooks.json").write_text(json.dumps({**probe.to_dict(), "cpu_s": {"powersgd": "slow"}}))
    caplog.set_level(logging.WARNING)
    assert hook_probe.read_hooks(tmp_path) is None
    assert "cost no CPU of their own" in caplog.text and "cpu_s.powersgd" in caplog.text


@pytest.mark.slow
def test_the_probe_measures_each_hook_and_averaging_and_records_it_once(tmp_path):
    probe = hook_probe.record(tmp_path, WANTED)
    assert set(probe.cpu_s) == {*hook_probe.HOOKS, *hook_probe.AVERAGING}
    assert all(seconds >= 0 for seconds in probe.cpu_s.values())
    # DiLoCo's outer step does more than local SGD's averaging: a pseudo-gradient, an optimizer step, two copies
    assert probe.cpu_s["diloco"] > probe.cpu_s["local_sgd"] > 0
    written = (tmp_path / "hooks.json").stat().st_mtime_ns
    assert hook_probe.record(tmp_path, WANTED) == probe  # the same model, batch and threads: not probed again
    assert (tmp_path / "hooks.json").stat().st_mtime_ns == written
