"""The run card (`dptrain card RUN_DIR`; `dptrain report RUN_DIR` still writes it, with a note): a real 2-rank run
stopped by SIGTERM and resumed once, then its card's files, sections and numbers against metrics.jsonl; a planted bad line and planted Markdown in a run's files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dptrain.reporting import run_card
from dptrain.errors import ConfigError
from dptrain.faults import SIGNAL_AT
from dptrain.reporting.run_card import SECTIONS, write_run_card
from dptrain.reporting.run_record import is_run_dir, timeline
from dptrain.stopping import EXIT_STOPPED
from tests.conftest import log_tail, read_events, run_cli
from tests.ranks import run_cli_on_ranks

# 256 samples in batches of 32: 8 steps an epoch, 16 in all; a step loss every 2 steps
TRAIN = ["train", "--nproc-per-node", "2", "--data.name", "synthetic", "--data.synthetic_train_size", "256",
         "--data.synthetic_test_size", "32", "--train.global_batch_size", "32", "--train.epochs", "2",
         "--train.log_every", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """A run stopped by SIGTERM after step 10 (mid-epoch 2; the snapshot is of the step it stops at) and resumed by
    the same command to the end: two starts, one stop, two epochs. The stop goes through the real launcher."""
    root = tmp_path_factory.mktemp("card")
    run_dir = root / "run"
    args = [*TRAIN, "--output.dir", str(run_dir)]
    stopped = run_cli(args, root, env={SIGNAL_AT: "0:10:SIGTERM:self"})
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    # the resume on the test pool's rank processes, as under torchrun: in a whole-suite run they are up already
    [code] = run_cli_on_ranks(2, [args], str(root))
    assert code == 0, log_tail(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def card(resumed_run) -> str:
    return write_run_card(resumed_run).read_text()


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table under `## heading`, header and rule left out."""
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


