"""perf/speed.py: its cells and its memory sampler here; the whole script with --quick in the slow set."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[2] / "perf"


@pytest.fixture(scope="module")
def speed():
    sys.path.insert(0, str(BENCH))  # speed.py imports throughput.py, next to it, as a script does
    try:
        import speed

        yield speed
    finally:
        sys.path.remove(str(BENCH))


def test_commands_are_shown_as_typed(speed):
    shown = speed.dptrain_shown(2, ["--train.max_steps", "5"])
    assert shown == "`dptrain train --nproc-per-node 2 --train.max_steps 5`"  # no temporary run folder
    plain = speed.shown(speed.throughput.plain_command(2, 100, 128, "fashion-mnist"))
    assert plain == ("`torchrun --standalone --nproc-per-node=2 perf/plain_ddp.py --steps 100 --global-batch 128 "
                     "--data fashion-mnist`")


def test_spread_and_table(speed):
    assert speed.spread([3.0, 1.0, 2.0], ".1f", " s") == "1.0-3.0 s over 3" and speed.spread([1.0], ".1f") == "1 run"
    text = speed.table([("1. a | b", "2", "1 run", "`x`")], "Machine: m.")
    assert text.splitlines()[2] == "Machine: m." and "| 1. a / b | 2 | 1 run | `x` |" in text


def test_quick_shortens_every_part(speed):
    import argparse

    plan = speed.Plan.from_args(argparse.Namespace(repeats=None, steps=None, quick=True))
    assert (plan.repeats, plan.steps, plan.accuracy_args) == (1, 20, ("--train.max_steps", "20"))
    plan = speed.Plan.from_args(argparse.Namespace(repeats=None, steps=None, quick=False))
    assert (plan.repeats, plan.accuracy_args, plan.growth_repeats) == (5, ("--train.epochs", "2"), 3)


def test_memory_sample_counts_the_agent_and_its_children(speed):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        memory = speed.Memory()
        deadline = time.monotonic() + 10
        while child.pid not in memory.worker_rss and time.monotonic() < deadline:
            memory.sample(psutil.Process())
        assert memory.agent_rss > 0 and memory.agent_pss > 0 and memory.worker_rss[child.pid] > 0
        assert memory.workers_rss_sum >= memory.worker_rss[child.pid] and memory.workers_pss_sum > 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.timeout(600)  # about 45 s on the project's idle 2-core machine; several minutes when it is loaded
def test_quick_run_writes_every_target(tmp_path):
    out = tmp_path / "speed.md"
    proc = subprocess.run([sys.executable, str(BENCH / "speed.py"), "--quick", "--output", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert proc.stdout == text and "| target | value | spread | command |" in text and "Machine: " in text
    for target in ("1. dptrain / plain", "1. dptrain, bf16", "1. eval accuracy", "2. dptrain achieved / peak, float32",
                   "2. matmul peak, bfloat16", "3. start-up", "4. workers together", "4. workers' own rss_max_mb",
                   "5. per-rank images/s", "5. epoch time, 2x"):
        assert f"| {target}" in text, target
