"""A hang's verdict: the sentence composed from the ranks' reports (pure), where a thread's frame says it is, and real
faults on 2 ranks of the real CLI (gloo, a short launch.timeout_s), each asserting the named rank, collective and
phase. The 50 randomised trials are perf/hang_trials.py's; the larger fault cases here are nightly."""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import pytest

from dptrain.distributed.collectives import OWN_GROUP, WORLD_GROUP, Collective, CollectiveRing, where
from dptrain.distributed.hangs import hang_after_s, ranks_words, report, verdict
from dptrain.events import HANG_EVENT, schema_problem
from dptrain.faults import FAULT, SIGNAL_AT
from tests.conftest import read_events

NOW = 100 * 10**9


def rep(rank: int, collectives: list[Collective], made: dict[str, int], doing: str = "", line: str = "",
        marks: list[str] | None = None, host: str = "h") -> dict:
    return {"rank": rank, "host": f"{host}{rank}", "doing": doing, "line": line, "phase": "", "step": 5,
            "marks": marks or [], "status": {g: [m, m] for g, m in made.items()},
            "collectives": [c.as_row() for c in collectives]}


def ar(seq: int, done: bool, phase: str = "step 5", index: int = 0, sizes=((2,),), at_s: float = 10,
       group: str = WORLD_GROUP, op: str = "all_reduce") -> Collective:
    return Collective(group=group, seq=seq, op=op, sizes=[list(s) for s in sizes], dtype="Float",
                      entered_ns=int(at_s * 1e9), done=done, phase=phase, index=index)


def test_a_rank_that_never_entered_is_named_with_the_collective_its_bucket_and_its_line():
    waiting = [ar(11, True, "step 4"), ar(12, False, "step 5", index=2)]
    reports = {0: rep(0, waiting, {WORLD_GROUP: 12}), 1: rep(1, waiting, {WORLD_GROUP: 12}),
               2: rep(2, waiting, {WORLD_GROUP: 12}),
               3: rep(3, waiting[:1], {WORLD_GROUP: 11}, doing="data loading", line="my_dataset.py:88")}
    found = verdict(reports, 4, now_ns=NOW)
    assert found.sentence == ("rank 3 (h3) never entered all_reduce #12 (bucket 2 of step 5); ranks 0-2 waited 90 s in "
                              "it; rank 3 was in data loading at my_dataset.py:88; its stack is in its rank log")
    assert (found.ranks, found.collective, found.doing, found.line) == ([3], "all_reduce #12", "data loading",
                                                                         "my_dataset.py:88")


def test_a_rank_that_left_the_phase_without_the_collective_skipped_it():
    """Rank 1 went past "loss reduction of step 4" without its all_reduce and waits in a later one that rank 0, stuck
    in the skipped one, never reaches: the skipped one is the cause, though rank 1 entered its own first."""
    r0 = [ar(22, True, "step 4"), ar(23, False, "loss reduction of step 4", at_s=20)]
    r1 = [ar(22, True, "step 4"), ar(4, False, "signal exchange after step 4", at_s=15, group="1")]
    marks0 = ["step 4", "start-up", "loss reduction of step 4"]
    marks1 = ["step 4", "start-up", "loss reduction of step 4", "start-up", "signal exchange after step 4"]
    reports = {0: rep(0, r0, {WORLD_GROUP: 23, "1": 3}, marks=marks0),
               1: rep(1, r1, {WORLD_GROUP: 22, "1": 4}, line="train.py:300", marks=marks1)}
    found = verdict(reports, 2, now_ns=NOW)
    assert found.sentence.startswith("rank 1 (h1) skipped all_reduce #23 (loss reduction of step 4): it left that "
                                     "phase without making it; rank 0 waited 80 s in it; rank 1 was in all_reduce #4 "
                                     "of group 1 (signal exchange after step 4) at train.py:300"), found.sentence
    assert found.ranks == [1]


def test_another_shape_at_the_same_sequence_number_is_a_mismatch_naming_the_odd_rank():
    same = [ar(6, True, "step 2")]
    reports = {0: rep(0, [*same, ar(7, True, "loss reduction of step 2")], {WORLD_GROUP: 7}),
               1: rep(1, [*same, ar(7, False, "loss reduction of step 2", sizes=((3,),))], {WORLD_GROUP: 7}),
               2: rep(2, [*same, ar(7, True, "loss reduction of step 2")], {WORLD_GROUP: 7})}
    found = verdict(reports, 3, now_ns=NOW)
    assert found.sentence.startswith("the ranks' collectives no longer match: rank 1 (h1) made all_reduce #7 of [3] "
                                     "Float (loss reduction of step 2) where ranks 0 and 2 made all_reduce #7 of [2] "
                                     "Float (loss reduction of step 2)"), found.sentence
    assert found.ranks == [1] and found.collective == "all_reduce #7"


