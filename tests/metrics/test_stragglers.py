"""Stragglers named while training (metrics/stragglers.py): the naming rule, the own clock on a real model, and real
runs where one rank is made slower (faults.SLOW: real busy work, or a real sleep before its batches)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.events import (DATA_WAIT_MS_PER_STEP, OWN_COMPUTE_CPU_MS_PER_STEP, OWN_COMPUTE_MS_PER_STEP, STRAGGLER,
                            STRAGGLER_HOST, STRAGGLER_PHASE, STRAGGLER_RANK, STRAGGLER_SLOWER_PCT)
from dptrain.metrics.epoch_lines import epoch_line
from dptrain.metrics.stragglers import (CPU_MEASURE, MIN_STEPS, OWN_TIME_MEASURE, OwnClock, own_time_fields,
                                        publish_window, straggler, window_straggler)
from tests.conftest import read_events


def test_no_straggler_where_every_rank_is_within_the_margin_or_alone():
    assert straggler([50.0, 55.0, 59.0, 52.0], [1.0, 1.0, 1.0, 1.0]) is None  # 59 + 1 is 17.6% above the median 53
    assert straggler([50.0], [1.0]) is None
    assert straggler([0.0, 0.0], [0.0, 0.0]) is None  # nothing timed (a strategy whose gradients no hook sees)


def test_no_straggler_is_named_over_fewer_timed_steps_than_the_minimum():
    """A 2-step epoch of two equal ranks named one 28% and then 106% slower: a handful of steps is noise."""
    assert straggler([30.0, 61.0], [0.3, 0.3], steps=MIN_STEPS - 1) is None
    assert straggler([30.0, 61.0], [0.3, 0.3], steps=MIN_STEPS).rank == 1


def test_the_slowest_rank_is_named_with_its_host_phase_and_how_much_slower():
    found = straggler([50.0, 50.0, 66.0, 50.0], [1.0, 1.0, 1.0, 1.0], hosts=["a", "a", "b", "b"])
    assert (found.rank, found.host, found.phase, found.measure) == (2, "b", "compute", OWN_TIME_MEASURE)
    assert found.slower_pct == pytest.approx(100 * (67 / 51 - 1))
    assert found.fields() == {STRAGGLER_RANK: 2, STRAGGLER_HOST: "b", STRAGGLER_PHASE: "compute",
                              STRAGGLER_SLOWER_PCT: round(100 * (67 / 51 - 1), 1)}
    assert found.sentence(3).startswith("rank 2 (b) was 31% slower than the other ranks in epoch 3, in compute (67.0 ms "
                                        "of its own time a step against 51.0)")
    data = straggler([50.0, 50.0], [1.0, 20.0])  # the extra time is in waiting for batches
    assert (data.rank, data.phase, data.host) == (1, "data", "?")


def test_cpu_time_names_a_rank_that_computes_more_where_wall_clocks_are_blurred():
    """Ranks sharing cores take each other's time, so wall clocks move together; the CPU time of the compute does not."""
    found = straggler([70.0, 72.0, 71.0, 73.0], [0.5] * 4, compute_cpu_ms=[35.0, 35.5, 45.0, 34.8])
    assert (found.rank, found.phase, found.measure) == (2, "compute", CPU_MEASURE)
    assert found.slower_pct == pytest.approx(100 * (45 / 35 - 1))
    assert straggler([70.0, 72.0], [0.5, 0.5], compute_cpu_ms=[-1.0, -1.0]) is None  # CUDA: no CPU column


def test_own_time_fields_are_milliseconds_a_step_per_rank_without_a_cpu_column_on_cuda():
    columns = [[0.5, 0.6], [0.25, 0.3], [0.01, 0.02], [10, 10]]
    assert own_time_fields(columns) == {OWN_COMPUTE_MS_PER_STEP: [50.0, 60.0], OWN_COMPUTE_CPU_MS_PER_STEP: [25.0, 30.0],
                                        DATA_WAIT_MS_PER_STEP: [1.0, 2.0]}
    assert OWN_COMPUTE_CPU_MS_PER_STEP not in own_time_fields([[0.5], [-1.0], [0.01], [10]])


class Ticks:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed(nn.Module):
    """A model whose forward takes 5 ticks of both clocks."""

    def __init__(self, wall: Ticks, cpu: Ticks) -> None:
        super().__init__()
        self.layer, self.wall, self.cpu = nn.Linear(3, 2), wall, cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.wall.now += 5
        self.cpu.now += 4
        return self.layer(x)


