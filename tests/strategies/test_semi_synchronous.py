"""local_sgd and diloco, the semi-synchronous strategies: with period 1 (DiLoCo's outer step plain SGD of rate 1)
they train ddp's model, in float64; with a longer period they do not; a run killed by SIGKILL between two averagings
resumes bit-identical, from snapshots that hold each rank's own model and optimizer and the outer state; on another
number of ranks each goes on from their mean."""

from __future__ import annotations

import pytest
import torch

from dptrain import config
from dptrain.errors import ConfigError
from dptrain.faults import SIGNAL_AT
from tests.conftest import FLOAT64_ENV, assert_trained_alike, log_tail, plan_runs, read_events
from tests.ranks import run_cli_on_ranks, run_on_ranks

# 200 samples in global batches of 24: 9 steps an epoch, 18 in all; every step's loss logged, no dropout.
SMALL = ["--data.name", "synthetic", "--data.synthetic_train_size", "200", "--data.synthetic_test_size", "50",
         "--train.global_batch_size", "24", "--train.epochs", "2", "--model.dropout", "false", "--train.log_every", "1",
         "--launch.timeout_s", "60"]
STEPS = 18
# SGD with momentum: linear in the gradients, so the mean of the ranks' models after one step each is ddp's model
SGD = ["--optim.name", "sgd", "--optim.lr", "0.05", "--optim.momentum", "0.9"]
LIKE_DDP = {
    "ddp": ["--strategy.name", "ddp"],
    "local_sgd-period1": ["--strategy.name", "local_sgd", "--strategy.local_sgd.period", "1"],
    "diloco-period1": ["--strategy.name", "diloco", "--strategy.diloco.period", "1", "--strategy.diloco.outer_lr", "1",
                       "--strategy.diloco.outer_momentum", "0"],
    # post-local SGD whose DDP steps outlast the run: every step is ddp's
    "local_sgd-ddp-throughout": ["--strategy.name", "local_sgd", "--strategy.local_sgd.period", "4",
                                 "--strategy.local_sgd.post_local_steps", "100"],
}
UNLIKE_DDP = {"local_sgd-period4": ["--strategy.name", "local_sgd", "--strategy.local_sgd.period", "4"]}
# Killed by SIGKILL after step 12; snapshots every 5 steps and at the epoch's end (9): the restart resumes from step 10,
# one step past local_sgd's averaging at 9 (post_local_steps 5 of DDP, then every 4) and two past DiLoCo's outer step
# at 8 (every 4, the paper's outer optimizer): each rank's model apart from the others', Adam's state its own.
KILLED = {"local_sgd": ["--strategy.name", "local_sgd", "--strategy.local_sgd.period", "4",
                        "--strategy.local_sgd.post_local_steps", "5"],
          "diloco": ["--strategy.name", "diloco", "--strategy.diloco.period", "4"],
          # streaming: the exchange started after step 8 is owed until 11, so the snapshot of step 10 takes it early
          "diloco-streaming": ["--strategy.name", "diloco", "--strategy.diloco.period", "4",
                               "--strategy.diloco.overlap_steps", "3"]}
SNAPSHOTS = ["--checkpoint.every_steps", "5", "--checkpoint.keep_last", "5"]

plan_runs({f"semi/{name}": (["train", *SMALL, *SGD, *args], (2,)) for name, args in {**LIKE_DDP, **UNLIKE_DDP}.items()},
          precision="float64")
plan_runs({f"semi/killed-ref/{name}": (["train", *SMALL, *SNAPSHOTS, *args], (2,)) for name, args in KILLED.items()},
          precision="float64", nightly_worlds=(2,))  # read by the nightly tests only

# (the tests that use planned_run or start ranks are slow: conftest marks them)


@pytest.mark.parametrize("name", [n for n in LIKE_DDP if n != "ddp"])
def test_period_1_trains_ddps_model_in_float64(planned_run, name):
    reference = planned_run("semi/ddp", 2)
    weights = assert_trained_alike(planned_run(f"semi/{name}", 2), reference, STEPS)
    assert weights["fc1.weight"].dtype == torch.float64  # the float64 mode took


