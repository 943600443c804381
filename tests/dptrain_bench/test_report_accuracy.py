"""`dptrain report`'s accuracy against bytes and time: each line's curve (accuracy.png), its gap to exact training's
accuracy, and with --accuracy-budget whether each line that rounds or delays the gradients keeps within it; the
sweep's local_sgd period in the model's plan. Folders written by hand, no training."""

from __future__ import annotations

import json

from dptrain.cli import main


def write_point(bench, strategy: str, workers: int, accs: list[float], sent: int, epoch_s: float) -> None:
    """A finished point whose epochs of 10 steps each end with these accuracies, `sent` bytes a step from each rank."""
    run_dir = bench / "runs" / f"dptrain-{strategy}-w{workers}-r1"
    run_dir.mkdir(parents=True)
    events = [{"event": "run_start", "global_batch_size": 32}]
    events += [{"event": "epoch", "epoch": e, "step": 10 * e, "epoch_time_s": epoch_s, "train_samples": 320,
                "eval_loss": 0.5, "eval_acc": acc, "peak_mem_mb": 100.0, "comm_bytes_per_step": [sent] * workers,
                "mem_params_bytes": [4_000_000] * workers, "mem_optim_bytes": [8_000_000] * workers}
               for e, acc in enumerate(accs, 1)]
    events.append({"event": "run_end"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_report_draws_accuracy_against_bytes_and_time_and_marks_each_line_against_the_budget(tmp_path, capsys):
    bench = tmp_path / "bench"
    write_point(bench, "ddp", 1, [0.80, 0.90], 0, 2.0)
    write_point(bench, "ddp", 2, [0.81, 0.90], 4_000_000, 1.5)  # exact: ddp's gradients every step
    write_point(bench, "local_sgd", 2, [0.79, 0.897], 250_000, 1.0)  # a 16th of them: 0.3 points below
    write_point(bench, "diloco", 2, [0.70, 0.89], 125_000, 1.0)  # 1 point below
    (bench / "sweep.json").write_text(json.dumps({"config": {"strategy": {"local_sgd": {"period": 16}}}}))
    assert main(["report", str(bench), "--accuracy-budget", "0.5"]) == 0, capsys.readouterr().err
    assert (bench / "accuracy.png").stat().st_size > 10_000
    text = (bench / "report.md").read_text()
    section = text.split("## Accuracy against bytes and time", 1)[1].split("\n## ", 1)[0]
    assert "![Accuracy against bytes and time](accuracy.png)" in section
    assert "Exact training's accuracy: 0.9000, the mean of the 2 lines" in section
    assert "| dptrain | ddp | 2 | 213 | 4,000,000 | 0.9000 | +0.00 | yes (exact) |" in section
    assert "| dptrain | local_sgd | 2 | 320 | 250,000 | 0.8970 | +0.30 | yes |" in section
    assert "| dptrain | diloco | 2 | 320 | 125,000 | 0.8900 | +1.00 | no |" in section
    from dptrain_bench.report import accuracy_curves, load_rows

    curves = {c.label: c.points for c in accuracy_curves(bench, load_rows(bench)[0])}
    assert curves["dptrain local_sgd w2"] == [(2_500_000, 1.0, 0.79), (5_000_000, 2.0, 0.897)]  # cumulated
    assert main(["report", str(bench)]) == 0  # without a budget: the gaps, no verdict
    assert "within the budget" not in (bench / "report.md").read_text()


def test_the_models_plan_takes_the_sweeps_period():
    from dptrain_bench.report import _plan

    assert _plan("local_sgd", {"local_sgd": {"period": 8}}).period == 8
    assert _plan("diloco", {}).period == 32  # its option's default
    assert _plan("ddp", {"local_sgd": {"period": 8}}).period == 1
