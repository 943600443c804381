"""The learning rate over a run: warm-up on top of every schedule, scaling to the global batch, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain import config
from dptrain.cli import main
from dptrain.schedule import build_scheduler, peak_lr


def lrs(schedule: str, steps: int, *pairs: tuple[str, str], steps_per_epoch: int = 4) -> list[float]:
    """The learning rate each of `steps` optimizer steps runs at."""
    cfg = config.load(None, [("optim.schedule", schedule), ("optim.lr", "0.1"), *pairs])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(cfg))
    sched = build_scheduler(cfg, opt, steps, steps_per_epoch)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_learning_rate_schedules():
    assert lrs("constant", 10) == [0.1] * 10
    # approx: float64 closed forms of a few operations, ~1e-16 off, within approx's default rel 1e-6.
    # The < bounds are shapes, not rounding: cosine's 10th lr is 0.05 (1 + cos(0.9 pi)) = 2.4e-3; onecycle
    # starts at lr / 25 = 4e-3 and ends at lr / 25 / 1e4 = 4e-7 (torch's div_factor and final_div_factor).
    cosine = lrs("cosine", 10)
    assert cosine[0] == pytest.approx(0.1) and cosine[5] == pytest.approx(0.05) and cosine[-1] < 0.003
    onecycle = lrs("onecycle", 20)
    peak = max(range(20), key=onecycle.__getitem__)
    assert onecycle[0] < 0.01 and 3 <= peak <= 8 and onecycle[-1] < 1e-3
    step = lrs("step", 12, ("optim.step_epochs", "2"), ("optim.gamma", "0.5"), steps_per_epoch=4)
    assert step == pytest.approx([0.1] * 8 + [0.05] * 4)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step", "onecycle"])
def test_warmup_scales_every_schedule_linearly_from_zero(schedule):
    plain = lrs(schedule, 20)
    warm = lrs(schedule, 20, ("optim.warmup_steps", "5"))
    # float64 products of two exact-enough factors: approx's default rel 1e-6 is far above their 1e-16 rounding
    assert warm[:5] == pytest.approx([plain[s] * s / 5 for s in range(5)])
    assert warm[0] == 0.0 and warm[5:] == pytest.approx(plain[5:])


def test_warmup_values_at_given_steps_under_cosine():
    warm = lrs("cosine", 100, ("optim.warmup_steps", "10"))
    cosine = [0.05 * (1 + math.cos(math.pi * s / 100)) for s in range(100)]
    for step in (0, 1, 5, 9):
        assert warm[step] == pytest.approx(cosine[step] * step / 10)
    for step in (10, 50, 99):  # the warm-up is counted in the run: cosine runs over all 100 steps
        assert warm[step] == pytest.approx(cosine[step])


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 2.0), ("sqrt", math.sqrt(2.0))])
def test_the_peak_scales_with_the_global_batch(rule, factor):
    cfg = config.load(None, [("optim.lr", "0.1"), ("optim.scale_lr_with", rule), ("train.global_batch_size", "512"),
                             ("optim.reference_batch_size", "256")])
    assert peak_lr(cfg) == pytest.approx(0.1 * factor)
    assert lrs("constant", 3, ("optim.scale_lr_with", rule), ("train.global_batch_size", "512")) == \
        pytest.approx([0.1 * factor] * 3)


@pytest.mark.slow
def test_a_resume_mid_warmup_ends_bit_identical(tmp_path):
    """Stopped at step 4 of a 10-step warm-up under a scaled, cosine rate, resumed to 12: the same weights as one run."""
    run = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "256", "--data.synthetic_test_size", "32",
           "--train.global_batch_size", "32", "--train.epochs", "2", "--optim.schedule", "cosine",
           "--optim.warmup_steps", "10", "--optim.scale_lr_with", "sqrt", "--optim.reference_batch_size", "64",
           "--checkpoint.every_epochs", "0"]
    assert main([*run, "--train.max_steps", "12", "--output.dir", str(tmp_path / "whole")]) == 0
    # cosine is planned for the run's length: the stopped run keeps max_steps 12 and stops by a signal-free route:
    # it snapshots every 4 steps, and a copy of its step-4 snapshot is resumed.
    assert main([*run, "--train.max_steps", "12", "--checkpoint.every_steps", "4", "--checkpoint.keep_last", "5",
                 "--output.dir", str(tmp_path / "cut")]) == 0
    step4 = tmp_path / "cut" / "checkpoints" / "step-00000004"
    assert main([*run, "--train.max_steps", "12", "--train.resume", str(step4), "--output.dir", str(tmp_path / "resumed")]) == 0
    whole, resumed = (torch.load(tmp_path / name / "model.pt") for name in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_warmup_longer_than_the_run_is_one_warning_line_at_start(caplog):
    cfg = config.load(None, [("optim.warmup_steps", "1000")])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr(cfg))
    with caplog.at_level("WARNING", logger="dptrain"):
        build_scheduler(cfg, opt, total_steps=11, steps_per_epoch=11)
        build_scheduler(cfg, opt, total_steps=1000, steps_per_epoch=100)  # the warm-up fits: no line
    assert [record.getMessage() for record in caplog.records] == [
        "optim.warmup_steps 1000 is longer than the run's 11 optimizer steps, so the learning rate never reaches its "
        "peak 0.001 (the last step runs at 1% of it); lower --optim.warmup_steps, or train for more steps."]
