"""Property-based: generated values and shapes planted in each kind of file the measuring side reads back (link.json,
peak.json, sweep.json, results.csv, metrics.jsonl, env.json), read by what reads them (`dptrain report` of a sweep,
`--fitted-on`, the run card, `--probes-from`, the scaling model). Whatever is planted, the outcome is clean: exit 0
or 2, at most one error line and no traceback, every number shown finite, nothing written outside the output.

A planted value replaces one place of a file dptrain would write (a key's value, a list's item, the whole file), or
removes a key. The values are the kinds that broke readers before (1e308, 1e-320, 0, -1, NaN, inf, true for a number,
a string, a list, an object, huge integers) and whatever else hypothesis draws. The fast tests draw many examples;
the end-to-end ones (matplotlib draws each report, about a second) fewer.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dptrain_bench import link, peak
from dptrain_bench.collect import read_results, summarize
from dptrain_bench.sweep import adopt_probes
from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.read_back import UnreadableFile
from tests.dptrain_bench.test_report_inputs import epoch, result_row, write_results, write_run

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# capsys is read out (and so emptied) in each example
END_TO_END = settings(max_examples=8, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

ODD = [0, -1, -0.0, 1e308, -1e308, 1e-320, math.nan, math.inf, -math.inf, 2**70, -(2**70), True, False, None, "",
       "1", "nan", "x" * 300, [], {}, [1e308], {"1": 1}]
VALUES = st.one_of(st.sampled_from(ODD), st.floats(), st.integers(), st.text(max_size=20),
                   st.lists(st.floats(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@st.composite
def planted(draw: st.DrawFn, tree: Any) -> Any:
    """tree with one place (at any depth) given a generated value, or one key removed."""
    tree = copy.deepcopy(tree)
    parent: Any = None
    key: Any = None
    node = tree
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 5)) > 0:  # mostly deeper
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else list(range(len(node)))))
        parent, node = node, node[key]
    if parent is None:
        return draw(VALUES)
    if isinstance(parent, dict) and draw(st.integers(0, 4)) == 0:
        del parent[key]
    else:
        parent[key] = draw(VALUES)
    return tree


def link_tree() -> dict[str, Any]:
    timings = [link.Timing(c, 2, s, link.collective_seconds(c, 2, s, 50e-6, 125e6))
               for c in link.COLLECTIVES for s in (1 << 10, 1 << 16, 1 << 22)]
    probe = link.LinkProbe(backend="gloo", device="cpu", world=2, hosts=2, timings=timings)
    return {"host": "h", "probes": [probe.to_dict()]}


def peak_tree() -> dict[str, Any]:
    return {"cpu": "x", "probes": {str(w): {"device": "cpu", "dtype": "float32", "workers": w, "threads": 1,
                                            "tflops_by_size": {"512": 0.1 * w, "1024": 0.12 * w}} for w in (1, 2)}}


def sweep_tree() -> dict[str, Any]:
    return {"config": {"strategy": {"ddp": {"comm_hook": "allreduce", "bucket_mb": 25.0, "powersgd_rank": 4},
                                    "fsdp": {"reshard_after_forward": True, "param_dtype": "auto"}}},
            "train_args": [], "warmup_epochs": 1, "slurm": False}


def events_of(workers: int) -> list[dict[str, Any]]:
    return [{"event": "run_start", "global_batch_size": 128},
            epoch(1, mem_params_bytes=[4_000_000] * workers, mem_optim_bytes=[8_000_000] * workers,
                  comm_bytes_per_step=[0 if workers == 1 else 4_000_000] * workers),
            epoch(2, mem_params_bytes=[4_000_000] * workers), {"event": "run_end"}]


ENV = {"torch": "2.13.0", "host": "h", "hosts": 2, "machines": 1, "machine_cores": 2, "cpu_threads_per_rank": 1}


def write_sweep(bench: Path) -> None:
    """A finished sweep of ddp at 1 and 2 workers, as `dptrain bench` leaves it, with its probes."""
    write_results(bench, [result_row(w, 2.0 / w, nodes=w, images_per_s=64.0 * w, global_batch_size=128,
                                     cpu_util_pct=90.0) for w in (1, 2)])
    for w in (1, 2):
        run_dir = write_run(bench, events_of(w), workers=w)
        (run_dir / "env.json").write_text(json.dumps(ENV))
    (bench / "link.json").write_text(json.dumps(link_tree()))
    (bench / "peak.json").write_text(json.dumps(peak_tree()))
    (bench / "sweep.json").write_text(json.dumps(sweep_tree()))


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_clean(code: int, err: str) -> None:
    """Exit 0 or 2; a refusal is one line; no traceback reached the user."""
    assert code in (0, 2), err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("dptrain: error:")]
    assert len(errors) == (code == 2) and len(err.splitlines()) == len(errors), err


def report_cleanly(args: list[str], watched: Path, capsys: pytest.CaptureFixture) -> tuple[int, set[str]]:
    """`dptrain report ARGS`, its outcome clean (assert_clean), nothing that `watched` held changed: (its exit code,
    the files it added to `watched`)."""
    before = files_of(watched)
    capsys.readouterr()
    code = main(["report", *args])
    assert_clean(code, capsys.readouterr().err)
    after = files_of(watched)
    assert {k: v for k, v in after.items() if k in before} == before
    return code, after.keys() - before.keys()


def assert_finite_numbers(text: str) -> None:
    """No nan, inf or absurd figure reached a report's tables (a value out of range shows as one of these; the lines
    that say what was left out may quote it)."""
    tables = "\n".join(line for line in text.replace("\\", "").splitlines() if line.startswith("|"))
    for word in ("nan", "inf%", " inf ", "-inf", "1e+308"):
        assert word not in tables, word


# ---- fast: the readers and the model on what they took -----------------------------------------------------------

@pytest.mark.slow
@FAST
@given(tree=planted(link_tree()))
def test_a_planted_link_json_is_taken_checked_or_refused_in_one_sentence(tree):
    from dptrain_bench.scaling_model import Plan, Workload, curve

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / link.LINK_FILE
        path.write_text(json.dumps(tree))
        try:
            record = link.load_link(Path(folder))
        except UnreadableFile as exc:
            assert str(exc).startswith(f"{path} ") and str(exc).endswith(".") and "\n" not in str(exc)
            return
    fitted = record.across_hosts or record.within_host if record else None
    if fitted is None:
        return
    assert math.isfinite(fitted.latency_s) and fitted.latency_s >= 0 and 0 < fitted.bandwidth_bps < math.inf
    work = Workload(param_bytes=4e6, global_batch=128, compute_s_per_sample=1e-3)
    for point in curve(Plan(strategy="ddp"), work, fitted, ranks_per_node=1, overlap=0.5):
        assert math.isfinite(point.images_per_s) and point.images_per_s >= 0


@FAST
@given(tree=planted(peak_tree()))
def test_a_planted_peak_json_gives_a_finite_peak_above_zero_or_is_refused(tree):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / peak.PEAK_FILE).write_text(json.dumps(tree))
        try:
            probes = peak.load_peaks(Path(folder))
        except UnreadableFile as exc:
            assert "\n" not in str(exc) and str(exc).count("; ") == 1
            return
    for probe in probes.values():
        assert peak.TFLOPS[0] <= probe.peak_tflops <= peak.TFLOPS[1]
        assert math.isfinite(1.0 / probe.peak_tflops)  # a fraction of peak divides by it


@FAST
@given(cell=st.sampled_from(["epoch_time_s", "images_per_s", "cpu_util_pct", "eval_acc", "peak_mem_mb", "workers",
                             "global_batch_size", "status"]),
       value=st.one_of(st.sampled_from(ODD), st.floats(), st.text(max_size=12)))
def test_a_planted_results_csv_cell_leaves_its_row_out_or_gives_finite_speedups(cell, value):
    with tempfile.TemporaryDirectory() as folder:
        bench = Path(folder)
        write_results(bench, [result_row(1, 2.0), result_row(2, 1.0) | {cell: value}])
        rows, left_out = read_results(bench / "results.csv")
    assert len(rows) + len(left_out) == 2 and all("\n" not in line for line in left_out)
    for row in summarize(rows):
        for key in ("speedup", "efficiency", "epoch_time_s_mean", "images_per_s_mean"):
            assert row[key] == "" or (math.isfinite(row[key]) and row[key] > 0), (key, row[key])


# ---- end to end: the commands that read them --------------------------------------------------------------------

KINDS = {"link.json": link_tree, "peak.json": peak_tree, "sweep.json": sweep_tree,
         "runs/dptrain-ddp-w2-r1/env.json": lambda: ENV,
         "runs/dptrain-ddp-w2-r1/metrics.jsonl": lambda: events_of(2)}


def write_planted(bench: Path, name: str, tree: Any) -> None:
    path = bench / name
    if name.endswith(".jsonl"):  # a list of events: each planted value one line, or the file one JSON line
        lines = tree if isinstance(tree, list) else [tree]
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    else:
        path.write_text(json.dumps(tree))


@st.composite
def planted_file(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(sorted(KINDS)))
    return name, draw(planted(KINDS[name]()))


@pytest.mark.nightly  # a report drawn for each planted file (11 s); the default run keeps the card's and the readers'
@END_TO_END
@given(plant=planted_file())
def test_report_of_a_sweep_with_a_planted_file_is_clean(plant, capsys):
    name, tree = plant
    with tempfile.TemporaryDirectory() as folder:
        bench = Path(folder) / "bench"
        write_sweep(bench)
        write_planted(bench, name, tree)
        code, added = report_cleanly([str(bench)], bench, capsys)
        # only the report's own files are written, each inside the sweep's folder
        assert all(k == "report.md" or k == "summary.csv" or k.endswith(".png") for k in added)
        if code == 0:
            assert_finite_numbers((bench / "report.md").read_text())


@pytest.mark.nightly
@END_TO_END
@given(plant=planted_file())
def test_fitted_on_a_sweep_with_a_planted_file_is_clean_and_writes_nothing_there(plant, capsys):
    name, tree = plant
    with tempfile.TemporaryDirectory() as folder:
        bench, other = Path(folder) / "bench", Path(folder) / "other"
        write_sweep(bench)
        write_sweep(other)
        write_planted(other, name, tree)
        code, added = report_cleanly([str(bench), "--fitted-on", str(other)], other, capsys)
        assert added == set()
        if code == 0:
            assert_finite_numbers((bench / "report.md").read_text())


def run_events_of() -> list[dict[str, Any]]:
    """A 2-rank run's events as the run card reads them: its start, two epochs with their curves' points, its end."""
    start = {"event": "run_start", "step": 0, "world_size": 2, "device": "cpu", "global_batch_size": 128}
    epochs = [epoch(n, step=10 * n, train_loss=1.0 / n, achieved_tflops=0.01, comm_ms_per_step=[5.0, 6.0],
                    comm_exposed_ms_per_step=[1.0, 2.0], comm_bytes_per_step=[4e6, 4e6], lr=1e-3) for n in (1, 2)]
    steps = [{"event": "step", "step": s, "train_loss": 1.0 / s, "time": 0.1 * s} for s in (5, 15)]
    return [start, epochs[0], steps[0], epochs[1], steps[1], {"event": "run_end", "step": 20}]


RUN_KINDS = {"metrics.jsonl": run_events_of, "env.json": lambda: ENV, "peak.json": lambda: {
    "probes": {"2": peak_tree()["probes"]["2"]}}}


@pytest.mark.slow
@END_TO_END
@given(name=st.sampled_from(sorted(RUN_KINDS)), data=st.data())
def test_the_run_card_of_a_run_with_a_planted_file_is_clean(name, data, capsys):
    tree = data.draw(planted(RUN_KINDS[name]()))
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        run_dir.mkdir()
        for kind, make in RUN_KINDS.items():
            write_planted(run_dir, kind, make())
        write_planted(run_dir, name, tree)
        code, added = report_cleanly([str(run_dir)], run_dir, capsys)
        assert all(k.startswith("card/") for k in added)
        if code == 0 and name != "env.json":  # the card shows env.json's values as the file gives them
            assert_finite_numbers((run_dir / "card" / "card.md").read_text())


@pytest.mark.slow
@FAST
@given(plant=st.sampled_from(["link.json", "peak.json"]).flatmap(
    lambda name: st.tuples(st.just(name), planted(link_tree() if name == "link.json" else peak_tree()))))
def test_probes_from_a_folder_with_a_planted_file_copies_only_what_it_checked(plant):
    name, tree = plant
    with tempfile.TemporaryDirectory() as folder:
        source, bench = Path(folder) / "source", Path(folder) / "bench"
        source.mkdir()
        (source / name).write_text(json.dumps(tree))
        try:
            copied = adopt_probes(source, bench)
        except ConfigError as exc:
            assert str(exc).startswith(f"--probes-from {source}") and "\n" not in str(exc)
            assert not bench.exists()
            return
        assert copied == [name] and (bench / name).read_bytes() == (source / name).read_bytes()
        # what was copied reads back whole, as the sweep will read it
        assert (peak.load_peaks(bench) if name == "peak.json" else link.load_link(bench)) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["link.json", "peak.json", "sweep.json"])
def test_a_link_to_dev_zero_planted_in_a_sweep_is_left_out_in_one_line(tmp_path, capsys, caplog, name):
    bench = tmp_path / "bench"
    write_sweep(bench)
    (bench / name).unlink()
    (bench / name).symlink_to("/dev/zero")
    assert main(["report", str(bench)]) == 0
    assert any(m.startswith(f"{bench / name} is a character device, not a regular file") for m in
               caplog.messages)
    for option in (["--fitted-on", str(bench)], ["--probes-from"]):
        if option[0] == "--fitted-on" and name != "sweep.json":
            code = main(["report", str(bench), *option])
            assert code == 2
            [line] = capsys.readouterr().err.splitlines()
            assert line.startswith(f"dptrain: error: --fitted-on {bench}: {name} is a character device")
    if name != "sweep.json":
        with pytest.raises(ConfigError, match=f"^--probes-from {bench}: {name} is a character device"):
            adopt_probes(bench, tmp_path / "new")


# ---- the values the hostile pass planted, one by one --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tflops", [0, -1, "NaN", 1e-320, None])
def test_the_run_card_with_a_planted_peak_shows_no_fraction_of_peak_from_it(tmp_path, capsys, tflops):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_planted(run_dir, "metrics.jsonl", run_events_of())
    probe = peak_tree()["probes"]["2"] | {"tflops_by_size": {} if tflops is None else {"512": tflops}}
    (run_dir / "peak.json").write_text(json.dumps({"probes": {"2": probe}}).replace('"NaN"', "NaN"))
    assert main(["report", str(run_dir)]) == 0, capsys.readouterr().err
    text = (run_dir / "card" / "card.md").read_text()
    assert_finite_numbers(text)
    assert "%" not in text.split("## Throughput and fraction of peak", 1)[1].split("##", 1)[0]


@pytest.mark.slow
def test_the_run_card_leaves_out_an_epoch_whose_cpu_use_is_1e308(tmp_path, capsys):
    events = run_events_of()
    events[1]["cpu_util_pct"] = [1e308, 1e308]
    write_planted(tmp_path, "metrics.jsonl", events)
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    text = (tmp_path / "card" / "card.md").read_text()
    assert "line 2: cpu_util_pct is \\[1e+308, 1e+308\\], not a number from 0 to 1e+06" in text


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [1e308, -1, 1e-320])
def test_a_link_json_of_absurd_timings_is_left_out_of_the_report_and_refused_by_fitted_on(tmp_path, capsys, seconds):
    bench, other = tmp_path / "bench", tmp_path / "other"
    write_sweep(bench)
    write_sweep(other)
    for folder in (bench, other):
        tree = link_tree()
        tree["probes"][0]["timings"][3]["seconds"] = seconds
        (folder / "link.json").write_text(json.dumps(tree))
    assert main(["report", str(bench)]) == 0, capsys.readouterr().err
    assert "Scaling model" not in (bench / "report.md").read_text()
    assert main(["report", str(bench), "--fitted-on", str(other)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dptrain: error: --fitted-on {other}: link.json is not what dptrain writes there (probes[0].timings[3].seconds = ")


@pytest.mark.slow
def test_an_epoch_time_of_1e_320_s_leaves_its_row_out_of_the_report(tmp_path, capsys):
    bench = tmp_path / "bench"
    write_results(bench, [result_row(1, 2.0), result_row(2, 1.0), result_row(4, 1e-320)])
    assert main(["report", str(bench)]) == 0, capsys.readouterr().err
    text = (bench / "report.md").read_text()
    assert "results.csv line 4: epoch_time_s is '1e-320', not a number from 1e-06 to 1e+08" in text.replace("\\", "")
    assert [line.split(" | ")[2] for line in text.split("## Summary", 1)[1].splitlines()
            if line.startswith("| dptrain |")] == ["1", "2"]  # the summary's rows (the accuracy table has its own)