def test_the_own_clock_counts_forward_to_the_last_gradient_and_the_wait_for_batches_in_steps_only():
    """Each step after the first: the epoch's first step, with the loader's start and the one-time costs, is not timed."""
    wall, cpu = Ticks(), Ticks()
    model = Timed(wall, cpu)
    clock = OwnClock(model, torch.device("cpu"), clock=wall, cpu_clock=cpu)

    def batches():
        wall.now += 50  # the loader's start, before the first batch
        for _ in range(4):
            wall.now += 2  # the loader's wait
            yield torch.ones(4, 3)

    for batch in clock.batches(batches()):
        with clock.step():
            model(batch).sum().backward()
            wall.now += 7  # after the last gradient: a wait for the other ranks, not this rank's own time
            cpu.now += 1
    with torch.no_grad():
        model(torch.ones(1, 3))  # an evaluation's forward, outside any step
    assert clock.totals() == (15.0, 12.0, 6.0, 3)
    clock.close()
    assert not model._forward_pre_hooks


def test_the_windows_of_the_log_steps_follow_each_other():
    wall, cpu = Ticks(), Ticks()
    model = Timed(wall, cpu)
    clock = OwnClock(model, torch.device("cpu"), clock=wall, cpu_clock=cpu)
    windows = []
    for step in range(1, 8):
        with clock.step():
            model(torch.ones(2, 3)).sum().backward()
        if step in (3, 7):  # two log steps: the first step is not timed, so 2 steps then 4
            windows.append(clock.window())
    assert windows == [(10.0, 8.0, 0.0, 2), (20.0, 16.0, 0.0, 4)]


def test_the_ranks_windows_are_compared_through_the_store_at_the_log_step():
    """Rank 1's window of 10 steps took 60% more compute: named at step 20, in its step event; a window of another step (a rank already
    past it) or of fewer than MIN_STEPS steps names no one."""
    import torch.distributed as dist

    store = dist.HashStore()
    publish_window(store, 0, 20, (0.5, 0.48, 0.01, 10))
    publish_window(store, 1, 20, (0.8, 0.78, 0.01, 10))
    found = window_straggler(store, 2, 20, ["a", "b"])
    assert (found.rank, found.host, found.phase, found.measure) == (1, "b", "compute", CPU_MEASURE)
    assert found.slower_pct == pytest.approx(100 * (78 / 48 - 1))  # the larger of its CPU time's and its own time's
    assert window_straggler(store, 2, 30, ["a", "b"]) is None  # both windows are step 20's
    publish_window(store, 1, 30, (0.8, 0.78, 0.01, 10))
    assert window_straggler(store, 2, 20, ["a", "b"]) is None  # rank 1 ran on to step 30's
    publish_window(store, 0, 25, (0.25, 0.24, 0.01, MIN_STEPS - 1))
    publish_window(store, 1, 25, (0.5, 0.49, 0.01, MIN_STEPS - 1))
    assert window_straggler(store, 2, 25, None) is None
    publish_window(store, 0, 40, (0.5, -1.0, 0.01, 10))  # CUDA: no CPU time
    publish_window(store, 1, 40, (0.5, -1.0, 0.01, 10))
    assert window_straggler(store, 2, 40, None) is None


def test_micro_batches_add_their_forward_and_backward_spans():
    wall, cpu = Ticks(), Ticks()
    model = Timed(wall, cpu)
    clock = OwnClock(model, torch.device("cpu"), clock=wall, cpu_clock=cpu)
    with clock.step():  # the epoch's first step: not timed
        model(torch.ones(2, 3)).sum().backward()
    assert clock.totals() == (0.0, 0.0, 0.0, 0)
    with clock.step():
        for _ in range(2):
            model(torch.ones(2, 3)).sum().backward()
            wall.now += 100  # between pieces: not this rank's compute
    assert clock.totals()[:2] == (10.0, 8.0)


RUN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "512", "--data.synthetic_test_size", "64",
       "--train.epochs", "1", "--train.global_batch_size", "32", "--train.log_every", "8", "--nproc-per-node", "2"]


