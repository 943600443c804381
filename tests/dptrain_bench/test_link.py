"""The link probe's fit on synthetic timings (a known latency and bandwidth come back), its record in the bench folder,
and one real probe of two gloo processes at tiny sizes (in the slow set: a fresh Python with torch, about 2 s on a quiet
machine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dptrain_bench import link
from dptrain_bench.link import (COLLECTIVES, LinkProbe, Timing, collective_seconds, fit, read_link, record,
                                ring_terms)

ALPHA, BANDWIDTH = 50e-6, 125e6  # 50 us a message, 1 Gbit/s
SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)


def synthetic(alpha: float = ALPHA, bandwidth: float = BANDWIDTH, worlds: tuple[int, ...] = (2, 4),
              collectives: tuple[str, ...] = COLLECTIVES, noise: float = 0.0) -> list[Timing]:
    """Timings that follow the ring formulas exactly (or off by +-noise, alternating)."""
    timings = []
    for i, (world, collective, nbytes) in enumerate((w, c, s) for w in worlds for c in collectives for s in SIZES):
        seconds = collective_seconds(collective, world, nbytes, alpha, bandwidth) * (1 + noise * (-1) ** i)
        timings.append(Timing(collective, world, nbytes, seconds))
    return timings


def test_ring_terms_are_the_textbook_factors():
    assert ring_terms("all_reduce", 4) == (6.0, 1.5)  # 2(N-1) messages, 2(N-1)/N of the buffer
    assert ring_terms("reduce_scatter", 4) == ring_terms("all_gather", 4) == (3.0, 0.75)
    assert ring_terms("broadcast", 5) == (3.0, 3.0)  # ceil(log2 5) levels of a binomial tree
    assert ring_terms("all_reduce", 1) == (0.0, 0.0)
    # 2 ranks, 1 MB all-reduce at 50 us and 125 MB/s: 2 x 50 us + 1 x 8 ms
    assert collective_seconds("all_reduce", 2, 1e6, ALPHA, BANDWIDTH) == pytest.approx(100e-6 + 8e-3)
    with pytest.raises(ValueError, match="not one of"):
        ring_terms("all_to_all", 2)


def test_fit_recovers_a_known_latency_and_bandwidth():
    fitted = fit(synthetic())
    assert fitted.latency_s == pytest.approx(ALPHA, rel=1e-6)
    assert fitted.bandwidth_bps == pytest.approx(BANDWIDTH, rel=1e-6)
    assert fitted.worst_relative_error < 1e-6
    assert set(fitted.per_collective) == set(COLLECTIVES)
    for latency, bandwidth in fitted.per_collective.values():
        assert (latency, bandwidth) == (pytest.approx(ALPHA, rel=1e-6), pytest.approx(BANDWIDTH, rel=1e-6))
    # the per-collective line t = a + b S folds the ring factors in: 4 ranks all-reduce, a = 6 alpha, b = 1.5 / B
    assert fitted.line("all_reduce", 4) == (pytest.approx(6 * ALPHA), pytest.approx(1.5 / BANDWIDTH))


def test_at_a_probed_world_a_collective_is_read_along_its_timings_and_elsewhere_by_the_ring_formulas():
    """The lab at 100 Mbit/s: 4 hosts' small messages far slower than 2 hosts' (7.5 ms against 1.6 at 4 KiB), so one
    alpha and B for both worlds took 4.8 MB on 4 hosts as 0.50 s where the probe timed 8 MiB at 1.09 s. At a probed
    world the timings themselves are read: between two sizes the straight line, beyond the largest the line through
    the two largest."""
    lab = {2: (1.6e-3, 5.5e-3, 88.6e-3, 715e-3), 4: (7.5e-3, 8.3e-3, 133e-3, 1089e-3)}
    sizes = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
    fitted = fit([Timing("all_reduce", w, n, t) for w, times in lab.items() for n, t in zip(sizes, times)])
    for world, times in lab.items():
        assert [fitted.seconds("all_reduce", world, n) for n in sizes] == pytest.approx(list(times))
    middle = (sizes[2] + sizes[3]) / 2
    assert fitted.seconds("all_reduce", 4, middle) == pytest.approx((133e-3 + 1089e-3) / 2)
    assert fitted.seconds("all_reduce", 4, 16 << 20) == pytest.approx(1089e-3 + (1089e-3 - 133e-3) * 8 / 7)
    assert fitted.ring_seconds("all_reduce", 4, 4.8e6) < 0.9 * fitted.seconds("all_reduce", 4, 4.8e6)
    assert fitted.seconds("all_reduce", 8, 4.8e6) == fitted.ring_seconds("all_reduce", 8, 4.8e6)  # not probed
    assert fitted.seconds("all_gather", 4, 4.8e6) == fitted.ring_seconds("all_gather", 4, 4.8e6)  # not timed


def test_fit_keeps_each_collectives_own_numbers_and_stays_close_under_noise():
    # reduce-scatter twice as slow as its ring formula (as gloo's is): its own fit says so, the others' do not move
    timings = synthetic(collectives=("all_reduce", "all_gather")) + synthetic(bandwidth=BANDWIDTH / 2,
                                                                               collectives=("reduce_scatter",))
    fitted = fit(timings)
    assert fitted.per_collective["reduce_scatter"][1] == pytest.approx(BANDWIDTH / 2, rel=1e-6)
    assert fitted.per_collective["all_reduce"][1] == pytest.approx(BANDWIDTH, rel=1e-6)
    assert "broadcast" not in fitted.per_collective  # not probed: seconds() falls back on the joint fit
    assert fitted.seconds("broadcast", 2, 1e6) == collective_seconds("broadcast", 2, 1e6, fitted.latency_s,
                                                                     fitted.bandwidth_bps)
    noisy = fit(synthetic(noise=0.05))
    assert noisy.latency_s == pytest.approx(ALPHA, rel=0.1) and noisy.bandwidth_bps == pytest.approx(BANDWIDTH, rel=0.1)


def test_fit_never_returns_a_negative_latency():
    # a fast link's latency drowned in noise: a plain least squares would go below zero
    timings = [Timing("all_reduce", 2, s, s / BANDWIDTH * (1.2 if s == SIZES[0] else 1.0)) for s in SIZES[:1]]
    timings += [Timing("all_reduce", 2, s, s / BANDWIDTH) for s in SIZES[1:]]
    fitted = fit(timings)
    assert fitted.latency_s >= 0 and fitted.bandwidth_bps > 0


@pytest.mark.parametrize("timings, says", [
    ([], "no timing of a collective between two processes"),
    ([Timing("all_reduce", 1, 1024, 1e-3)], "no timing of a collective between two processes"),
    ([Timing("all_reduce", 2, s, 1e-3 * 1024 / s) for s in SIZES], "do not grow with the buffer size"),
])
def test_fit_says_why_it_cannot(timings, says):
    with pytest.raises(ValueError, match=says):
        fit(timings)


def fake_measure(calls: list) -> object:
    def measure(worlds, device):
        calls.append(worlds)
        return {w: LinkProbe(backend="gloo", device=device, world=w, hosts=1, timings=synthetic(worlds=(w,)))
                for w in worlds}
    return measure


def test_record_probes_the_missing_worlds_and_keeps_across_host_probes_apart(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(link, "measure", fake_measure(calls))
    saved, measured = record(tmp_path, "cpu", (1, 2))  # one process sends nothing: not probed
    assert measured == [2] and calls == [(2,)]
    _, measured = record(tmp_path, "cpu", (2, 4))
    assert measured == [4] and calls == [(2,), (4,)]
    across = LinkProbe(backend="gloo", device="cpu", world=2, hosts=2,
                       timings=synthetic(alpha=1e-3, bandwidth=12.5e6, worlds=(2,)))
    record(tmp_path, "cpu", (), launched=across)
    loaded = read_link(tmp_path)
    assert loaded is not None and sorted(loaded.probes) == [(1, 2), (1, 4), (2, 2)]
    assert loaded.within_host.bandwidth_bps == pytest.approx(BANDWIDTH)
    assert loaded.across_hosts.bandwidth_bps == pytest.approx(12.5e6)
    assert loaded.for_nodes(4) is not None and loaded.for_nodes(4).latency_s == pytest.approx(1e-3)
    data = json.loads((tmp_path / link.LINK_FILE).read_text())
    assert data["within_host"]["bandwidth_gbit_s"] == pytest.approx(1.0) and "2(N-1)/N" in data["model"]


def test_read_link_of_a_missing_or_broken_file_is_none(tmp_path):
    assert read_link(tmp_path) is None
    (tmp_path / link.LINK_FILE).write_text("{not json")
    assert read_link(tmp_path) is None
    (tmp_path / link.LINK_FILE).write_text('{"probes": []}')
    assert read_link(tmp_path) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_two_process_gloo_probe_fits_and_round_trips(tmp_path):
    # a fresh Python, as measure() starts it, at tiny sizes and short rounds (about three seconds, most of it torch)
    out = subprocess.run([sys.executable, "-m", "dptrain_bench.link", "--world", "2", "--sizes", "256,1048576",
                          "--min-s", "0.01", "--record", str(tmp_path), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    probes = {int(w): LinkProbe.from_dict(p) for w, p in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    assert [len(probes[2].timings)] == [2 * len(COLLECTIVES)]
    loaded = read_link(tmp_path)
    assert loaded is not None and loaded.within_host is not None
    fitted = loaded.within_host
    per_collective = [v for pair in fitted.per_collective.values() for v in pair]
    for number in (fitted.latency_s, fitted.bandwidth_bps, *per_collective):
        assert math.isfinite(number) and number >= 0
    assert fitted.bandwidth_bps > 0
    assert "all_reduce" in link.table(loaded.probes.values())


def test_a_probe_whose_timings_give_no_fit_is_still_recorded_and_printed(tmp_path):
    # Under load, a probe at two small sizes timed the larger faster: `--launched --record` ended in a traceback
    # (ValueError from the fit inside to_dict) instead of writing link.json.
    flat = LinkProbe(backend="gloo", device="cpu", world=2, hosts=2,
                     timings=[Timing("all_reduce", 2, 1024, 2e-4), Timing("all_reduce", 2, 65536, 1e-4)])
    data = flat.to_dict()
    assert data["fit"] is None and "do not grow with the buffer size" in data["fit_error"]
    assert "no fit: the timings do not grow" in link.table([flat])
    record(tmp_path, "cpu", (), launched=flat)
    loaded = read_link(tmp_path)
    assert loaded is not None and loaded.probes[(2, 2)].timings == flat.timings and loaded.across_hosts is None