def test_of_two_ranks_that_differ_the_one_whose_collective_changed_from_its_own_last_step_is_named():
    """No majority with 2 ranks: rank 0 made the loss reduction of [2] at step 1 and of [3] at step 2, rank 1 of [2]
    both times, so rank 0's changed (it was named rank 1, the higher rank, before)."""
    before = [ar(5, True, "loss reduction of step 1")]
    reports = {0: rep(0, [*before, ar(7, False, "loss reduction of step 2", sizes=((3,),))], {WORLD_GROUP: 7}),
               1: rep(1, [*before, ar(7, False, "loss reduction of step 2")], {WORLD_GROUP: 7})}
    found = verdict(reports, 2, now_ns=NOW)
    assert found.sentence.startswith("the ranks' collectives no longer match: rank 0 (h0) made all_reduce #7 of [3] "
                                     "Float (loss reduction of step 2) where rank 1 made all_reduce #7 of [2] Float"), \
        found.sentence
    assert found.ranks == [0]


def test_a_rank_that_does_not_answer_is_named_and_so_is_where_the_others_wait():
    found = verdict({0: rep(0, [ar(3, False, "step 3", group=OWN_GROUP)], {OWN_GROUP: 3}), 1: None}, 2,
                    hosts={1: "node2"}, now_ns=NOW)
    assert found.sentence == ("rank 1 (node2) did not answer (stopped, or dead unseen); rank 0 waited 90 s in "
                              "all_reduce #3 through shared memory (bucket 0 of step 3); look at that host")
    assert found.ranks == [1]


def test_every_rank_in_the_collective_blames_the_link_not_a_rank():
    c = [ar(9, False)]
    found = verdict({0: rep(0, c, {WORLD_GROUP: 9}), 1: rep(1, c, {WORLD_GROUP: 9})}, 2, now_ns=NOW)
    assert found.ranks == [] and found.sentence.endswith("every rank entered it, so the link or the backend is stuck, "
                                                         "not a rank")


def test_ranks_are_said_as_ranges():
    assert [ranks_words(r) for r in ([3], [0, 1, 2], [0, 2, 5])] == ["rank 3", "ranks 0-2", "ranks 0, 2 and 5"]


def test_the_ring_places_each_collective_in_its_phase_and_counts_the_buckets():
    ring = CollectiveRing()
    ring.mark("step 1")
    first, second = ring.enter("all_reduce", [[10]], "float32"), ring.enter("all_reduce", [[4]], "float32")
    ring.leave(first)
    ring.mark("loss reduction of step 1")
    third = ring.enter("all_reduce", [[2]], "float64")
    own = [c for c in ring.entries() if c.group == OWN_GROUP]
    assert [(c.seq, c.phase, c.index, c.done) for c in own] == [(1, "step 1", 0, True), (2, "step 1", 1, False),
                                                               (3, "loss reduction of step 1", 0, False)]
    assert ring.status()[OWN_GROUP] == (3, 1)
    assert (second.done, third.done) == (False, False)


def test_where_a_thread_stands_is_its_own_innermost_line_and_what_it_does():
    """A thread stuck in a Dataset's __getitem__ is in data loading at that line, sampled from another thread."""
    from torch.utils.data import Dataset

    started, release = threading.Event(), threading.Event()

    class Stuck(Dataset):
        def __getitem__(self, i):
            started.set()
            release.wait(10)  # the line sampled
            return i

    thread = threading.Thread(target=lambda: Stuck()[0])
    thread.start()
    try:
        assert started.wait(10)
        time.sleep(0.05)
        found = where(sys._current_frames()[thread.ident])
    finally:
        release.set()
        thread.join()
    line = Stuck.__getitem__.__code__.co_firstlineno + 2
    assert (found.doing, found.line, found.function) == ("data loading", f"test_hangs.py:{line}", "__getitem__")


def test_a_report_says_the_step_and_the_phases_passed():
    ring = CollectiveRing()
    for name in ("step 7", "start-up", "loss reduction of step 7"):
        ring.mark(name)
    mine = report(2, "node3", ring, phase="loss reduction of step 7")
    assert (mine["rank"], mine["host"], mine["step"], mine["marks"][-1]) == (2, "node3", 7, "loss reduction of step 7")


def test_the_verdict_comes_before_the_backends_own_timeout():
    for timeout in (4, 10, 60, 300, 1800):
        assert 0 < hang_after_s(timeout) < timeout


# ---- real faults, 2 ranks of the real CLI ---------------------------------------------------------------------------

