"""strategy.ddp.update_in_next_forward (src/dptrain/strategies/deferred_update.py): each bucket's all-reduce left
running when backward ends, each layer's update applied just before the next forward reaches it. The same model as
one process in float64, with a learning rate that changes every step; updates really owed between steps; settle()
leaving none; with a compressing hook (fp16, PowerSGD) the same weights and bytes as the hook without the option; the
refusals. Resuming exactly from its snapshots is tests/test_checkpoint.py's (ddp-deferred)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.config import OptimConfig, RunConfig, StrategyConfig
from dptrain.strategies.ddp.options import DDPOptions
from dptrain.distributed.env import DistEnv
from dptrain.strategies.registry import build_strategy
from dptrain.strategies.ddp.deferred_update import priority_params, update_only
from dptrain.train import optimizer_spec
from tests.ranks import run_on_ranks
from tests.strategies.test_parity import CNN, GLOBAL_BATCH, LR, batch, initial_model, worst

STEPS = 5
# shared_memory false: these ranks run on one host, where the option otherwise gives way to the shared-memory sum
DEFERRED = StrategyConfig(name="ddp", ddp=DDPOptions(update_in_next_forward=True, shared_memory=False))
# 4 KB buckets: a bucket about each tensor, several owed at once, the first layers' on the second channel
SMALL_BUCKETS = StrategyConfig(name="ddp", ddp=DDPOptions(update_in_next_forward=True, shared_memory=False,
                                                          bucket_mb=0.004))
ON_ONE_HOST = StrategyConfig(name="ddp", ddp=DDPOptions(update_in_next_forward=True))
# The compressing hooks, each against itself without the option (their math is not one process's): PowerSGD's first
# two steps are plain all-reduces, its third draws its first factors (from generators of their own: owed like any other
# step); in 4 KB buckets several are owed at once, compressed and sent one after another on its thread.
HOOKED = {"fp16": DDPOptions(comm_hook="fp16"), "bf16": DDPOptions(comm_hook="bf16"),
          "powersgd": DDPOptions(comm_hook="powersgd"),
          "powersgd-buckets": DDPOptions(comm_hook="powersgd", bucket_mb=0.004)}


def train(cfg: StrategyConfig, env: DistEnv, optim: str, settle_after: tuple[int, ...] = ()) -> dict[str, list]:
    """As TrainStep.eager does it, through the strategy's zero_grad, optimizer_step and settle, in float64, the
    learning rate halved after every step (a scheduler moves it on before the deferred update runs): the weights
    after each step in settle_after and at the end (settled first), and the updates owed after each step."""
    strategy = build_strategy(cfg, env, torch.device("cpu"))
    model = strategy.wrap(initial_model(torch.float64))
    run_cfg = RunConfig(optim=OptimConfig(name=optim, lr=LR[optim]), strategy=cfg)  # type: ignore[arg-type]
    optimizer = strategy.build_optimizer(strategy.eval_module, optimizer_spec(run_cfg))
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    index, share_count = strategy.data_share()
    out: dict[str, list] = {"weights": [], "owed": [], "unchanged": []}
    for step in range(STEPS):
        images, labels = batch(step, torch.float64)
        strategy.zero_grad(optimizer)
        loss_sum = F.cross_entropy(model(images[index::share_count]), labels[index::share_count], reduction="sum")
        before = {k: v.detach().clone() for k, v in strategy.eval_module.state_dict().items()}  # as this forward used
        strategy.backward(loss_sum, GLOBAL_BATCH)
        strategy.optimizer_step(optimizer)
        schedule.step()
        deferred = getattr(strategy, "deferred", None)
        out["owed"].append(len(deferred.pending) if deferred is not None else 0)
        # owed: the weights the next forward will update are still the ones this step's forward used
        now = strategy.eval_module.state_dict()
        out["unchanged"].append(sorted(k for k in before if torch.equal(before[k], now[k])))
        if step == STEPS - 1:  # counted as each bucket went out, before any is settled: the steps' own bytes
            out["bytes sent"] = [strategy.comm_bytes(STEPS)]
        if step in settle_after or step == STEPS - 1:
            strategy.settle()
            out["weights"].append({k: v.detach().clone() for k, v in strategy.full_state_dict().items()})
    deferred = getattr(strategy, "deferred", None)
    out["steps timed"] = [len(deferred.timed) if deferred is not None else 0]
    out["summed through shared memory"] = [getattr(strategy, "shared_memory_sum", None) is not None]
    timings = [strategy.comm_timing() for _ in range(2)]  # the epoch's mean, then nothing new to tell
    out["timing"] = [None if t is None else (t.total_ms, t.exposed_ms) for t in timings]
    return out


def _deferred_cases(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    env = DistEnv(rank, rank, world, world, "127.0.0.1", 0, "torchrun")
    results = {(name, optim): train(cfg, env, optim, settle_after=(2,))
               for name, cfg in (("deferred", DEFERRED), ("small-buckets", SMALL_BUCKETS)) for optim in LR}
    results[("on one host", "sgd")] = train(ON_ONE_HOST, env, "sgd")
    for name, options in HOOKED.items():
        for deferred in (False, True):
            cfg = StrategyConfig(name="ddp", ddp=dataclasses.replace(options, update_in_next_forward=deferred))
            results[(name, deferred)] = train(cfg, env, "sgd", settle_after=(2,))
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def two_ranks():
    """(case, optim) -> train() on 2 gloo ranks, rank 0's view."""
    return torch.load(io.BytesIO(run_on_ranks(_deferred_cases, 2, timeout=240)[0]))


