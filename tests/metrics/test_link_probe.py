"""Each node's link measured at the epoch's end (metrics/link_probe.py) and the link phase of a straggler: the rule on
tables made from known link speeds, the probe on real gloo ranks on loopback, and a training run whose one node's
sends are held back (faults.SLOW's link phase). tests/clusters/test_lab_cluster.py shapes one lab host's link."""

from __future__ import annotations

import os

import pytest

from dptrain import faults
from dptrain.events import LINK_PROBE_MS, LINK_PROBE_S, STRAGGLER_HOST, STRAGGLER_PHASE, STRAGGLER_RANK, STRAGGLER_SLOWER_PCT
from dptrain.metrics.epoch_lines import epoch_line
from dptrain.metrics.link_probe import FAULT_BASE_S, FLOOR_MS, ROUNDS, LinkProbe, node_link_ms
from dptrain.metrics.stragglers import LINK_MEASURE, LINK_PHASE, link_straggler
from tests.conftest import read_events
from tests.ranks import run_cli_on_ranks, run_on_ranks


def probed(sending: list[float], receiving: list[float], per_node: int = 1) -> list[list[float]]:
    """The world's (in from the left, in from the right) seconds by global rank, for nodes whose sending and
    receiving sides take these seconds: a transfer as slow as its slower end; the leaders' rows only filled."""
    nodes = len(sending)
    table = [[0.0, 0.0] for _ in range(nodes * per_node)]
    for n in range(nodes):
        left, right = (n - 1) % nodes, (n + 1) % nodes
        table[n * per_node] = [max(sending[left], receiving[n]), max(sending[right], receiving[n])]
    return table


@pytest.mark.parametrize("nodes", [3, 4, 6])
@pytest.mark.parametrize("slow_side", ["sending", "receiving", "both"])
def test_each_nodes_link_time_is_its_slower_side_whichever_side_of_which_node_is_slow(nodes, slow_side):
    for slow in range(nodes):
        sending, receiving = [0.004] * nodes, [0.004] * nodes
        if slow_side in ("sending", "both"):
            sending[slow] = 0.012
        if slow_side in ("receiving", "both"):
            receiving[slow] = 0.012
        assert node_link_ms(probed(sending, receiving, per_node=2), per_node=2) == pytest.approx(
            [12.0 if n == slow else 4.0 for n in range(nodes)])


def test_the_slowest_link_is_named_by_its_nodes_first_rank_and_host_in_the_link_phase():
    hosts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    found = link_straggler([4.0, 4.2, 6.0, 3.9], per_node=2, hosts=hosts)
    assert (found.rank, found.host, found.phase, found.measure) == (4, "c", LINK_PHASE, LINK_MEASURE)
    assert found.slower_pct == pytest.approx(100 * (6.0 / 4.0 - 1))
    assert found.others_ms == 4.0 and found.own_ms == 6.0
    sentence = found.sentence(3)
    assert sentence.startswith("the link of c (the node of rank 4) was 50% slower than the other nodes' in epoch 3 "
                               "(6.0 ms to move the link probe's 256 KiB against 4.0)"), sentence


def test_no_link_is_named_within_the_margin_under_the_floor_or_with_two_nodes():
    assert link_straggler([4.0, 4.2, 4.7, 3.9], per_node=1) is None  # 4.7 is 17.5% above the others' median
    assert link_straggler([0.3, 0.3, 1.9], per_node=1) is None  # six times slower, but under FLOOR_MS
    assert FLOOR_MS < 1.9 * 2 and link_straggler([0.3, 0.3, 3.8], per_node=1).rank == 2
    assert link_straggler([4.0, 40.0], per_node=1) is None  # one link joins 2 nodes: nothing to compare it with
    assert LinkProbe.for_run(0, 4, 2, 10) is None and LinkProbe.for_run(0, 2, 1, 10) is None  # (no group made)


def probe_on(rank: int, world_size: int, per_node: int, slowed: str | None) -> tuple[float, float]:
    """A rank's probe, in a world of per_node ranks a node; slowed: faults.SLOW's spec, for this job only."""
    saved = {name: os.environ.get(name) for name in ("RANK", faults.SLOW)}
    os.environ["RANK"] = str(rank)
    if slowed is not None:
        os.environ[faults.SLOW] = slowed
    try:
        return LinkProbe(rank, world_size, per_node, timeout_s=30).measure()
    finally:
        for name, value in saved.items():  # the pool's process runs other jobs next
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_ranks_probe_their_neighbours_and_a_node_whose_sends_are_held_back_is_named():
    """3 ranks as 3 nodes on loopback: node 1's sends, held back by half the probe's time at 100 Mbit/s, make its link
    the slow one (each other node has one fast transfer each way); without the fault, every link is under the floor,
    and none is named."""
    held_ms = 0.5 * FAULT_BASE_S * 1e3
    rows = run_on_ranks(probe_on, 3, 1, "1:0.5:link")
    times = node_link_ms(rows, per_node=1)
    assert times[1] > held_ms and max(times[0], times[2]) < held_ms, times
    # the whole probe's time: node 1 held back each of its 2 x ROUNDS sends, and every node waited for it at the barriers
    assert min(row[2] for row in rows) > (2 * ROUNDS - 1) * held_ms / 1e3, rows
    found = link_straggler(times, per_node=1, hosts=["h1", "h2", "h3"])
    assert (found.rank, found.host, found.phase) == (1, "h2", LINK_PHASE), times
    clean = node_link_ms(run_on_ranks(probe_on, 3, 1, None), per_node=1)
    assert link_straggler(clean, per_node=1) is None and max(clean) < held_ms, clean


@pytest.mark.slow
@pytest.mark.nightly  # the default run keeps the probe on real ranks above and the rule's unit tests
@pytest.mark.timeout(180)
def test_a_run_of_three_nodes_names_the_node_whose_link_is_slower_in_its_epoch_event_line_and_log(tmp_path):
    """3 ranks as 3 nodes of 1 on loopback, node 2's probe sends held back: the epoch event has each node's link time
    and names rank 2 in the link phase, the epoch line shows it, and rank 0's log has the sentence."""
    run = tmp_path / "run"
    argv = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "768", "--data.synthetic_test_size",
            "64", "--train.global_batch_size", "48", "--train.epochs", "1", "--output.dir", str(run)]
    [code] = run_cli_on_ranks(3, [argv], str(tmp_path), env={faults.SLOW: "2:0.5:link"}, per_node=1)
    assert code == 0, (run / "logs" / "rank0.log").read_text()[-3000:]
    (epoch,) = read_events(run, "epoch")
    link = epoch[LINK_PROBE_MS]
    assert len(link) == 3 and link[2] > 0.5 * FAULT_BASE_S * 1e3 > max(link[:2]), link
    assert epoch[LINK_PROBE_S] > 2 * ROUNDS * 0.5 * FAULT_BASE_S, epoch  # what the probe added to the run
    assert (epoch[STRAGGLER_RANK], epoch[STRAGGLER_PHASE]) == (2, LINK_PHASE), epoch
    assert epoch_line(epoch, 1).endswith(f" | straggler rank 2 ({epoch[STRAGGLER_HOST]}) "
                                         f"+{epoch[STRAGGLER_SLOWER_PCT]:.0f}% link")
    assert "(the node of rank 2) was" in (run / "logs" / "rank0.log").read_text()
