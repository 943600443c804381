"""The matmul probe's arithmetic, its record in the sweep folder, and the columns it feeds (achieved_tflops,
peak_tflops, fraction_of_peak); one real probe, in the slow set."""

from __future__ import annotations

import json

import pytest

from dptrain_bench import peak
from dptrain_bench.collect import add_efficiency, summarize
from dptrain_bench.peak import Probe, calls_to_fill, cpu_threads, matmul_flops, rate_tflops, read_peaks, record
from dptrain_bench.report import table


def test_rates_count_two_operations_per_multiply_add_over_every_process():
    assert matmul_flops(1024) == 2 * 1024**3
    # 2 processes x 5 calls of 2 * 1000^3 operations in 0.5 s: 40 GFLOPS
    assert rate_tflops(1000, calls=5, processes=2, seconds=0.5) == pytest.approx(0.04)
    assert calls_to_fill(0.03, 0.2) == 7 and calls_to_fill(0.5, 0.2) == 1 and calls_to_fill(0.0, 0.2) >= 1
    assert [cpu_threads(2, w) for w in (1, 2, 4)] == [2, 1, 1]  # oversubscribed: one thread each
    assert cpu_threads(16, 3) == 5


def test_a_probe_peaks_at_its_best_size_and_round_trips():
    probe = Probe(device="cpu", dtype="bfloat16", workers=2, threads=1, tflops_by_size={512: 0.4, 1024: 0.5, 2048: 0.3})
    assert probe.peak_tflops == 0.5
    data = json.loads(json.dumps(probe.to_dict()))
    assert data["peak_tflops"] == 0.5 and data["tflops_by_size"]["1024"] == 0.5
    assert Probe.from_dict(data) == probe


def fake_measure(calls: list) -> object:
    def measure(workers, device, dtype):
        calls.append(workers)
        return {w: Probe(device=device, dtype=dtype, workers=w, threads=1, tflops_by_size={512: 0.1 * w}) for w in workers}
    return measure


def test_record_probes_the_missing_worker_counts_only(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(peak, "measure", fake_measure(calls))
    probes, measured = record(tmp_path, "cpu", "float32", (1, 2))
    assert measured == [1, 2] and probes[2].peak_tflops == pytest.approx(0.2)
    _, measured = record(tmp_path, "cpu", "float32", (1, 2, 4))
    assert measured == [4] and calls == [(1, 2), (4,)]
    assert sorted(read_peaks(tmp_path)) == [1, 2, 4]
    saved = json.loads((tmp_path / peak.PEAK_FILE).read_text())
    assert saved["cores"] >= 1 and saved["torch"].startswith("2.") and saved["probes"]["4"]["workers"] == 4
    _, measured = record(tmp_path, "cpu", "bfloat16", (1,))  # another dtype: probed afresh
    assert measured == [1] and {p.dtype for p in read_peaks(tmp_path).values()} == {"bfloat16"}


def test_read_peaks_of_a_missing_or_broken_file_is_empty(tmp_path):
    assert read_peaks(tmp_path) == {}
    (tmp_path / peak.PEAK_FILE).write_text("{not json")
    assert read_peaks(tmp_path) == {}


def row(engine: str, workers: int, images_per_s: float, flops: object = "", status: str = "ok") -> dict:
    return {"engine": engine, "strategy": "ddp", "workers": workers, "repeat": 1, "status": status,
            "images_per_s": images_per_s, "epoch_time_s": 1.0, "model_flops_per_sample": flops}


def test_fraction_of_peak_divides_the_model_rate_by_the_probe_of_the_same_worker_count():
    rows = [row("dptrain", 1, 1000.0, 7e7), row("dptrain", 2, 1500.0, 7e7), row("tutorial", 2, 1200.0),
            row("dptrain", 4, "", 7e7, status="failed")]
    add_efficiency(rows, {1: 0.1, 2: 0.2})
    assert rows[0]["achieved_tflops"] == pytest.approx(0.07) and rows[0]["fraction_of_peak"] == pytest.approx(0.7)
    assert rows[1]["peak_tflops"] == 0.2 and rows[1]["fraction_of_peak"] == pytest.approx(0.105 / 0.2)
    # the other engine logs no operation count: the sweep's model is the same, so dptrain's count serves
    assert rows[2]["achieved_tflops"] == pytest.approx(0.084) and rows[2]["fraction_of_peak"] == pytest.approx(0.42)
    assert "fraction_of_peak" not in rows[3] and "peak_tflops" not in rows[3]
    summary = summarize(rows)
    line = next(s for s in summary if (s["engine"], s["workers"]) == ("dptrain", 2))
    assert line["peak_tflops_mean"] == 0.2 and line["fraction_of_peak_mean"] == pytest.approx(0.525)
    text = table(summary)
    assert "| TFLOPS | of peak |" in text and "| 0.105 | 52.5% |" in text


def test_no_probe_leaves_the_peak_columns_empty():
    rows = [row("dptrain", 1, 1000.0, 7e7)]
    add_efficiency(rows, {})
    assert rows[0]["achieved_tflops"] == pytest.approx(0.07) and "peak_tflops" not in rows[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_probe_runs_its_processes_at_once_on_the_cpu(machine_probes):
    """The session's probes (peak.record: peak.measure of 1 and 2 processes), as peak.json holds them."""
    probes = peak.read_peaks(machine_probes)
    assert sorted(probes) == [1, 2]
    for w, probe in probes.items():
        assert probe.workers == w and probe.threads == cpu_threads(peak.usable_cores(), w)
        assert sorted(probe.tflops_by_size) == list(peak.SIZES["cpu"]) and probe.peak_tflops > 0


def test_a_failed_probe_leaves_the_sweep_going(tmp_path, monkeypatch, caplog):
    import logging

    from dptrain_bench import sweep as sweep_mod

    def broken(workers, device, dtype):
        raise RuntimeError("the matmul probe (1 processes, cpu, float32) failed: MemoryError: no")

    monkeypatch.setattr(peak, "measure", broken)
    sweep, _ = sweep_mod.sweep_from_options(config_path=None, pairs=[("data.name", "synthetic"), ("output.dir",
                                            str(tmp_path / "b"))], workers="1", strategies="ddp", repeats=1,
                                            warmup_epochs=None, engines="dptrain", run_timeout_s=60.0)
    caplog.set_level(logging.INFO, logger="dptrain_bench")  # the lab's modules log under their own names
    sweep_mod.record_peaks(sweep)
    assert "failed: MemoryError: no; peak_tflops and fraction_of_peak stay empty" in caplog.text
    assert read_peaks(tmp_path / "b") == {}
