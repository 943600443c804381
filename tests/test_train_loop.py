"""The loop in one process (no agent): stopping rules, resuming after a stop, schedules, bf16 and clipping."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from dptrain import config
from dptrain.cli import main
from dptrain.events import EPOCH_EVENT
from dptrain.faults import SIGNAL_AT
from dptrain.metrics import EventLog
from dptrain.stopping import EXIT_STOPPED
from dptrain.train import build_trainer
from dptrain.worker import rank_life
from tests.conftest import read_events

SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "100", "--data.synthetic_test_size", "30",
         "--strategy.name", "single", "--train.global_batch_size", "32", "--train.log_every", "1"]


@pytest.mark.slow
def test_max_steps_stops_mid_epoch_and_still_reports_the_partial_epoch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, "--train.epochs", "3", "--train.max_steps", "5", "--output.name", "r"]) == 0
    epochs = read_events(tmp_path / "runs" / "r", "epoch")
    assert [(e["epoch"], e["step"], e["train_samples"]) for e in epochs] == [(1, 4, 100), (2, 5, 32)]
    assert all(e["eval_count"] == 30 for e in epochs)
    assert len(read_events(tmp_path / "runs" / "r", "step")) == 5


@pytest.mark.slow
def test_bf16_autocast_and_clipping_train_close_to_fp32(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    losses = {}
    for name, extra in (("fp32", []), ("bf16", ["--train.bf16", "true", "--train.grad_clip", "1.0"])):
        assert main(["train", *SMALL, "--train.max_steps", "8", "--model.dropout", "false", "--output.name", name, *extra]) == 0
        losses[name] = [e["loss"] for e in read_events(tmp_path / "runs" / name, "step")]
    assert all(math.isfinite(x) for x in losses["bf16"])
    # Not a rounding bound: clipping at 1.0 changes Adam's steps from step 2 on (clipping alone, measured:
    # up to 3.5e-2), and bf16 (8 significant bits, u = 2^-8 ~ 3.9e-3) adds up to 5e-3 over these 8 steps
    # (measured): the same curve to 5%, a diverging or untrained run is off by far more.
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) <= 0.05 * a
    # Step 1's loss comes before any update, so clipping cannot change it: only autocast can (measured 6e-5).
    assert losses["bf16"][0] != losses["fp32"][0]  # autocast really ran


@pytest.mark.slow
def test_deterministic_kernels_change_no_result_and_no_snapshot(tmp_path, monkeypatch):
    """--train.deterministic picks kernels, not math: the same weights on the CPU, and a snapshot resumes across it."""
    monkeypatch.chdir(tmp_path)
    had_workspace = "CUBLAS_WORKSPACE_CONFIG" in os.environ
    try:
        assert main(["train", *SMALL, "--train.max_steps", "4", "--output.name", "det", "--train.deterministic", "true"]) == 0
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
    finally:  # process-wide switches: leave the other tests as they were
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        if not had_workspace:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert main(["train", *SMALL, "--train.max_steps", "4", "--output.name", "plain"]) == 0
    det, plain = (torch.load(tmp_path / "runs" / name / "model.pt") for name in ("det", "plain"))
    assert all(torch.equal(det[k], plain[k]) for k in det)
    assert main(["train", *SMALL, "--train.max_steps", "6", "--output.name", "det"]) == 0  # resumes without the flag
    assert [e["step"] for e in read_events(tmp_path / "runs" / "det", "run_end")] == [4, 6]


@pytest.mark.slow
def test_dp_without_gpus_says_it_runs_as_one_device_and_trains_like_single(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("single", "dp"):
        args = [a if a != "single" else name for a in SMALL]
        assert main(["train", *args, "--train.max_steps", "4", "--model.dropout", "false", "--output.name", name]) == 0
    log = (tmp_path / "runs" / "dp" / "logs" / "rank0.log").read_text()
    assert "strategy dp: no GPU here, so it runs as one device" in log
    losses = {n: [e["loss"] for e in read_events(tmp_path / "runs" / n, "step")] for n in ("single", "dp")}
    assert losses["dp"] == losses["single"]


@pytest.mark.slow
def test_adamw_trains_and_decays_the_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = [*SMALL, "--model.dropout", "false", "--train.max_steps", "12", "--optim.name", "adamw", "--optim.lr", "3e-3"]
    assert main(["train", *common, "--output.name", "nodecay"]) == 0
    assert main(["train", *common, "--optim.weight_decay", "0.5", "--output.name", "decay"]) == 0
    losses = [e["loss"] for e in read_events(tmp_path / "runs" / "nodecay", "step")]
    assert sum(losses[-3:]) < sum(losses[:3])  # it trains
    norm = {name: sum(t.norm() ** 2 for t in torch.load(tmp_path / "runs" / name / "model.pt").values()) ** 0.5
            for name in ("nodecay", "decay")}
    assert norm["decay"] < norm["nodecay"]  # the decoupled decay pulls the weights in


@pytest.mark.slow
def test_gradient_clipping_clips_the_global_norm(tmp_path, monkeypatch):
    """A bound above every gradient's norm changes nothing; a tiny one makes SGD steps exactly that long."""
    monkeypatch.chdir(tmp_path)
    common = [*SMALL, "--model.dropout", "false", "--train.max_steps", "1", "--optim.name", "sgd", "--optim.momentum", "0",
              "--optim.lr", "1.0", "--checkpoint.every_epochs", "0"]
    weights = {}
    for name, extra in (("free", []), ("loose", ["--train.grad_clip", "1e6"]), ("tight", ["--train.grad_clip", "1e-3"])):
        assert main(["train", *common, "--output.name", name, *extra]) == 0
        weights[name] = torch.load(tmp_path / "runs" / name / "model.pt")
    torch.manual_seed(0)  # the initial weights, as build() makes them
    initial = config.load(None, [("data.name", "synthetic")])
    from dptrain.models import build_model

    start = build_model(initial.model, (1, 28, 28), 10).state_dict()
    assert all(torch.equal(weights["free"][k], weights["loose"][k]) for k in start)
    step = sum(((weights["tight"][k] - start[k]) ** 2).sum() for k in start) ** 0.5  # lr 1 x the clipped gradient
    # clip_grad_norm_ scales to 1e-3 * |g| / (|g| + 1e-6): 5e-7 short for |g| ~ 2.2. Each new fp32 weight is
    # rounded (u = 2^-24) relative to the weight, not to the step: |error| <= u |w| = 6e-8 x 8.9 (the initial
    # weights' norm) = 5.3e-7, at most 5.3e-4 of the 1e-3 step. Sum < 1e-3 (measured: 2.4e-5).
    assert step.item() == pytest.approx(1e-3, rel=1e-3)


