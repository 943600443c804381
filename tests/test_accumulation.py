"""train.accumulate_steps: each rank's share of the global batch in micro-batches, the gradients synchronised once a step.

The same math as the larger batch: in float64 (tests/float64), a run of per-rank micro-batches of 4 accumulated 3 times
trains what the run of per-rank batches of 12 trains, for ddp, fsdp, zero1 and ps; the step count, the samples, the
epoch's loss and the bytes sent a step (one synchronisation) agree. Snapshots are taken between optimizer steps only,
and a run stopped there resumes bit for bit. The refusals are one sentence each.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.config import RunConfig, StrategyConfig, load as load_config
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.strategies.registry import build_strategy, check_world
from dptrain.train import TrainStep
from tests.conftest import log_tail, plan_runs, read_events
from tests.ranks import run_cli_on_ranks

# ---------------------------------------------------------------- the step itself, in this process

ONE = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "none")


def trained(micro_batches: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, list]:
    """A small float64 model after one TrainStep per batch (one process, SGD with momentum): its weights, and each
    step's (loss sum, correct) as the step returned them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 5)).double()
    strategy = build_strategy(StrategyConfig(name="single"), ONE, torch.device("cpu"), micro_batches=micro_batches)
    wrapped = strategy.wrap(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(strategy=strategy, model=wrapped, optimizer=optimizer,
                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                     autocast=contextlib.nullcontext, grad_clip=0.5, micro_batches=micro_batches)
    returned = []
    for images, labels in batches:
        loss_sum, correct = step.eager(images, labels, len(labels))
        returned.append((loss_sum.item(), int(correct)))
    return {k: v.clone() for k, v in model.state_dict().items()}, returned


@pytest.mark.parametrize("micro_batches", [3, 8])  # 8: more pieces than the short batch's 7 samples, one of them empty
def test_micro_batches_sum_to_the_step_of_the_whole_batch(micro_batches):
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, 2, 2, generator=gen, dtype=torch.float64), torch.randint(0, 5, (n,), generator=gen))
               for n in (12, 12, 7)]
    whole, whole_returned = trained(1, batches)
    pieces, pieces_returned = trained(micro_batches, batches)
    for name, weight in whole.items():
        assert (pieces[name] - weight).abs().max() <= 1e-12 * weight.abs().max(), name
    for (loss, correct), (loss_of_pieces, correct_of_pieces) in zip(whole_returned, pieces_returned, strict=True):
        assert abs(loss_of_pieces - loss) <= 1e-12 * loss and correct_of_pieces == correct
    assert trained(1, batches[:1])[0]["1.weight"].ne(whole["1.weight"]).any()  # the later steps changed the weights


# ---------------------------------------------------------------- refusals, before any worker starts


def test_a_global_batch_that_does_not_split_into_equal_micro_batches_is_one_sentence():
    cfg = load_config(None, [("train.global_batch_size", "24"), ("train.accumulate_steps", "5")])
    with pytest.raises(ConfigError) as caught:
        check_world(cfg, 2, 1000, on_cpu=True)
    assert str(caught.value) == ("train.global_batch_size 24 does not split into 2 ranks x 5 micro-batches "
                                 "(train.accumulate_steps) of equal size; choose a multiple of 10, for example 20, or "
                                 "another train.accumulate_steps.")
    check_world(load_config(None, [("train.global_batch_size", "24"), ("train.accumulate_steps", "4")]), 2, 1000, on_cpu=True)


@pytest.mark.parametrize("options, sentence", [
    ([("train.cuda_graph", "true"), ("train.accumulate_steps", "2")],
     "train.cuda_graph captures one forward and backward a step, and train.accumulate_steps 2 runs 2; drop one of the "
     "two."),
    ([("train.accumulate_steps", "0")], "train.accumulate_steps = 0 must be greater than 0."),
])
def test_what_accumulation_cannot_run_with_is_one_sentence(options, sentence):
    with pytest.raises(ConfigError) as caught:
        load_config(None, options)
    assert str(caught.value) == sentence


def test_the_update_in_the_next_forward_refuses_micro_batches():
    cfg = load_config(None, [("strategy.ddp.update_in_next_forward", "true"), ("train.accumulate_steps", "3")])
    with pytest.raises(ConfigError) as caught:
        check_world(cfg, 2, 1000, on_cpu=True)
    assert str(caught.value) == ("strategy.ddp.update_in_next_forward applies each step's update in the next forward, "
                                 "and train.accumulate_steps 3 runs 3 forwards a step; drop one of the two.")


