"""train.fp16: float16 autocast with torch.amp.GradScaler on GPUs. CI has no GPU: the scaler's work in the step
(overflow skipped and counted, clipping on the true gradients), its state as a snapshot part and the epoch event's
field are checked here on the CPU, where torch's GradScaler and float16 autocast run too, by building the step
directly (the command line refuses train.fp16 on the CPU, as checked below); perf/gpu_check.py runs it on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from dptrain.config import StrategyConfig, load as load_config
from dptrain.distributed.env import DistEnv
from dptrain.errors import ConfigError
from dptrain.events import EPOCH_EVENT, SKIPPED_STEPS
from dptrain.runtime import bf16_autocast
from dptrain.strategies.registry import build_strategy, check_world
from dptrain.train import LossScaler, TrainStep
from dptrain.train_state import TrainState

ONE = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "none")


def fp16_step(state: TrainState, grad_clip: float | None = None) -> TrainStep:
    torch.manual_seed(0)
    strategy = build_strategy(StrategyConfig(name="single"), ONE, torch.device("cpu"))
    model = strategy.wrap(nn.Sequential(nn.Flatten(), nn.Linear(12, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainStep(strategy=strategy, model=model, optimizer=optimizer,
                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                     autocast=functools.partial(bf16_autocast, torch.device("cpu"), True, dtype=torch.float16),
                     grad_clip=grad_clip, scaler=LossScaler(torch.device("cpu"), state, 0))


def weights(step: TrainStep) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


@pytest.mark.parametrize("grad_clip", [None, 0.1])
def test_a_step_whose_scaled_gradients_overflow_is_skipped_and_counted(grad_clip):
    state = TrainState()
    state.start_epoch(0, torch.device("cpu"))
    step = fp16_step(state, grad_clip)
    images, labels = torch.randn(8, 3, 2, 2), torch.randint(0, 5, (8,))
    step.eager(images, labels, 8)  # a clean step: applied
    applied, scale = weights(step), step.scaler.scaler.get_scale()
    assert state.epoch_skipped == 0 and scale == 65536.0
    step.eager(images * 1e4, labels, 8)  # float16 logits of 1e4-sized inputs: the scaled gradients overflow
    assert state.epoch_skipped == 1 and step.scaler.scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(applied, weights(step)))  # its update was not applied
    step.eager(images, labels, 8)
    assert state.epoch_skipped == 1 and not all(torch.equal(a, b) for a, b in zip(applied, weights(step)))
    state.start_epoch(1, torch.device("cpu"))
    assert state.epoch_skipped == 0  # counted per epoch


def test_the_scalers_state_is_a_snapshot_part_and_resumes(tmp_path):
    state = TrainState()
    state.start_epoch(0, torch.device("cpu"))
    step = fp16_step(state)
    step.eager(torch.randn(8, 3, 2, 2) * 1e4, torch.randint(0, 5, (8,)), 8)
    part = step.scaler.state_part()
    assert part.files(1) == {"loss_scaler.pt"}
    part.save(tmp_path, torch.save)
    fresh = LossScaler(torch.device("cpu"), TrainState(), 0)
    fresh.state_part().load(tmp_path, {}, lambda path: torch.load(path, weights_only=True), 1)
    assert fresh.scaler.get_scale() == step.scaler.scaler.get_scale() == 32768.0
    assert state.state_dict()["epoch_skipped"] == 1  # the loop's count, in the loop's state (extra.pt)


def test_the_epoch_event_has_a_skipped_steps_field():
    assert SKIPPED_STEPS in EPOCH_EVENT.optional


@pytest.mark.parametrize("options, sentence", [
    ([("train.fp16", "true"), ("train.bf16", "true")],
     "train.fp16 and train.bf16 are two precisions of the same autocast; keep one of them."),
    ([("train.fp16", "true"), ("train.cuda_graph", "true")],
     "train.cuda_graph replays a captured step, and train.fp16's loss scaler decides on the host, each step, whether "
     "to skip its update; drop one of the two."),
])
def test_what_fp16_cannot_run_with_is_one_sentence(options, sentence):
    with pytest.raises(ConfigError) as caught:
        load_config(None, options)
    assert str(caught.value) == sentence


@pytest.mark.parametrize("strategy, start", [
    ("fsdp", "train.fp16's torch.amp.GradScaler would look for overflow in each rank's shard"),
    ("ps", "train.fp16's torch.amp.GradScaler looks for overflow in each rank's own gradients, which strategy ps sums"),
    ("dp", "train.fp16 runs with one process per GPU"),
    ("deepspeed", "strategy deepspeed scales float16 losses with its own engine"),
])
def test_strategies_that_cannot_serve_fp16_refuse_it_in_one_sentence(strategy, start):
    cfg = load_config(None, [("train.fp16", "true"), ("strategy.name", strategy)])
    with pytest.raises(ConfigError) as caught:
        check_world(cfg, 1 if strategy == "dp" else 2, 1000, on_cpu=False)
    assert str(caught.value).startswith(start) and str(caught.value).count(". ") == 0


def test_fp16_on_the_cpu_and_with_the_update_in_the_next_forward_are_refused():
    with pytest.raises(ConfigError, match=r"^train.fp16 scales float16 losses on GPUs, and this run is on the CPU; "):
        check_world(load_config(None, [("train.fp16", "true")]), 2, 1000, on_cpu=True)
    deferred = load_config(None, [("train.fp16", "true"), ("strategy.ddp.update_in_next_forward", "true")])
    with pytest.raises(ConfigError, match="updates each layer on its own in a hook, and train.fp16's loss scaler"):
        check_world(deferred, 2, 1000, on_cpu=False)
    for strategy in ("ddp", "zero1", "single"):  # those it serves
        check_world(load_config(None, [("train.fp16", "true"), ("strategy.name", strategy)]),
                    1 if strategy == "single" else 2, 1000, on_cpu=False)