def slowed_run(cli, run_dir, slow: str, *options: str) -> tuple[dict, str]:
    """A 2-rank run with DPTRAIN_TEST_SLOW=slow: its one epoch event and its console."""
    done = cli(*RUN, *options, "--output.dir", str(run_dir), env={"DPTRAIN_TEST_SLOW": slow}, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    (epoch,) = read_events(run_dir, "epoch")
    return epoch, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_computes_more_is_named_in_the_epoch_event_its_line_and_one_warning(cli, tmp_path):
    """Rank 1 spins half its compute again (faults.SLOW): real CPU work, as on a slower core."""
    epoch, console = slowed_run(cli, tmp_path / "run", "1:0.5")
    assert (epoch[STRAGGLER_RANK], epoch[STRAGGLER_PHASE]) == (1, "compute"), epoch
    assert epoch[STRAGGLER_SLOWER_PCT] > 20
    assert epoch[OWN_COMPUTE_CPU_MS_PER_STEP][1] > 1.2 * epoch[OWN_COMPUTE_CPU_MS_PER_STEP][0]
    assert epoch_line(epoch, 1).endswith(f" | straggler rank 1 ({epoch[STRAGGLER_HOST]}) "
                                         f"+{epoch[STRAGGLER_SLOWER_PCT]:.0f}% compute")
    warnings = [line for line in console.splitlines() if "slower than the other ranks" in line]
    assert len(warnings) == 1 and "rank 1 (" in warnings[0] and " in epoch 1, in compute (" in warnings[0], warnings
    rank1_log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert "slower than the other ranks in epoch 1" in rank1_log  # every rank's log has it
    # each log step compares the window since the last: step 8's has 7 timed steps (too few), step 16's names rank 1
    named = [(e["step"], e[STRAGGLER_RANK], e[STRAGGLER_PHASE]) for e in read_events(tmp_path / "run", "step")
             if STRAGGLER_RANK in e]
    assert named == [(16, 1, "compute")], read_events(tmp_path / "run", "step")


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(240)
def test_a_rank_slow_in_its_data_is_named_with_the_data_phase_and_watch_false_times_nothing(cli, tmp_path):
    epoch, _ = slowed_run(cli, tmp_path / "data", "0:0.8:data")
    assert (epoch[STRAGGLER_RANK], epoch[STRAGGLER_PHASE]) == (0, "data"), epoch
    assert epoch[DATA_WAIT_MS_PER_STEP][0] > epoch[DATA_WAIT_MS_PER_STEP][1]
    epoch, _ = slowed_run(cli, tmp_path / "unwatched", "0:0.8:data", "--launch.watch", "false")
    assert not set(epoch) & {OWN_COMPUTE_MS_PER_STEP, DATA_WAIT_MS_PER_STEP, *STRAGGLER}


@pytest.mark.parametrize("name", ["single", "ddp", "local_sgd", "diloco"])
def test_the_own_clock_times_the_model_each_strategy_trains(name):
    """train.py hooks the clock on strategy.trained_module: the model the rank's optimizer steps, which for local SGD
    and DiLoCo is the rank's own and not the run's model (eval_module, the ranks' mean, which no step touches)."""
    from dptrain.config import StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.registry import build_strategy

    strategy = build_strategy(StrategyConfig(name=name), DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "torchrun"),
                              torch.device("cpu"))
    trained = strategy.wrap(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert {id(p) for p in strategy.trained_module.parameters()} == {id(p) for p in trained.parameters()}
    clock = OwnClock(strategy.trained_module, torch.device("cpu"))
    for _ in range(3):
        with clock.step():
            trained(torch.randn(8, 3)).sum().backward()
    compute, _, _, steps = clock.totals()
    assert steps == 2 and compute > 0


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(180)
def test_a_rank_of_diloco_that_computes_more_is_named_in_compute(cli, tmp_path):
    """DiLoCo trains each rank's own model, not the run's (its eval_module): until 2026-11-29 the clock timed the run's
    model, whose compute is 0, and a lab run named a rank from 0.1 ms of data wait."""
    epoch, _ = slowed_run(cli, tmp_path / "run", "1:0.5", "--strategy.name", "diloco", "--strategy.diloco.period", "4")
    assert min(epoch[OWN_COMPUTE_MS_PER_STEP]) > 0 and min(epoch[OWN_COMPUTE_CPU_MS_PER_STEP]) > 0, epoch
    assert (epoch[STRAGGLER_RANK], epoch[STRAGGLER_PHASE]) == (1, "compute"), epoch