def test_the_dry_run_shows_the_micro_batches(tmp_path, capsys, monkeypatch):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "--data.name", "synthetic", "--data.synthetic_train_size", "300",
                 "--nproc-per-node", "2", "--train.global_batch_size", "64", "--train.accumulate_steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "batches    global 64 = 32 per rank = 4 micro-batches of 8 (train.accumulate_steps); 5 steps per epoch" in out
    assert "one batch 8x1x28x28 ran forward on the CPU" in out  # a micro-batch is what a forward pass takes


def test_the_tutorials_batch_per_rank_is_a_micro_batch():
    from dptrain.prestart import resolve_batch

    cfg = resolve_batch(load_config(None, [("train.batch_size_per_rank", "16"), ("train.accumulate_steps", "4")]), 2)
    assert cfg.train.global_batch_size == 16 * 2 * 4


def test_accumulation_may_change_at_resume_as_the_world_size_may():
    """The same math: a snapshot of 4 micro-batches a step resumes with 2 (the global batch is what it keeps)."""
    from dptrain.config import fixed_at_resume

    assert "train.accumulate_steps" not in fixed_at_resume(RunConfig())


# ---------------------------------------------------------------- the same math as the larger batch, in float64

# 100 samples in global batches of 24 on 2 ranks: 5 steps an epoch, the last of 4 samples (2 a rank, so one of the 3
# micro-batches of each rank is empty), 10 steps in all; no dropout, SGD with momentum.
EXACT = ["--data.name", "synthetic", "--data.synthetic_train_size", "100", "--data.synthetic_test_size", "30",
         "--model.dropout", "false", "--train.epochs", "2", "--train.log_every", "1", "--optim.name", "sgd",
         "--optim.lr", "0.01", "--train.channels_last", "false", "--launch.timeout_s", "60",
         "--checkpoint.every_epochs", "0"]
STRATEGIES = ("ddp", "fsdp", "zero1", "ps")
plan_runs({f"accumulate/{s}-{k}": (["train", *EXACT, "--strategy.name", s, *args], (2,))
           for s in STRATEGIES for k, args in (("micro", ["--train.batch_size_per_rank", "4",
                                                          "--train.accumulate_steps", "3"]),
                                               ("whole", ["--train.batch_size_per_rank", "12"]))},
          precision="float64")


