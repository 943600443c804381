"""StopRequest directly: a signal on any rank stops every rank at the same step, and the handlers are given back."""

from __future__ import annotations

import os
import signal

import pytest

from dptrain.stopping import SlowNode, StopRequest
from tests.ranks import run_on_ranks


def test_one_process_stops_at_the_next_boundary_and_gives_the_handlers_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    stop = StopRequest(1)
    try:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets the flag
        assert stop.agreed() == "SIGUSR1"
    finally:
        stop.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _steps_until_agreed(rank: int, world: int, signals: dict[int, tuple[int, str]]) -> tuple[int, str, str | None]:
    """The loop's use: agreed() at each step's start. signals: rank -> (after which step, which signal) it gets one.

    Returns (the step at whose start the stop was agreed, the answer, this rank's own signal).
    """
    stop = StopRequest(world)
    try:
        for step in range(1, 20):
            answer = stop.agreed()
            if answer is not None:
                return step, answer, stop.signal_name
            if rank in signals and signals[rank][0] == step:
                os.kill(os.getpid(), getattr(signal, signals[rank][1]))
        raise AssertionError("no stop agreed in 19 steps")
    finally:
        stop.close()  # finishes the last exchange, which every rank started


SCENARIOS = {
    "one rank": {1: (3, "SIGUSR1")},  # rank 1 only, as a stray signal would
    "both ranks": {0: (2, "SIGTERM"), 1: (3, "SIGUSR1")},  # both, at different steps
}


def _every_scenario(rank: int, world: int) -> dict[str, tuple[int, str, str | None]]:
    return {name: _steps_until_agreed(rank, world, signals) for name, signals in SCENARIOS.items()}


@pytest.fixture(scope="module")
def on_two_ranks():
    """{scenario: [rank 0's, rank 1's (step, answer, own signal)]}: every scenario in one set of 2 rank processes."""
    by_rank = run_on_ranks(_every_scenario, 2, timeout=90)
    return {name: [by_rank[0][name], by_rank[1][name]] for name in SCENARIOS}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_signal_on_one_rank_stops_both_ranks_at_the_same_step(on_two_ranks):
    """SIGUSR1 to rank 1 during step 3: step 4 starts the exchange that carries it, step 5's start reads it, on both."""
    (step0, answer0, own0), (step1, answer1, own1) = on_two_ranks["one rank"]
    assert step0 == step1 == 5
    assert (answer1, own1) == ("SIGUSR1", "SIGUSR1")
    assert (answer0, own0) == ("a signal on another rank", None)  # rank 0 got none: it learns of it only from rank 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_signals_on_both_ranks_at_different_steps_stop_both_at_the_first_ones_step(on_two_ranks):
    """SIGTERM to rank 0 during step 2, SIGUSR1 to rank 1 during step 3: both stop where rank 0's signal says, each
    naming its own."""
    results = on_two_ranks["both ranks"]
    assert [step for step, _, _ in results] == [4, 4]
    assert [answer for _, answer, _ in results] == ["SIGTERM", "SIGUSR1"]


def _drill_then_stop(rank: int, world: int) -> list[tuple[int, str, bool, list[bool]]]:
    """A rehearsal's run (one drill, then the stop): rank 0 alone gets SIGUSR1 after steps 3 and 8. Returns, for each
    agreed signal, (its step, the answer, whether it was a drill, which ranks had received it)."""
    stop = StopRequest(world)
    stop.drills_left = 1  # what DRILLS_VAR=1 sets
    agreed = []
    try:
        for step in range(1, 30):
            answer = stop.agreed()
            if answer is not None:
                received = stop.receipts()
                drill = stop.drill()
                agreed.append((step, answer, drill, [r is not None for r in received]))
                if not drill:
                    return agreed
            if rank == 0 and step in (3, 8):
                os.kill(os.getpid(), signal.SIGUSR1)
        raise AssertionError(f"no stop agreed in 29 steps: {agreed}")
    finally:
        stop.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_drill_writes_its_step_and_goes_on_and_the_next_signal_stops_both_ranks():
    """The drill's own exchange, started at its step with its flag, is dropped: the run goes on until the next signal,
    which stops it; the receipts say which rank got each signal."""
    rank0, rank1 = run_on_ranks(_drill_then_stop, 2, timeout=90)
    assert rank0 == [(5, "SIGUSR1", True, [True, False]), (10, "SIGUSR1", False, [True, False])]
    assert [(s, d, r) for s, _, d, r in rank1] == [(s, d, r) for s, _, d, r in rank0]


def test_a_node_leaves_once_its_rank_is_the_straggler_that_many_epochs_in_a_row_and_never_node_0():
    """launch.leave_slow_node 2 on 3 nodes of 2 ranks that may go on with 2: ranks 2-3 are node 1, 4-5 node 2."""
    slow = SlowNode(epochs=2, ranks_per_node=2, nodes=3, fewest=2)
    assert [slow.after_epoch(rank) for rank in (3, None, 2, 5, 4)] == [None, None, None, None, 2]  # in a row only
    again = SlowNode(epochs=2, ranks_per_node=2, nodes=3, fewest=2)
    assert [again.after_epoch(rank) for rank in (2, 3)] == [None, 1]  # either rank of node 1
    hosts_the_rendezvous = SlowNode(epochs=1, ranks_per_node=2, nodes=3, fewest=1)
    assert [hosts_the_rendezvous.after_epoch(rank) for rank in (0, 1, 1)] == [None, None, None]  # named, never leaves
    fewest = SlowNode(epochs=1, ranks_per_node=1, nodes=2, fewest=2)
    assert fewest.after_epoch(1) is None  # the run may not go on with fewer nodes