SYNTHETIC = ["--data.name", "synthetic", "--data.synthetic_train_size", "1000", "--data.synthetic_test_size", "101"]
TIMEOUT_S = 6
FAULTS = {
    # name: (options, environment, the sentence's start, its other parts)
    "forward": (["--model.name", "tests.user_code:SleepsInForward"], {FAULT: "forward:1:3:120"},
                "rank 1 ", ["never entered all_reduce #3 through shared memory (bucket 0 of step 3)",
                            "rank 0 waited", "rank 1 was in forward at user_code.py:"]),
    "skip": (["--train.log_every", "1"], {FAULT: "skip:1:4"},
             "rank 1 ", ["skipped all_reduce #", "(loss reduction of step 4): it left that phase without making it",
                         "rank 0 waited"]),
    "data": (["--data.name", "tests.user_code:BlocksInData", "--model.name", "tests.user_code:TinyNet",
              "--train.global_batch_size", "10"], {FAULT: "data:1:20:120"},
             "rank 1 ", ["never entered all_reduce #", "through shared memory (bucket 0 of step 4)",
                         "rank 1 was in data loading at user_code.py:"]),
    "mismatch": (["--train.log_every", "1"], {FAULT: "mismatch:1:3"},
                 "the ranks' collectives no longer match: rank 1 ", ["of [3] Double (loss reduction of step 3) where rank "
                                                                   "0 made all_reduce #", "of [2] Double"]),
    "sigstop": ([], {SIGNAL_AT: "1:3:SIGSTOP:self"},
                "rank 1 ", ["did not answer (stopped, or dead unseen)", "rank 0 waited", "after step 3"]),
}
# The default run's one fault: a rank stuck in forward, named with its collective, its phase and its line (the
# verdict's every part); the other four, the same end to end path with another cause, in the nightly tier, and each
# verdict's sentence for every cause in this file's unit tests above.
DEFAULT_RUN = ("forward",)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [pytest.param(name, marks=() if name in DEFAULT_RUN else pytest.mark.nightly)
                                   for name in FAULTS])
def test_a_fault_made_for_real_ends_the_run_with_its_verdict_in_time(cli, tmp_path, fault):
    args, env, start, parts = FAULTS[fault]
    run = tmp_path / "run"
    began = time.monotonic()
    result = cli("train", "--nproc-per-node", "2", *SYNTHETIC, "--train.max_steps", "30", *args,
                 "--launch.timeout_s", str(TIMEOUT_S), "--output.dir", str(run), env=env, timeout=120)
    elapsed = time.monotonic() - began
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr[-2000:]
    assert last.startswith(f"dptrain: error: {start}") and all(p in last for p in parts), last
    # within launch.timeout_s of the collective (plus the start of 2 ranks): not the backend's own timeout error
    assert "Timed out" not in last and elapsed < 60
    events = read_events(run, "hang")
    assert len(events) == 1 and f"dptrain: error: {events[0]['message']}" == last
    assert schema_problem(events[0]) is None and events[0]["ranks"] == [1]
    assert read_events(run, "run_start"), "metrics.jsonl kept what was written before"
    for rank in (0, 1):
        if fault != "sigstop" or rank == 0:  # a stopped rank writes nothing more
            assert events[0]["message"] in (run / "logs" / f"rank{rank}.log").read_text()


@pytest.mark.slow
@pytest.mark.nightly
def test_a_rank_killed_unseen_is_named_by_the_survivor_with_the_collective_and_the_phase(tmp_path):
    """Two ranks started apart (no agent sees the death); rank 1 is SIGKILLed after step 3: rank 0's sentence names
    rank 1, the collective it was left in and its phase."""
    from tests.conftest import two_ranks_apart

    args = ["train", *SYNTHETIC, "--launch.timeout_s", str(TIMEOUT_S), "--output.dir", str(tmp_path / "run"),
            "--train.max_steps", "30", "--strategy.ddp.shared_memory", "false"]
    ranks, err0 = two_ranks_apart(args, tmp_path, {SIGNAL_AT: "1:3:SIGKILL:self"})
    last = err0.strip().splitlines()[-1]
    assert ranks[1].returncode == -9 and ranks[0].returncode == 1
    assert last.startswith("dptrain: error: rank 0 failed during step 4 in all_reduce #"), last
    assert re.search(r"in all_reduce #\d+ \(bucket \d of step 4\): rank 1 did not answer \(dead or stuck\)", last), last


def test_the_hang_event_is_in_the_schema():
    record = {"event": "hang", "time": 1.0, "step": 3, "message": "m", "ranks": [1], "waited_s": 2.0}
    assert schema_problem(record) is None and HANG_EVENT.name == "hang"
    assert json.loads(json.dumps(record)) == record


@pytest.mark.slow
@pytest.mark.nightly
def test_rank_0_stopped_with_its_store_is_named_by_the_survivor_before_the_backends_timeout(cli, tmp_path):
    """Rank 0 serves the world's store: stopped (SIGSTOP), it answers nothing and no rank can compare. The survivor
    names it alone, in time; before, its watch and its roll call waited on the store until killed (a randomised trial
    ran 240 s)."""
    run = tmp_path / "run"
    began = time.monotonic()
    result = cli("train", "--nproc-per-node", "2", *SYNTHETIC, "--train.max_steps", "30", "--launch.timeout_s",
                 str(TIMEOUT_S), "--output.dir", str(run), env={SIGNAL_AT: "0:3:SIGSTOP:self"}, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and time.monotonic() - began < 60, result.stderr[-2000:]
    assert last.startswith("dptrain: error: rank 0 did not answer (stopped, or dead unseen), nor did the world's store "
                           "it serves; rank 1 waited "), last
    [event] = read_events(run, "hang")
    assert event["ranks"] == [0] and event["message"] in (run / "logs" / "rank1.log").read_text()