@pytest.fixture(scope="module")
def exact(planned_run):
    return lambda strategy, kind: planned_run(f"accumulate/{strategy}-{kind}", 2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_micro_batches_train_what_the_larger_batch_trains_in_float64(exact, strategy):
    micro, whole = exact(strategy, "micro"), exact(strategy, "whole")
    assert "accumulate_steps = 3\n" in (micro / "config.toml").read_text()
    ours, theirs = torch.load(micro / "model.pt"), torch.load(whole / "model.pt")
    worst = 0.0
    for name, ref in theirs.items():
        assert ours[name].dtype == torch.float64, name
        worst = max(worst, ((ours[name] - ref).abs().max() / ref.abs().max()).item())
    print(f"{strategy}: worst weight difference {worst:.1e} of a tensor's scale")
    assert worst <= 1e-12
    losses = {e["step"]: e["loss"] for e in read_events(micro, "step")}
    expected = {e["step"]: e["loss"] for e in read_events(whole, "step")}
    assert sorted(losses) == sorted(expected) == list(range(1, 11))  # one step per global batch
    assert all(abs(losses[s] - expected[s]) <= 1e-12 * expected[s] for s in expected)
    for mine, reference in zip(read_events(micro, "epoch"), read_events(whole, "epoch"), strict=True):
        assert (mine["step"], mine["train_samples"]) == (reference["step"], reference["train_samples"])
        assert abs(mine["train_loss"] - reference["train_loss"]) <= 1e-12 * reference["train_loss"]
        assert mine["train_samples"] == 100  # every sample of the epoch once
        if strategy != "fsdp":  # one synchronisation a step: the same bytes
            assert mine["comm_bytes_per_step"] == reference["comm_bytes_per_step"]


@pytest.mark.slow
def test_fsdp_gathers_the_parameters_for_each_micro_batch_and_reduces_once(exact):
    """Its bytes a step, through shared memory (2 ranks on this host): the half of each gather of the float64 parameters
    it writes (the whole model twice a forward and backward, reshard_after_forward) in each of the 3 micro-batches, and
    its whole float64 gradients once for the reduce-scatter."""
    numel = sum(t.numel() for t in torch.load(exact("fsdp", "whole") / "model.pt").values())
    micro, whole = (read_events(exact("fsdp", kind), "epoch")[-1]["comm_bytes_per_step"] for kind in ("micro", "whole"))
    assert whole == [2 * numel * 8 // 2 + numel * 8] * 2
    assert micro == [3 * 2 * numel * 8 // 2 + numel * 8] * 2


# DeepSpeed's engine (ZeRO-2 here) accumulates at its own boundary (gradient_sync): the same training as the larger
# batch, to float32's rounding (its partitions and buckets stay float32 under the float64 mode), on the nightly tier.
plan_runs({f"accumulate/deepspeed-{k}": (["train", *EXACT, "--strategy.name", "deepspeed", *args], (2,))
           for k, args in (("micro", ["--train.batch_size_per_rank", "4", "--train.accumulate_steps", "3"]),
                           ("whole", ["--train.batch_size_per_rank", "12"]))}, nightly_worlds=(2,))


@pytest.mark.nightly
def test_deepspeed_micro_batches_train_what_the_larger_batch_trains(planned_run):
    micro, whole = (planned_run(f"accumulate/deepspeed-{kind}", 2) for kind in ("micro", "whole"))
    ours, theirs = torch.load(micro / "model.pt"), torch.load(whole / "model.pt")
    for name, ref in theirs.items():
        assert (ours[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
    losses, expected = ([e["loss"] for e in read_events(run, "step")] for run in (micro, whole))
    assert len(losses) == len(expected) == 10 and all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, expected))
    assert read_events(micro, "epoch")[-1]["train_samples"] == 100


# ---------------------------------------------------------------- snapshots between optimizer steps, exact resume

# 200 samples in global batches of 32 on 2 ranks, 4 micro-batches of 4 a rank: 7 steps an epoch, 14 in all; dropout on
# (each rank's RNG is the snapshot's); a snapshot every 5 steps.
RESUMED = ["--data.name", "synthetic", "--data.synthetic_train_size", "200", "--data.synthetic_test_size", "50",
           "--train.global_batch_size", "32", "--train.accumulate_steps", "4", "--train.epochs", "2",
           "--checkpoint.every_steps", "5", "--checkpoint.keep_last", "5", "--launch.timeout_s", "60"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """strategy -> (the uninterrupted run's folder, the folder of the run stopped by train.max_steps 9 and then run
    again to the end), for ddp and fsdp, made on 2 rank processes of the pool, two waves side by side."""
    root = tmp_path_factory.mktemp("accumulate-resume")
    first, second = [], []
    for s in ("ddp", "fsdp"):
        first += [["train", *RESUMED, "--strategy.name", s, "--output.dir", str(root / f"ref-{s}")],
                  ["train", *RESUMED, "--strategy.name", s, "--output.dir", str(root / s), "--train.max_steps", "9"]]
        second.append(["train", *RESUMED, "--strategy.name", s, "--output.dir", str(root / s)])
    codes = [*run_cli_on_ranks(2, first, str(root), side_by_side=True),
             *run_cli_on_ranks(2, second, str(root), side_by_side=True)]
    for argv, code in zip([*first, *second], codes):
        assert code == 0, log_tail(Path(argv[argv.index("--output.dir") + 1]))
    return lambda s: (root / f"ref-{s}", root / s)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_of_micro_batches_stopped_between_steps_resumes_bit_identical(resumed, strategy):
    reference, run_dir = resumed(strategy)
    assert "step-00000009 at step 9 (epoch 2, 2 batches into it)" in (run_dir / "logs" / "rank0.log").read_text()
    ours, theirs = torch.load(run_dir / "model.pt"), torch.load(reference / "model.pt")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # the resumed epoch's numbers cover each of its samples once, as if never stopped
    mine, never_stopped = read_events(run_dir, "epoch")[-1], read_events(reference, "epoch")[-1]
    assert (mine["step"], mine["train_samples"], mine["train_loss"]) == \
        (never_stopped["step"], never_stopped["train_samples"], never_stopped["train_loss"]) == (14, 200, mine["train_loss"])