@pytest.mark.slow
def test_the_card_of_a_resumed_run_has_its_files_and_every_section(resumed_run, card):
    path = resumed_run / "card" / "card.md"
    assert path.is_file()
    for name in (run_card.LOSS_PLOT, run_card.THROUGHPUT_PLOT, run_card.COMM_PLOT, run_card.UTIL_PLOT):
        assert (resumed_run / "card" / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in card  # embedded, relative to card.md
    headings = re.findall(r"^## (.+)$", card, flags=re.M)
    assert headings == list(SECTIONS)  # in order, and nothing left out: no "Left out of this card"
    assert "Fraction of peak: not measured" in card  # no peak.json beside the run, and none probed


@pytest.mark.slow
def test_the_card_shows_both_starts_the_stop_and_the_snapshots(resumed_run, card):
    [stop] = read_events(resumed_run, "stopped")
    starts = table_rows(card, "Starts, stops and snapshots")
    assert [row[0] for row in starts[:2]] == ["1", "2"]
    first, second = starts[0], starts[1]
    assert first[2] == "0" and first[7].startswith(f"stopped at step {stop['step']}")
    assert second[2] == str(stop["step"]) and second[7] == "finished at step 16"  # resumed where it stopped
    listed = [row[0].replace("\\", "") for row in starts if row[0].startswith("step")]
    assert listed == sorted((p.name for p in (resumed_run / "checkpoints").glob("step-*")), reverse=True)
    assert "State: finished at step 16. Step 16 of 16, 2 epochs logged, 2 starts (1 resume)" in card


@pytest.mark.slow
def test_the_cards_numbers_are_those_of_metrics_jsonl(resumed_run, card):
    epochs = read_events(resumed_run, "epoch")
    assert [e["epoch"] for e in epochs] == [1, 2]  # each once, though the run stopped in epoch 2
    rows = table_rows(card, "Loss and accuracy")
    assert [r[:3] for r in rows] == [[str(e["epoch"]), str(e["step"]), f"{e['train_loss']:.4f}"] for e in epochs]
    assert [r[5] for r in rows] == [f"{e['eval_acc']:.4f}" for e in epochs]
    rate = sum(e["train_samples"] for e in epochs) / sum(e["epoch_time_s"] for e in epochs)
    assert f"{rate:.0f} images/s over all 2 epochs" in card
    throughput = table_rows(card, "Throughput and fraction of peak")
    assert [r[2] for r in throughput] == [f"{e['train_samples'] / e['epoch_time_s']:.0f}" for e in epochs]
    assert [r[3] for r in throughput] == [f"{e['epoch_time_s'] * 1e3 / 8:.1f}" for e in epochs]  # 8 steps an epoch
    shares = table_rows(card, "Communication")
    for row, e in zip(shares, epochs, strict=True):  # ddp times its communication: every epoch has a share
        exposed = e["comm_exposed_ms_per_step"]
        assert row[5] == f"{max(exposed) / (e['epoch_time_s'] * 1e3 / 8):.2%}"
    ranks = table_rows(card, "Utilisation and memory per rank")
    assert [r[0] for r in ranks] == ["0", "1"]
    assert [r[3] for r in ranks] == [f"{b / 2**20:.1f}" for b in epochs[-1]["mem_params_bytes"]]
    assert [r[2] for r in ranks] == [f"{max(e['rss_max_mb'][rank] for e in epochs):.1f}" for rank in (0, 1)]


@pytest.mark.slow
def test_a_planted_line_is_left_out_and_named_and_planted_markdown_stays_text(resumed_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(resumed_run, copy, ignore=shutil.ignore_patterns("checkpoints", "tb", "model.pt", "report"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, "![x](http://attacker.example/x.png) not JSON")
    lines.insert(3, json.dumps({"event": "epoch", "epoch": 9, "step": 70, "train_samples": 32, "epoch_time_s": 1.0,
                                "train_loss": "<script>alert(1)</script>"}))
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    env = json.loads((copy / "env.json").read_text())
    (copy / "env.json").write_text(json.dumps(env | {"host": "# host\n| a | b |<img src=x>"}))
    text = write_run_card(copy).read_text()
    assert "- metrics.jsonl line 3: it is not JSON" in text
    assert "epoch 9's event: train_loss is " in text
    assert [r[0] for r in table_rows(text, "Loss and accuracy")] == ["1", "2"]  # the run's epochs, all of them
    assert "<script>" not in text and "<img" not in text and "](http" not in text
    host = next(line for line in text.splitlines() if line.startswith("| host |"))
    # one table cell, no extra column; the value is quoted, so its # is no heading's (nor would a table cell's be)
    assert host.count(" | ") == 1 and '| "# host' in host


def test_a_resume_replaces_what_was_logged_past_its_snapshot():
    events = [{"event": "run_start", "step": 0, "world_size": 2, "global_batch_size": 4},
              {"event": "step", "step": 2, "loss": 2.0},
              {"event": "epoch", "epoch": 1, "step": 4, "train_samples": 16, "epoch_time_s": 1.0, "train_loss": 1.5},
              {"event": "step", "step": 6, "loss": 1.0},
              {"event": "step", "step": 8, "loss": 0.8},
              {"event": "epoch", "epoch": 2, "step": 8, "train_samples": 16, "epoch_time_s": 1.0, "train_loss": 0.9},
              # killed before step 8's snapshot: the next start resumes from step 4's, and is stopped after step 6
              {"event": "run_start", "step": 4, "world_size": 3, "global_batch_size": 4},
              {"event": "step", "step": 6, "loss": 1.1},
              {"event": "stopped", "step": 6, "message": "stopped by SIGTERM after step 6"},
              # the third start resumes from step 6 and finishes epoch 2
              {"event": "run_start", "step": 6, "world_size": 3, "global_batch_size": 4},
              {"event": "epoch", "epoch": 2, "step": 8, "train_samples": 16, "epoch_time_s": 2.0, "train_loss": 1.2},
              {"event": "run_end", "step": 8}]
    line = timeline(events[:10])  # as the card sees it while the third start has not begun
    assert line.steps == {2: 2.0, 6: 1.1} and list(line.epochs) == [1]  # step 8 and epoch 2 were undone
    line = timeline(events)
    assert {n: (e["train_loss"], s.world_size) for n, (e, s) in line.epochs.items()} == {1: (1.5, 2), 2: (1.2, 3)}
    assert [(s.step, s.ended) for s in line.starts] == [(0, "no end recorded (still running, or killed)"),
                                                         (4, "stopped at step 6: stopped by SIGTERM after step 6"),
                                                         (6, "finished at step 8")]


def test_is_run_dir_tells_a_run_from_a_sweep_and_from_nothing(tmp_path):
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (sweep / "runs" / "dptrain-ddp-w2-r0").mkdir(parents=True)
    (sweep / "results.csv").write_text("engine\n")
    assert is_run_dir(run) and not is_run_dir(sweep) and not is_run_dir(tmp_path / "missing")


def test_a_folder_without_metrics_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "env.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no metrics\.jsonl, so there is nothing to report; give the folder"):
        write_run_card(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("not json\n{}\n")
    with pytest.raises(ConfigError, match=r"holds no run_start or epoch event dptrain can read \(2 lines left out, "
                                          r"the first as line 1: it is not JSON\)"):
        write_run_card(tmp_path)


@pytest.mark.slow
def test_a_wide_gpu_run_with_a_peak_json_gets_its_fraction_of_peak_and_rank_summaries(tmp_path):
    """40 ranks on GPUs, written by hand: more ranks than the card lists or draws one by one, the GPU panels, and a
    peak.json of the same world size and device beside the run."""
    ranks = 40

    def epoch(n: int) -> dict:
        return {"event": "epoch", "epoch": n, "step": 10 * n, "train_samples": 1280, "epoch_time_s": 2.0,
                "train_loss": 1.0 / n, "achieved_tflops": 5.0, "cpu_util_pct": [100.0 + r for r in range(ranks)],
                "rss_max_mb": [1000.0] * ranks, "gpu_util_mean_pct": [90.0] * ranks,
                "gpu_mem_used_max_mb": [float(2000 + r) for r in range(ranks)]}

    events = [{"event": "run_start", "step": 0, "world_size": ranks, "device": "cuda:0", "global_batch_size": 128},
              epoch(1), epoch(2), {"event": "run_end", "step": 20}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    probe = {"device": "cuda", "dtype": "float32", "workers": ranks, "threads": 0, "tflops_by_size": {"8192": 20.0}}
    (tmp_path / "peak.json").write_text(json.dumps({"probes": {str(ranks): probe}}))
    text = write_run_card(tmp_path).read_text()
    assert [r[5] for r in table_rows(text, "Throughput and fraction of peak")] == ["25.0%", "25.0%"]  # 5 of 20 TFLOPS
    rows = table_rows(text, "Utilisation and memory per rank")
    assert [r[0] for r in rows] == ["lowest of 40", "mean of 40", "highest of 40"]
    assert [r[1] for r in rows] == ["100.0", "119.5", "139.0"] and [r[-1] for r in rows] == ["2000", "2020", "2039"]
    assert (tmp_path / "card" / run_card.UTIL_PLOT).is_file()
    assert not (tmp_path / "card" / run_card.COMM_PLOT).exists()  # no communication timed: nothing drawn
    assert "Communication time: not measured" in text
    assert "Not shown: config.toml is missing" in text and "Not shown: env.json is missing" in text


def test_a_stop_and_its_requeue_are_both_in_the_starts_ending():
    events = [{"event": "run_start", "step": 0, "world_size": 2},
              {"event": "stopped", "step": 7, "message": "stopped by SIGUSR1 after step 7"},
              {"event": "requeue", "step": 7, "job_id": "41"}]
    [start] = timeline(events).starts
    assert start.ended == "stopped at step 7: stopped by SIGUSR1 after step 7; requeued (SLURM job 41)"


def test_the_card_of_a_hung_run_says_its_verdict(tmp_path):
    """A run that hung ends with a hang event (distributed/hangs.py): the card's state line and its starts table say
    the verdict."""
    verdict = ("rank 1 (node2) never entered all_reduce #12 (bucket 0 of step 5); rank 0 waited 283 s in it; rank 1 "
               "was in data loading at my_dataset.py:88; its stack is in its rank log")
    events = [{"event": "run_start", "step": 0, "world_size": 2, "global_batch_size": 32},
              {"event": "hang", "step": 5, "message": verdict, "ranks": [1], "waited_s": 283.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = write_run_card(tmp_path).read_text()
    assert f"State: hung at step 5: {verdict}." in text
    assert table_rows(text, "Starts, stops and snapshots")[0][7] == f"hung at step 5: {verdict}"


def test_the_card_names_each_epochs_straggler_and_shows_every_ranks_own_time(tmp_path):
    def epoch(n: int, straggler: bool) -> dict:
        named = {"straggler_rank": 1, "straggler_host": "node2", "straggler_phase": "compute",
                 "straggler_slower_pct": 31.4} if straggler else {}
        return {"event": "epoch", "epoch": n, "step": 10 * n, "train_samples": 1280, "epoch_time_s": 2.0,
                "train_loss": 1.0, "own_compute_ms_per_step": [40.0, 52.0 if straggler else 41.0],
                "own_compute_cpu_ms_per_step": [39.0, 51.0 if straggler else 40.0],
                "data_wait_ms_per_step": [0.5, 0.25], **named, "cpu_util_pct": [90.0, 95.0]}

    events = [{"event": "run_start", "step": 0, "world_size": 2, "device": "cpu", "global_batch_size": 128},
              epoch(1, False), epoch(2, True)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = write_run_card(tmp_path).read_text()
    assert "Stragglers (a rank more than 20% slower" in text
    assert text.count("rank 1 (node2), 31% slower in compute") == 1 and "epoch 2: rank 1 (node2)" in text
    rows = table_rows(text, "Utilisation and memory per rank")
    assert [r[-3:] for r in rows] == [["40.0", "39.0", "0.50"], ["46.5", "45.5", "0.25"]]  # means over the epochs
    assert (tmp_path / "card" / run_card.UTIL_PLOT).is_file()


def test_a_number_planted_where_an_event_holds_text_is_left_out_not_shown():
    """Found by the planted-file property test: a run_start whose device is 1e308 showed `1e+308` as the device."""
    events = [{"event": "run_start", "step": 0, "world_size": 2, "device": 1e308},
              {"event": "stopped", "step": 7, "message": float("inf")},
              {"event": "requeue", "step": 7, "job_id": 1e308}]
    [start] = timeline(events).starts
    assert start.device == "" and start.ended == "stopped at step 7: ; requeued (SLURM job ?)"


@pytest.mark.slow
def test_dptrain_card_writes_a_run_folders_card_and_report_still_does_with_a_note(resumed_run, tmp_path, capsys, caplog):
    from dptrain.cli import main

    run = tmp_path / "run"
    shutil.copytree(resumed_run, run, ignore=shutil.ignore_patterns("card"))
    assert main(["card", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "card" / "card.md") and (run / "card" / "card.md").is_file()
    (run / "card" / "card.md").unlink()
    with caplog.at_level("INFO"):
        assert main(["report", str(run)]) == 0  # the spelling of before the card had its command
    out, err = capsys.readouterr()
    assert out.strip() == str(run / "card" / "card.md") and (run / "card" / "card.md").is_file()
    assert f"its card is `dptrain card {run}` now" in err + caplog.text  # a log line: stderr from the command line
    assert main(["report", str(run), "--link", "1gbit"]) == 2
    assert "drop --link" in capsys.readouterr().err


def test_a_link_among_the_snapshots_is_named_and_never_followed(tmp_path):
    """checkpoints/step-* that is a symbolic link: its target's manifest was read as the run's own snapshot."""
    from dptrain.reporting.run_record import read_snapshots

    outside = tmp_path / "outside" / "step-00000009"
    outside.mkdir(parents=True)
    (outside / "manifest.json").write_text(json.dumps({"step": 9, "world_size": 2, "strategy": "ddp", "torch": "x"}))
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-00000009").symlink_to(outside)
    (checkpoints / "step-00000004").write_text("not a folder")
    snapshots, _ = read_snapshots(checkpoints)
    assert [(s.name, s.step, s.problem) for s in snapshots] == [
        ("step-00000009", None, "a symbolic link, not a snapshot folder (a run refuses it)"),
        ("step-00000004", None, "a file, not a snapshot folder (a run refuses it)")]