@pytest.mark.slow
@pytest.mark.parametrize("optim", list(LR))
@pytest.mark.parametrize("case", ["deferred", "small-buckets"])
def test_deferred_updates_train_what_one_process_trains_in_float64(two_ranks, case, optim):
    result = two_ranks[(case, optim)]
    reference = train(StrategyConfig(name="ddp"), DistEnv.single(), optim, settle_after=(2,))
    for weights, expected, when in zip(result["weights"], reference["weights"], ("step 3", f"step {STEPS}")):
        diff, tensor = worst(weights, expected)
        assert diff <= 1e-10, f"after {when}, {tensor} differs by {diff:.2e} of its scale"
    # the first step is settled at once (DDP rebuilds its buckets in the second forward); from the second on, every
    # bucket is owed to the next forward, the weights still the step's starting ones, but after a settle (step 3)
    # the exchange's time: a mean over every step (each applied, the last by the final settle), taken once
    (total_ms, exposed_ms), again = result["timing"]
    assert result["steps timed"] == [STEPS] and total_ms > 0 and 0 <= exposed_ms and again is None
    buckets = result["owed"][1]
    assert result["owed"] == [0, buckets, buckets, buckets, buckets] and buckets >= (3 if case == "small-buckets" else 1)
    every = len(reference["weights"][0])
    assert len(result["unchanged"][0]) < every and all(len(u) == every for u in result["unchanged"][1:])


@pytest.mark.slow
@pytest.mark.parametrize("hook", list(HOOKED))
def test_a_compressing_hooks_updates_in_the_next_forward_are_the_ones_it_makes_without_them(two_ranks, hook):
    deferred, direct = two_ranks[(hook, True)], two_ranks[(hook, False)]
    for weights, expected in zip(deferred["weights"], direct["weights"]):
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in weights), hook  # the same operations, later
    settled, owed = 1, deferred["owed"]  # the first step settled at once: DDP rebuilds its buckets in the second forward
    assert owed[:settled] == [0] * settled and all(n >= (2 if hook.endswith("buckets") else 1) for n in owed[settled:])
    assert direct["owed"] == [0] * STEPS
    assert deferred["bytes sent"] == direct["bytes sent"] and direct["bytes sent"][0] > 0


@pytest.mark.slow
def test_on_one_host_the_option_gives_way_to_the_shared_memory_sum(two_ranks):
    result = two_ranks[("on one host", "sgd")]
    assert result["summed through shared memory"] == [True] and result["owed"] == [0] * STEPS
    reference = train(StrategyConfig(name="ddp"), DistEnv.single(), "sgd")
    diff, tensor = worst(result["weights"][-1], reference["weights"][-1])
    assert diff <= 1e-10, f"{tensor} differs by {diff:.2e} of its scale"


def test_an_update_of_some_parameters_runs_with_the_settings_of_its_step_and_puts_everything_back():
    first, second = nn.Parameter(torch.ones(3, dtype=torch.float64)), nn.Parameter(torch.ones(2, dtype=torch.float64))
    optimizer = torch.optim.SGD([first, second], lr=0.05)
    first.grad, second.grad = torch.full((3,), 2.0, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.float64)
    update_only(optimizer, {id(first)}, [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                                          "lr": 0.25}])
    assert torch.equal(first.detach(), torch.full((3,), 0.5, dtype=torch.float64))  # 1 - 0.25 x 2: the noted lr
    assert torch.equal(second.detach(), torch.ones(2, dtype=torch.float64))  # not chosen: untouched
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["params"] == [first, second]


def test_the_first_layers_are_the_parameters_before_the_largest():
    model = CNN()
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[i] for i in priority_params(model)) == [
        "features.0.bias", "features.0.weight", "features.2.bias", "features.2.weight"]  # before head.0.weight


@pytest.mark.parametrize("options, sentence", [
    (["--strategy.name", "zero1"], "strategy.ddp.update_in_next_forward applies to strategy ddp only, not zero1; drop "
                                   "it or use --strategy.name ddp."),
    (["--strategy.ddp.comm_hook", "ring"], "strategy.ddp.update_in_next_forward leaves a hook's communication "
                                           "running, and strategy.ddp.comm_hook ring has finished its own when it "
                                           "returns; use allreduce, fp16, bf16, powersgd, or drop one of the two."),
    (["--train.grad_clip", "1.0"], "strategy.ddp.update_in_next_forward updates each layer on its own, and "
                                   "train.grad_clip needs every gradient's norm first; drop one of the two."),
    (["--train.compile", "true"], "strategy.ddp.update_in_next_forward applies each layer's update in a hook before "
                                  "its forward, which train.compile would compile through; drop one of the two."),
])
def test_what_deferred_updates_cannot_run_with_is_refused_in_one_sentence(tmp_path, monkeypatch, capsys, options,
                                                                          sentence):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", "--dry-run", "--nproc-per-node", "2", "--data.name", "synthetic",
                 "--strategy.ddp.update_in_next_forward", "true", *options])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[-1] == f"dptrain: error: {sentence}", err