def test_run_epoch_is_public_and_on_step_sees_each_step_once_it_is_counted(tmp_path):
    """perf/gpu_profile.py's way in: run_epoch() trains one epoch on its own (entering it as the TrainState says) and
    returns its training fields; on_step is called once per step, the step counted."""
    pairs = [(key.removeprefix("--"), value) for key, value in zip(SMALL[::2], SMALL[1::2])]
    cfg = config.load(None, [*pairs, ("output.dir", str(tmp_path / "run"))])
    seen = []
    with rank_life(cfg, None) as (env, phase, device, _):
        trainer = build_trainer(cfg, env, device, EventLog([]), phase)
        trainer.on_step = lambda state: seen.append((state.step, state.batches_consumed, state.epoch_seen))
        fields = trainer.run_epoch(0)
        trainer.snapshots.wait()
    assert seen == [(1, 1, 32), (2, 2, 64), (3, 3, 96), (4, 4, 100)]  # 100 samples in global batches of 32
    assert fields["train_samples"] == 100 and list(fields) == [f for f in EPOCH_EVENT.fields if f in fields]


RESUMED = [*SMALL, "--model.name", "tests.user_code:TinyNet", "--train.epochs", "2", "--checkpoint.every_steps", "0"]


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory) -> Path:
    """RESUMED run through its 2 epochs of 4 steps without a stop: what every stopped and resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("never_stopped") / "run"
    assert main(["train", *RESUMED, "--output.dir", str(run_dir)]) == 0
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("stop_after", [2, 4, 8],
                         ids=["mid-epoch", "after an epoch's last step", "after the run's last step"])
def test_a_run_stopped_by_a_signal_resumes_where_it_stood(tmp_path, monkeypatch, never_stopped, stop_after):
    """The position a snapshot keeps, in one process: stopped mid-epoch the resume trains only the epoch's remaining
    batches (batches_consumed); stopped after an epoch's last step, before its event, the resume still owes that epoch
    its event (epoch_reported), the run's last one too, and emits it once, with the numbers of a run never stopped."""
    run_dir, expected = tmp_path / "run", read_events(never_stopped, "epoch")
    monkeypatch.setenv(SIGNAL_AT, f"0:{stop_after}:SIGUSR1:self")
    with pytest.raises(SystemExit) as stopped:
        main(["train", *RESUMED, "--output.dir", str(run_dir)])
    assert stopped.value.code == EXIT_STOPPED
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stop_after:08d}"
    before = [e["epoch"] for e in expected if e["step"] < stop_after]  # the events of the epochs done before the stop
    assert [e["epoch"] for e in read_events(run_dir, "epoch")] == before
    monkeypatch.delenv(SIGNAL_AT)
    assert main(["train", *RESUMED, "--output.dir", str(run_dir)]) == 0
    assert [e["step"] for e in read_events(run_dir, "run_start")] == [0, stop_after]  # resumed, not started afresh
    got = read_events(run_dir, "epoch")
    assert [(e["epoch"], e["step"]) for e in got] == [(1, 4), (2, 8)]
    for key in ("train_loss", "train_acc", "train_samples", "eval_loss", "eval_count"):
        assert [e[key] for e in got] == [e[key] for e in expected], key
    resumed, whole = (torch.load(folder / "model.pt") for folder in (run_dir, never_stopped))
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.nightly
@pytest.mark.slow  # the compiler takes about 10 s here
def test_compiled_training_follows_the_eager_losses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--train.compile", "true"])):
        assert main(["train", *SMALL, "--model.name", "tests.user_code:TinyNet", "--train.max_steps", "6",
                     "--optim.name", "sgd", "--optim.lr", "0.01", "--output.name", name, *extra]) == 0
        losses[name] = [e["loss"] for e in read_events(tmp_path / "runs" / name, "step")]
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # the compiled run really ran compiled code
    assert len(losses["compiled"]) == 6
    # Inductor calls the same matmul kernels and fuses elementwise work exactly; a reduction it writes itself (the
    # bias gradients' sum over the batch) may add in another order, which changes last bits (fp32: u = 6e-8). SGD
    # carries that rounding through its 6 steps without amplifying it: the loss moves by orders of magnitude less than
    # this bound. Not Adam: its first step moves every weight by lr whatever its gradient's size, so a near-zero
    # gradient summed in another order (another CPU's vector width) may flip sign and move the loss by far more.
    for a, b in zip(losses["eager"], losses["compiled"]):
        assert abs(a - b) <= 1e-5 * a


@pytest.mark.parametrize("overrides, sentence", [
    ([("train.cuda_graph", "true")], "train.compile and train.cuda_graph"),
    ([("strategy.name", "dp")], "train.compile cannot compile through nn.DataParallel"),
])
def test_compile_is_refused_where_it_cannot_apply(overrides, sentence):
    with pytest.raises(config.ConfigError, match=sentence) as refused:
        config.load(None, [("train.compile", "true"), *overrides])
    assert len(str(refused.value).splitlines()) == 1