@pytest.mark.parametrize("name", UNLIKE_DDP)
def test_a_longer_period_trains_another_model(planned_run, name):
    """What the test above tells apart: 4 steps alone between averagings move the weights far from ddp's."""
    ours = torch.load(planned_run(f"semi/{name}", 2) / "model.pt")
    ddp = torch.load(planned_run("semi/ddp", 2) / "model.pt")
    assert max(float((ours[k] - ddp[k]).abs().max() / ddp[k].abs().max()) for k in ddp) > 1e-3


# Nightly (10 s each), as the resume on another number of ranks below: the default run keeps period 1 equal to ddp
# and a longer period apart
@pytest.mark.nightly
@pytest.mark.parametrize("name", KILLED)
def test_a_run_killed_between_averagings_resumes_bit_identical(cli, tmp_path, planned_run, name):
    run_dir, marker = tmp_path / "killed", tmp_path / "killed-after-12"
    result = cli("train", "--nproc-per-node", "2", *SMALL, *SNAPSHOTS, *KILLED[name], "--output.dir", str(run_dir),
                 "--launch.max_restarts", "1", "--launch.timeout_s", "10",
                 env={**FLOAT64_ENV, SIGNAL_AT: f"1:12:SIGKILL:self:{marker}"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.exists() and len(read_events(run_dir, "run_start")) == 2  # killed once, restarted once
    assert "step-00000010 at step 10" in result.stdout
    reference = planned_run(f"semi/killed-ref/{name}", 2)
    ours, theirs = torch.load(run_dir / "model.pt"), torch.load(reference / "model.pt")
    assert theirs["fc1.weight"].dtype == torch.float64
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # every epoch's numbers, the evaluation of the run's model included, as the run never stopped
    for key in ("train_loss", "eval_loss", "eval_acc"):
        assert [e[key] for e in read_events(run_dir, "epoch")] == [e[key] for e in read_events(reference, "epoch")]


@pytest.mark.nightly
@pytest.mark.parametrize("name", KILLED)
def test_a_snapshot_between_averagings_resumes_on_another_number_of_ranks(planned_run, tmp_path, name):
    """2 -> 3 ranks from step 10: each goes on from the mean of the 2 ranks' models and optimizer states."""
    snapshot = planned_run(f"semi/killed-ref/{name}", 2) / "checkpoints" / "step-00000010"
    run_dir = tmp_path / "on-3"
    [code] = run_cli_on_ranks(3, [["train", *SMALL, *SNAPSHOTS, *KILLED[name], "--output.dir", str(run_dir),
                                   "--train.resume", str(snapshot)]], str(tmp_path), env=FLOAT64_ENV)
    assert code == 0, log_tail(run_dir)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "goes on from the mean of the models and optimizer states of 2 ranks" in log
    assert sorted(e["step"] for e in read_events(run_dir, "step")) == list(range(11, STEPS + 1))


def streamed(rank: int, world: int, period: int, overlap: int, steps: int) -> dict:
    """DiLoCo through its strategy on 2 ranks, in float64 (a linear layer and a BatchNorm, inner SGD), beside a
    reference written from the schedule in diloco/strategy.py's docstring: each rank's own model after every step, the
    global one, and whether an exchange was under way."""
    from dptrain.config import StrategyConfig
    from dptrain.distributed.env import DistEnv
    from dptrain.strategies.diloco.options import DiLoCoOptions
    from dptrain.strategies.local_sgd.strategy import averaged_tensors
    from dptrain.strategies.registry import build_strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
    cfg = StrategyConfig(name="diloco", diloco=DiLoCoOptions(period=period, overlap_steps=overlap))
    strategy = build_strategy(cfg, DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun"), torch.device("cpu"))
    own = strategy.wrap(model)
    inner = torch.optim.SGD(own.parameters(), lr=0.1)
    # the reference: every rank's model, the global one, the outer optimizer, the copies as sent, the step owed
    import copy
    ranks = [copy.deepcopy(model) for _ in range(world)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]
    global_model = copy.deepcopy(model)
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    sent, owed = None, None
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(world * 4, 3, generator=data, dtype=torch.float64),
                torch.randint(0, 2, (world * 4,), generator=data)) for _ in range(steps)]
    seen = {"own": [], "reference": [], "global": [], "reference global": [], "under way": []}
    for step, (x, y) in enumerate(batches, start=1):
        strategy.zero_grad(inner)
        loss = torch.nn.functional.cross_entropy(own(x[rank::world]), y[rank::world])
        strategy.backward(loss, world)  # (times world / global_count: the mean loss as it is)
        strategy.optimizer_step(inner)
        for r, (m, opt) in enumerate(zip(ranks, inners)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x[r::world]), y[r::world]).backward()
            opt.step()
        if owed == step:  # the outer step on the mean pseudo-gradient; each rank: the global model + its progress
            tensors = [averaged_tensors(m) for m in ranks]
            params = len(list(global_model.parameters()))
            g = averaged_tensors(global_model)
            means = [sum(parts) / world for parts in zip(*pseudo)]
            for p, mean in zip(global_model.parameters(), means[:params]):
                p.grad = mean.clone()
            outer.step()
            with torch.no_grad():
                for b, mean in zip(g[params:], means[params:]):
                    b.copy_(mean)
                for mine, copies in zip(tensors, sent):
                    for t, c, gt in zip(mine, copies, g):
                        t.copy_(gt + (t - c))
            owed = None
        if step % period == 0:
            tensors = [averaged_tensors(m) for m in ranks]
            params = len(list(global_model.parameters()))
            g = averaged_tensors(global_model)
            pseudo = [[gt - t for gt, t in zip(g[:params], mine[:params])] + [t.clone() for t in mine[params:]]
                      for mine in tensors]
            sent = [[t.clone() for t in mine] for mine in tensors]
            owed = step + overlap
            assert overlap > 0  # (the reference is written for streaming)
        seen["own"].append([t.clone() for t in averaged_tensors(own)])
        seen["reference"].append([t.clone() for t in averaged_tensors(ranks[rank])])
        seen["global"].append([t.clone() for t in averaged_tensors(strategy.consensus)])
        seen["reference global"].append([t.clone() for t in averaged_tensors(global_model)])
        seen["under way"].append(strategy.under_way is not None)
    seen["params held"] = strategy.memory_bytes(inner)["params"] / sum(p.numel() * 8 for p in model.parameters())
    return seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_streaming_diloco_follows_its_schedule_in_float64():
    """Period 3, the exchange 2 inner steps behind, 2 ranks, 9 steps: under way after steps 3-4, 6-7 and 9; after each
    step every rank's model and the global one are the reference's, to float64's last bits (the same operations, in
    another order: 1e-12); the global model moves at steps 5 and 8 only."""
    for rank, seen in enumerate(run_on_ranks(streamed, 2, 3, 2, 9)):
        assert seen["under way"] == [False, False, True, True, False, True, True, False, True]
        for step in range(9):
            for ours, theirs in [(seen["own"][step], seen["reference"][step]),
                                 (seen["global"][step], seen["reference global"][step])]:
                assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-12, (rank, step)
        moved = [step + 1 for step in range(1, 9)
                 if any(not torch.equal(a, b) for a, b in zip(seen["global"][step], seen["global"][step - 1]))]
        assert moved == [5, 8], moved
        assert seen["params held"] == 3  # its own, the global model, and the copy of what it sent
        # the ranks' own models differ between exchanges, and each keeps its own progress after one
        assert any(not torch.equal(a, b) for a, b in zip(seen["own"][4], seen["global"][4]))


@pytest.mark.parametrize(("option", "value", "sentence"), [
    ("strategy.local_sgd.period", "0", "strategy.local_sgd.period = 0 must be greater than 0."),
    ("strategy.local_sgd.post_local_steps", "-1", "strategy.local_sgd.post_local_steps = -1 must be 0 or more."),
    ("strategy.diloco.period", "0", "strategy.diloco.period = 0 must be greater than 0."),
    ("strategy.diloco.outer_lr", "0", "strategy.diloco.outer_lr = 0.0 must be greater than 0."),
    ("strategy.diloco.outer_momentum", "-0.5", "strategy.diloco.outer_momentum = -0.5 must be 0 or more."),
    ("strategy.diloco.overlap_steps", "-1", "strategy.diloco.overlap_steps = -1 must be 0 or more."),
    ("strategy.diloco.overlap_steps", "32",
     "strategy.diloco.overlap_steps = 32 must be less than strategy.diloco.period = 32 (a period's outer step comes "
     "before the next one's exchange); lower it or raise the period."),
])
def test_their_options_refuse_in_one_sentence(option, value, sentence):
    with pytest.raises(ConfigError) as refused:
        config.load(None, [("strategy.name", option.split(".")[1]), (option, value)])
    assert str(refused.value) == sentence
